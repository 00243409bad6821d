"""The weight transport of asynchronous rollouts (:mod:`agentopsd.rollout.weight_transport`) and ``rollout.devices``.

The collective channel runs here exactly as on GPUs but over gloo: this test process is the trainer, a spawned
process the worker. Each version published reaches the worker's policy whole; a publish returns while the worker
is busy in a turn; a killed worker or trainer ends the other side within a timeout. NCCL itself never ran here.
"""

from __future__ import annotations

import copy
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
    bucket_layout,
    check_devices_at_start,
    collective_backend,
    flatten,
    resolve_transport,
    unflatten_into,
)

CTX = mp.get_context("spawn")
WAIT = 60.0
"""Seconds a test waits for a spawned process' first report (it imports torch)."""


def _model() -> nn.Module:
    """Two dtypes (two buckets) and a frozen tensor the transport must leave alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2).double(), nn.Linear(2, 2))
    model[2].requires_grad_(False)
    return model


def _bump(model: nn.Module, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def _params(model: nn.Module) -> list[torch.Tensor]:
    """By value (numpy): a tensor would cross the queue by a handle that dies with the process that sent it."""
    return [p.detach().numpy().copy() for p in model.parameters()]


# ------------------------------------------------------------------ processes (module-level: they cross the spawn)


def _follow(receiver, out, last: int, busy_seconds: float) -> None:
    """A worker: report each version it loads (and its weights) until ``last``; first ``busy_seconds`` in a 'turn'
    that loads nothing."""
    receiver.start("cpu")
    policy = copy.deepcopy(receiver.model)
    version = receiver.load_into(policy, -1)
    out.put(("started", version, os.getpid()))
    time.sleep(busy_seconds)
    try:
        while version < last:
            if receiver.available() > version:
                version = receiver.load_into(policy, version)
                out.put(("loaded", version, _params(policy)))
            time.sleep(0.005)
    except Exception as err:  # noqa: BLE001  (the receiver's failure ends this worker, as the real one)
        out.put(("failed", str(err), None))
        return
    out.put(("ended", receiver.ended(WAIT), None))  # the trainer's close ends the receiver thread


def _trainer(out) -> None:
    """A trainer that spawns its worker, publishes version 1, reports the worker's pid, then waits to be killed."""
    model = _model()
    sender = CollectiveSender(model, 0, "cpu", "cpu")
    reports = CTX.Queue()
    worker = CTX.Process(target=_follow, args=(sender.receiver, reports, 10**9, 0.0), daemon=True)
    worker.start()
    sender.connect()
    reports.get(timeout=WAIT)
    _bump(model, 1.0)
    sender.publish(model, 1, worker.is_alive)
    reports.get(timeout=WAIT)
    out.put(worker.pid)
    time.sleep(600)


def _start_worker(model: nn.Module, last: int, busy_seconds: float = 0.0):
    sender = CollectiveSender(model, 0, "cpu", "cpu", timeout=30.0)
    reports = CTX.Queue()
    worker = CTX.Process(target=_follow, args=(sender.receiver, reports, last, busy_seconds), daemon=True)
    worker.start()
    sender.connect()
    kind, version, _ = reports.get(timeout=WAIT)
    assert (kind, version) == ("started", 0)
    return sender, worker, reports


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# ------------------------------------------------------------------ the collective channel between two processes


def test_buckets_round_trip_every_trainable_tensor():
    model, other = _model(), _model()
    _bump(other, 5.0)
    layout = bucket_layout(model)
    assert [b.dtype for b in layout] == [torch.float32, torch.float64]  # one flat buffer per dtype
    assert "2.weight" not in {n for b in layout for n in b.names}  # frozen: never sent
    unflatten_into(other, layout, flatten(model, layout, "cpu"))
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(a, b) != name.startswith("2."), name


def test_collective_publishes_whole_versions_to_a_spawned_worker():
    model = _model()
    sender, worker, reports = _start_worker(model, last=3)
    try:
        for version in (1, 2, 3):
            _bump(model, float(version))
            assert sender.publish(model, version, worker.is_alive)
            kind, got, weights = reports.get(timeout=WAIT)
            assert (kind, got) == ("loaded", version)
            for (name, a), b in zip(model.named_parameters(), weights):
                if a.requires_grad:
                    assert torch.equal(a, torch.from_numpy(b)), (version, name)
        sender.close()
        assert reports.get(timeout=WAIT) == ("ended", True, None)
    finally:
        sender.close()
        worker.join(WAIT)
    assert worker.exitcode == 0


def test_publish_returns_while_the_worker_is_busy_in_a_turn():
    model = _model()
    busy = 3.0
    sender, worker, reports = _start_worker(model, last=3, busy_seconds=busy)
    try:
        t0 = time.monotonic()
        for version in (1, 2, 3):
            _bump(model, 1.0)
            assert sender.publish(model, version, worker.is_alive)
        took = time.monotonic() - t0
        assert took < busy / 2, f"three publishes took {took:.1f}s: they waited for the worker's turn"
        kind, got, weights = reports.get(timeout=WAIT)  # after its turn the worker loads the newest at once
        assert (kind, got) == ("loaded", 3)
        assert all(torch.equal(a, torch.from_numpy(b)) for a, b in zip(model.parameters(), weights) if a.requires_grad)
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
