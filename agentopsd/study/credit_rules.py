"""Every turn-level credit rule of the package, recomputed on one logged task group.

A rollout shard of an AgentOPSD run holds, per turn, the evidence e_k (the turn's summed log-prob
gap between the teacher and student views) and, per trajectory, the success bit and A_seq. That is
all the turn-level rules need, so they can be compared on the *same* rollouts and the *same*
teacher scores, which separate training runs never give:

- ``agentopsd``: the paper's method, q_k = sign(A) dB_k with the group's success prior;
- ``no_prior``, ``raw_gap``, ``magnitude``: the paper's ablations (l0 = 0; q_k = sign(A) e_k, no
  accumulator; q_k = |dB_k|, no outcome sign);
- ``stepopsd``: w_k = clip(exp(sign(A) * e_k / n_k), 1-b, 1+b), each turn scored by its own mean gap;
- ``gigpo``: A_episode + A_step from anchor states (teacher-free; needs the whole group);
- where the shard also holds each token's gap delta_t: ``token``, the paper's per-token ablation (the
  same recursion over the trajectory's action tokens), and ``rlsd``, w_t = clip(exp(sign(A) delta_t),
  1-b, 1+b), each as the mean of its token multipliers over the turn.

Each rule's output here is the order it puts on a trajectory's turns: ``sign(A) * w_k`` for the
multiplier rules (the turn advantage A ((1 - lam) + lam w_k) orders the turns this way for every
lam > 0; the token rules use the turn's mean w_t), the turn advantage itself for GiGPO.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from agentopsd.credit import (
    anchor_state_groups,
    discounted_turn_returns,
    gigpo_advantages,
    stepopsd_multipliers,
    turn_multipliers,
)

RULES = ("agentopsd", "no_prior", "raw_gap", "magnitude", "token", "stepopsd", "rlsd", "gigpo")
"""Every rule, the paper's method first (``token`` and ``rlsd`` only where token gaps were logged)."""
TOKEN_RULES = ("token", "rlsd")
MODES = {"agentopsd": "belief", "no_prior": "no_prior", "raw_gap": "raw_gap", "magnitude": "magnitude"}
"""Rule -> ``turn_multipliers`` mode."""


@dataclass(frozen=True)
class LoggedGroup:
    """One task group as a rollout shard logged it (every trajectory of the group, in any order)."""

    success: Sequence[bool]
    """[B] the outcome bits."""
    seq_advantages: Sequence[float]
    """[B] A_seq as logged (GRPO's group-normalised outcome)."""
    evidence: Sequence[Sequence[float]]
    """[B][K_i] e_k per turn."""
    tokens: Sequence[Sequence[int]]
    """[B][K_i] tokens generated on each turn (StepOPSD's mean gap divides by them)."""
    states: Sequence[Sequence[Hashable]]
    """[B][K_i] the environment state each turn acted on (GiGPO's anchor states: equal = identical)."""
    token_gaps: Sequence[Sequence[Sequence[float]]] | None = None
    """[B][K_i][tokens] each action token's gap delta_t, where logged (``token`` and ``rlsd`` need them)."""

    def __post_init__(self) -> None:
        b = len(self.success)
        if not (len(self.seq_advantages) == len(self.evidence) == len(self.tokens) == len(self.states) == b) or b == 0:
            raise ValueError("success, seq_advantages, evidence, tokens and states need one row per trajectory (at least one)")
        for i, (e, n, s) in enumerate(zip(self.evidence, self.tokens, self.states)):
            if not len(e) == len(n) == len(s) or len(e) == 0:
                raise ValueError(f"trajectory {i}: evidence, tokens and states need one entry per turn (at least one), "
                                 f"got {len(e)}, {len(n)} and {len(s)}")
        if self.token_gaps is not None:
            if len(self.token_gaps) != b or any(len(g) != len(e) for g, e in zip(self.token_gaps, self.evidence)):
                raise ValueError("token_gaps need one list of token gaps per turn of every trajectory")
            if any(len(turn) == 0 for g in self.token_gaps for turn in g):
                raise ValueError("token_gaps: every turn generated at least one token")


def _pad(rows: Sequence[Sequence[float]], dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, K] values and their bool mask."""
    width = max(len(r) for r in rows)
    values = torch.zeros(len(rows), width, dtype=dtype)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        values[i, : len(r)] = torch.as_tensor(list(r), dtype=dtype)
        mask[i, : len(r)] = True
    return values, mask


def rule_orderings(group: LoggedGroup, *, gamma: float = 0.95, band: float = 0.2, gigpo_gamma: float = 0.95,
                   omega: float = 1.0) -> dict[str, list[np.ndarray]]:
    """rule -> one array [K_i] per trajectory: the order the rule puts on that trajectory's turns.

    Defaults are the shipped configs' (the paper's gamma and band; GiGPO's gamma and omega = 1).
    The prior is the group's success rate, as in training, so the group must be whole.
    """
    success = torch.as_tensor([float(s) for s in group.success], dtype=torch.float64)
    adv = torch.as_tensor([float(a) for a in group.seq_advantages], dtype=torch.float64)
    gaps, mask = _pad(group.evidence)
    counts, _ = _pad(group.tokens)
    prior = success.mean().expand(len(success))
    sign = torch.sign(adv)[:, None]
    out: dict[str, torch.Tensor] = {}
    for rule, mode in MODES.items():
        _, _, w = turn_multipliers(adv, gaps, mask, prior, gamma=gamma, band=band, mode=mode)
        out[rule] = sign * w
    out["stepopsd"] = sign * stepopsd_multipliers(adv, gaps / counts.clamp_min(1), mask, band=band)
    ids: dict[Hashable, int] = {}
    states = torch.tensor([[ids.setdefault(s, len(ids)) for s in row] + [-1] * (mask.shape[1] - len(row))
                           for row in group.states], dtype=torch.long)
    steps = anchor_state_groups(torch.zeros(len(success), dtype=torch.long), states, mask)
    out["gigpo"], _ = gigpo_advantages(adv, discounted_turn_returns(success, mask, gigpo_gamma), steps, mask, omega=omega)
    lengths = mask.sum(1).tolist()
    orders = {rule: [out[rule][i, :k].numpy().copy() for i, k in enumerate(lengths)] for rule in out}
    if group.token_gaps is not None:
        orders.update(_token_rules(group.token_gaps, adv, prior, sign, gamma=gamma, band=band))
    return orders


def _token_rules(token_gaps: Sequence[Sequence[Sequence[float]]], adv: torch.Tensor, prior: torch.Tensor, sign: torch.Tensor,
                 *, gamma: float, band: float) -> dict[str, list[np.ndarray]]:
    """``token`` and ``rlsd``: multipliers per action token, each turn ordered by its tokens' mean ``sign(A) w_t``."""
    flat, tmask = _pad([[d for turn in traj for d in turn] for traj in token_gaps])  # one row per trajectory, in generation order
    _, _, w_token = turn_multipliers(adv, flat, tmask, prior, gamma=gamma, band=band, mode="belief")
    w_rlsd = torch.exp((sign * flat).clamp(-30.0, 30.0)).clamp(1 - band, 1 + band)
    out: dict[str, list[np.ndarray]] = {"token": [], "rlsd": []}
    for i, traj in enumerate(token_gaps):
        bounds = np.cumsum([0] + [len(turn) for turn in traj])
        for rule, w in (("token", w_token), ("rlsd", w_rlsd)):
            row = (sign[i] * w[i]).numpy()
            out[rule].append(np.asarray([row[a:b].mean() for a, b in zip(bounds[:-1], bounds[1:])]))
    return out
