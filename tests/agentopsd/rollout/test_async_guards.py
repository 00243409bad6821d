"""What a stuck or dead rollout worker does to the trainer: a clear line within a deadline, never a hang.

- a worker alive but stuck (its start, a turn) fails ``next_batch`` after ``rollout.worker_stall_seconds``;
- the collective transport's private group is proven by one small collective at ``connect`` (NCCL starts its
  communicator lazily, inside the first collective), with a Python deadline shorter than the group's own timeout;
- ``rollout.devices`` per local rank on several nodes without ``LOCAL_WORLD_SIZE`` (Lightning's own launcher);
- the worker's engine, never asleep, never empties the CUDA cache before a turn.

Gloo on CPU throughout: NCCL never ran here.
"""

from __future__ import annotations

import datetime
import os
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from agentopsd.config import RolloutConfig
from agentopsd.rollout import factory
from agentopsd.rollout import weight_transport as wt
from agentopsd.rollout.async_rollout import (
    AsyncRollout,
    Progress,
    RolloutWorkerError,
    WorkerSpec,
    stalled_for,
)

CTX = mp.get_context("spawn")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _policy(device: str, dtype: torch.dtype) -> nn.Module:
    """The worker's own policy (picklable): the first publish fills it."""
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(device, dtype)


def _hang() -> None:
    """A worker stuck in its start (as in an engine start that never returns): alive, silent."""
    time.sleep(3600)


def _hang_after_the_first_sync() -> None:
    """A worker that takes its first weights, then is stuck starting its generator."""
    from agentopsd.rollout import factory

    factory.prompt_builder = lambda *a, **k: time.sleep(3600)


def _exit_at_once() -> None:
    os._exit(3)


def _spec(rollout: RolloutConfig, worker_init) -> WorkerSpec:
    return WorkerSpec(tokenizer=None, env=None, rollout=rollout, seed=0, rank=0, world=1, with_teacher=False,
                      task_fn=None, start=0, end=2, max_staleness=1, threads=1, parent_pid=os.getpid(), device="cpu",
                      worker_init=worker_init, policy=_policy)


# ------------------------------------------------------------------ E: a worker alive but stuck


@pytest.mark.timeout(120)  # without a deadline next_batch waits forever on a live, silent worker
@pytest.mark.parametrize("transport", ["shared_memory", "collective"])
def test_a_stuck_worker_ends_next_batch_within_its_deadline(transport):
    rollout = RolloutConfig(max_staleness=1, worker_stall_seconds=3.0, weight_transport=transport)
    t0 = time.monotonic()
    # the worker's one full sync at start waits for it to build its policy: a worker stuck before that (as in an
    # engine start that never returns) fails the producer's start, or its first batch, within the deadline
    with pytest.raises(RolloutWorkerError) as err:
        producer = AsyncRollout(_spec(rollout, _hang), _model())
        try:
            producer.next_batch(0, lambda: False)
        finally:
            producer.close()
    waited = time.monotonic() - t0
    message = str(err.value)
    assert "\n" not in message
    assert "rollout.worker_stall_seconds" in message
    assert 3.0 <= waited < 30.0
    # the run ends cleanly: the stuck worker is killed, even when the producer failed in its start
    assert not [p for p in CTX.active_children() if p.name.startswith("agentopsd-rollout")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shared_memory", "collective"])
def test_a_worker_stuck_after_its_first_sync_ends_next_batch_within_its_deadline(transport):
    rollout = RolloutConfig(max_staleness=1, worker_stall_seconds=3.0, weight_transport=transport)
    producer = AsyncRollout(_spec(rollout, _hang_after_the_first_sync), _model())
    try:
        t0 = time.monotonic()
        with pytest.raises(RolloutWorkerError) as err:
            producer.next_batch(0, lambda: False)
        waited = time.monotonic() - t0
        message = str(err.value)
        assert "\n" not in message and producer.process.is_alive()  # stuck, not dead: only the deadline ends it
        assert "made no progress" in message and "rollout.worker_stall_seconds=3" in message
        assert "(last: taking the first weights)" in message  # what stalled: the step after the first sync
        assert 3.0 <= waited < 30.0
    finally:
        producer.close()
    assert not producer.process.is_alive()


def test_progress_marks_a_new_step_at_once_and_repeats_at_most_every_few_seconds():
    sent: list = []
    now = [0.0]

    class Out:
        def put(self, item) -> None:
            sent.append(item[2])

    progress = Progress(Out(), every=5.0, clock=lambda: now[0])
    progress.mark(0, "starting")
    progress.mark(0, "playing iteration 0")
    now[0] = 1.0
    progress.mark(0, "playing iteration 0")  # a turn 1 s later: not sent
    now[0] = 6.0
    progress.mark(0, "playing iteration 0")  # 5 s on: sent
    progress.mark(1, "playing iteration 1")
    assert sent == ["starting", "playing iteration 0", "playing iteration 0", "playing iteration 1"]


def test_the_stall_counts_from_the_later_of_the_wait_and_the_last_mark():
    # a worker idle for an hour while the trainer updated is not stalled once the trainer starts to wait
    assert stalled_for(now=3700.0, waiting_since=3690.0, last_progress=100.0) == 10.0
    assert stalled_for(now=3700.0, waiting_since=3000.0, last_progress=3650.0) == 50.0
    assert stalled_for(now=50.0, waiting_since=0.0, last_progress=float("-inf")) == 50.0


def test_the_stall_setting_is_checked_and_has_a_generous_default():
    assert RolloutConfig().worker_stall_seconds >= 600  # a large model's engine start fits
    with pytest.raises(ValueError, match="worker_stall_seconds must be > 0"):
        RolloutConfig(worker_stall_seconds=0)


# ------------------------------------------------------------------ F: the private group starts at connect


class _LazyGroup:
    """NCCL's behaviour without a GPU: the constructor returns at once; the first collective starts the communicator
    and blocks, with no timeout, until the other member joins (here it never does)."""

    def broadcast(self, tensors, opts):
        threading.Event().wait()  # forever


def _publish_in_thread(sender, model, alive):
    """``sender.publish`` in a daemon thread (a hang must fail the test, not hold it): (outcome, seconds)."""
    result: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            result["outcome"] = sender.publish(model, 1, alive)
        except BaseException as err:  # noqa: BLE001  (the test inspects it)
            result["outcome"] = err
        result["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30.0)
    assert not thread.is_alive(), "publish hung in the group's start"
    return result["outcome"], result["seconds"]


def test_a_worker_that_never_joins_fails_the_first_publish_within_the_connect_deadline(monkeypatch):
    monkeypatch.setattr(wt, "private_group", lambda *a, **k: _LazyGroup())
    model = _model()
    sender = wt.CollectiveSender(model, torch.float32, "cpu", "cpu", timeout=5.0, connect_timeout=2.0)
    sender.connect()
    outcome, seconds = _publish_in_thread(sender, model, lambda: True)
    assert isinstance(outcome, wt.WeightTransferError)
    assert "did not join the weight transfer group within 2s" in str(outcome) and "\n" not in str(outcome)
    assert seconds < 10.0


def test_a_worker_dead_before_it_joins_ends_the_publish_at_once(monkeypatch):
    monkeypatch.setattr(wt, "private_group", lambda *a, **k: _LazyGroup())
    model = _model()
    sender = wt.CollectiveSender(model, torch.float32, "cpu", "cpu", timeout=60.0, connect_timeout=60.0)
    sender.connect()
    outcome, seconds = _publish_in_thread(sender, model, lambda: False)
    assert outcome is False and sender.broken and seconds < 5.0  # nothing sent; the producer reports the dead worker


def _join_only(port: int, timeout: float) -> None:
    """A worker that joins the gloo group (its rendezvous) and then hangs before the first collective."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=timeout))
    group = wt.private_group(store, 1, "gloo", timeout)  # noqa: F841  (held: the member stays in the group)
    time.sleep(3600)


@pytest.mark.timeout(120)
def test_connect_waits_for_a_collective_not_only_the_rendezvous():
    model = _model()
    sender = wt.CollectiveSender(model, torch.float32, "cpu", "cpu", timeout=5.0, connect_timeout=8.0)
    worker = CTX.Process(target=_join_only, args=(sender.store.port, sender.group_timeout), daemon=True)
    worker.start()
    try:
        sender.connect()
        deadline = time.monotonic() + 60.0
        with pytest.raises(wt.WeightTransferError, match="did not join the weight transfer group within 8s"):
            while time.monotonic() < deadline:  # the rendezvous is done within seconds; the handshake never is
                assert not sender.connected()
                time.sleep(0.1)
    finally:
        worker.kill()
        worker.join(10)


@pytest.mark.timeout(120)
def test_a_worker_never_started_fails_the_producer_within_the_deadline():
    """A real gloo group whose other member dies before joining: next_batch says so in one line."""
    rollout = RolloutConfig(max_staleness=1, worker_stall_seconds=60.0, weight_transport="collective")
    producer = AsyncRollout(_spec(rollout, _exit_at_once), _model())
    try:
        with pytest.raises(RolloutWorkerError, match="exited with code 3"):
            producer.next_batch(0, lambda: False)
        assert producer.sender.publish(_model(), 1, producer.process.is_alive) is False
    finally:
        producer.close()


def test_the_groups_own_timeout_outlasts_every_python_deadline(monkeypatch):
    seen: list[float] = []

    def record(store, rank, backend, timeout):
        seen.append(timeout)
        return _LazyGroup()

    monkeypatch.setattr(wt, "private_group", record)
    sender = wt.CollectiveSender(_model(), torch.float32, "cpu", "cpu", timeout=5.0, connect_timeout=7.0)
    sender.connect()
    deadline = time.monotonic() + 10.0
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    # NCCL's watchdog aborts the process at the group's timeout: the Python side must fail first, in one line
    assert seen and seen[0] > 7.0 and sender.group_timeout > 7.0
    assert wt.group_timeout(5.0, 7.0) > 7.0


# ------------------------------------------------------------------ H: the local world on several nodes


def test_two_nodes_of_two_without_local_world_size():
    # Lightning's own launcher sets LOCAL_RANK but no LOCAL_WORLD_SIZE: the strategy's devices per node decide
    env = {"LOCAL_RANK": "1", "NODE_RANK": "1", "WORLD_SIZE": "4"}
    assert wt.local_world(4, env, per_node=2) == 2
    assert wt.check_devices_at_start([2, 3], "collective", "cuda:1", 3, 4, 4, env=env, per_node=2) == 3
    # under SLURM (srun --ntasks-per-node=2) with no strategy at hand
    slurm = {"LOCAL_RANK": "1", "SLURM_NTASKS_PER_NODE": "2"}
    assert wt.local_world(4, slurm) == 2
    assert wt.local_world(6, {"SLURM_NTASKS_PER_NODE": "2(x3)"}) == 2
    assert wt.check_devices_at_start([2, 3], "collective", "cuda:1", 3, 4, 4, env=slurm) == 3
    # torchrun's own count wins; one node without any of them is the world
    assert wt.local_world(4, {"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "4"}, per_node=4) == 2
    assert wt.local_world(2, {}) == 2


def test_the_placement_carries_the_strategys_devices_per_node():
    from agentopsd.rollout.source import Placement

    assert Placement(_model(), 0, torch.device("cpu"), per_node=2).per_node == 2
    assert WorkerSpec.__dataclass_fields__["per_node"].default is None


# ------------------------------------------------------------------ I: no cache emptied per turn


class _Engine:
    """A vLLM-like generator: it can sleep; ``asleep`` says whether its memory was handed back."""

    def __init__(self) -> None:
        self.asleep = False

    def sleep(self) -> None:
        self.asleep = True

    def sync_weights(self, model, step=None) -> None:
        self.asleep = False


def test_an_engine_awake_never_empties_the_cache_and_a_sleeping_one_does(monkeypatch):
    emptied: list[int] = []  # a CUDA machine, faked: each empty_cache is a device-wide synchronisation
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    model, engine = _model(), _Engine()
    for turn in range(5):  # the worker: a sync before every turn, its engine never asleep
        factory.engine_sync(engine, model, step=turn // 2)
    assert len(emptied) == 0
    factory.engine_sleep(engine)  # lockstep: the engine handed its memory back for the update
    factory.engine_sync(engine, model, step=3)
    assert len(emptied) == 1
