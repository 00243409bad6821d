"""Reset and step many environments in lockstep, isolating faults.

The rollout collector advances N*G text environments one turn at a time. One broken
environment (an engine crash, a bad task file, a network error in a retriever) must end
only its own episode: :class:`BatchedRunner` catches the exception, records it as a
:class:`FaultRecord`, logs a warning, and reports that episode as terminated with
reward 0 and ``error`` set. The other environments carry on.

Threads or inline: environments written in pure Python (BabyAI, the generated WebShop)
hold the GIL, so a thread pool cannot run them in parallel and only adds its overhead;
measured on BabyAI-GoToLocal with 64 envs on this 2-core machine, inline stepping was
faster than 2, 4 or 8 threads (see tests/envs/test_runner.py's docstring). Threads pay
off for environments that wait on I/O or release the GIL (an HTTP retriever, engines in
other processes). ``num_threads=0`` (or 1) steps inline, and so does an env whose class sets
``thread_safe_step = False`` (see :class:`agentopsd.envs.base.TextEnv`).

Stepping beside other work: :meth:`BatchedRunner.submit` hands a step to the thread pool and returns
at once; the caller collects it with :meth:`PendingStep.result` after doing something else (the rollout
collector generates the next wave of episodes meanwhile). Every piece of bookkeeping (faults, which
episodes are active) happens on the caller's thread, in ``result``: the workers only call the envs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

from agentopsd.envs.base import steps_thread_safe

logger = logging.getLogger(__name__)

Outcome = tuple[Any, Exception | None]
"""What one guarded env call gave: its return value, or the Exception it raised."""
_warned_unsafe: set[str] = set()
"""Env classes already named in the "stepping inline" warning (once per process, not once per rollout)."""


@dataclass(frozen=True)
class StepResult:
    """What one environment returned for one reset or step."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict
    error: str | None
    """None unless the environment raised; then terminated is True and reward 0.0."""


@dataclass(frozen=True)
class FaultRecord:
    """One exception raised by one environment."""

    env_index: int
    task: str
    """The task of the episode that faulted (info["task"]); for a failed reset, the
    task_index or seed asked for."""
    phase: str
    """"reset" or "step"."""
    error: str
    """"ExceptionType: message"."""


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _requested_task(seed: int | None, options: dict | None) -> str:
    if options and "task_index" in options:
        return f"task_index={options['task_index']}"
    return f"seed={seed}"


class BatchedRunner:
    """Resets and steps a list of environments, inline or with a thread pool.

    An episode is active from a successful reset until it terminates, truncates or
    faults; ``step`` accepts actions for active episodes only.
    """

    def __init__(self, envs: Sequence[gym.Env], num_threads: int = 8) -> None:
        if not envs:
            raise ValueError("BatchedRunner needs at least one environment")
        if num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0 = inline), got {num_threads}")
        self.envs = list(envs)
        self.num_threads = num_threads
        self.faults: list[FaultRecord] = []
        """Every fault so far, in order (within one call, by env index)."""
        self.thread_safe = all(steps_thread_safe(env) for env in self.envs)
        """False when some env's class opts out of worker threads: then every call runs inline."""
        workers = min(num_threads, len(self.envs)) if self.thread_safe else 0
        if num_threads > 1 and not self.thread_safe:
            _warn_inline(self.envs)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env") if workers > 1 else None
        self._active = [False] * len(self.envs)
        self._tasks = [""] * len(self.envs)
        self._in_flight: set[int] = set()
        """Envs whose submitted step was not collected yet: stepping or resetting them again is refused."""

    @property
    def inline(self) -> bool:
        return self._pool is None

    @property
    def active(self) -> list[bool]:
        """Per env: is its episode running (reset succeeded, not ended yet)?"""
        return list(self._active)

    def reset(self, seeds: Sequence[int | None], options: Sequence[dict | None]) -> list[StepResult]:
        """Reset every environment; ``seeds[i]`` and ``options[i]`` go to env i."""
        n = len(self.envs)
        if len(seeds) != n or len(options) != n:
            raise ValueError(f"reset needs one seed and one options entry per env ({n}), "
                             f"got {len(seeds)} seeds and {len(options)} options")
        if self._in_flight:
            raise ValueError(f"envs {sorted(self._in_flight)} are still stepping (a submitted step not collected): "
                             "collect it with PendingStep.result() before resetting")
        results = self._run([self._reset_call(i, seeds[i], options[i]) for i in range(n)])
        out = []
        for i, (result, exc) in enumerate(results):
            if exc is not None:
                task = _requested_task(seeds[i], options[i])
                self._fault(i, task, "reset", exc)
                out.append(self._fault_result(task, exc))
                continue
            obs, info = result
            self._active[i], self._tasks[i] = True, str(info.get("task", ""))
            out.append(StepResult(obs, 0.0, False, False, info, None))
        return out

    def step(self, actions: Mapping[int, str]) -> dict[int, StepResult]:
        """Step the environments named in ``actions`` (env index -> action text)."""
        indices = self._check_step(actions)
        return self._step_results(indices, self._run([self._step_call(i, actions[i]) for i in indices]))

    def submit(self, actions: Mapping[int, str]) -> PendingStep:
        """Start stepping the environments named in ``actions`` and return without waiting for them.

        With a thread pool the steps run in it, every one of them (even a single step: the point is that
        the caller does other work meanwhile); inline, they run here before this returns. Either way
        ``result()`` on the returned :class:`PendingStep` gives what :meth:`step` would have given.
        """
        indices = self._check_step(actions)
        calls = [self._step_call(i, actions[i]) for i in indices]
        started = time.perf_counter()
        if self._pool is None:
            futures = [_finished(_stamped(call)) for call in calls]
        else:
            futures = [self._pool.submit(_stamped, call) for call in calls]
        self._in_flight.update(indices)
        return PendingStep(self, indices, futures, started)

    def release(self) -> None:
        """Shut the thread pool down and leave the environments open (their owner reuses them)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def close(self) -> None:
        """Shut the thread pool down and close every environment (errors are logged)."""
        self.release()
        for i, env in enumerate(self.envs):
            try:
                env.close()
            except Exception as exc:  # closing must not stop closing the others
                logger.warning("env %d raised while closing: %s", i, _error_text(exc))

    def __enter__(self) -> BatchedRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------

    def _check_step(self, actions: Mapping[int, str]) -> list[int]:
        """The env indices of ``actions``, sorted, after refusing any that cannot step now."""
        for i in actions:
            if not isinstance(i, int) or not 0 <= i < len(self.envs):
                raise ValueError(f"env index {i!r} out of range [0, {len(self.envs) - 1}]")
            if not self._active[i]:
                raise ValueError(f"env {i} has no active episode (it ended, faulted or was never reset); "
                                 "reset it before stepping")
            if i in self._in_flight:
                raise ValueError(f"env {i} is still stepping (a submitted step not collected): "
                                 "collect it with PendingStep.result() first")
        return sorted(actions)

    def _step_results(self, indices: list[int], outcomes: list[Outcome]) -> dict[int, StepResult]:
        """Record faults and ended episodes for finished steps (caller's thread only: no locks needed)."""
        out: dict[int, StepResult] = {}
        for i, (result, exc) in zip(indices, outcomes):
            if exc is not None:
                self._fault(i, self._tasks[i], "step", exc)
                out[i] = self._fault_result(self._tasks[i], exc)
                continue
            obs, reward, terminated, truncated, info = result
            if terminated or truncated:
                self._active[i] = False
            out[i] = StepResult(obs, float(reward), bool(terminated), bool(truncated), info, None)
        return out

    def _reset_call(self, i: int, seed: int | None, options: dict | None) -> Callable[[], Any]:
        return lambda: self.envs[i].reset(seed=seed, options=options)

    def _step_call(self, i: int, action: str) -> Callable[[], Any]:
        return lambda: self.envs[i].step(action)

    def _run(self, calls: list[Callable[[], Any]]) -> list[Outcome]:
        if self._pool is None or len(calls) <= 1:
            return [_guarded(call) for call in calls]
        return list(self._pool.map(_guarded, calls))

    def _fault(self, i: int, task: str, phase: str, exc: Exception) -> None:
        self._active[i] = False
        record = FaultRecord(env_index=i, task=task, phase=phase, error=_error_text(exc))
        self.faults.append(record)
        logger.warning("env %d (task %r) faulted in %s: %s", i, task, phase, record.error)

    @staticmethod
    def _fault_result(task: str, exc: Exception) -> StepResult:
        info = {"task": task, "won": False, "action_valid": False}
        return StepResult("", 0.0, True, False, info, _error_text(exc))


class PendingStep:
    """Steps handed to a runner by :meth:`BatchedRunner.submit`, collected with :meth:`result`."""

    def __init__(self, runner: BatchedRunner, indices: list[int], futures: list[Future], started: float) -> None:
        self.runner, self.indices = runner, indices
        self._futures, self._started = futures, started
        self._results: dict[int, StepResult] | None = None
        self.seconds = 0.0
        """The steps' own wall time, from submission to the last env's return (known once collected)."""

    def done(self) -> bool:
        """Have all these envs returned (``result`` would not wait)?"""
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        """Block until every env returned (``result`` then only records; a caller timing its wait times this)."""
        wait(self._futures)

    def abandon(self) -> None:
        """Wait until every env returned and drop the results: for a caller on its way out on an exception,
        which must not leave an env stepping behind its back. Uncollected, these episodes count as ended
        (reset to play them again)."""
        self.wait()
        if self._results is None:
            self.runner._in_flight.difference_update(self.indices)
            for i in self.indices:
                self.runner._active[i] = False

    def result(self) -> dict[int, StepResult]:
        """Wait for the steps, then record them as :meth:`BatchedRunner.step` does (once; later calls repeat it)."""
        if self._results is None:
            stamped = [f.result() for f in self._futures]
            self.runner._in_flight.difference_update(self.indices)
            self.seconds = max((end for _, _, end in stamped), default=self._started) - self._started
            self._results = self.runner._step_results(self.indices, [(value, exc) for value, exc, _ in stamped])
        return self._results


def _guarded(call: Callable[[], Any]) -> Outcome:
    """Run one env call; an Exception becomes a value (KeyboardInterrupt still propagates)."""
    try:
        return call(), None
    except Exception as exc:
        return None, exc


def _stamped(call: Callable[[], Any]) -> tuple[Any, Exception | None, float]:
    """:func:`_guarded`, and when the call returned: a submitted step's wall time ends at its last env."""
    value, exc = _guarded(call)
    return value, exc, time.perf_counter()


def _finished(value: Any) -> Future:
    """A future that already holds ``value`` (an inline runner's submitted step)."""
    future: Future = Future()
    future.set_result(value)
    return future


def _warn_inline(envs: Sequence[gym.Env]) -> None:
    names = sorted({type(getattr(env, "unwrapped", env)).__name__ for env in envs if not steps_thread_safe(env)})
    if set(names) <= _warned_unsafe:
        return
    _warned_unsafe.update(names)
    logger.warning("%s sets thread_safe_step = False: its envs step inline, one at a time, whatever env.num_threads says",
                   ", ".join(names))
