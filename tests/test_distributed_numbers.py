"""The numbers of a 2-process update, not only its exit code: the reduced gradient and the loss equal one
process's on the same rows, and both ranks end with equal weights (DDP and FSDP2 on gloo, unequal rows
per rank so that one rank runs dummy micro-batches; entropy bonus and KL on)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def probe(out: Path, mode: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "tests/distributed_update_probe.py", str(out), mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """Each mode's probe, run once for every test of this file."""
    done: dict[str, Path] = {}

    def get(mode: str) -> Path:
        if mode not in done:
            done[mode] = probe(tmp_path_factory.mktemp(mode), mode)
        return done[mode]

    return get


@pytest.fixture(scope="module")
def single(probed) -> Path:
    return probed("single")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp", "fsdp-deferred"])
def test_two_process_update_equals_one_process(single, probed, mode):
    out = probed(mode)
    want, got = torch.load(single / "grads.pt"), torch.load(out / "grads.pt")
    assert set(got) == set(want) and len(want) > 10
    for name, g in want.items():
        scale = float(g.abs().max()) + 1e-12
        assert float((got[name] - g).abs().max()) / scale < 1e-4, name  # float32 sums in another order
    w0, w1 = torch.load(out / "weights-rank0.pt"), torch.load(out / "weights-rank1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "the ranks' weights differ after the update"
    ws = torch.load(single / "weights-rank0.pt")
    assert max(float((w0[k] - ws[k]).abs().max()) for k in ws) < 1e-4
    m_want, m_got = torch.load(single / "metrics.pt"), torch.load(out / "metrics.pt")
    assert m_got["loss/total"] == pytest.approx(m_want["loss/total"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_deferred_reduction_reduce_scatters_once_per_mini_batch(probed):
    """optim.defer_grad_reduction: each FSDP2 unit (2 decoder layers and the root) reduce-scatters once, at the
    last of the mini-batch's 3 micro-batches, on both ranks (rank 1 runs 2 of them as dummies), not 3 times."""
    plain, deferred = probed("fsdp"), probed("fsdp-deferred")
    for rank in (0, 1):
        assert (plain / f"reductions-rank{rank}.txt").read_text() == "9"
        assert (deferred / f"reductions-rank{rank}.txt").read_text() == "3"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp+skip", "fsdp+skip", "single+skip-recompute", "ddp+skip-recompute", "fsdp+skip-recompute"])
def test_two_process_update_skipping_zero_advantage_rows_equals_one_process(probed, mode):
    """optim.skip_zero_advantage under 2 processes: rows 2, 5 and 6 hold advantage 0, so under FSDP2 rank 1 (rows 5
    and 6) runs only dummy passes; the reduced gradient and the weights are still one process's on the same rows.
    ``+skip-recompute``: the behaviour log-probs arrive 0.1 off and the update recomputes its trained rows' first
    (rank 1 of FSDP2 has none and joins with dummy forwards): the same numbers, and the gap logged is that 0.1."""
    want, got = torch.load(probed("single+skip") / "grads.pt"), torch.load(probed(mode) / "grads.pt")
    assert set(got) == set(want) and len(want) > 10
    for name, g in want.items():
        scale = float(g.abs().max()) + 1e-12
        assert float((got[name] - g).abs().max()) / scale < 1e-4, name
    out = probed(mode)
    if not mode.startswith("single"):
        w0, w1 = torch.load(out / "weights-rank0.pt"), torch.load(out / "weights-rank1.pt")
        assert all(torch.equal(w0[k], w1[k]) for k in w0), "the ranks' weights differ after the update"
    gap = torch.load(out / "metrics.pt").get("rollout/logprob_diff_mean")
    assert (gap is None) if mode.endswith("+skip") else gap == pytest.approx(0.1, abs=1e-5)
