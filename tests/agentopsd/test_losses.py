"""The clipped objective: hand cases, clip-higher asymmetry, aggregation, KL."""

from __future__ import annotations

import pytest
import torch

from agentopsd.losses import aggregate, clipped_policy_loss, distillation_loss, kl_k3, token_logprobs


def test_on_policy_loss_is_minus_mean_advantage():
    lp = torch.log(torch.tensor([[0.5, 0.25, 1.0]]))
    adv = torch.tensor([2.0])
    mask = torch.tensor([[True, True, False]])
    loss, stats = clipped_policy_loss(lp, lp.clone(), adv, mask)
    assert loss.item() == pytest.approx(-2.0)
    assert stats.clip_frac.item() == 0.0 and stats.ratio_mean.item() == pytest.approx(1.0)


def test_clip_higher_is_asymmetric():
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    # ratio 1.3 with positive advantage: clipped at 1 + eps_high = 1.24
    lp = torch.full((1, 2), torch.log(torch.tensor(1.3)).item())
    loss, stats = clipped_policy_loss(lp, old, torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-1.24, abs=1e-6) and stats.clip_frac.item() == 1.0
    # ratio 0.7 with negative advantage: clipped at 1 - eps_low = 0.8
    lp = torch.full((1, 2), torch.log(torch.tensor(0.7)).item())
    loss, _ = clipped_policy_loss(lp, old, torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx(0.8, abs=1e-6)


def test_gradient_zero_when_clipped():
    lp = torch.full((1, 1), torch.log(torch.tensor(1.5)).item(), requires_grad=True)
    loss, _ = clipped_policy_loss(lp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool))
    loss.backward()
    assert lp.grad.abs().item() == 0.0


def test_aggregations():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(8 / 5)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((1 + 4) / 2)
    assert aggregate(values, mask, "token-mean", normalizer=10).item() == pytest.approx(0.8)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(values, mask, "sum")


def test_micro_batches_sum_to_the_full_batch():
    torch.manual_seed(0)
    lp, old = torch.randn(4, 6), torch.randn(4, 6)
    adv = torch.randn(4)
    mask = torch.rand(4, 6) > 0.3
    full, _ = clipped_policy_loss(lp, old, adv, mask)
    n = float(mask.sum())
    halves = sum(clipped_policy_loss(lp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], normalizer=n)[0] for i in (0, 2))
    assert halves.item() == pytest.approx(full.item(), abs=1e-6)


def test_kl_penalty_is_nonnegative_and_added():
    lp, ref = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.all(kl_k3(lp, ref) >= 0)
    assert kl_k3(lp, lp).abs().max().item() == 0.0
    mask = torch.ones(3, 4, dtype=torch.bool)
    plain, _ = clipped_policy_loss(lp, lp, torch.ones(3), mask)
    with_kl, stats = clipped_policy_loss(lp, lp, torch.ones(3), mask, ref_logprobs=ref, kl_coef=0.1)
    assert with_kl.item() == pytest.approx(plain.item() + stats.kl_loss.item()) and stats.kl_loss.item() > 0


def test_distillation_loss_zero_iff_equal():
    logits = torch.randn(2, 3, 5)
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert distillation_loss(logits, logits, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert distillation_loss(logits, torch.randn(2, 3, 5), mask).item() > 0


def test_token_logprobs_matches_log_softmax():
    logits = torch.randn(2, 3, 7)
    targets = torch.randint(0, 7, (2, 3))
    want = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, targets), want, atol=1e-6)
