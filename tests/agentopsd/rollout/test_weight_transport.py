"""The weight transport of asynchronous rollouts (:mod:`agentopsd.rollout.weight_transport`) and ``rollout.devices``.

The collective channel runs here exactly as on GPUs but over gloo: this test process is the trainer, a spawned
process the worker, which builds its own policy (in bf16 here, the worker's dtype on a GPU) and takes the first
publish whole. Each version streams in buckets of a few bytes (tensors split across them) straight into that policy,
which then equals the trainer's weights in its dtype; a publish waits for the worker's turn; a killed worker or
trainer ends the other side within a timeout. NCCL itself never ran here.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from agentopsd.config import RolloutConfig
from agentopsd.rollout.async_rollout import worker_device_env
from agentopsd.rollout.weight_transport import (
    CollectiveSender,
    check_devices_at_start,
    collective_backend,
    plan_buckets,
    receive_buckets,
    resolve_transport,
    send_buckets,
    wire_layout,
)

CTX = mp.get_context("spawn")
WAIT = 60.0
"""Seconds a test waits for a spawned process' first report (it imports torch)."""
WIRE = torch.bfloat16
"""The worker's dtype in these tests (a GPU worker's)."""
CAP = 40
"""Bytes per bucket: smaller than the first layer's weight, which then spans buckets."""


def _model() -> nn.Module:
    """A frozen tensor the transport sends only in the first (full) publish."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Linear(8, 2), nn.Linear(2, 2))
    model[2].requires_grad_(False)
    return model


def _worker_model(device: str = "cpu", dtype: torch.dtype = WIRE) -> nn.Module:
    """The worker's own policy: the same architecture, other (random) weights, in its dtype."""
    torch.manual_seed(123)
    return nn.Sequential(nn.Linear(3, 8), nn.Linear(8, 2), nn.Linear(2, 2)).to(device, dtype).requires_grad_(False)


def _bump(model: nn.Module, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def _params(model: nn.Module) -> list:
    """By value (numpy, float32): a tensor would cross the queue by a handle that dies with the process that sent it."""
    return [p.detach().float().numpy().copy() for p in model.parameters()]


def _same(model: nn.Module, weights: list, trainable: bool = False) -> bool:
    """The trainer's weights (``trainable``: those a later publish sends), rounded to the wire's dtype, equal the
    worker's."""
    return all(torch.equal(a.detach().to(WIRE).float(), torch.from_numpy(b))
               for a, b in zip(model.parameters(), weights) if a.requires_grad or not trainable)


# ------------------------------------------------------------------ buckets (pure, in one process)


def test_buckets_are_bounded_and_cover_every_byte_once():
    sizes = [10, 100, 3, 0, 50]
    plan = plan_buckets(sizes, 32)
    assert all(sum(stop - start for _, start, stop in b) <= 32 for b in plan)
    assert all(sum(stop - start for _, start, stop in b) == 32 for b in plan[:-1])  # no room left unused
    covered: dict[int, list[tuple[int, int]]] = {}
    for bucket in plan:
        for index, start, stop in bucket:
            covered.setdefault(index, []).append((start, stop))
    for index, size in enumerate(sizes):
        ranges = covered.get(index, [])
        assert [r for r in ranges if r[0] < r[1]] == ranges and (not ranges or ranges[0][0] == 0), (index, ranges)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and (ranges[-1][1] if ranges else 0) == size


def test_buckets_stream_straight_into_the_workers_policy_in_its_dtype():
    model, worker = _model(), _worker_model()
    wire: list[torch.Tensor] = []

    def send(bucket: torch.Tensor) -> bool:
        assert bucket.numel() <= CAP  # the sender holds one bucket of at most CAP bytes
        wire.append(bucket.clone())
        return True

    full = wire_layout(model, WIRE, full=True)
    assert send_buckets(model, full, CAP, "cpu", send)
    assert sum(b.numel() for b in wire) == sum(p.numel() for p in model.parameters()) * 2  # bf16 on the wire
    receive_buckets(worker, full, CAP, "cpu", lambda bucket: bucket.copy_(wire.pop(0)))
    assert not wire and _same(model, _params(worker))
    _bump(model, 1.0)
    trainable = wire_layout(model, WIRE, full=False)
    assert "2.weight" not in {s.name for s in trainable}  # frozen: only in the full sync
    send_buckets(model, trainable, CAP, "cpu", send)
    receive_buckets(worker, trainable, CAP, "cpu", lambda bucket: bucket.copy_(wire.pop(0)))
    for (name, a), b in zip(model.named_parameters(), worker.parameters()):
        assert torch.equal(a.detach().to(WIRE), b) != name.startswith("2."), name
    with pytest.raises(ValueError, match="wire's dtype"):  # a float32 policy cannot take bf16 bytes
        receive_buckets(_worker_model(dtype=torch.float32), trainable, CAP, "cpu", lambda bucket: None)


# ------------------------------------------------------------------ processes (module-level: they cross the spawn)


def _follow(receiver, out, last: int, busy_seconds: float) -> None:
    """A worker: build its policy, take the first (full) publish, report it; then a 'turn' of ``busy_seconds`` that
    takes nothing; then report each version it takes until ``last``."""
    policy = _worker_model()
    receiver.start("cpu")
    version = -1
    try:
        while version < 0:
            version = receiver.load_into(policy, version)
            time.sleep(0.005)
        out.put(("started", version, _params(policy)))
        time.sleep(busy_seconds)
        while version < last and not receiver.closed:
            got = receiver.load_into(policy, version)
            if got > version:
                version = got
                out.put(("loaded", version, _params(policy)))
            time.sleep(0.005)
        while not receiver.closed:  # the trainer's close: the sentinel
            receiver.load_into(policy, version)
            time.sleep(0.005)
    except Exception as err:  # noqa: BLE001  (the receiver's failure ends this worker, as the real one)
        out.put(("failed", str(err), None))
        return
    out.put(("ended", True, None))


def _publish(sender: CollectiveSender, model: nn.Module, version: int, worker) -> tuple[bool, float]:
    t0 = time.monotonic()
    return sender.publish(model, version, worker.is_alive), time.monotonic() - t0


def _trainer(out) -> None:
    """A trainer that spawns its worker, publishes version 0 (full) and 1, reports the worker's pid, then waits to be
    killed."""
    model = _model()
    sender = CollectiveSender(model, WIRE, "cpu", "cpu", max_bytes=CAP)
    reports = CTX.Queue()
    worker = CTX.Process(target=_follow, args=(sender.receiver, reports, 10**9, 0.0), daemon=True)
    worker.start()
    sender.connect()
    sender.publish(model, 0, worker.is_alive)
    reports.get(timeout=WAIT)
    _bump(model, 1.0)
    sender.publish(model, 1, worker.is_alive)
    reports.get(timeout=WAIT)
    out.put(worker.pid)
    time.sleep(600)


def _start_worker(model: nn.Module, last: int, busy_seconds: float = 0.0):
    sender = CollectiveSender(model, WIRE, "cpu", "cpu", timeout=30.0, max_bytes=CAP)
    reports = CTX.Queue()
    worker = CTX.Process(target=_follow, args=(sender.receiver, reports, last, busy_seconds), daemon=True)
    worker.start()
    sender.connect()
    assert sender.publish(model, 0, worker.is_alive)  # the full sync: the worker's own policy takes every weight
    kind, version, weights = reports.get(timeout=WAIT)
    assert (kind, version) == ("started", 0) and _same(model, weights)
    return sender, worker, reports


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# ------------------------------------------------------------------ the collective channel between two processes


def test_collective_publishes_whole_versions_to_a_spawned_worker():
    model = _model()
    sender, worker, reports = _start_worker(model, last=3)
    try:
        for version in (1, 2, 3):
            _bump(model, float(version))
            assert sender.publish(model, version, worker.is_alive)
            kind, got, weights = reports.get(timeout=WAIT)
            assert (kind, got) == ("loaded", version)
            assert _same(model, weights, trainable=True)
        sender.close()
        assert reports.get(timeout=WAIT) == ("ended", True, None)
    finally:
        sender.close()
        worker.join(WAIT)
    assert worker.exitcode == 0


def test_a_publish_waits_for_the_turn_in_flight_then_streams():
    """The worker takes a version between turns, straight into its policy: a publish during a turn returns once the
    turn has ended and the buckets are in (no staging copy holds them meanwhile)."""
    model = _model()
    busy = 2.0
    sender, worker, reports = _start_worker(model, last=1, busy_seconds=busy)
    try:
        _bump(model, 1.0)
        ok, took = _publish(sender, model, 1, worker)
        assert ok and took > busy / 2, f"the publish returned after {took:.1f}s, inside the worker's {busy:.0f}s turn"
        kind, got, weights = reports.get(timeout=WAIT)
        assert (kind, got) == ("loaded", 1) and _same(model, weights, trainable=True)
    finally:
        sender.close()
        worker.join(WAIT)


def test_a_killed_worker_ends_the_publish_at_once():
    model = _model()
    sender, worker, reports = _start_worker(model, last=10)
    try:
        assert sender.publish(model, 1, worker.is_alive)
        reports.get(timeout=WAIT)
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(WAIT)
        t0 = time.monotonic()
        assert not sender.publish(model, 2, worker.is_alive)  # nothing sent; the producer reports the dead worker
        assert time.monotonic() - t0 < 5.0
    finally:
        sender.close()


def test_a_killed_trainer_ends_its_worker():
    reports = CTX.Queue()
    trainer = CTX.Process(target=_trainer, args=(reports,))  # not a daemon: it spawns its worker
    trainer.start()
    worker_pid = None
    try:
        worker_pid = reports.get(timeout=2 * WAIT)
        assert _alive(worker_pid)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.join(WAIT)
        deadline = time.monotonic() + 15.0
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker_pid), "the worker outlived its trainer"
    finally:
        trainer.kill()
        trainer.join(WAIT)
        if worker_pid is not None and _alive(worker_pid):  # when the test fails: no orphan left behind
            os.kill(worker_pid, signal.SIGKILL)


# ------------------------------------------------------------------ settings


def test_transport_and_backend_choices():
    assert resolve_transport("auto", None) == "shared_memory"
    assert resolve_transport("auto", [1]) == "collective"
    assert resolve_transport("shared_memory", [1]) == "shared_memory"
    assert collective_backend("cuda:0", "cuda:0") == "nccl"
    assert collective_backend("cpu", "cpu") == "gloo"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"devices": [1]}, "max_staleness >= 1"),
    ({"weight_transport": "collective"}, "max_staleness >= 1"),
    ({"max_staleness": 1, "devices": [1, 1]}, "each GPU once"),
    ({"max_staleness": 1, "devices": [-1]}, "non-negative"),
    ({"max_staleness": 1, "devices": [True]}, "non-negative"),
    ({"max_staleness": 1, "devices": "1"}, "list of GPU indices"),
    ({"max_staleness": 1, "weight_transport": "nccl"}, "auto, shared_memory, collective"),
])
def test_config_refuses_bad_rollout_devices(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        RolloutConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_config_accepts_rollout_devices():
    assert RolloutConfig(max_staleness=1, devices=[2, 3]).devices == [2, 3]
    assert RolloutConfig(max_staleness=1, devices=(2,), weight_transport="shared_memory").devices == [2]


@pytest.mark.parametrize(("args", "env", "message"), [
    (([1], "collective", "cpu", 0, 1, None), {}, "needs the trainer on CUDA"),
    ((None, "collective", "cuda:0", 0, 1, 2), {}, "needs rollout.devices"),
    (([2], "collective", "cuda:0", 0, 2, 4), {}, "2 training processes"),
    (([2, 3], "collective", "cuda:0", 0, 4, 4), {"LOCAL_WORLD_SIZE": "1"}, "for 1 training processes"),
    (([0, 1], "collective", "cuda:1", 1, 2, 4), {}, "trainer's own GPU"),
    (([2, 4], "collective", "cuda:1", 1, 2, 4), {"LOCAL_RANK": "1"}, "sees 4 GPUs"),
])
def test_producer_start_refuses_bad_rollout_devices(args, env, message):
    with pytest.raises(ValueError, match=message) as err:
        check_devices_at_start(*args, env=env)
    assert "\n" not in str(err.value)


def test_each_local_rank_takes_its_rollout_gpu():
    assert check_devices_at_start([2, 3], "collective", "cuda:0", 0, 2, 4, env={}) == 2
    assert check_devices_at_start([2, 3], "collective", "cuda:1", 1, 2, 4, env={}) == 3
    # two nodes of two: global rank 3 is local rank 1
    assert check_devices_at_start([2, 3], "collective", "cuda:1", 3, 4, 4, env={"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == 3
    assert check_devices_at_start(None, "shared_memory", "cuda:0", 0, 1, 1, env={}) is None
    assert check_devices_at_start(None, "collective", "cpu", 0, 1, None, env={}) is None  # gloo: the tests' path


def test_the_producer_refuses_rollout_devices_before_spawning_a_worker():
    """A CPU trainer with rollout.devices: refused in AsyncRollout's constructor, with no worker started."""
    from agentopsd.rollout.async_rollout import AsyncRollout, WorkerSpec

    spec = WorkerSpec(tokenizer=None, env=None, rollout=RolloutConfig(max_staleness=1, devices=[1]), seed=0, rank=0,
                      world=1, with_teacher=False, task_fn=None, start=0, end=1, max_staleness=1, threads=1,
                      parent_pid=os.getpid(), device="cpu")
    before = mp.active_children()
    with pytest.raises(ValueError, match="needs the trainer on CUDA"):
        AsyncRollout(spec, _model())
    assert mp.active_children() == before


def test_a_worker_with_a_rollout_gpu_sees_only_that_gpu():
    assert worker_device_env("cuda:0", None, 2) == {"CUDA_VISIBLE_DEVICES": "2"}
    assert worker_device_env("cuda:1", "4,5,6,7", 3) == {"CUDA_VISIBLE_DEVICES": "7"}  # the trainer's numbering
    assert worker_device_env("cuda:1", "4,5,6,7", None) == {"CUDA_VISIBLE_DEVICES": "5"}  # unset: beside the trainer
    assert worker_device_env("cpu", "4,5", 1) == {}
