"""Algorithms as small config objects: choosing an algorithm is choosing a file in conf/algorithm/.

Each algorithm says whether it needs the teacher view and turns a batch's gaps into the
per-token advantages the clipped objective consumes. The math lives in
:mod:`agentopsd.credit`; this module only moves tensors between layouts.

Batch fields (a :class:`~agentopsd.types.RolloutBatch` or any mapping with these keys):

* row layout (ours): ``teacher_logprobs``/``student_logprobs`` ``[M,L]``, ``action_mask`` ``[M,L]``,
  ``turn_traj`` ``[M]``, ``turn_index`` ``[M]``;
* token layout (other code): ``teacher_logprobs``/``student_logprobs`` ``[B,T]`` and ``token_turn``
  ``[B,T]`` (-1 off the action tokens);
* both: ``seq_advantages`` ``[B]``, ``success`` ``[B]`` (0/1 bits), ``group_ids`` ``[B]``.

Written: ``advantages`` (same shape as the log-probs), ``turn_advantages`` (``[M]`` rows, or ``[B,K]``),
and ``credit`` (a dict of ``beliefs``, ``revisions``, ``multipliers``, ``evidence``, ``turn_mask``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from agentopsd.credit import (
    MODES,
    group_success_rate,
    pack_turns,
    rlsd_token_advantages,
    turn_evidence,
    turn_multipliers,
    unpack_turns,
)

FIELDS_READ = (
    "teacher_logprobs and student_logprobs with either action_mask, turn_traj, turn_index (one row per turn) "
    "or token_turn ([B, T], -1 off the action tokens); always seq_advantages, success, group_ids"
)


def _get(batch: Mapping | object, key: str) -> Tensor:
    value = batch.get(key) if isinstance(batch, Mapping) else getattr(batch, key, None)
    if value is None:
        raise KeyError(f"the batch has no field {key!r}; the credit step reads {FIELDS_READ}")
    return value


def _set(batch: Mapping | object, key: str, value: object) -> None:
    if isinstance(batch, dict):
        batch[key] = value
    else:
        batch[key] = value  # RolloutBatch implements __setitem__


def _write_rows(batch: Mapping | object, turn_adv: Tensor, action_mask: Tensor) -> None:
    """Row layout: one advantage per turn row, spread over that row's action tokens."""
    _set(batch, "turn_advantages", turn_adv)
    _set(batch, "advantages", turn_adv[:, None] * action_mask)


@dataclass(frozen=True)
class TurnView:
    """A batch's gaps in the padded ``[B,K]`` layout plus the maps back to its own layout."""

    gaps: Tensor  # [B, K]
    mask: Tensor  # [B, K]
    rows: tuple[Tensor, Tensor] | None  # (turn_traj, turn_index) for the row layout
    token_turn: Tensor | None  # [B, T] for the token layout


def turn_view(batch: Mapping | object) -> TurnView:
    """Turn evidence e_k in ``[B,K]`` from either layout."""
    teacher, student = _get(batch, "teacher_logprobs"), _get(batch, "student_logprobs")
    seq_adv = _get(batch, "seq_advantages")
    token_turn = batch.get("token_turn") if isinstance(batch, Mapping) else None
    if token_turn is not None:
        k = int(token_turn.max()) + 1 if token_turn.numel() else 0
        gaps = turn_evidence(teacher, student, token_turn, max(k, 1))
        # non-action tokens go to a spill column that is cut off
        spill = torch.where(token_turn >= 0, token_turn, torch.full_like(token_turn, gaps.shape[1])).long()
        present = torch.zeros(gaps.shape[0], gaps.shape[1] + 1, dtype=torch.bool, device=gaps.device)
        present.scatter_(1, spill, torch.ones_like(spill, dtype=torch.bool))
        return TurnView(gaps, present[:, :-1], None, token_turn)
    mask = _get(batch, "action_mask").bool()
    traj, index = _get(batch, "turn_traj").long(), _get(batch, "turn_index").long()
    row_gap = ((teacher.detach().float() - student.detach().float()) * mask).sum(dim=1)  # e_k per row
    gaps, turn_mask = pack_turns(row_gap, traj, index, num_trajectories=seq_adv.shape[0])
    return TurnView(gaps, turn_mask, (traj, index), None)


def _spread(view: TurnView, turn_adv: Tensor, like: Tensor, action_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Turn advantages back to per-token advantages in the batch's own layout."""
    if view.token_turn is not None:
        idx = view.token_turn.clamp_min(0).long()
        per_token = torch.gather(turn_adv, 1, idx)
        return torch.where(view.token_turn >= 0, per_token, torch.zeros_like(per_token)).to(like.dtype), turn_adv
    traj, index = view.rows
    rows = unpack_turns(turn_adv, traj, index)
    return (rows[:, None] * action_mask).to(like.dtype), rows


@dataclass(frozen=True)
class Algorithm:
    """GRPO: every token of a trajectory gets its sequence advantage."""

    name: str = "grpo"
    eps_low: float = 0.2
    """Lower clip range of the ratio."""
    eps_high: float = 0.24
    """Upper clip range ("clip-higher", the paper's setting)."""
    kl_coef: float = 0.0
    """k3 KL penalty to a frozen reference (off by default, as in the paper)."""
    aggregation: str = "token-mean"

    def __post_init__(self) -> None:
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError(f"algorithm.eps_low must be in [0, 1) and eps_high >= 0, got {self.eps_low}, {self.eps_high}")

    needs_teacher = False
    needs_teacher_logits = False
    distill_coef = 0.0

    def assign(self, batch: Mapping | object) -> dict[str, Tensor]:
        seq_adv = _get(batch, "seq_advantages")
        if isinstance(batch, Mapping) and batch.get("token_turn") is not None:
            tt = batch["token_turn"]
            adv = torch.where(tt >= 0, seq_adv[:, None].expand_as(tt), torch.zeros((), device=tt.device)).float()
            _set(batch, "advantages", adv)
            return {}
        mask = _get(batch, "action_mask").bool()
        traj = _get(batch, "turn_traj").long()
        _write_rows(batch, seq_adv[traj].float(), mask)
        return {}


@dataclass(frozen=True)
class AgentOPSD(Algorithm):
    """Turn-level credit by recursive belief revision (DESIGN.md section 2)."""

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

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.mult_lambda <= 1.0:
            raise ValueError(f"algorithm.mult_lambda must be in [0, 1], got {self.mult_lambda}")
        if not 0.0 < self.mult_band < 1.0:
            raise ValueError(f"algorithm.mult_band must be in (0, 1), got {self.mult_band}")
        if not 0.0 <= self.gap_decay_gamma <= 1.0:
            raise ValueError(f"algorithm.gap_decay_gamma must be in [0, 1], got {self.gap_decay_gamma}")
        if self.mode not in MODES:
            raise ValueError(f"algorithm.mode must be one of {MODES}, got {self.mode!r}")

    def assign(self, batch: Mapping | object) -> dict[str, Tensor]:
        if self.token_level:
            return self._assign_tokens(batch)
        view = turn_view(batch)
        seq_adv = _get(batch, "seq_advantages")
        prior = group_success_rate(_get(batch, "success"), _get(batch, "group_ids"))
        beliefs, revisions, w = turn_multipliers(
            seq_adv, view.gaps, view.mask, prior, gamma=self.gap_decay_gamma, band=self.mult_band, mode=self.mode
        )
        lam = self.mult_lambda
        turn_adv = torch.where(view.mask, seq_adv.to(w.dtype)[:, None] * ((1 - lam) + lam * w), torch.zeros((), dtype=w.dtype, device=w.device))
        like = _get(batch, "teacher_logprobs")
        action_mask = None if view.token_turn is not None else _get(batch, "action_mask")
        adv, turn_out = _spread(view, turn_adv, like, action_mask)
        _set(batch, "advantages", adv)
        _set(batch, "turn_advantages", turn_out)
        credit = {"beliefs": beliefs, "revisions": revisions, "multipliers": w, "evidence": view.gaps, "turn_mask": view.mask}
        _set(batch, "credit", credit)
        return credit

    def _assign_tokens(self, batch: Mapping | object) -> dict[str, Tensor]:
        """Per-token accumulation: the trajectory's action tokens in order form the K axis."""
        mask = _get(batch, "action_mask").bool()
        traj = _get(batch, "turn_traj").long()
        seq_adv = _get(batch, "seq_advantages")
        delta = (_get(batch, "teacher_logprobs").float() - _get(batch, "student_logprobs").float())[mask]
        token_traj = traj[:, None].expand_as(mask)[mask]
        # position of each token within its trajectory: rows are ordered by (trajectory, turn)
        order = torch.arange(token_traj.numel(), device=mask.device)
        starts = torch.zeros(seq_adv.shape[0], dtype=torch.long, device=mask.device)
        counts = torch.bincount(token_traj, minlength=seq_adv.shape[0])
        starts[1:] = torch.cumsum(counts, 0)[:-1]
        pos = order - starts[token_traj]
        gaps, tmask = pack_turns(delta, token_traj, pos, num_trajectories=seq_adv.shape[0])
        prior = group_success_rate(_get(batch, "success"), _get(batch, "group_ids"))
        beliefs, revisions, w = turn_multipliers(seq_adv, gaps, tmask, prior, gamma=self.gap_decay_gamma, band=self.mult_band, mode=self.mode)
        lam = self.mult_lambda
        tok_adv = seq_adv.to(w.dtype)[:, None] * ((1 - lam) + lam * w)
        adv = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        adv[mask] = unpack_turns(tok_adv, token_traj, pos).float()
        _set(batch, "advantages", adv)
        _set(batch, "turn_advantages", seq_adv[traj].float())
        credit = {"beliefs": beliefs, "revisions": revisions, "multipliers": w, "evidence": gaps, "turn_mask": tmask}
        _set(batch, "credit", credit)
        return credit


@dataclass(frozen=True)
class RLSD(Algorithm):
    """Token multiplier ``clip(exp(sign(A) delta_t), 1-b, 1+b)`` mixed with lam (baseline)."""

    name: str = "rlsd"
    mult_lambda: float = 0.5
    mult_band: float = 0.2
    needs_teacher = True

    def assign(self, batch: Mapping | object) -> dict[str, Tensor]:
        mask = _get(batch, "action_mask").bool()
        seq_adv = _get(batch, "seq_advantages")
        traj = _get(batch, "turn_traj").long()
        rows_adv = seq_adv[traj]
        adv = rlsd_token_advantages(
            rows_adv, _get(batch, "teacher_logprobs"), _get(batch, "student_logprobs"), mask, lam=self.mult_lambda, band=self.mult_band
        )
        _set(batch, "advantages", adv.float())
        _set(batch, "turn_advantages", rows_adv.float())
        return {}


@dataclass(frozen=True)
class StepOPSD(Algorithm):
    """Turn-level, locally scored: ``w_k = clip(exp(sign(A) * mean_t delta_{k,t}), 1-b, 1+b)``.

    Each turn is judged on its own gap (no accumulated belief, no prior), the contrast the
    paper draws with AgentOPSD.
    """

    name: str = "stepopsd"
    mult_lambda: float = 0.5
    mult_band: float = 0.2
    needs_teacher = True

    def assign(self, batch: Mapping | object) -> dict[str, Tensor]:
        mask = _get(batch, "action_mask").bool()
        seq_adv = _get(batch, "seq_advantages")
        traj = _get(batch, "turn_traj").long()
        delta = (_get(batch, "teacher_logprobs").float() - _get(batch, "student_logprobs").float()) * mask
        mean_gap = delta.sum(1) / mask.sum(1).clamp_min(1)
        rows_adv = seq_adv[traj].float()
        w = torch.exp((torch.sign(rows_adv) * mean_gap).clamp(-30, 30)).clamp(1 - self.mult_band, 1 + self.mult_band)
        _write_rows(batch, rows_adv * ((1 - self.mult_lambda) + self.mult_lambda * w), mask)
        return {}


@dataclass(frozen=True)
class GRPOOPSD(Algorithm):
    """GRPO plus a token-level distillation loss toward the detached teacher view."""

    name: str = "grpo_opsd"
    distill_coef: float = 0.1
    """Weight of KL(teacher || student) on the action tokens."""
    needs_teacher = True
    needs_teacher_logits = True
