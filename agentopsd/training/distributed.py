"""Keeping ranks in step: the one place where ranks agree before they issue collectives.

THE RANK INVARIANT. Every rank issues the same sequence of collectives, whatever its data. Under
FSDP every forward of the policy (or of the sharded reference) all-gathers parameters; under DDP and
FSDP every backward reduces gradients; every agreement in this module is a collective too. A rank
that issues one forward fewer does not fail: it waits in the other's all-gather until the process
group times out.

The rule, for anyone adding a forward or a backward:

1. A loop whose number of passes depends on this rank's data (prefill chunks, decode steps, scoring
   slices, micro-batches, turns, evaluation episodes) first agrees the count with :func:`agree`
   (or :func:`padded`), then runs exactly that many passes, filling the missing ones with dummy
   passes made by the *same code* on a placeholder row (so a dummy issues what a real pass issues).
2. Whether a pass happens at all may depend only on settings every rank shares (the algorithm, its
   coefficients, the rollout config), never on this rank's data; a data-dependent decision that gates
   a collective is agreed first (:func:`any_rank`).
3. Metrics are reduced with :func:`reduce_metrics`: one collective per call, whatever keys exist.

Everything here answers for one process when no process group exists, and for a simulated rank
(:class:`SimulatedWorld`, threads in one process) in the tests that record the collective sequence
two ranks issue on unequal data.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

_local = threading.local()
"""Per thread: ``world`` (a SimulatedWorld when simulating), ``rank``, ``last`` (the last agreement entered)."""


# ------------------------------------------------------------------ who am I


def _simulated() -> SimulatedWorld | None:
    return getattr(_local, "world", None)


def is_distributed() -> bool:
    """More than one process takes part (or a simulated rank of a world of several)."""
    sim = _simulated()
    if sim is not None:
        return sim.size > 1
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    sim = _simulated()
    if sim is not None:
        return _local.rank, sim.size
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def last_collective() -> str:
    """What this rank entered last (named in a timeout's message: where the ranks parted)."""
    return getattr(_local, "last", "none yet")


def _collective_device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo takes CPU tensors
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------ the agreements


def exchange(values: Sequence[float], what: str) -> list[list[float]]:
    """Every rank's ``values`` (the same length on every rank), by rank: one collective.

    The building block of every agreement: one all-gather answers a max, a sum and an any at once.
    """
    _local.last = what
    record(("agree", what))
    sim = _simulated()
    if sim is not None:
        return sim.gather(_local.rank, [float(v) for v in values], what)
    if not is_distributed():
        return [[float(v) for v in values]]
    local = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device())
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.cpu().tolist() for t in out]


def agree(count: int, what: str) -> int:
    """The largest ``count`` over ranks: how many passes of kind ``what`` every rank runs."""
    if not is_distributed():
        return count
    return int(max(row[0] for row in exchange([count], what)))


def all_max(value: int, what: str = "all_max") -> int:
    """The largest ``value`` over ranks (the value itself when not distributed)."""
    return agree(value, what)


def any_rank(flag: bool, what: str = "any_rank") -> bool:
    """True when ``flag`` holds on at least one rank."""
    return agree(int(flag), what) > 0


def padded(items: Sequence[T], what: str) -> list[T | None]:
    """``items`` followed by ``None`` up to the ranks' largest count: iterate it and run a dummy pass
    (the same code on a placeholder row) for each ``None``."""
    n = agree(len(items), what)
    return list(items) + [None] * (n - len(items))


def gather_objects(obj: Any, what: str) -> list[Any]:
    """Every rank's picklable ``obj``, by rank: one collective."""
    _local.last = what
    record(("gather", what))
    sim = _simulated()
    if sim is not None:
        return sim.gather(_local.rank, obj, what)
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


MetricRule = Callable[[str], str]


def reduce_metrics(metrics: Mapping[str, float], what: str, weight: float = 1.0, rule: MetricRule | None = None) -> dict[str, float]:
    """Metrics over every rank: one collective, whatever keys each rank holds.

    ``rule(key)`` says how a key combines: ``"mean"`` (weighted by each rank's ``weight``, e.g. its
    trajectories), ``"sum"`` (counts, throughputs) or ``"max"`` (wall times). A key a rank lacks is
    left out of that key's reduction, never counted as 0.
    """
    if not is_distributed():
        return dict(metrics)
    rows = gather_objects((dict(metrics), float(weight)), what)
    rule = rule or (lambda key: "mean")
    out: dict[str, float] = {}
    for key in sorted({k for m, _ in rows for k in m}):
        have = [(float(m[key]), w) for m, w in rows if key in m and not math.isnan(float(m[key]))]
        if not have:
            out[key] = float("nan")
            continue
        how = rule(key)
        if how == "sum":
            out[key] = sum(v for v, _ in have)
        elif how == "max":
            out[key] = max(v for v, _ in have)
        else:
            total = sum(w for _, w in have)
            out[key] = sum(v * w for v, w in have) / total if total > 0 else sum(v for v, _ in have) / len(have)
    return out


def barrier(what: str) -> None:
    """Every rank waits here for the others (a collective)."""
    exchange([0], what)


# ------------------------------------------------------------------ sharding the work


def shard_groups(group_ids: list[int], rank: int, world: int) -> list[int]:
    """Positions of the items whose group falls to ``rank``: whole groups stay together, since
    GRPO compares the copies of one task."""
    order = sorted(set(group_ids))
    mine = {g for n, g in enumerate(order) if n % world == rank}
    return [i for i, g in enumerate(group_ids) if g in mine]


def shard_items(items: Sequence[T], rank: int, world: int) -> list[T]:
    """Every ``world``-th item from ``rank``: disjoint shards that together cover ``items``."""
    return list(items[rank::world])


# ------------------------------------------------------------------ process-group timeout


def process_group_timeout(seconds: float | None, accelerator: str) -> _dt.timedelta:
    """How long a collective may wait before the run fails: ``seconds`` when set, else a short
    default on CPU (gloo: a stuck test or laptop run ends in minutes) and NCCL's 30 minutes on GPUs
    (a slow first vLLM start or a large checkpoint must not trip it)."""
    if seconds is not None and seconds > 0:
        return _dt.timedelta(seconds=float(seconds))
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return _dt.timedelta(minutes=30) if on_gpu else _dt.timedelta(seconds=300)


def is_collective_timeout(err: BaseException) -> bool:
    """Whether ``err`` is a process group giving up on a collective (gloo or NCCL)."""
    text = str(err).lower()
    return isinstance(err, (RuntimeError, dist.DistBackendError)) and (
        "timed out" in text or "timeout" in text or "connection closed by peer" in text or "connection reset" in text
    )


def timeout_message(err: BaseException) -> str:
    rank, world = rank_and_world()
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (f"error: rank {rank} of {world} gave up waiting in a collective (last agreement entered: {last_collective()}): "
            f"another rank stopped, crashed or issued a different sequence of forwards ({first[:200]})")


# ------------------------------------------------------------------ leaving the process


def exit_code(code: object) -> int:
    """``sys.exit``'s argument as the process's exit status: None is 0, an int itself, anything else
    (a message) is printed to stderr and gives 1, as the interpreter would."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_process(code: object = 0) -> NoReturn:
    """End the process with ``code``: ``sys.exit(code)`` where no process group was made; after a
    distributed run, the exit handlers run (Lightning's process-group teardown, logging's flush,
    loggers' own), the standard streams are flushed, and ``os._exit`` skips interpreter shutdown.

    Why: with gloo, one of the process group's worker threads can still hold the last reference to a
    finished collective when the interpreter shuts down. Releasing it drops a Python object kept in
    the collective's thread-local state; during shutdown the thread cannot take the GIL, and the
    whole process aborts ("terminate called without an active exception", exit -6) after its work is
    done and its files are written: a 2-process ``agentopsd-eval`` did so once in a CI run. Every
    file the trainer writes is closed before this point, and the exit handlers run while the
    interpreter is whole, so skipping its shutdown loses nothing."""
    status = exit_code(code)
    if not (dist.is_available() and dist.is_initialized()):
        sys.exit(status)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to lose
            pass
    os._exit(status)


# ------------------------------------------------------------------ simulation and recording (tests)


class SimulatedWorld:
    """``size`` ranks as threads of one process: the agreements above exchange values between them.

    Each thread enters with ``with world.rank(r):``; a rank that waits longer than ``timeout`` for
    the others raises (a mismatch fails in seconds instead of hanging).
    """

    def __init__(self, size: int, timeout: float = 60.0) -> None:
        self.size, self.timeout = size, timeout
        self._barrier = threading.Barrier(size)
        self._slots: list[Any] = [None] * size
        self.logs: list[list[tuple]] = [[] for _ in range(size)]

    @contextmanager
    def rank(self, r: int) -> Iterator[None]:
        _local.world, _local.rank = self, r
        try:
            yield
        finally:
            _local.world = None

    def gather(self, rank: int, value: Any, what: str) -> list[Any]:
        """Every rank's ``value``; raises when the ranks entered different agreements (a real process
        group would pair them silently, or hang)."""
        try:
            self._slots[rank] = (what, value)
            self._barrier.wait(self.timeout)
            entered = list(self._slots)
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            self._barrier.abort()
            raise RuntimeError(f"simulated rank {rank}: the other ranks never reached {what!r}") from None
        if len({w for w, _ in entered}) > 1:
            self._barrier.abort()
            raise RuntimeError(f"simulated rank {rank}: ranks entered different agreements {[w for w, _ in entered]}")
        return [v for _, v in entered]

    def abort(self) -> None:
        self._barrier.abort()

    def run(self, target: Callable[[int], Any], join_timeout: float = 120.0,
            expected: tuple[type[BaseException], ...] = ()) -> dict[int, Any]:
        """``target(rank)`` on every rank, each in its own thread inside ``with self.rank(rank)``; returns each
        rank's result, or the exception it raised. An ``expected`` exception is an outcome like a result; any
        other aborts the agreements, so the other ranks fail fast instead of waiting. Raises when a rank is
        still running after ``join_timeout`` seconds."""
        out: dict[int, Any] = {}

        def one(r: int) -> None:
            try:
                with self.rank(r):
                    out[r] = target(r)
            except expected as err:
                out[r] = err
            except BaseException as err:  # noqa: BLE001 (handed back to the caller, whatever it is)
                out[r] = err
                self.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(join_timeout)
        if any(t.is_alive() for t in threads):
            raise RuntimeError(f"a simulated rank is still running after {join_timeout} s")
        return out


def record(event: tuple) -> None:
    """Append ``event`` to this simulated rank's log (no-op outside a simulation)."""
    sim = _simulated()
    if sim is not None:
        sim.logs[_local.rank].append(event)


def kill_launched_ranks(strategy: object) -> None:
    """Rank 0 of Lightning's own launcher started the other ranks: kill them (before this process exits on an
    error the others would otherwise wait on in their next collective)."""
    import signal

    launcher = getattr(strategy, "launcher", None)
    if launcher is not None and getattr(launcher, "procs", None) and hasattr(launcher, "kill"):
        launcher.kill(signal.SIGKILL)
