"""``scale_by_std=false`` (``optim.scale_by_std: false``, the quickstart's setting) changes the advantages every
algorithm computes: each builds on the centred outcome ``R - mean_g R``, never on ``(R - mean_g R) / std_g``.

The checks read the advantages written, not the flag: a rule that recomputed or reread the scaled sequence
advantage would keep the flag and lose the setting."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentopsd.credit import group_success_rate, reshape_advantages
from agentopsd.credit.advantages import grpo_advantages
from agentopsd.credit.algorithms import AgentOPSD, GiGPO
from tests.agentopsd.credit.test_algorithms import CONFIGURED, evidence_and_mask, multi_token_batch

REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0])
GROUPS = torch.zeros(4, dtype=torch.long)
"""One group of four, one failure: centred ``[0.25, -0.75, 0.25, 0.25]``; divided by the std (0.5) twice that."""


def one_group_batch() -> dict[str, torch.Tensor]:
    """:func:`multi_token_batch`'s four trajectories (1-4 turns of 1-5 tokens) in one group, as the trainer hands
    them over: ``seq_advantages`` scaled by the group's std (``agentopsd.training.data``)."""
    b = multi_token_batch(2)
    b.update(rewards=REWARDS.clone(), success=REWARDS.clone(), group_ids=GROUPS.clone(),
             seq_advantages=grpo_advantages(REWARDS, GROUPS))
    return b


CENTRED = grpo_advantages(REWARDS, GROUPS, scale_by_std=False)
SCALED = grpo_advantages(REWARDS, GROUPS)
assert not torch.allclose(CENTRED, SCALED)  # the batch tells the two apart


@pytest.mark.parametrize("mode", ["belief", "raw_gap", "magnitude", "no_prior"])
def test_agentopsd_unscaled_is_reshape_advantages_of_the_centred_outcome(mode):
    b = one_group_batch()
    algo = AgentOPSD(mode=mode, scale_by_std=False)
    algo.assign(b)
    gaps, mask = evidence_and_mask(b)
    prior = group_success_rate(b["success"], b["group_ids"])
    kw = dict(gamma=algo.gap_decay_gamma, lam=algo.mult_lambda, band=algo.mult_band, mode=mode)
    want = reshape_advantages(CENTRED, gaps, mask, prior, **kw)
    scaled = reshape_advantages(SCALED, gaps, mask, prior, **kw)
    got = b["turn_advantages"]
    for r in range(got.shape[0]):
        i, k = int(b["turn_traj"][r]), int(b["turn_index"][r])
        assert got[r].item() == pytest.approx(want[i, k].item(), abs=1e-6), (
            f"AgentOPSD(scale_by_std=False) turn ({i}, {k}): {got[r].item():.4f}, from the centred outcome "
            f"{want[i, k].item():.4f}, from the std-scaled one {scaled[i, k].item():.4f}")
        sel = b["action_mask"][r]
        assert torch.allclose(b["advantages"][r][sel], want[i, k].expand(int(sel.sum())), atol=1e-6)


def _ratio_to_centred(algo) -> torch.Tensor:
    """Each action token's advantage over its trajectory's centred outcome (every trajectory's is nonzero)."""
    b = one_group_batch()
    algo.assign(b)
    mask = b["action_mask"]
    per_token_outcome = CENTRED[b["turn_traj"]][:, None].expand_as(mask)
    return (b["advantages"] / per_token_outcome)[mask]


UNSCALED = [dataclasses.replace(a, scale_by_std=False) for a in CONFIGURED if not isinstance(a, GiGPO)]


@pytest.mark.parametrize("algo", UNSCALED, ids=lambda a: a.name)
def test_every_configured_algorithm_unscaled_stays_within_its_band_of_the_centred_outcome(algo):
    """Turn and token multipliers move an advantage by at most ``lambda * band`` (at most 0.25 here); dividing by
    the group's std would double it."""
    ratio = _ratio_to_centred(algo)
    assert float(ratio.min()) > 0.75 and float(ratio.max()) < 1.25, (
        f"{algo.name} with scale_by_std=False: advantage / centred outcome in [{float(ratio.min()):.3f}, "
        f"{float(ratio.max()):.3f}]; std-scaled would be x{float(SCALED[0] / CENTRED[0]):.1f}")


@pytest.mark.parametrize("algorithm", ["agentopsd", "grpo", "rlsd", "stepopsd"])
def test_the_quickstart_algorithm_computes_centred_advantages(algorithm, tiny_walk_policy):
    """The quickstart (``optim.scale_by_std: false``) as ``train.py`` builds it: the algorithm of
    ``AgentRLModule.from_config`` writes advantages of the centred outcome's size, not the std-scaled one's."""
    from agentopsd.training.module import AgentRLModule
    from tests.test_configs import _resolve, cfg_for

    model, tokenizer = tiny_walk_policy
    algo = AgentRLModule.from_config(_resolve(cfg_for("experiment=quickstart", f"algorithm={algorithm}")), model, tokenizer).algorithm
    ratio = _ratio_to_centred(algo)
    assert float(ratio.min()) > 0.75 and float(ratio.max()) < 1.25, (
        f"quickstart {algorithm}: advantage / centred outcome in [{float(ratio.min()):.3f}, {float(ratio.max()):.3f}] "
        f"(std-scaled: x{float(SCALED[0] / CENTRED[0]):.1f})")
