"""``rollout.overlap_waves``: a turn's episodes in waves, one wave's env steps running while the next generates.

The generator here writes a function of the prompt alone, so any split into calls gets the same generations;
then the waves must give the serial path's trajectories exactly (turns, prompts of both views, rewards,
penalties, faults), its counters, and leave no env stepping when a collect ends early.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import zlib

import gymnasium as gym
import pytest

from agentopsd.config import RolloutConfig
from agentopsd.envs.faults import FaultInjectionWrapper
from agentopsd.rollout.base import Generation, SamplingConfig
from agentopsd.rollout.collector import Collector, split_waves, wave_sampling
from agentopsd.rollout.prompts import PromptBuilder
from agentopsd.rollout.skills import SkillBank
from agentopsd.training.preemption import RolloutStopped
from agentopsd.types import TaskSpec
from tests.conftest import WALK_SKILLS, WalkEnv

PACED_ID = "tests/PacedWalk-v0"
BROKEN_ID = "tests/BrokenWalk-v0"
UNSAFE_ID = "tests/UnsafeWalk-v0"
TEXTS = ("<action>right</action>", "<action>right</action>", "<action>left</action>", "<action>jump</action>", "no tags")


class PacedWalk(WalkEnv):
    """The walk, each step taking ``pause`` seconds (sleeping: the GIL is free, as for an env waiting on I/O);
    counts the steps running at any moment."""

    pause = 0.001
    running = 0
    lock = threading.Lock()

    def step(self, action):
        with PacedWalk.lock:
            PacedWalk.running += 1
        try:
            time.sleep(self.pause)
            return super().step(action)
        finally:
            with PacedWalk.lock:
                PacedWalk.running -= 1


class BrokenWalk(WalkEnv):
    """Goal 5's second step raises; goal 3's reset raises."""

    def reset(self, seed=None, options=None):
        out = super().reset(seed=seed, options=options)
        if self.goal == 3:
            raise RuntimeError("no room at position 3")
        self.steps = 0
        return out

    def step(self, action):
        self.steps += 1
        if self.goal == 5 and self.steps == 2:
            raise RuntimeError("the floor gave way")
        return super().step(action)


class UnsafeWalk(WalkEnv):
    thread_safe_step = False


for env_id, cls in ((PACED_ID, PacedWalk), (BROKEN_ID, BrokenWalk), (UNSAFE_ID, UnsafeWalk)):
    if env_id not in gym.registry:
        gym.register(env_id, entry_point=cls, max_episode_steps=10)


class PromptGenerator:
    """Writes a function of the prompt alone (whatever call it comes in), taking ``pause`` seconds a call."""

    def __init__(self, pause: float = 0.0) -> None:
        self.pause, self.calls = pause, []

    def generate(self, prompts, sampling):
        self.calls.append(len(prompts))
        time.sleep(self.pause)
        out = []
        for p in prompts:
            h = zlib.crc32(",".join(map(str, p)).encode())
            out.append(Generation((h % 97, h % 89, 5), (-0.1 * (h % 7),) * 3, TEXTS[h % len(TEXTS)], "stop"))
        return out

    def sync_weights(self, model) -> None:
        pass


def _collector(tok, waves: int, *, env_id: str = PACED_ID, generator=None, num_threads: int = 4,
               faults: tuple[float, float] | None = None, max_turns: int = 6, **kwargs) -> Collector:
    seeds = itertools.count(7)  # one seed per env in creation order: the same faults for every collector
    wrappers = [lambda e: FaultInjectionWrapper(e, p_reset=faults[0], p_step=faults[1], seed=next(seeds))] if faults else []
    return Collector(env_id, generator or PromptGenerator(), PromptBuilder(tok, history_window=2), SamplingConfig(max_new_tokens=4),
                     max_turns=max_turns, skill_bank=SkillBank.for_env(WALK_SKILLS), num_threads=num_threads,
                     env_wrappers=wrappers, overlap_waves=waves, **kwargs)


def _tasks(env_id: str, goals: list[int], copies: int = 1) -> list[TaskSpec]:
    # copies of a task share its index and seed (as GRPO's groups do)
    return [TaskSpec(env_id, "train", g, 100 + g, group_id=g) for g in goals for _ in range(copies)]


def _play(tok, waves: int, tasks, **kwargs):
    collector = _collector(tok, waves, **kwargs)
    try:
        return collector.collect(tasks, with_teacher=True), collector
    finally:
        collector.close()


def _counters(collector: Collector) -> tuple:
    s = collector.stats
    return s.turns, s.generated_tokens, s.format_errors, s.invalid_actions, s.faults


def test_split_and_seeds():
    assert split_waves(5, 2) == [[0, 2, 4], [1, 3]] and split_waves(1, 3) == [[0], [], []] and split_waves(0, 2) == [[], []]
    seeded = SamplingConfig(seed=11)
    assert wave_sampling(seeded, 0) is seeded and wave_sampling(seeded, 1).seed != 11
    assert wave_sampling(SamplingConfig(), 1).seed is None


@pytest.mark.parametrize("waves", [2, 3])
def test_waves_play_the_serial_turns(tiny_walk_policy, waves):
    """Unequal waves (11 episodes), random faults in reset and step, wins, truncations, format errors and
    invalid actions: every trajectory, both prompt views of every turn and the counters as serial."""
    _, tok = tiny_walk_policy
    tasks = _tasks(PACED_ID, [0, 1, 2, 3], copies=3)[:11]
    serial, s_col = _play(tok, 1, tasks, faults=(0.2, 0.06))
    overlapped, o_col = _play(tok, waves, tasks, faults=(0.2, 0.06))
    assert o_col.waves == waves and s_col.waves == 1
    assert overlapped == serial
    assert _counters(o_col) == _counters(s_col)
    # what the comparison covered
    faults = [t.fault or "" for t in serial]
    assert any(f.startswith("reset:") for f in faults) and any(f.startswith("step:") for f in faults)
    assert any(t.success for t in serial) and any(t.truncated for t in serial)
    assert s_col.stats.format_errors and s_col.stats.invalid_actions
    # one generate call per wave per turn, each wave's episodes in it
    gen = o_col.generator
    assert len(gen.calls) % waves == 0 and len(gen.calls) // waves == len(s_col.generator.calls)
    assert gen.calls[:waves] == [sum(not (serial[i].fault or "").startswith("reset:") for i in w) for w in split_waves(11, waves)]
    assert sum(gen.calls) == sum(s_col.generator.calls)


def test_a_fault_in_one_wave_ends_only_its_episodes(tiny_walk_policy):
    """Wave 0 holds the goal-5 tasks (their second step raises), wave 1 a goal-3 task (its reset raises) and
    a goal-2 task: each fault ends its own episode, in the turn it happened, as serially."""
    _, tok = tiny_walk_policy
    tasks = _tasks(BROKEN_ID, [3, 1, 3, 0])  # goals 5, 3, 5, 2 -> wave 0: both goal 5; wave 1: goals 3 and 2
    serial, _ = _play(tok, 1, tasks, env_id=BROKEN_ID, generator=_Scripted())
    overlapped, collector = _play(tok, 2, tasks, env_id=BROKEN_ID, generator=_Scripted())
    assert overlapped == serial
    goal5, goal3, goal5b, goal2 = overlapped
    for t in (goal5, goal5b):
        assert t.fault == "step: RuntimeError: the floor gave way" and len(t.turns) == 2 and not t.success
    assert goal3.fault == "reset: RuntimeError: no room at position 3" and not goal3.turns
    assert goal2.success and goal2.fault is None and len(goal2.turns) == 2
    assert collector.stats.faults == 3


class _Scripted(PromptGenerator):
    def generate(self, prompts, sampling):
        self.calls.append(len(prompts))
        return [Generation((1, 2), (-0.5, -0.5), "<action>right</action>", "stop") for _ in prompts]


def test_steps_run_while_the_next_wave_generates(tiny_walk_policy):
    """Proof of overlap, not of timing: in turn 1, wave 0's env steps wait until wave 1's generate call has
    begun, and that call waits until one of them is running. Serially this would deadlock (and time out)."""
    _, tok = tiny_walk_policy
    env_started, gen_started = threading.Event(), threading.Event()

    class Meeting(PromptGenerator):
        def generate(self, prompts, sampling):
            if len(self.calls) == 1:  # wave 1 of turn 1
                gen_started.set()
                assert env_started.wait(10), "wave 0's steps did not run beside wave 1's generation"
            return super().generate(prompts, sampling)

    class Meet(PacedWalk):
        def step(self, action):
            env_started.set()
            assert gen_started.wait(10), "no generation ran beside this step"
            return super().step(action)

    if "tests/MeetWalk-v0" not in gym.registry:
        gym.register("tests/MeetWalk-v0", entry_point=Meet, max_episode_steps=10)
    tasks = _tasks("tests/MeetWalk-v0", [0, 1, 2, 3])
    out, collector = _play(tok, 2, tasks, env_id="tests/MeetWalk-v0", generator=Meeting())
    assert all(t.fault is None for t in out) and collector.stats.turns > 4


def test_env_time_hidden_behind_generation_is_measured(tiny_walk_policy, monkeypatch):
    """env_wait_seconds: all of env_seconds serially, little of it when the waves overlap (sleeping envs and
    generator: 8 envs of 20 ms on 8 threads against 40 ms calls, so each wave's steps end within the other's
    call, also at the top of a turn: the pipeline runs across turns)."""
    _, tok = tiny_walk_policy
    monkeypatch.setattr(PacedWalk, "pause", 0.02)
    tasks = _tasks(PACED_ID, [0, 1, 2, 3], copies=2)
    _, serial = _play(tok, 1, tasks, num_threads=8, generator=PromptGenerator(0.04), max_turns=4)
    _, overlapped = _play(tok, 2, tasks, num_threads=8, generator=PromptGenerator(0.04), max_turns=4)
    s, o = serial.stats, overlapped.stats
    assert s.env_wait_seconds >= 0.9 * s.env_seconds > 0
    assert o.env_wait_seconds < 0.3 * o.env_seconds


def test_a_stop_or_a_generator_error_leaves_no_env_stepping(tiny_walk_policy, monkeypatch):
    """Between turns a stop raises RolloutStopped (one check per turn, as serially); a generator that raises
    mid-turn propagates. Either way every submitted step has returned first, and the next collect of the same
    envs plays as a fresh one."""
    _, tok = tiny_walk_policy
    monkeypatch.setattr(PacedWalk, "pause", 0.02)
    tasks = _tasks(PACED_ID, [1, 2, 3], copies=2)
    checks = []
    collector = _collector(tok, 2, stop_requested=lambda: checks.append(1) or len(checks) > 2)
    with pytest.raises(RolloutStopped):
        collector.collect(tasks, with_teacher=True)
    assert len(checks) == 3 and PacedWalk.running == 0
    collector.stop_requested = None
    again = collector.collect(tasks, with_teacher=True)
    fresh, _ = _play(tok, 1, tasks)
    assert again == fresh

    class Failing(PromptGenerator):
        def generate(self, prompts, sampling):
            if len(self.calls) == 4:
                raise RuntimeError("CUDA error: out of memory")
            return super().generate(prompts, sampling)

    collector.generator = Failing()
    with pytest.raises(RuntimeError, match="out of memory"):
        collector.collect(tasks, with_teacher=True)
    assert PacedWalk.running == 0
    collector.generator = PromptGenerator()
    assert collector.collect(tasks, with_teacher=True) == fresh
    collector.close()


@pytest.mark.parametrize(("env_id", "num_threads", "why"), [
    (PACED_ID, 0, "needs env.num_threads >= 2"),
    (PACED_ID, 1, "needs env.num_threads >= 2"),
    (UNSAFE_ID, 4, "sets thread_safe_step = False"),
])
def test_serial_where_the_env_or_threads_do_not_allow_it(tiny_walk_policy, caplog, env_id, num_threads, why):
    _, tok = tiny_walk_policy
    with caplog.at_level(logging.WARNING, logger="agentopsd.rollout.collector"):
        out, collector = _play(tok, 2, _tasks(env_id, [0, 1]), env_id=env_id, num_threads=num_threads)
    assert collector.waves == 1 and why in caplog.text and "rollout.overlap_waves=2" in caplog.text
    assert len(collector.generator.calls) == max(len(t.turns) for t in out)  # one call per turn


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_wave_counts_are_refused_in_one_line(tiny_walk_policy, bad):
    _, tok = tiny_walk_policy
    for build in (lambda: RolloutConfig(overlap_waves=bad), lambda: _collector(tok, bad)):
        with pytest.raises(ValueError) as err:
            build()
        assert str(err.value).startswith("rollout.overlap_waves must be an integer >= 1") and "\n" not in str(err.value)


def test_a_collect_leaves_no_env_threads_behind(tiny_walk_policy):
    """Each collect's runner shuts its thread pool down on the way out (its envs stay pooled): a run of
    hundreds of iterations must not pile up idle worker threads."""
    _, tok = tiny_walk_policy
    before = {t.ident for t in threading.enumerate() if t.name.startswith("env")}
    collector = _collector(tok, 2)
    try:
        for _ in range(3):
            assert collector.collect(_tasks(PACED_ID, [1, 2], copies=2), with_teacher=False)
        assert not {t.ident for t in threading.enumerate() if t.name.startswith("env")} - before
        assert collector._pools["train"]  # the envs themselves are kept for the next collect
    finally:
        collector.close()
