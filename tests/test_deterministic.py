"""trainer.deterministic=true: two runs of the (shortened) quickstart on one machine are bit-identical."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_train import metrics_rows

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["num_iterations=2", "data.tasks_per_batch=2", "data.group_size=4", "evaluation.num_tasks=8", "evaluation.every_n_iterations=1",
         "warm_start.episodes=40", "warm_start.steps=6", "trainer.enable_progress_bar=false", "report=false"]
VARIES = ("perf/",)
"""Wall-clock measurements: the only columns allowed to differ."""


def _launch(runs_dir: Path, threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HYDRA_FULL_ERROR": "1"}
    return subprocess.Popen([sys.executable, "train.py", "trainer.deterministic=true", f"runs_dir={runs_dir}", *SHORT], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=1200)
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    return out


def _logged(run: Path) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if not k.startswith(VARIES)} for row in metrics_rows(run)]


@pytest.mark.slow
def test_two_deterministic_quickstarts_are_bit_identical(tmp_path):
    """Warm start, rollouts, updates and evaluations, both runs at once on the same cores (about 2 min):
    the same losses and evaluations to the last digit, and the same final weights bit for bit."""
    threads = min(2, os.cpu_count() or 1)  # several threads: their reductions must be reproducible too
    procs = [_launch(tmp_path / name, threads) for name in ("a", "b")]
    outs = [_finish(p) for p in procs]
    warm = [next(line for line in out.splitlines() if line.startswith("warm start:")) for out in outs]
    assert warm[0].split("final loss")[1] == warm[1].split("final loss")[1]
    runs = [(tmp_path / name / "latest").resolve() for name in ("a", "b")]
    rows = [_logged(run) for run in runs]
    assert rows[0] and any(r.get("loss/pg_loss") for r in rows[0]) and any(r.get("eval/success") for r in rows[0])
    assert rows[0] == rows[1]  # as logged: every loss, rollout, credit and evaluation value, as text
    weights = [torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"] for run in runs]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_every_trainer_config_has_the_switch():
    """`trainer.deterministic=true` works whichever trainer group is chosen (off by default)."""
    from omegaconf import OmegaConf

    for path in sorted((ROOT / "conf" / "trainer").glob("*.yaml")):
        assert OmegaConf.load(path).get("deterministic") is False, path.name
