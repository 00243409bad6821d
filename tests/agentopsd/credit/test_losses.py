"""The clipped objective: hand cases, clip-higher asymmetry, aggregation, KL; the baselines' distillation terms."""

from __future__ import annotations

import math

import pytest
import torch

from agentopsd.credit.losses import (
    aggregate,
    clipped_policy_loss,
    distillation_loss,
    kl_k3,
    sdar_loss,
    skill_sd_loss,
    token_entropy,
    token_logprobs,
    truncated_is_weights,
)


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


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_sdar_loss_hand_case_and_gradient():
    student = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -2.5, -9.0]])
    mask = torch.tensor([[True, True, False]])
    loss = sdar_loss(student, teacher, mask, beta=5.0)
    g = [_sigmoid(5 * 0.5), _sigmoid(5 * -0.5)]  # delta = +0.5 (teacher surer) and -0.5
    assert loss.item() == pytest.approx((g[0] * 0.5 + g[1] * -0.5) / 2)
    loss.backward()
    # the gate is detached: d/d log pi_S = -g_t / n on each counted token, 0 on the masked one
    assert torch.allclose(student.grad.float(), torch.tensor([[-g[0] / 2, -g[1] / 2, 0.0]], dtype=torch.float32), atol=1e-6)
    flat = sdar_loss(student.detach(), teacher, mask, beta=0.0)  # beta 0: a constant gate of one half
    assert flat.item() == pytest.approx(0.5 * (0.5 - 0.5) / 2)


def test_skill_sd_loss_hand_case():
    student = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -2.0]])
    old = torch.tensor([[-1.2, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss = skill_sd_loss(student, teacher, old, mask)
    l0 = -1.0 - -0.5
    k3 = math.exp(-l0) - 1 + l0
    rho = math.exp(-1.0 - -1.2)
    assert loss.item() == pytest.approx((rho * k3 + 0.0) / 2)  # the second token: l = 0 gives k3 = 0
    loss.backward()
    assert student.grad[0, 1].item() == pytest.approx(0.0) and student.grad[0, 0].item() != 0.0


def test_skill_sd_loss_is_nonnegative_and_finite_on_wild_gaps():
    student = torch.tensor([[-50.0, 0.0, -1.0]])
    teacher = torch.tensor([[0.0, -50.0, -1.0]])
    old = torch.tensor([[-80.0, -1.0, -1.0]])
    loss = skill_sd_loss(student, teacher, old, torch.ones(1, 3, dtype=torch.bool))
    assert torch.isfinite(loss) and loss.item() >= 0  # exp(-l) clamped at e^20, rho at e^10


def test_token_entropy():
    uniform = torch.zeros(2, 4)
    assert token_entropy(uniform).tolist() == pytest.approx([math.log(4)] * 2)
    peaked = torch.tensor([[100.0, 0.0, 0.0]])
    assert token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)


def test_dual_clip_bounds_negative_advantage_tokens_by_hand():
    """verl's dual-clip, clip_ratio_c = 3: for A < 0 the loss is min(max(-A r, -A clip(r)), -A c)."""
    # ratios 4, 2, 4 (log 4, log 2, log 4); advantages -1, -1, +1; eps 0.2 / 0.24
    lp = torch.tensor([[math.log(4.0), math.log(2.0), math.log(4.0)]], requires_grad=True)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    per_token = []
    for t in range(3):
        m = torch.zeros(1, 3, dtype=torch.bool)
        m[0, t] = True
        loss, _ = clipped_policy_loss(lp, old, adv, m, clip_ratio_c=3.0)
        per_token.append(float(loss))
    # token 0: max(4, 1.24) = 4, dual-clipped to 3; token 1: max(2, 1.24) = 2 < 3; token 2: max(-4, -1.24) = -1.24 (A > 0 untouched)
    assert per_token == pytest.approx([3.0, 2.0, -1.24], abs=1e-6)
    loss, _ = clipped_policy_loss(lp, old, adv, mask, clip_ratio_c=3.0)
    assert float(loss) == pytest.approx((3.0 + 2.0 - 1.24) / 3, abs=1e-6)
    loss.backward()
    # the dual-clipped token and the clipped positive one carry no gradient; token 1's is d(-A r)/dlp / 3 = r / 3
    assert lp.grad[0].tolist() == pytest.approx([0.0, 2.0 / 3, 0.0], abs=1e-6)
    off, _ = clipped_policy_loss(lp.detach(), old, adv, mask)
    assert float(off) == pytest.approx((4.0 + 2.0 - 1.24) / 3, abs=1e-6)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        clipped_policy_loss(lp, old, adv, mask, clip_ratio_c=0.5)


def test_k3_value_clamp_like_verl_low_var_kl_by_hand():
    """k3 = exp(r) - r - 1, r = ref - logp: r = 3 gives e^3 - 4 = 16.09, clamped to 10; r = -3 gives e^-3 + 2 = 2.05."""
    lp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[3.0, -3.0]])
    assert kl_k3(lp, ref)[0].tolist() == pytest.approx([math.exp(3) - 4, math.exp(-3) + 2], abs=1e-5)
    clamped = kl_k3(lp, ref, clamp=10.0)
    assert clamped[0].tolist() == pytest.approx([10.0, math.exp(-3) + 2], abs=1e-5)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, st = clipped_policy_loss(lp, torch.zeros(1, 2), torch.zeros(1), mask, ref_logprobs=ref, kl_coef=0.5, kl_clamp=10.0)
    assert float(st.kl_loss) == pytest.approx(0.5 * (10.0 + math.exp(-3) + 2) / 2, abs=1e-5)
    loss.backward()
    # the clamped token has no gradient; the other: d/dlp (exp(r) - r - 1) = 1 - exp(r), times 0.5 / 2
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.25 * (1 - math.exp(-3))], abs=1e-6)


def test_truncated_importance_sampling_weights_by_hand():
    """w = min(exp(log pi_trainer - log pi_engine), cap): exp(0.5) = 1.6487 stays, exp(2) = 7.39 is capped at 2,
    exp(-1) = 0.3679 stays; the policy loss of each token is multiplied by its weight."""
    trainer = torch.tensor([[-1.0, 0.0, -2.0]])
    engine = torch.tensor([[-1.5, -2.0, -1.0]])
    w = truncated_is_weights(trainer, engine, cap=2.0)
    assert w[0].tolist() == pytest.approx([math.exp(0.5), 2.0, math.exp(-1)], abs=1e-6)
    lp = torch.zeros(1, 3, requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, _ = clipped_policy_loss(lp, torch.zeros(1, 3), adv, mask, is_weights=w)
    # on-policy ratio 1: per-token loss -A, weighted
    assert float(loss) == pytest.approx((-math.exp(0.5) + 2.0 - 2 * math.exp(-1)) / 3, abs=1e-6)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-math.exp(0.5) / 3, 2.0 / 3, -2 * math.exp(-1) / 3], abs=1e-6)
