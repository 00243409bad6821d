"""Two processes on CPU (gloo), on unequal data per rank: DDP and FSDP2 run the quickstart's task and every
``*_tiny`` experiment to the end (report included), checkpoint and resume, under a watchdog.

The watchdog: a collective that waits 60 s fails the run with one line naming the rank and where it
waited (the process-group timeout); a run still going past its time limit is sent SIGABRT, which makes
every rank print its Python stack (``PYTHONFAULTHANDLER``), and the test fails with those stacks instead
of hanging CI.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train import metrics_rows, shard_records

ROOT = Path(__file__).resolve().parents[1]

COMMON = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.enable_progress_bar=false", "trainer.strategy.timeout.seconds=60"]
# unequal data: several micro-batches per rank (row counts differ), an odd evaluation list; every loss term on
UNEQUAL = ["optim.micro_batch_size=2", "evaluation.num_tasks=3", "++algorithm.entropy_coef=0.001", "++algorithm.kl_coef=0.01"]
EXPERIMENTS = {
    # the quickstart's own task and recipe, with a short warm start and one iteration
    "quickstart": ["warm_start.steps=4", "warm_start.episodes=40", "data.tasks_per_batch=4", "data.group_size=3"],
    "babyai_tiny": [],
    "webshop_tiny": [],
    "searchqa_tiny": [],
    "alfworld_tiny": [],
}


def run_watched(*overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python train.py`` in its own process group, with stacks from every rank if it outlives ``timeout``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen([sys.executable, "train.py", *overrides], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)  # every rank dumps its stack: where each one waits
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"train.py {' '.join(overrides)} still running after {timeout} s; stacks:\n{err[-8000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-6000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("experiment", list(EXPERIMENTS))
def test_two_processes_on_unequal_data_run_to_the_end(experiment, strategy, tmp_path):
    if experiment == "alfworld_tiny":
        pytest.importorskip("alfworld")
    out = tmp_path / experiment
    proc = run_watched(f"experiment={experiment}", f"trainer={strategy}", *COMMON, *UNEQUAL, *EXPERIMENTS[experiment],
                       "trainer.precision=32-true", "num_iterations=1", "report=true", f"output_dir={out}")
    assert "eval success:" in proc.stdout and proc.stdout.count("eval success:") == 1  # the closing lines, once
    assert (out / "report" / "index.html").is_file()
    evals = [r for r in metrics_rows(out) if r.get("eval/episodes")]
    assert evals and all(float(r["eval/episodes"]) == 3 for r in evals)  # the shards cover the list, once
    trained = [r for r in metrics_rows(out) if r.get("rollout/trajectories")]
    assert trained and float(trained[0]["rollout/trajectories"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_checkpoint_and_resume(strategy, tmp_path):
    out = tmp_path / strategy
    common = ["experiment=babyai_tiny", f"trainer={strategy}", *COMMON, "trainer.precision=32-true", f"output_dir={out}",
              "num_iterations=3", "evaluation.num_tasks=2"]
    # 2 mini-batches per iteration: max_steps=4 stops after 2 of the 3 iterations
    run_watched(*common, "+trainer.max_steps=4")
    last = out / "checkpoints" / "last.ckpt"
    assert last.exists() and (out / "checkpoints" / "previous.ckpt").exists()
    if strategy == "fsdp":
        assert last.is_dir() and any(last.iterdir())  # a sharded (distributed) checkpoint
    run_watched(*common, "ckpt_path=last")
    assert list(shard_records(out)) == [f"rollouts-{i:06d}.tar" for i in (1, 2, 3)]  # numbered 1, 2, 3 like every log
    iterations = [int(float(r["rollout/iteration"])) for r in metrics_rows(out) if r.get("rollout/iteration")]
    assert iterations == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_a_finished_run_on_to_more_iterations(strategy, tmp_path):
    """``ckpt_path=last num_iterations=4`` on a finished 2-iteration run: every rank reopens the closed epoch
    on its own (no collective), so both must agree or one would wait for the other forever; an odd
    evaluation list gives the ranks unequal shards."""
    out = tmp_path / strategy
    common = ["experiment=babyai_tiny", f"trainer={strategy}", *COMMON, "optim.micro_batch_size=2", "trainer.precision=32-true",
              f"output_dir={out}", "evaluation.num_tasks=3"]
    run_watched(*common, "num_iterations=2")
    proc = run_watched(*common, "num_iterations=4", "ckpt_path=last")
    assert proc.stdout.count("eval success:") == 1  # the extended run closes once, at its new end
    assert list(shard_records(out)) == [f"rollouts-{i:06d}.tar" for i in (1, 2, 3, 4)]
    iterations = [int(float(r["rollout/iteration"])) for r in metrics_rows(out) if r.get("rollout/iteration")]
    assert iterations == [1, 2, 3, 4]
