"""Asynchronous rollouts (``rollout.max_staleness=1``) through ``train.py``: two processes on unequal data, each with
its own rollout worker, run to the end under a watchdog; a SIGTERM with the workers alive stops the run with its
checkpoint, leaves no worker behind, and the resumed run plays every iteration's tasks exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.callbacks.test_preemption import _wait_for_shards
from tests.test_distributed import COMMON, UNEQUAL, run_watched
from tests.test_train import ROOT, metrics_rows, run_train, shard_records


def _check_versions(out: Path, k: int) -> int:
    """Every logged turn was generated at most ``k`` updates before its own update; the largest staleness seen."""
    worst = 0
    for name, records in shard_records(out).items():
        iteration = int(name[9:15]) - 1  # shards are numbered by iterations completed
        for record in records:
            for turn in record["turns"]:
                staleness = iteration - turn["policy_version"]
                assert 0 <= staleness <= k, (name, turn["policy_version"])
                worst = max(worst, staleness)
    return worst


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shared_memory", "collective"])
def test_two_processes_with_rollout_workers_on_unequal_data(tmp_path, transport):
    """Each rank's worker gets its weights by ``transport``: under ``collective`` each rank has a private gloo group of
    two with its own worker, beside the training's default group."""
    out = tmp_path / "async"
    run_watched("experiment=quickstart", "trainer=ddp", *COMMON, *UNEQUAL, "warm_start.steps=4", "warm_start.episodes=40",
                "data.tasks_per_batch=4", "data.group_size=3", "num_iterations=3", "rollout.max_staleness=1",
                f"rollout.weight_transport={transport}",
                "trainer.precision=32-true", "rollout_log.every_n_iterations=1", "report=false", f"output_dir={out}")
    rows = [r for r in metrics_rows(out) if r.get("rollout/iteration")]
    assert [int(float(r["rollout/iteration"])) for r in rows] == [1, 2, 3]
    for row in rows:
        assert float(row["rollout/staleness_max"]) <= 1
        assert float(row["loss/first_ratio_dev"]) < 1e-4  # the ratio is taken against the proximal policy
    _check_versions(out, 1)


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_with_the_workers_alive_keeps_the_checkpoint_then_resumes(processes, tmp_path):
    out = tmp_path / f"p{processes}"
    common = ["experiment=babyai_tiny", f"output_dir={out}", "num_iterations=5", "checkpoint.every_n_iterations=100",
              "evaluation.num_tasks=2", "trainer.enable_progress_bar=false", "data.tasks_per_batch=2",
              "rollout.max_staleness=1", "rollout_log.every_n_iterations=1", "report=false"]
    if processes == 2:
        common += ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.Popen([sys.executable, "train.py", *common], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_shards(out, 2, proc, timeout=600)
        workers = _children(proc.pid)
        assert workers, "no rollout worker process"
        proc.send_signal(signal.SIGTERM)  # to rank 0 only: the ranks agree and stop together
        sent = time.monotonic()
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert time.monotonic() - sent < 60, "the run did not stop within a bounded time"
    assert proc.returncode == 143, output[-3000:]
    assert "stopped by SIGTERM" in output and "ckpt_path=last" in output
    deadline = time.monotonic() + 15
    while workers & _children_alive(workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _children_alive(workers), "a rollout worker outlived its run"
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    done = state["agentopsd"]["iterations_done"]
    assert 2 <= done < 5
    run_train(*common, "ckpt_path=last", timeout=900)
    # every iteration trained exactly once: one shard each, no gaps, and the resumed run's staleness holds its bound
    assert list(shard_records(out)) == [f"rollouts-{i:06d}.tar" for i in range(1, 6)]
    iterations = [int(float(r["rollout/iteration"])) for r in metrics_rows(out) if r.get("rollout/iteration")]
    assert sorted(set(iterations)) == [1, 2, 3, 4, 5] and iterations[-(5 - done):] == list(range(done + 1, 6))
    _check_versions(out, 1)


def _children_alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"
