"""The clipped policy objective and its aggregations (pure torch).

Shapes: ``N`` sequences (one per turn sample), ``T`` token positions; ``mask`` is True on
the generated action tokens that carry loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


@dataclass(frozen=True)
class PolicyLossStats:
    """Detached diagnostics of one policy-loss call (scalars)."""

    pg_loss: Tensor
    """The clipped policy-gradient term, before the KL penalty."""
    kl_loss: Tensor
    """The KL penalty term (0 when no reference is given)."""
    clip_frac: Tensor
    """Fraction of tokens whose clipped branch was the active one."""
    approx_kl: Tensor
    """``0.5 * mean((log pi - log pi_old)^2)``, the behaviour-to-current drift."""
    ratio_mean: Tensor
    ratio_max: Tensor


def aggregate(values: Tensor, mask: Tensor, mode: str = "token-mean", normalizer: float | None = None) -> Tensor:
    """Reduce ``[N,T]`` per-token values to a scalar over ``mask``.

    ``token-mean``: sum over all tokens / number of tokens (long turns weigh more), or / ``normalizer``
    when given: gradient accumulation passes the mini-batch's token count so that micro-batches
    add up to the mini-batch mean.
    ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (each turn weighs
    the same); with ``normalizer`` the sequence sum is divided by it instead (the mini-batch's
    sequence count).
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")
    m = mask.to(values.dtype)
    if mode == "token-mean":
        denom = m.sum().clamp_min(1.0) if normalizer is None else normalizer
        return (values * m).sum() / denom
    per_seq_count = m.sum(dim=-1)
    per_seq = (values * m).sum(dim=-1) / per_seq_count.clamp_min(1.0)
    has_tokens = (per_seq_count > 0).to(values.dtype)
    denom = has_tokens.sum().clamp_min(1.0) if normalizer is None else normalizer
    return (per_seq * has_tokens).sum() / denom


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, clamp: float = 0.0) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): ``exp(r) - r - 1`` with ``r = ref - logp``; always >= 0.

    ``clamp > 0`` bounds the value to ``[-clamp, clamp]`` as verl's ``low_var_kl`` does (10 there): a
    token far from the reference (``|r|`` of 3 or more) then adds a constant, without gradient.
    """
    r = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    kl = torch.exp(r) - r - 1.0
    return kl.clamp(-clamp, clamp) if clamp > 0 else kl


def truncated_is_weights(trainer_logprobs: Tensor, engine_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weights for the engine/trainer mismatch (token level, detached):
    ``min(exp(log pi_trainer - log pi_engine), cap)``. The rollout engine sampled the tokens, the
    trainer's forward defines the ratio's denominator: this corrects the sampling distribution."""
    log_w = (trainer_logprobs - engine_logprobs).detach().clamp(-20.0, 20.0)
    return torch.exp(log_w).clamp(max=cap)


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.24,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    clip_ratio_c: float = 0.0,
    kl_clamp: float = 0.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, PolicyLossStats]:
    """PPO/GRPO clipped surrogate with clip-higher (``eps_high > eps_low``, DAPO).

    ``loss_t = max(-A_t r_t, -A_t clip(r_t, 1-eps_low, 1+eps_high))``, ``r_t = exp(logp - logp_old)``.
    ``advantages`` is ``[N]`` (one per turn sample, broadcast to its tokens) or ``[N,T]``.
    With ``ref_logprobs`` and ``kl_coef > 0`` the k3 KL to the reference is added (each token's value
    clamped to ``[-kl_clamp, kl_clamp]`` when ``kl_clamp > 0``, verl's ``low_var_kl``).
    ``clip_ratio_c > 1``: dual-clip (verl): where ``A_t < 0`` the token's loss is
    ``min(loss_t, -A_t clip_ratio_c)``. ``is_weights`` ``[N,T]`` (detached, e.g. truncated
    importance-sampling weights) multiply each token's policy-gradient loss.
    """
    if logprobs.shape != old_logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(f"logprobs, old_logprobs and mask must share one shape, got {tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}")
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    adv = adv.to(logprobs.dtype).detach()
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if clip_ratio_c:
        if clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1 (or 0: off), got {clip_ratio_c}")
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * clip_ratio_c), per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    pg_loss = aggregate(per_token, mask, aggregation, normalizer)
    kl_loss = logprobs.new_zeros(())
    if ref_logprobs is not None and kl_coef > 0:
        kl_loss = kl_coef * aggregate(kl_k3(logprobs, ref_logprobs.detach(), kl_clamp), mask, aggregation, normalizer)
    with torch.no_grad():
        m = mask.bool()
        n = m.sum().clamp_min(1)
        stats = PolicyLossStats(
            pg_loss=pg_loss.detach(),
            kl_loss=kl_loss.detach(),
            clip_frac=((clipped > unclipped) & m).sum() / n,
            approx_kl=0.5 * (log_ratio.pow(2) * m).sum() / n,
            ratio_mean=(ratio * m).sum() / n,
            ratio_max=torch.where(m, ratio, torch.zeros_like(ratio)).max() if m.any() else ratio.new_ones(()),
        )
    return pg_loss + kl_loss, stats


def distillation_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    *,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> Tensor:
    """Token-level forward KL(teacher || student) over the vocabulary, teacher detached (GRPO+OPSD).

    ``student_logits`` and ``teacher_logits`` are ``[N,T,V]`` at the action positions.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError("student_logits and teacher_logits must share one [N, T, V] shape")
    t_logp = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    s_logp = F.log_softmax(student_logits.float(), dim=-1)
    per_token = (t_logp.exp() * (t_logp - s_logp)).sum(dim=-1)
    return aggregate(per_token, mask, aggregation, normalizer)


def sdar_loss(
    logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    *,
    beta: float = 5.0,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> Tensor:
    """SDAR's confidence-gated distillation on the sampled action tokens: ``agg_t g_t (log pi_T - log pi_S)``.

    ``delta_t = log pi_T - log pi_S``, gate ``g_t = sigmoid(beta * delta_t)``, detached: tokens the
    teacher view is surer of pull the student harder. The gradient flows through ``log pi_S``
    only (``-g_t`` per token). ``[N,T]`` inputs; teacher detached.
    """
    if logprobs.shape != teacher_logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError("logprobs, teacher_logprobs and mask must share one [N, T] shape")
    teacher = teacher_logprobs.detach().to(logprobs.dtype)
    gate = torch.sigmoid(beta * (teacher - logprobs.detach()))
    return aggregate(gate * (teacher - logprobs), mask, aggregation, normalizer)


def skill_sd_loss(
    logprobs: Tensor,
    teacher_logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    *,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> Tensor:
    """Skill-SD's self-distillation loss on the sampled action tokens: ``agg_t rho_t k3_t``.

    ``l_t = log pi_S - log pi_T``, ``k3_t = exp(-l_t) - 1 + l_t`` (>= 0, a sampled estimate of
    KL(student || teacher)), ``rho_t = exp(min(log pi_S - log pi_old, 10))`` the importance ratio to
    the behaviour policy. Gradients flow through ``log pi_S`` in both factors, as in the public
    code; the teacher and the behaviour log-probs are detached. The exponent of k3 is clamped at
    20 and that of rho at 10, so one wild token cannot overflow the loss.
    """
    if not logprobs.shape == teacher_logprobs.shape == old_logprobs.shape == mask.shape:
        raise ValueError("logprobs, teacher_logprobs, old_logprobs and mask must share one [N, T] shape")
    gap = logprobs - teacher_logprobs.detach().to(logprobs.dtype)
    k3 = torch.exp((-gap).clamp(max=20.0)) - 1.0 + gap
    rho = torch.exp((logprobs - old_logprobs.detach().to(logprobs.dtype)).clamp(max=10.0))
    return aggregate(rho * k3, mask, aggregation, normalizer)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution at each position, ``[..., V] -> [...]`` in float32."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """``log softmax(logits)[targets]`` in float32 without materializing the full log-softmax twice.

    ``logits [N,T,V]``, ``targets [N,T]`` -> ``[N,T]``.
    """
    logits = logits.float()
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
