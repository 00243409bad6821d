"""The PPO objective of one micro-batch: every loss term the algorithm asks for, on the rows given.

Which forwards run depends on the algorithm alone (one student forward, plus a teacher forward when
``needs_teacher_logits``), never on the rows: a dummy pass on a placeholder row issues exactly what a
real one does, which keeps ranks in step under FSDP (the rank invariant, :mod:`agentopsd.training.distributed`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from agentopsd.config import OptimConfig, RolloutConfig
from agentopsd.credit.algorithms import Algorithm
from agentopsd.credit.losses import aggregate, clipped_policy_loss
from agentopsd.rollout.scoring import Scorer
from agentopsd.types import RolloutBatch


def check_settings(algo: Algorithm, rollout: RolloutConfig, optim: OptimConfig, *, has_skills: bool) -> bool:
    """Refuse, in one line naming the fix, an algorithm the run's settings cannot serve; returns whether it distils
    the teacher view into its loss (which needs that view scored at the update)."""
    if algo.needs_teacher and not has_skills:
        raise ValueError(f"algorithm {algo.name} needs a teacher view: set env.skills to a SkillBank name")
    distils = algo.needs_teacher_logits or algo.distill_coef > 0
    if rollout.teacher_scoring == "worker" and distils:
        raise ValueError(f"algorithm {algo.name} distils the teacher view into its loss, which needs that view "
                         "scored at the update: set rollout.teacher_scoring=trainer (or auto)")
    if optim.skip_zero_advantage and (distils or algo.kl_coef > 0 or algo.entropy_coef > 0):
        raise ValueError(f"optim.skip_zero_advantage needs a loss that is 0 where the advantage is, but algorithm {algo.name} "
                         "has a KL penalty, an entropy bonus or a distillation term: set optim.skip_zero_advantage=false")
    return distils


def micro_batch_loss(algo: Algorithm, optim: OptimConfig, scorer: Scorer, batch: RolloutBatch, rows: Tensor,
                     normalizer: float) -> tuple[Tensor, dict[str, Tensor], float]:
    """The loss of ``batch``'s ``rows`` (normalised by ``normalizer``, the mini-batch's token or row count over
    every rank), its terms' detached values by name, and max |ratio - 1| over their action tokens (0 on-policy).

    Terms: the clipped policy objective (with the KL to the reference, dual-clip, truncated IS weights as set),
    the algorithm's own hooks (``logits_loss`` on the full-vocabulary logits of both views, ``token_distill_loss``
    on the sampled tokens' log-probs) and the entropy bonus.
    """
    mask = batch.action_mask[rows]
    old = batch.old_logprobs[rows]
    lp, entropy, s_logits = scorer.logprobs_and_entropy(batch, rows, entropy=algo.entropy_coef > 0,
                                                        keep_logits=algo.needs_teacher_logits)
    loss, st = clipped_policy_loss(
        lp, old, batch.advantages[rows], mask,
        eps_low=algo.eps_low, eps_high=algo.eps_high, aggregation=algo.aggregation, normalizer=normalizer,
        ref_logprobs=None if batch.ref_logprobs is None else batch.ref_logprobs[rows], kl_coef=algo.kl_coef,
        clip_ratio_c=optim.clip_ratio_c, kl_clamp=optim.kl_clamp,
        is_weights=None if batch.is_weights is None else batch.is_weights[rows],
    )
    stats = dict(vars(st))
    logits_term = algo.logits_loss(s_logits, lambda: scorer.teacher_logits(batch, rows), normalizer)
    if logits_term is not None:  # grpo_opsd: full-vocabulary distillation toward the teacher view
        loss = loss + logits_term
    teacher_lp = None if batch.teacher_logprobs is None else batch.teacher_logprobs[rows]
    extra = algo.token_distill_loss(lp, teacher_lp, old, mask, normalizer)
    if extra is not None:  # SDAR, Skill-SD: a loss on the sampled action tokens
        loss = loss + extra
        stats["distill_loss"] = extra.detach()
    if algo.entropy_coef > 0:  # a bonus: higher entropy lowers the loss
        mean_entropy = aggregate(entropy, mask, algo.aggregation, normalizer)
        loss = loss - algo.entropy_coef * mean_entropy
        stats["entropy"] = mean_entropy.detach()
    ratio = torch.exp(lp.detach() - old)[mask]
    return loss, stats, float((ratio - 1).abs().max()) if ratio.numel() else 0.0


def signal_rows(advantages: Tensor, mask: Tensor) -> Tensor:
    """Positions of the rows with a nonzero advantage on at least one action token: the others' clipped policy
    loss is exactly 0 (``-min(r A, clip(r) A)`` with ``A = 0``), whatever their ratio (``optim.skip_zero_advantage``)."""
    return ((advantages != 0) & mask.bool()).any(-1).nonzero(as_tuple=True)[0]
