"""agentopsd/training/objective.py: one micro-batch's loss is the sum of the terms it reports."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentopsd.credit.algorithms import Algorithm  # GRPO: the base rule
from agentopsd.training.data import TaskBatch
from agentopsd.training.objective import micro_batch_loss
from agentopsd.types import TaskSpec
from tests.agentopsd.training.test_module import make_module
from tests.conftest import TOY_ID


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_the_loss_is_its_terms_and_on_policy_rows_have_ratio_one(tiny_walk_policy, entropy_coef):
    torch.manual_seed(0)
    algo = dataclasses.replace(Algorithm(), kl_coef=0.05, entropy_coef=entropy_coef)
    module = make_module(tiny_walk_policy, algorithm=algo)
    module.model.eval()  # no dropout: the rollout's log-probs are the scorer's
    batch = module.rollout(TaskBatch(0, tuple(TaskSpec(TOY_ID, "train", s, 1, group_id=0) for s in range(3))))
    batch.advantages = torch.where(batch.action_mask, torch.linspace(-1, 1, batch.num_rows)[:, None], 0.0)
    rows = torch.arange(batch.num_rows)
    normalizer = float(batch.action_mask.sum())
    with torch.no_grad():
        loss, stats, ratio_dev = micro_batch_loss(algo, module.optim_cfg, module.scorer, batch, rows, normalizer)
    assert ratio_dev < 1e-5  # the behaviour log-probs are this model's own
    expected = stats["pg_loss"] + stats["kl_loss"] - entropy_coef * stats.get("entropy", torch.tensor(0.0))
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    assert ("entropy" in stats) == (entropy_coef > 0)
    assert float(stats["kl_loss"]) == pytest.approx(0.0, abs=1e-6)  # the reference is the policy itself
