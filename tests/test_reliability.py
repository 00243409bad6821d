"""Reliability: a killed run resumes, faults and garbage never crash a run or poison the update."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_train import ROOT, metrics_rows, run_train, shard_records


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"training exited early with {proc.returncode}: {proc.stderr.read()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.5)


@pytest.mark.slow
def test_sigkill_between_checkpoints_then_resume(tmp_path):
    out = tmp_path / "run"
    common = ["train.py", "experiment=babyai_tiny", f"output_dir={out}", "num_iterations=6", "checkpoint.every_n_iterations=2",
              "trainer.enable_progress_bar=false", "evaluation.num_tasks=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, *common], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # the checkpoint after iteration 2, then the shard of iteration 3: we are between checkpoints
    _wait_for(out / "checkpoints" / "last.ckpt", proc, timeout=600)
    _wait_for(out / "rollouts" / "rollouts-000003.tar", proc, timeout=600)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    run_train(*common[1:], "ckpt_path=last")
    shards = shard_records(out)  # every shard reads back whole: none truncated
    assert list(shards) == [f"rollouts-{i:06d}.tar" for i in range(1, 7)]
    assert not list((out / "rollouts").glob(".*tmp*")) and not list((out / "checkpoints").glob(".*tmp*"))
    versions = sorted((out / "csv").glob("version_*"))
    resumed = [r for r in metrics_rows(out) if r.get("rollout/iteration")]
    resumed_iterations = [int(float(r["rollout/iteration"])) for r in resumed][-4:]
    assert len(versions) == 2 and resumed_iterations == [3, 4, 5, 6]  # continued after the checkpoint's 2 iterations


@pytest.mark.slow
def test_faults_and_garbage_do_not_stop_training(tmp_path):
    out = tmp_path / "faulty"
    # 3 iterations x 2 tasks x 4 copies at a 30% fault and malformed-output rate (20 iterations at 5% before):
    # the seeded fault stream faults 2, 3 and 0 trajectories here, and format errors happen on every iteration
    proc = run_train(
        "experiment=babyai_tiny", f"output_dir={out}", "num_iterations=3", "+env.fault_rate=0.3", "+rollout.malformed_rate=0.3",
        "data.group_size=4", "trainer.enable_progress_bar=false", "evaluation.num_tasks=2", "checkpoint.every_n_iterations=3",
        "rollout_log.every_n_iterations=3",
    )
    rows = [r for r in metrics_rows(out) if r.get("rollout/faults")]
    assert [int(float(r["rollout/iteration"])) for r in rows] == [1, 2, 3]  # every iteration trained, none crashed
    assert sum(float(r["rollout/faults"]) for r in rows) > 0  # faults happened and were counted
    assert all(float(r["rollout/format_errors"]) > 0 for r in rows)
    # each faulted trajectory is left out of the update: of the 8 launched, 8 - faults are used
    assert [float(r["rollout/trajectories_used"]) for r in rows] == [8 - float(r["rollout/faults"]) for r in rows]
    for r in rows:
        assert math.isfinite(float(r["loss/pg_loss"]))  # the update saw no garbage
    assert "injected fault" in proc.stdout + proc.stderr  # logged with the environment and task
