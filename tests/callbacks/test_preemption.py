"""A run that survives its cluster: SIGTERM/SIGUSR1 stop it at a safe point with a checkpoint,
and ``ckpt_path=last`` continues the same task stream."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from agentopsd.callbacks.checkpoint import IterationCheckpoint
from agentopsd.callbacks.credit import CreditCallback
from agentopsd.callbacks.preemption import PreemptionCallback
from agentopsd.training.data import TaskDataModule
from agentopsd.training.preemption import Preempted, RolloutStopped, StopRequest
from tests.agentopsd.training.test_module import _task_batch, make_module
from tests.conftest import TOY_ID
from tests.test_train import ROOT, run_train, shard_records


def test_exit_code_names_the_signal():
    assert Preempted("SIGTERM", 3, update_done=True).exit_code == 143
    assert Preempted("SIGUSR1", 3, update_done=False).exit_code == 128 + signal.SIGUSR1


def test_unknown_signal_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="SIGTERM"):
        PreemptionCallback(IterationCheckpoint(str(tmp_path)), signals=("SIGTERMM",))


def test_stop_request_keeps_the_first_signal():
    request = StopRequest()
    assert not request.requested and not request.agreed()
    request.set("SIGUSR1")
    request.set("SIGTERM")
    assert request.signal_name == "SIGUSR1" and request.agreed()


def test_rollout_stops_between_turns_and_is_abandoned(tiny_walk_policy):
    module = make_module(tiny_walk_policy)
    module.trainer = None
    checks = []

    def stop_from_third_turn() -> bool:
        checks.append(1)
        return len(checks) > 2

    module.collector.stop_requested = stop_from_third_turn
    module.stop_request.set("SIGTERM")
    with pytest.raises(Preempted) as info:
        module.rollout(_task_batch(5))
    assert info.value.iteration == 5 and not info.value.update_done
    assert len(checks) == 3  # two turns were played, the third never started
    assert module.model.training  # train mode restored on the way out


def test_collector_raises_when_asked_to_stop(tiny_walk_policy):
    module = make_module(tiny_walk_policy)
    module.trainer = None
    module.collector.stop_requested = lambda: True
    with pytest.raises(RolloutStopped):
        module.collector.collect(_task_batch(0).tasks, with_teacher=False)


class _SignalAt(L.Callback):
    """Sends a real signal to this process at a chosen point of the fit."""

    def __init__(self, signum: int, hook: str, iteration: int) -> None:
        self.signum, self.hook, self.iteration = signum, hook, iteration

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.hook == "update" and pl_module.iteration == self.iteration:
            os.kill(os.getpid(), self.signum)  # arrives during the update: the iteration is kept


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_during_update_keeps_the_iteration(tiny_walk_policy, tmp_path, signum):
    module = make_module(tiny_walk_policy, iterations=4)
    checkpoint = IterationCheckpoint(str(tmp_path), every_n_iterations=100)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[PreemptionCallback(checkpoint), CreditCallback(), checkpoint, _SignalAt(signum, "update", 1)])
    previous = signal.getsignal(signum)
    with pytest.raises(Preempted) as info:
        trainer.fit(module, datamodule=TaskDataModule(TOY_ID, tasks_per_batch=2, group_size=3, num_iterations=4))
    assert info.value.update_done and info.value.signal_name == signal.Signals(signum).name
    assert signal.getsignal(signum) == previous  # handlers restored after the fit
    state = torch.load(checkpoint.last_path, weights_only=False)
    assert state["agentopsd"]["iterations_done"] == 2
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["position"] == 2


def test_abandoned_iteration_rewinds_the_stream(tiny_walk_policy, tmp_path):
    module = make_module(tiny_walk_policy, iterations=4)
    checkpoint = IterationCheckpoint(str(tmp_path), every_n_iterations=100)

    class SignalInRollout(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if pl_module.iteration == 0:
                pl_module.collector.stop_requested = lambda: True  # as if a signal came during the next rollout
                pl_module.stop_request.set("SIGTERM")

    # the stop check in on_train_batch_end would fire first: request it only for the rollout
    module.on_train_batch_end = lambda *a: None
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[PreemptionCallback(checkpoint), CreditCallback(), checkpoint, SignalInRollout()])
    with pytest.raises(Preempted) as info:
        trainer.fit(module, datamodule=TaskDataModule(TOY_ID, tasks_per_batch=2, group_size=3, num_iterations=4))
    assert info.value.iteration == 1 and not info.value.update_done
    state = torch.load(checkpoint.last_path, weights_only=False)
    assert state["agentopsd"]["iterations_done"] == 1
    # iteration 1 was drawn but never trained: the resumed stream starts there
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["position"] == 1



def _csv_rows(folder: Path) -> list[dict[str, str]]:
    import csv

    return [row for f in sorted(folder.glob("version_*/metrics.csv")) for row in csv.DictReader(f.open())]


def test_a_stop_during_a_periodic_evaluation_loses_nothing(tiny_walk_policy, tmp_path):
    """SIGTERM during iteration 2's update: the evaluation due after it starts, is dropped at its first turn, and
    the run stops with iteration 2 kept. Iteration 2's metrics still reach the CSV, and the resumed run evaluates
    after iteration 2 before it trains on: a curve with no hole, every iteration's row once."""
    from lightning.pytorch.loggers import CSVLogger

    from agentopsd.callbacks.evaluation import EvaluationCallback

    def fit(module, *extra, ckpt_path=None):
        checkpoint = IterationCheckpoint(str(tmp_path / "checkpoints"), every_n_iterations=100)
        evaluation = EvaluationCallback(every_n_iterations=2, before_training=False)
        trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=CSVLogger(tmp_path, name="csv"), enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                            callbacks=[PreemptionCallback(checkpoint), CreditCallback(), evaluation, checkpoint, *extra])
        trainer.fit(module, datamodule=TaskDataModule(TOY_ID, tasks_per_batch=2, group_size=3, num_iterations=4), ckpt_path=ckpt_path)
        return checkpoint, evaluation

    first = make_module(tiny_walk_policy, iterations=4)
    with pytest.raises(Preempted) as info:
        fit(first, _SignalAt(signal.SIGTERM, "update", 1))
    assert info.value.update_done and first.iterations_done == 2
    assert first.eval_history == []  # the periodic evaluation was dropped, not half recorded
    trained = [int(r["step"]) for r in _csv_rows(tmp_path / "csv") if r.get("rollout/success")]
    assert trained == [1, 2]

    second = make_module(tiny_walk_policy, iterations=4)
    checkpoint, evaluation = fit(second, ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))
    assert [int(m["eval/iteration"]) for m in second.eval_history] == [2, 4]
    rows = _csv_rows(tmp_path / "csv")
    assert [int(r["step"]) for r in rows if r.get("rollout/success")] == [1, 2, 3, 4]
    assert [int(r["step"]) for r in rows if r.get("eval/success")] == [2, 4]


def _wait_for_shards(out: Path, n: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(list((out / "rollouts").glob("*.tar"))) < n:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_real_signal_to_a_real_run_then_resume(processes, tmp_path):
    out = tmp_path / f"p{processes}"
    common = [
        "experiment=babyai_tiny", f"output_dir={out}", "num_iterations=6", "checkpoint.every_n_iterations=100",
        "evaluation.num_tasks=2", "evaluation.every_n_iterations=1", "trainer.enable_progress_bar=false", "data.tasks_per_batch=2",
    ]
    if processes == 2:
        common += ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.Popen([sys.executable, "train.py", *common], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_shards(out, 2, proc, timeout=600)
        proc.send_signal(signal.SIGTERM)  # to rank 0 only: the ranks agree and stop together
        sent = time.monotonic()
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert time.monotonic() - sent < 60, "the run did not stop within a bounded time"
    assert proc.returncode == 143, output[-3000:]
    assert "stopped by SIGTERM" in output and "ckpt_path=last" in output
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    done = state["agentopsd"]["iterations_done"]
    assert 2 <= done < 6
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["position"] == done
    run_train(*common, "ckpt_path=last", timeout=900)
    # every iteration trained exactly once, on the same task stream: one shard each, no gaps
    assert list(shard_records(out)) == [f"rollouts-{i:06d}.tar" for i in range(1, 7)]  # numbered by completed iterations
    # and one CSV row each, and an evaluation after every one (wherever the signal landed: in a rollout, an
    # update, or the evaluation after it, which the resumed run makes up)
    rows = _csv_rows(out / "csv")
    assert [int(r["step"]) for r in rows if r.get("rollout/success")] == list(range(1, 7))
    assert [int(r["step"]) for r in rows if r.get("eval/success")] == list(range(0, 7))


@pytest.mark.parametrize("how", ["second signal", "grace over"])
def test_a_stop_never_waits_forever(monkeypatch, tmp_path, how):
    """Ranks stuck in a collective never reach a safe point: a second signal, or the grace period after
    the first, ends the process at once with 128 + the signal number."""
    import threading
    from types import SimpleNamespace

    import agentopsd.callbacks.preemption as preemption

    exits: list[tuple[int, str]] = []
    done = threading.Event()

    def fake_exit(rank, name, code, why):
        exits.append((code, why))
        done.set()

    monkeypatch.setattr(preemption, "_exit_now", fake_exit)
    callback = PreemptionCallback(IterationCheckpoint(str(tmp_path)), grace_s=0.2 if how == "grace over" else 60)
    module = SimpleNamespace(stop_request=StopRequest())
    callback.on_train_start(SimpleNamespace(global_rank=0), module)
    try:
        handler = signal.getsignal(signal.SIGTERM)
        handler(signal.SIGTERM, None)
        assert module.stop_request.requested and not exits  # the first signal only asks for a safe point
        if how == "second signal":
            handler(signal.SIGTERM, None)
        assert done.wait(5)
    finally:
        callback._restore()
    code, why = exits[0]
    assert code == 128 + signal.SIGTERM and (("second" in why) if how == "second signal" else ("no safe point" in why))


def test_a_stop_reached_in_time_leaves_no_forced_exit(tmp_path):
    """The grace timer of a stop that reached its safe point is cancelled (on_exception: Lightning does
    not call teardown there), or it would end the process later: a test run died so, 600 s on."""
    from types import SimpleNamespace

    callback = PreemptionCallback(IterationCheckpoint(str(tmp_path)), grace_s=600)
    module = SimpleNamespace(stop_request=StopRequest())
    callback.on_train_start(SimpleNamespace(global_rank=0), module)
    try:
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        timer = callback._timer
        assert timer is not None and timer.is_alive()
        callback.on_exception(SimpleNamespace(), module, RuntimeError("not a stop"))
        timer.join(2)
        assert not timer.is_alive() and callback._timer is None
    finally:
        callback._restore()


def test_a_dropped_evaluation_skips_only_the_checkpoint_hook(tmp_path):
    """A stop during an evaluation skips every batch-end hook after it: the rollout shard must come before (or
    the kept iteration's shard is lost), the iteration's checkpoint after (so that it holds the evaluation, and
    the stop's own checkpoint takes its place when the evaluation is dropped)."""
    from agentopsd.callbacks import EvaluationCallback, RolloutShardWriter, default_callbacks
    from tests.test_configs import cfg_for

    kinds = [type(cb) for cb in default_callbacks(cfg_for(), tmp_path)]
    assert kinds[0] is PreemptionCallback
    assert kinds.index(RolloutShardWriter) < kinds.index(EvaluationCallback) < kinds.index(IterationCheckpoint)
