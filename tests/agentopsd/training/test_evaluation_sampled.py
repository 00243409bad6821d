"""The sampled evaluation (``evaluation.sampled_copies``) and kept policies (``checkpoint.keep_policies``)."""

from __future__ import annotations

import pytest
import torch

from tests.test_train import metrics_rows, run_train

TINY = ["experiment=babyai_tiny", "num_iterations=2", "evaluation.num_tasks=3", "trainer.enable_progress_bar=false"]


def _training_rows(out) -> list[dict[str, str]]:
    return [{k: v for k, v in r.items() if v and k.startswith(("loss/", "rollout/success", "credit/"))}
            for r in metrics_rows(out) if r.get("loss/pg_loss")]


@pytest.mark.slow
def test_sampled_evaluation_is_logged_and_leaves_training_untouched(tmp_path):
    plain, sampled = tmp_path / "plain", tmp_path / "sampled"
    run_train(*TINY, f"output_dir={plain}", "evaluation.every_n_iterations=1")
    run_train(*TINY, f"output_dir={sampled}", "evaluation.every_n_iterations=1", "evaluation.sampled_copies=2",
              "checkpoint.keep_policies=true", "checkpoint.every_n_iterations=1")
    evals = [r for r in metrics_rows(sampled) if r.get("eval/success")]
    assert len(evals) == 3  # before training, after iteration 1, after iteration 2
    for r in evals:
        assert r["eval/sampled/episodes"] == "6.0" and r["eval/episodes"] == "3.0"
        assert 0.0 <= float(r["eval/sampled/success"]) <= 1.0
    assert not any(k.startswith("eval/sampled") for r in metrics_rows(plain) for k, v in r.items() if v)
    # the sampled episodes draw from their own seeded stream: iteration 2 trains exactly as without them
    assert _training_rows(plain) == _training_rows(sampled) and len(_training_rows(plain)) == 2
    kept = sorted(p.name for p in (sampled / "checkpoints").glob("policy-*.pt"))
    assert kept == ["policy-000001.pt", "policy-000002.pt"]
    one, two = (torch.load(sampled / "checkpoints" / k) for k in kept)
    assert one.keys() == two.keys() and any(not torch.equal(one[k], two[k]) for k in one)  # iteration 2 changed the weights


def test_sampled_copies_must_not_be_negative():
    from agentopsd.config import EvalConfig

    with pytest.raises(ValueError, match="sampled_copies must be >= 0"):
        EvalConfig(sampled_copies=-1)
