"""agentopsd/training/objective.py: the truncated importance weights a rollout carries (``RolloutBatch.is_weights``,
decoupled PPO's engine/trainer correction, ``optim.tis_cap``) reach the policy loss of the rows asked for."""

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


def test_is_weights_multiply_each_rows_policy_loss(tiny_walk_policy):
    """On-policy (ratio 1) the token loss is ``-A w``: the loss of a subset of rows with weights ``w`` per row is
    the weighted sum, not the unweighted one, and the weights are those of the rows asked for (indexed by ``rows``)."""
    torch.manual_seed(0)
    algo = dataclasses.replace(Algorithm(), kl_coef=0.0, entropy_coef=0.0)
    module = make_module(tiny_walk_policy, algorithm=algo)
    module.model.eval()  # no dropout: the rollout's log-probs are the scorer's
    batch = module.rollout(TaskBatch(0, tuple(TaskSpec(TOY_ID, "train", s, 1, group_id=0) for s in range(3))))
    n = batch.num_rows
    assert n >= 3
    mask = batch.action_mask
    batch.advantages = torch.where(mask, 1.0, 0.0)  # every action token has advantage 1: loss_t = -ratio_t w_t
    row_w = torch.linspace(0.1, 0.9, n)  # a different weight per row, so indexing by rows matters
    rows = torch.arange(n - 1, 0, -1)  # every row but the first, reversed
    normalizer = float(mask[rows].sum())
    assert normalizer > 0

    def loss_with(weights):
        batch.is_weights = weights
        with torch.no_grad():
            loss, stats, dev = micro_batch_loss(algo, module.optim_cfg, module.scorer, batch, rows, normalizer)
        assert dev < 1e-5  # on-policy: the ratio is 1, so the loss is the weights' doing alone
        return float(loss), float(stats["pg_loss"])

    unweighted, _ = loss_with(None)
    assert unweighted == pytest.approx(-1.0, abs=1e-4)
    weighted, pg = loss_with(torch.where(mask, row_w[:, None], 0.0))
    m = mask[rows].float()
    expected = float(-(row_w[rows][:, None] * m).sum() / normalizer)
    assert weighted == pytest.approx(expected, abs=1e-4), (
        f"micro_batch_loss ignored the truncated importance weights: loss {weighted:.5f}, weighted {expected:.5f}, "
        f"unweighted {unweighted:.5f}")
    assert pg == pytest.approx(expected, abs=1e-4)
