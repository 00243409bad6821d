"""BatchedRunner and FaultInjectionWrapper (envs/runner.py, envs/faults.py).

Inline or threads, measured with 64 BabyAI-GoToLocal envs (random actions, best of 4
rounds, this loaded 2-core machine): inline 6,990 env steps/s, 2 threads 7,460, 4 threads
7,142, 8 threads 4,968. The envs hold the GIL, so threads buy nothing for BabyAI: run it
inline (num_threads=0); threads are for envs that wait on I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import gymnasium as gym
import pytest

from agentopsd.envs import base
from agentopsd.envs.babyai.env import BabyAIEnv
from agentopsd.envs.faults import FaultInjectionWrapper
from agentopsd.envs.runner import BatchedRunner, FaultRecord, StepResult


def _babyai(n: int) -> list[gym.Env]:
    return [BabyAIEnv("GoToLocal", split="eval", compute_expert_steps=False) for _ in range(n)]


class Recorder(gym.Wrapper):
    """Fails the test if the runner steps an env whose episode has ended."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.ended = True
        self.bad_calls = 0
        self.closed = False

    def reset(self, **kwargs: Any) -> Any:
        out = self.env.reset(**kwargs)
        self.ended = False
        return out

    def step(self, action: Any) -> Any:
        if self.ended:
            self.bad_calls += 1
        try:
            out = self.env.step(action)
        except Exception:
            self.ended = True  # a fault ends the episode too
            raise
        self.ended = out[2] or out[3]
        return out

    def close(self) -> None:
        self.closed = True
        super().close()


def _options(n: int) -> list[dict]:
    return [{"task_index": i} for i in range(n)]


@pytest.mark.parametrize("num_threads", [0, 4])
def test_reset_and_step(num_threads: int) -> None:
    with BatchedRunner(_babyai(4), num_threads=num_threads) as runner:
        assert runner.inline == (num_threads == 0)
        first = runner.reset([None] * 4, _options(4))
        assert all(isinstance(r, StepResult) and r.error is None for r in first)
        assert first[2].info["task_index"] == 2 and first[2].observation.startswith("Mission: ")
        out = runner.step({0: "turn left", 3: "go forward"})
        assert set(out) == {0, 3}
        assert out[0].observation.endswith("you turned left.") and out[0].info["action_valid"]
        assert runner.faults == []


def test_threads_and_inline_agree() -> None:
    results = []
    for num_threads in (0, 3):
        runner = BatchedRunner(_babyai(6), num_threads=num_threads)
        trace = [r.observation for r in runner.reset([None] * 6, _options(6))]
        for action in ["go forward", "turn right", "pick up", "go forward"]:
            active = {i: action for i, a in enumerate(runner.active) if a}
            trace += [r.observation for _, r in sorted(runner.step(active).items())]
        runner.close()
        results.append(trace)
    assert results[0] == results[1]


@pytest.mark.parametrize("num_threads", [0, 4])
def test_step_fault_ends_only_that_episode(num_threads: int, caplog: pytest.LogCaptureFixture) -> None:
    envs = _babyai(4)
    envs[1] = FaultInjectionWrapper(envs[1], p_reset=0.0, p_step=1.0, seed=0)
    runner = BatchedRunner(envs, num_threads=num_threads)
    tasks = [r.info["task"] for r in runner.reset([None] * 4, _options(4))]
    with caplog.at_level(logging.WARNING, logger="agentopsd.envs.runner"):
        out = runner.step({i: "turn left" for i in range(4)})
    bad = out[1]
    assert bad.error is not None and bad.error.startswith("RuntimeError: injected fault")
    assert bad.terminated and bad.reward == 0.0 and not bad.info["won"]
    assert runner.faults == [FaultRecord(env_index=1, task=tasks[1], phase="step", error=bad.error)]
    assert "env 1" in caplog.text and tasks[1] in caplog.text and "injected fault" in caplog.text
    assert all(out[i].error is None and not out[i].terminated for i in (0, 2, 3))
    assert runner.active == [True, False, True, True]
    with pytest.raises(ValueError, match="env 1 has no active episode"):
        runner.step({0: "turn left", 1: "turn left"})
    assert set(runner.step({0: "turn left", 2: "go forward", 3: "toggle"})) == {0, 2, 3}
    # a new episode starts cleanly after the fault (the wrapper still faults every step)
    runner.reset([None] * 4, _options(4))
    assert runner.active == [True] * 4
    runner.close()


def test_reset_fault_is_recorded_with_the_requested_task(caplog: pytest.LogCaptureFixture) -> None:
    envs = _babyai(3)
    envs[2] = FaultInjectionWrapper(envs[2], p_reset=1.0, p_step=0.0, seed=0)
    runner = BatchedRunner(envs, num_threads=0)
    with caplog.at_level(logging.WARNING, logger="agentopsd.envs.runner"):
        first = runner.reset([None] * 3, _options(3))
    assert first[2].error is not None and first[2].terminated and first[2].observation == ""
    assert [r.error for r in first[:2]] == [None, None]
    (record,) = runner.faults
    assert (record.env_index, record.phase, record.task) == (2, "reset", "task_index=2")
    assert record.error.startswith("RuntimeError: injected fault in reset")
    assert "env 2" in caplog.text
    assert runner.active == [True, True, False]
    assert set(runner.step({0: "turn left", 1: "turn left"})) == {0, 1}


def test_random_faults_over_full_rollouts() -> None:
    """Many envs, random faults in reset and step, episodes run to their end.

    Every injected fault is recorded once, in order, and no ended env is ever stepped.
    """
    n = 12
    wrapped = [FaultInjectionWrapper(env, p_reset=0.1, p_step=0.03, seed=i) for i, env in enumerate(_babyai(n))]
    recorders = [Recorder(env) for env in wrapped]
    runner = BatchedRunner(recorders, num_threads=4)
    for round_ in range(3):
        runner.reset([None] * n, [{"task_index": round_ * n + i} for i in range(n)])
        turns = 0
        while any(runner.active) and turns < 80:
            # the collector only asks for envs whose episode is still running
            expert = {i: recorders[i].unwrapped.expert_action() for i, a in enumerate(runner.active) if a}
            for result in runner.step(expert).values():
                assert (result.error is None) or (result.terminated and result.reward == 0.0)
            turns += 1
    assert sum(w.injected for w in wrapped) == len(runner.faults) > 0
    assert {f.phase for f in runner.faults} == {"reset", "step"}
    assert all(r.bad_calls == 0 for r in recorders)
    runner.close()
    assert all(r.closed for r in recorders)


def test_threads_run_concurrently_for_waiting_envs() -> None:
    """Envs that wait (I/O) overlap in the pool: 4 envs sleeping 0.2 s take ~0.2 s, not 0.8 s."""

    class Sleepy(gym.Env):
        observation_space = base.observation_space()
        action_space = base.action_space()

        def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
            super().reset(seed=seed)
            return "start", {"task": "sleep"}

        def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
            time.sleep(0.2)
            return threading.current_thread().name, 0.0, False, False, {"task": "sleep"}

    runner = BatchedRunner([Sleepy() for _ in range(4)], num_threads=4)
    runner.reset([None] * 4, [None] * 4)
    start = time.perf_counter()
    out = runner.step({i: "wait" for i in range(4)})
    assert time.perf_counter() - start < 0.6
    assert all(r.observation.startswith("env") for r in out.values())
    runner.close()


def test_close_survives_a_failing_close(caplog: pytest.LogCaptureFixture) -> None:
    class BadClose(Recorder):
        def close(self) -> None:
            raise OSError("disk gone")

    envs = [BadClose(_babyai(1)[0]), Recorder(_babyai(1)[0])]
    runner = BatchedRunner(envs, num_threads=2)
    with caplog.at_level(logging.WARNING, logger="agentopsd.envs.runner"):
        runner.close()
    assert envs[1].closed and "OSError: disk gone" in caplog.text


def test_runner_errors() -> None:
    with pytest.raises(ValueError, match="at least one"):
        BatchedRunner([])
    with pytest.raises(ValueError, match="num_threads"):
        BatchedRunner(_babyai(1), num_threads=-1)
    runner = BatchedRunner(_babyai(2), num_threads=0)
    with pytest.raises(ValueError, match="one seed and one options entry per env"):
        runner.reset([None], [None, None])
    runner.reset([None, None], [None, None])
    with pytest.raises(ValueError, match="out of range"):
        runner.step({5: "turn left"})


def test_fault_wrapper_is_reproducible_and_leaves_state_alone() -> None:
    def pattern(seed: int) -> list[bool]:
        env = FaultInjectionWrapper(BabyAIEnv("GoToLocal", compute_expert_steps=False), p_step=0.3, seed=seed)
        env.reset(seed=0)
        hits = []
        for _ in range(30):
            try:
                env.step("turn left")
                hits.append(False)
            except RuntimeError as exc:
                assert "injected fault" in str(exc)
                hits.append(True)
        return hits

    assert pattern(1) == pattern(1) and any(pattern(1)) and not all(pattern(1))
    assert pattern(1) != pattern(2)
    env = FaultInjectionWrapper(BabyAIEnv("GoToLocal", compute_expert_steps=False), p_step=1.0, seed=0)
    obs, _ = env.reset(seed=0)
    with pytest.raises(RuntimeError, match="injected fault in step"):
        env.step("go forward")
    assert env.injected == 1
    assert env.unwrapped._obs == obs  # the wrapped env never saw the action
    with pytest.raises(ValueError, match="p_step"):
        FaultInjectionWrapper(env, p_step=1.5)


class _Gate(gym.Env):
    """Steps block until the test opens the gate: a submitted step is seen running while the caller goes on."""

    observation_space = base.observation_space()
    action_space = base.action_space()

    def __init__(self, gate: threading.Event, fail_on: str = "") -> None:
        self.gate, self.fail_on, self.steps = gate, fail_on, 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        return "start", {"task": "gate"}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if not self.gate.wait(10):
            raise TimeoutError("the gate never opened")
        self.steps += 1
        if action == self.fail_on:
            raise RuntimeError("broken step")
        return f"stepped {action}", 1.0, action == "stop", False, {"task": "gate"}


def test_submit_returns_before_the_steps_and_result_matches_step() -> None:
    gate = threading.Event()
    runner = BatchedRunner([_Gate(gate, fail_on="crash") for _ in range(3)], num_threads=3)
    runner.reset([None] * 3, [None] * 3)
    pending = runner.submit({0: "go", 1: "stop", 2: "crash"})
    assert not pending.done()  # the caller is free while the envs wait: the point of submit
    with pytest.raises(ValueError, match="still stepping"):
        runner.step({0: "go"})
    with pytest.raises(ValueError, match="still stepping"):
        runner.reset([None] * 3, [None] * 3)
    gate.set()
    out = pending.result()
    assert pending.result() is out and pending.seconds > 0  # collected once
    assert (out[0].observation, out[1].terminated, out[2].error) == ("stepped go", True, "RuntimeError: broken step")
    assert runner.active == [True, False, False] and [f.env_index for f in runner.faults] == [2]
    assert runner.step({0: "go"})[0].observation == "stepped go"  # collected: env 0 steps again
    runner.close()


def test_an_inline_runner_submits_by_stepping_at_once() -> None:
    runner = BatchedRunner(_babyai(2), num_threads=0)
    runner.reset([None, None], [{"task_index": 0}, {"task_index": 1}])
    pending = runner.submit({0: "turn left", 1: "turn right"})
    assert pending.done() and set(pending.result()) == {0, 1}
    assert runner.submit({}).result() == {}


def test_an_abandoned_step_leaves_no_env_running() -> None:
    gate = threading.Event()
    envs = [_Gate(gate) for _ in range(2)]
    runner = BatchedRunner(envs, num_threads=2)
    runner.reset([None] * 2, [None] * 2)
    pending = runner.submit({0: "go", 1: "go"})
    threading.Timer(0.05, gate.set).start()
    pending.abandon()  # returns only once both steps did
    assert [e.steps for e in envs] == [1, 1] and runner.active == [False, False]
    runner.reset([None] * 2, [None] * 2)  # reset to play them again
    assert runner.active == [True, True]
    runner.close()


def test_an_env_that_is_not_thread_safe_steps_inline(caplog: pytest.LogCaptureFixture) -> None:
    class Unsafe(BabyAIEnv):
        thread_safe_step = False

    with caplog.at_level(logging.WARNING, logger="agentopsd.envs.runner"):
        runner = BatchedRunner([Unsafe("GoToLocal", split="eval", compute_expert_steps=False) for _ in range(3)], num_threads=4)
    assert runner.inline and not runner.thread_safe and "Unsafe sets thread_safe_step = False" in caplog.text
    assert not BatchedRunner(_babyai(3), num_threads=4).inline
    assert not base.steps_thread_safe(Unsafe) and base.steps_thread_safe(BabyAIEnv)
