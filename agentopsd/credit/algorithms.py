"""Algorithms as small config objects: choosing an algorithm is choosing a file in conf/algorithm/.

Each algorithm says whether it needs the teacher view, turns a batch into the per-token
advantages the clipped objective consumes, and may add a loss term of its own. The math lives
in :mod:`agentopsd.credit.advantages` and :mod:`agentopsd.credit.losses` (the functions the spec tests check);
this module only moves tensors between layouts.

Batch fields (a :class:`~agentopsd.types.RolloutBatch` or any mapping with these keys):

* row layout (ours): ``teacher_logprobs``/``student_logprobs`` ``[M,L]``, ``action_mask`` ``[M,L]``,
  ``turn_traj`` ``[M]``, ``turn_index`` ``[M]``; optional ``turn_penalties`` ``[M]``; GiGPO also
  reads ``turn_state`` ``[M]`` (an id per distinct observation text) and ``rewards`` ``[B]``;
* token layout (other code): ``teacher_logprobs``/``student_logprobs`` ``[B,T]`` and ``token_turn``
  ``[B,T]`` (-1 off the action tokens); optional ``turn_penalties`` ``[B,K]``;
* both: ``seq_advantages`` ``[B]``, ``success`` ``[B]`` (0/1 bits), ``group_ids`` ``[B]``.

Written: ``advantages`` (same shape as the log-probs), ``turn_advantages`` (``[M]`` rows, or ``[B,K]``),
and ``credit`` (AgentOPSD: ``beliefs``, ``revisions``, ``multipliers``, ``evidence``, ``turn_mask``).
Every algorithm ends the same way: each turn's shaping penalty is charged to that turn's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from agentopsd.credit.advantages import (
    MODES,
    anchor_state_groups,
    apply_turn_penalties,
    discounted_turn_returns,
    gigpo_advantages,
    group_success_rate,
    grpo_advantages,
    lambda_at,
    mix_advantages,
    pack_turns,
    rlsd_token_advantages,
    stepopsd_multipliers,
    turn_evidence,
    turn_multipliers,
    unpack_turns,
)
from agentopsd.credit.losses import AGGREGATIONS, distillation_loss, sdar_loss, skill_sd_loss

FIELDS_READ = (
    "teacher_logprobs and student_logprobs with either action_mask, turn_traj, turn_index (one row per turn) "
    "or token_turn ([B, T], -1 off the action tokens); always seq_advantages, success, group_ids"
)
GIGPO_NORMS = ("mean_std", "mean")


def _opt(batch: Mapping | object, key: str) -> Tensor | None:
    return batch.get(key) if isinstance(batch, Mapping) else getattr(batch, key, None)


def _get(batch: Mapping | object, key: str) -> Tensor:
    value = _opt(batch, key)
    if value is None:
        raise KeyError(f"the batch has no field {key!r}; the credit step reads {FIELDS_READ}")
    return value


def _set(batch: Mapping | object, key: str, value: object) -> None:
    batch[key] = value  # dicts, and RolloutBatch implements __setitem__


def _check_mix(lam: float, band: float) -> None:
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"algorithm.mult_lambda must be in [0, 1], got {lam}; 0 is GRPO, the paper uses 0.5")
    if not 0.0 < band < 1.0:
        raise ValueError(f"algorithm.mult_band must be in (0, 1), got {band}; the paper uses 0.2")


ALGORITHMS: dict[str, type[Algorithm]] = {}
"""Every algorithm class by its default ``name`` (filled by :func:`register`). The yaml files of
``conf/algorithm/`` choose among them and set their knobs; tests iterate over both."""


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make an ``Algorithm`` subclass known by its default ``name`` (one class per name)."""
    name = cls.name
    if name in ALGORITHMS and ALGORITHMS[name] is not cls:
        raise ValueError(f"algorithm name {name!r} is taken by {ALGORITHMS[name].__qualname__}")
    ALGORITHMS[name] = cls
    return cls


@dataclass(frozen=True)
class TurnView:
    """A batch's turns in the padded ``[B,K]`` layout plus the maps back to its own layout."""

    gaps: Tensor  # [B, K] e_k = sum of the turn's token gaps (0 when no teacher was read)
    counts: Tensor  # [B, K] action tokens per turn
    mask: Tensor  # [B, K]
    rows: tuple[Tensor, Tensor] | None  # (turn_traj, turn_index) for the row layout
    token_turn: Tensor | None  # [B, T] for the token layout


def turn_view(batch: Mapping | object, *, with_gaps: bool = True) -> TurnView:
    """Turn evidence e_k (and tokens per turn) in ``[B,K]`` from either layout."""
    seq_adv = _get(batch, "seq_advantages")
    token_turn = _opt(batch, "token_turn") if isinstance(batch, Mapping) else None
    if token_turn is not None:
        valid = token_turn >= 0
        k = max(int(token_turn.max()) + 1 if token_turn.numel() else 0, 1)
        spill = torch.where(valid, token_turn, torch.full_like(token_turn, k)).long()  # column k is cut off
        counts = torch.zeros(token_turn.shape[0], k + 1, device=token_turn.device).scatter_add_(1, spill, valid.float())[:, :k]
        gaps = turn_evidence(_get(batch, "teacher_logprobs"), _get(batch, "student_logprobs"), token_turn, k) if with_gaps else counts * 0
        return TurnView(gaps, counts, counts > 0, None, token_turn)
    mask = _get(batch, "action_mask").bool()
    traj, index = _get(batch, "turn_traj").long(), _get(batch, "turn_index").long()
    row_gap = torch.zeros(mask.shape[0], device=mask.device)
    if with_gaps:  # e_k per row: each row is one turn, its own turn 0
        row_turn = torch.where(mask, 0, -1)
        row_gap = turn_evidence(_get(batch, "teacher_logprobs"), _get(batch, "student_logprobs"), row_turn, 1)[:, 0]
    gaps, turn_mask = pack_turns(row_gap, traj, index, num_trajectories=seq_adv.shape[0])
    counts, _ = pack_turns(mask.sum(1).float(), traj, index, num_trajectories=seq_adv.shape[0])
    return TurnView(gaps, counts, turn_mask, (traj, index), None)


def _spread(view: TurnView, turn_adv: Tensor, action_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Turn advantages ``[B,K]`` back to per-token advantages (and turn advantages) in the batch's own layout."""
    if view.token_turn is not None:
        per_token = torch.gather(turn_adv, 1, view.token_turn.clamp_min(0).long())
        return torch.where(view.token_turn >= 0, per_token, torch.zeros_like(per_token)).float(), turn_adv
    traj, index = view.rows
    rows = unpack_turns(turn_adv, traj, index)
    return (rows[:, None] * action_mask).float(), rows


def _write_turns(batch: Mapping | object, view: TurnView, turn_adv: Tensor) -> None:
    turn_adv = torch.where(view.mask, turn_adv, torch.zeros((), dtype=turn_adv.dtype, device=turn_adv.device))
    action_mask = None if view.token_turn is not None else _get(batch, "action_mask")
    adv, turn_out = _spread(view, turn_adv, action_mask)
    _set(batch, "advantages", adv)
    _set(batch, "turn_advantages", turn_out)


def _token_mask(batch: Mapping | object) -> Tensor:
    token_turn = _opt(batch, "token_turn") if isinstance(batch, Mapping) else None
    return token_turn >= 0 if token_turn is not None else _get(batch, "action_mask").bool()


def _row_advantages(batch: Mapping | object) -> Tensor:
    """A_seq of each row's trajectory (row layout) or of each row (token layout: a row is a trajectory)."""
    seq_adv = _get(batch, "seq_advantages")
    token_turn = _opt(batch, "token_turn") if isinstance(batch, Mapping) else None
    return seq_adv if token_turn is not None else seq_adv[_get(batch, "turn_traj").long()]


@register
@dataclass(frozen=True)
class Algorithm:
    """GRPO: every token of a trajectory gets its sequence advantage."""

    name: str = "grpo"
    eps_low: float = 0.2
    """Lower clip range of the ratio."""
    eps_high: float = 0.24
    """Upper clip range ("clip-higher", the paper's setting)."""
    kl_coef: float = 0.0
    """k3 KL penalty to a frozen reference (off by default; the 3B/7B experiments set the public runs' 0.01)."""
    entropy_coef: float = 0.0
    """Entropy bonus on the action tokens (off by default; the 3B/7B experiments set the public runs' 0.001)."""
    aggregation: str = "token-mean"
    scale_by_std: bool = True
    """Divide each group's centred outcome by the group's std (GRPO, the paper's setting). False: ``R - mean_g R``
    (Dr. GRPO; GiGPO's ``norm: mean``): a group's advantages then have variance p(1-p), so one failure among 8
    copies weighs under half a half-won group instead of as much (``results/quickstart_seeds/README.md``)."""

    needs_teacher = False
    teacher_scales_advantage = False
    """The teacher view's log-probs only scale each row's sequence advantage (``mix_advantages``), so a row whose
    A_seq is 0 gets advantage 0 whatever they are: its teacher forward may be skipped
    (``rollout.teacher_skip_zero_advantage``). Not so for a credit that adds to A_seq, nor a distillation loss."""
    needs_teacher_logits = False
    """The update keeps the student's full-vocabulary logits and runs a no-grad teacher-view forward per
    micro-batch (dummy passes too: the count depends on the algorithm alone) for :meth:`logits_loss`."""
    distill_coef = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError(f"algorithm.eps_low must be in [0, 1) and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"algorithm.kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"algorithm.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")

    def assign(self, batch: Mapping | object, step: int = 0) -> dict[str, Tensor]:
        """Write ``advantages`` into ``batch`` for training iteration ``step``; return tensors to log.

        The algorithm's credit first, then each turn's shaping penalty on that turn's tokens only.
        """
        if not self.scale_by_std:  # the sequence advantage every algorithm builds on, centred only
            _set(batch, "seq_advantages", grpo_advantages(_get(batch, "rewards").float(), _get(batch, "group_ids"),
                                                          scale_by_std=False))
        credit = self.credit(batch, step)
        self._charge_penalties(batch)
        return credit

    def credit(self, batch: Mapping | object, step: int) -> dict[str, Tensor]:
        row_adv = _row_advantages(batch)
        mask = _token_mask(batch)
        _set(batch, "advantages", (row_adv.float()[:, None] * mask).float())
        if not (isinstance(batch, Mapping) and batch.get("token_turn") is not None):
            _set(batch, "turn_advantages", row_adv.float())
        return {}

    def _charge_penalties(self, batch: Mapping | object) -> None:
        penalties = _opt(batch, "turn_penalties")
        if penalties is None:
            return
        token_turn = _opt(batch, "token_turn") if isinstance(batch, Mapping) else None
        if token_turn is not None:  # [B, K] -> per token
            per_token = torch.gather(penalties, 1, token_turn.clamp_min(0).long())
            _set(batch, "advantages", apply_turn_penalties(_get(batch, "advantages"), per_token, token_turn >= 0))
        else:
            _set(batch, "advantages", apply_turn_penalties(_get(batch, "advantages"), penalties, _get(batch, "action_mask").bool()))
        turn_adv = _opt(batch, "turn_advantages")
        if turn_adv is not None and turn_adv.shape == penalties.shape:
            _set(batch, "turn_advantages", turn_adv - penalties.to(turn_adv.dtype))

    def token_distill_loss(
        self, logprobs: Tensor, teacher_logprobs: Tensor | None, old_logprobs: Tensor, mask: Tensor, normalizer: float | None
    ) -> Tensor | None:
        """An extra loss on the sampled action tokens (SDAR, Skill-SD), already weighted; None when none."""
        return None

    def logits_loss(self, student_logits: Tensor | None, teacher_logits: Callable[[], Tensor], normalizer: float) -> Tensor | None:
        """An extra loss on the full-vocabulary logits at the action tokens (grpo_opsd), already weighted; None
        when none. ``student_logits`` ``[n, V]`` (with gradient) are kept only when ``needs_teacher_logits``;
        ``teacher_logits()`` runs the teacher view's forward (no gradient) and gives the same ``[n, V]`` rows."""
        return None


@register
@dataclass(frozen=True)
class AgentOPSD(Algorithm):
    """Turn-level credit by recursive belief revision (the paper's method)."""

    name: str = "agentopsd"
    mult_lambda: float = 0.5
    """lam: mix of GRPO and the multiplier (0 = GRPO)."""
    mult_band: float = 0.2
    """b: the multiplier stays in [1-b, 1+b]."""
    gap_decay_gamma: float = 0.95
    """gamma: decay of the evidence accumulator."""
    mode: str = "belief"
    """``belief`` or an ablation: ``raw_gap``, ``magnitude``, ``no_prior``."""
    token_level: bool = False
    """Run the same recursion over tokens instead of turns (the per-token ablation)."""

    needs_teacher = True
    teacher_scales_advantage = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_mix(self.mult_lambda, self.mult_band)
        if not 0.0 <= self.gap_decay_gamma <= 1.0:
            raise ValueError(f"algorithm.gap_decay_gamma must be in [0, 1], got {self.gap_decay_gamma}; the paper uses 0.95")
        if self.mode not in MODES:
            raise ValueError(f"algorithm.mode must be one of {MODES}, got {self.mode!r}")

    def _multipliers(self, seq_adv: Tensor, gaps: Tensor, mask: Tensor, batch: Mapping | object) -> tuple[Tensor, Tensor, Tensor]:
        prior = group_success_rate(_get(batch, "success"), _get(batch, "group_ids"))
        return turn_multipliers(seq_adv, gaps, mask, prior, gamma=self.gap_decay_gamma, band=self.mult_band, mode=self.mode)

    def credit(self, batch: Mapping | object, step: int) -> dict[str, Tensor]:
        if self.token_level:
            return self._credit_tokens(batch)
        view = turn_view(batch)
        seq_adv = _get(batch, "seq_advantages")
        # turn_multipliers + mix_advantages: the two tested halves of credit.reshape_advantages
        beliefs, revisions, w = self._multipliers(seq_adv, view.gaps, view.mask, batch)
        _write_turns(batch, view, mix_advantages(seq_adv, w, self.mult_lambda))
        credit = {"beliefs": beliefs, "revisions": revisions, "multipliers": w, "evidence": view.gaps, "turn_mask": view.mask}
        _set(batch, "credit", credit)
        return credit

    def _credit_tokens(self, batch: Mapping | object) -> dict[str, Tensor]:
        """Per-token accumulation (the paper's ablation, 85.9 against 89.1 on 7B ALFWorld).

        The reading implemented: the whole method with K = the trajectory's action tokens in
        generation order across all its turns. One accumulator runs through the trajectory
        (``c_t = gamma c_{t-1} + delta_t``, so gamma decays per token and is not reset at turn
        boundaries), the prior is the same group success rate, ``q`` is standardised over all of
        the trajectory's tokens, and each token gets its own multiplier. Not implemented: the
        public code's ``granularity=token``, which runs the recursion inside each turn on its own
        (a fresh accumulator from the prior, and the standardisation, per turn row).

        Rows of different trajectories may come in any order, but the rows of one trajectory
        must come in turn order: its token sequence is read row by row, and a row out of turn
        order would feed tokens to the accumulator out of order, so it raises instead.
        """
        seq_adv = _get(batch, "seq_advantages")
        token_turn = _opt(batch, "token_turn") if isinstance(batch, Mapping) else None
        if token_turn is not None:  # one row per trajectory
            mask = token_turn >= 0
            traj = torch.arange(mask.shape[0], device=mask.device)
            turn = torch.zeros_like(traj)
            later = torch.cummax(torch.where(mask, token_turn, torch.full_like(token_turn, -1)), dim=1).values
            if bool((mask & (token_turn < later)).any()):
                raise ValueError("per-token accumulation reads a row's action tokens left to right: token_turn must not decrease along a row")
        else:
            mask = _get(batch, "action_mask").bool()
            traj, turn = _get(batch, "turn_traj").long(), _get(batch, "turn_index").long()
        order = torch.argsort(traj, stable=True)  # trajectories contiguous, each one's rows in batch order
        t_sorted, k_sorted = traj[order], turn[order]
        bad = (t_sorted[1:] == t_sorted[:-1]) & (k_sorted[1:] <= k_sorted[:-1])
        if bool(bad.any()):
            i = int(t_sorted[1:][bad][0])
            raise ValueError(
                f"per-token accumulation: the rows of trajectory {i} are not in turn order (turn_index "
                f"{turn[traj == i].tolist()}); sort the batch's rows by (turn_traj, turn_index)"
            )
        delta_rows = (_get(batch, "teacher_logprobs").float() - _get(batch, "student_logprobs").float())[order]
        mask_sorted = mask[order]
        delta = delta_rows[mask_sorted]  # row-major: trajectory, then turn, then position
        token_traj = t_sorted[:, None].expand_as(mask_sorted)[mask_sorted]
        counts = torch.bincount(token_traj, minlength=seq_adv.shape[0])
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(token_traj.numel(), device=mask.device) - starts[token_traj]
        gaps, tmask = pack_turns(delta, token_traj, pos, num_trajectories=seq_adv.shape[0])
        beliefs, revisions, w = self._multipliers(seq_adv, gaps, tmask, batch)
        tok_adv = mix_advantages(seq_adv, w, self.mult_lambda)
        sorted_adv = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        sorted_adv[mask_sorted] = unpack_turns(tok_adv, token_traj, pos).float()
        adv = torch.empty_like(sorted_adv)
        adv[order] = sorted_adv
        _set(batch, "advantages", adv)
        if token_turn is None:
            _set(batch, "turn_advantages", seq_adv[traj].float())
        # token_level: these [B, tokens] records are not per turn (the rollout shards skip them)
        credit = {"beliefs": beliefs, "revisions": revisions, "multipliers": w, "evidence": gaps, "turn_mask": tmask,
                  "token_level": torch.tensor(True)}
        _set(batch, "credit", credit)
        return credit


@register
@dataclass(frozen=True)
class RLSD(Algorithm):
    """Token multiplier ``clip(exp(sign(A) delta_t), 1-b, 1+b)`` mixed with lam (baseline)."""

    name: str = "rlsd"
    mult_lambda: float = 0.5
    """lam at iteration 0 (the public runs: rlsd_lambda=0.5)."""
    mult_band: float = 0.2
    """b: the token multiplier stays in [1-b, 1+b] (the public runs: clip_eps=0.2)."""
    lambda_warmdown_steps: int = 0
    """Decay lam linearly to 0 over this many iterations (0 = constant; the public runs: 100)."""
    needs_teacher = True
    teacher_scales_advantage = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_mix(self.mult_lambda, self.mult_band)
        if self.lambda_warmdown_steps < 0:
            raise ValueError(f"algorithm.lambda_warmdown_steps must be >= 0 (0 = constant lambda; RLSD's public runs use 100), "
                             f"got {self.lambda_warmdown_steps}")

    def lambda_at(self, step: int) -> float:
        return lambda_at(self.mult_lambda, step, self.lambda_warmdown_steps)

    def credit(self, batch: Mapping | object, step: int) -> dict[str, Tensor]:
        row_adv = _row_advantages(batch)
        adv = rlsd_token_advantages(
            row_adv, _get(batch, "teacher_logprobs"), _get(batch, "student_logprobs"), _token_mask(batch),
            lam=self.lambda_at(step), band=self.mult_band,
        )
        _set(batch, "advantages", adv.float())
        if not (isinstance(batch, Mapping) and batch.get("token_turn") is not None):
            _set(batch, "turn_advantages", row_adv.float())
        return {}


@register
@dataclass(frozen=True)
class StepOPSD(Algorithm):
    """Turn-level, locally scored: ``w_k = clip(exp(sign(A) * mean_t delta_{k,t}), 1-b, 1+b)`` (baseline)."""

    name: str = "stepopsd"
    mult_lambda: float = 0.5
    mult_band: float = 0.2
    needs_teacher = True
    teacher_scales_advantage = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_mix(self.mult_lambda, self.mult_band)

    def credit(self, batch: Mapping | object, step: int) -> dict[str, Tensor]:
        view = turn_view(batch)
        seq_adv = _get(batch, "seq_advantages")
        w = stepopsd_multipliers(seq_adv, view.gaps / view.counts.clamp_min(1), view.mask, band=self.mult_band)
        _write_turns(batch, view, mix_advantages(seq_adv, w, self.mult_lambda))
        return {}


@register
@dataclass(frozen=True)
class GiGPO(Algorithm):
    """Episode-level GRPO advantage plus a step-level advantage from anchor states (no teacher view).

    Turns of one task group that acted on the identical observation text form a step group; each
    turn's discounted return ``gamma^(K-1-k) R`` is normalised within its step group, and
    ``A_k = A_episode + omega * A_step_k`` (GiGPO, Eq. 3-8).
    """

    name: str = "gigpo"
    gamma: float = 0.95
    """Discount of the step returns (GiGPO's setting, and the public runs' algorithm.gamma)."""
    step_weight: float = 1.0
    """omega, the weight of the step-level advantage (GiGPO's step_advantage_w)."""
    norm: str = "mean_std"
    """``mean_std``: (R - mean) / (std + eps) at both levels, as GRPO; ``mean``: R - mean (the public runs' mean_norm)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"algorithm.gamma must be in [0, 1], got {self.gamma}; GiGPO uses 0.95")
        if self.step_weight < 0:
            raise ValueError(f"algorithm.step_weight must be >= 0, got {self.step_weight}")
        if self.norm not in GIGPO_NORMS:
            raise ValueError(f"algorithm.norm must be one of {GIGPO_NORMS}, got {self.norm!r}")
        if not self.scale_by_std and self.norm == "mean_std":
            raise ValueError("algorithm.scale_by_std=false with GiGPO's norm mean_std would scale the step level and not "
                             "the episode level: set algorithm.norm=mean instead (both levels centred only)")

    def credit(self, batch: Mapping | object, step: int) -> dict[str, Tensor]:
        if isinstance(batch, Mapping) and batch.get("token_turn") is not None:
            raise ValueError("GiGPO needs each turn's environment state: give the row layout with turn_state ([M] state ids)")
        view = turn_view(batch, with_gaps=False)
        rewards, group_ids = _get(batch, "rewards"), _get(batch, "group_ids")
        by_std = self.norm == "mean_std"
        # mean_std: the batch's own GRPO advantage, computed once from the same outcome rewards
        episode = _get(batch, "seq_advantages") if by_std else grpo_advantages(rewards, group_ids, scale_by_std=False)
        traj, index = view.rows
        states, _ = pack_turns(_get(batch, "turn_state").long(), traj, index, num_trajectories=view.mask.shape[0], fill=-1)
        groups = anchor_state_groups(group_ids, states, view.mask)
        returns = discounted_turn_returns(rewards, view.mask, self.gamma)
        total, step_adv = gigpo_advantages(episode, returns, groups, view.mask, omega=self.step_weight, scale_by_std=by_std)
        _write_turns(batch, view, total)
        # returned for the credit/ statistics only: batch.credit holds the belief records AgentOPSD logs per turn
        return {"step_advantages": step_adv, "step_groups": groups, "turn_mask": view.mask}


@register
@dataclass(frozen=True)
class GRPOOPSD(Algorithm):
    """GRPO plus a token-level distillation loss KL(teacher || student) over the vocabulary."""

    name: str = "grpo_opsd"
    distill_coef: float = 0.01
    """Weight of KL(teacher || student) on the action tokens (the public runs' coefficient, 0.01)."""
    needs_teacher = True
    needs_teacher_logits = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.distill_coef < 0:
            raise ValueError(f"algorithm.distill_coef must be >= 0, got {self.distill_coef}")

    def logits_loss(self, student_logits, teacher_logits, normalizer):
        t_logits = teacher_logits()
        ones = torch.ones(1, student_logits.shape[0], dtype=torch.bool, device=student_logits.device)
        norm = normalizer if self.aggregation == "token-mean" else None
        return self.distill_coef * distillation_loss(student_logits[None], t_logits[None], ones, normalizer=norm)


@register
@dataclass(frozen=True)
class SDAR(Algorithm):
    """GRPO plus confidence-gated distillation: ``mean_t g_t (log pi_T - log pi_S)``, ``g_t = sigmoid(beta delta_t)``."""

    name: str = "sdar"
    distill_coef: float = 0.01
    """Weight of the gated distillation term (the public runs: sdar_coef=0.01)."""
    gate_beta: float = 5.0
    """beta, the sharpness of the gate (the public runs: gate_beta=5.0; 0 gives a constant gate of 0.5)."""
    needs_teacher = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.distill_coef < 0 or self.gate_beta < 0:
            raise ValueError(f"algorithm.distill_coef and gate_beta must be >= 0, got {self.distill_coef}, {self.gate_beta}")

    def token_distill_loss(self, logprobs, teacher_logprobs, old_logprobs, mask, normalizer):
        if teacher_logprobs is None:
            raise ValueError("SDAR needs the teacher view's log-probs (batch.teacher_logprobs)")
        loss = sdar_loss(logprobs, teacher_logprobs, mask, beta=self.gate_beta, aggregation=self.aggregation, normalizer=normalizer)
        return self.distill_coef * loss


@register
@dataclass(frozen=True)
class SkillSD(Algorithm):
    """GRPO plus Skill-SD's self-distillation loss ``mean_t rho_t k3_t`` toward the detached teacher view."""

    name: str = "skill_sd"
    distill_coef: float = 0.001
    """Weight of the self-distillation term (the public runs: sdl_lambda=0.001)."""
    needs_teacher = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.distill_coef < 0:
            raise ValueError(f"algorithm.distill_coef must be >= 0, got {self.distill_coef}")

    def token_distill_loss(self, logprobs, teacher_logprobs, old_logprobs, mask, normalizer):
        if teacher_logprobs is None:
            raise ValueError("Skill-SD needs the teacher view's log-probs (batch.teacher_logprobs)")
        loss = skill_sd_loss(logprobs, teacher_logprobs, old_logprobs, mask, aggregation=self.aggregation, normalizer=normalizer)
        return self.distill_coef * loss
