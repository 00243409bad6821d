"""Oracle credit: AgentOPSD's recursion fed the true turn values instead of the teacher-student gap.

A study mode, not one of the paper's algorithms. It answers one question: when the evidence is right,
how far can AgentOPSD's reshaping (sign alignment, standardisation within the trajectory, the bounded
multiplier ``w_k`` in ``[1-b, 1+b]`` mixed with ``lam``) move learning? If the oracle at the paper's
settings does no better than GRPO, the lever, not the evidence, limits the method there.

Everything of :class:`~agentopsd.credit.algorithms.AgentOPSD` is kept (prior, accumulator, belief, revision,
``q_k = sign(A_seq) dB_k``, z-score, clip, mix) but the turn evidence ``e_k``:

    e*_k = s * g_k,   g_k = d(s_k) - d(s_{k+1})   (the expert's path saved by the turn, the ladder's label)

with ``d`` the environment expert's remaining path (:func:`agentopsd.study.groundtruth.expert_remaining`) on
a replay of the logged trajectory from its task index. A fatal turn (winnable before, not after) gets
``g_k = -fatal_gain``, by default the turns that were left in the episode's budget before it (the
whole rest of the episode is lost); a turn taken when the task was already lost gets 0. ``s`` makes
the oracle's spread equal the real evidence's spread on the same rollouts: the population std of
``e*`` over the turns the credit acts on (trajectories with ``A_seq != 0``) equals that of the
teacher-student gaps ``e_k`` over the same turns (or ``spread`` when given), so the sigmoid and the
accumulator work at the scale they work at in the real method.

Needs an environment that can be replayed and has an expert (BabyAI, ALFWorld) and the row layout of
:class:`~agentopsd.types.RolloutBatch` with its ``trajectories``. Selected by Hydra overrides on any
AgentOPSD config, e.g. (what ``studies/ladder.py --methods oracle`` passes)::

    python train.py experiment=keydoor algorithm._target_=agentopsd.study.oracle.OracleOPSD \
        algorithm.name=oracle +algorithm.max_turns='${env.max_turns}' +algorithm.env_kwargs='${oc.select:env.kwargs,null}'

The real gaps are kept beside it in ``batch.credit["teacher_evidence"]`` and the labels in
``batch.credit["expert_gain"]``; ``batch.credit["evidence"]`` (what the rollout shards log) is the oracle's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import torch
from torch import Tensor

from agentopsd.credit import mix_advantages
from agentopsd.credit.algorithms import AgentOPSD, _get, _opt, _set, _write_turns, turn_view
from agentopsd.study.groundtruth import (
    LoggedTrajectory,
    LoggedTurn,
    advance,
    expert_gain,
    expert_remaining,
    make_env,
    start,
)
from agentopsd.types import Trajectory

__all__ = ["OracleOPSD", "expert_turn_gains", "logged", "matched_scale", "oracle_env", "replayed_path"]


def logged(traj: Trajectory) -> LoggedTrajectory:
    """A trainer's trajectory as the ground-truth code reads a logged one (the rollout shards' record)."""
    turns = tuple(LoggedTurn(k=t.index, action=t.parsed_action or t.action_text, observation=t.observation, valid=t.valid, signals={})
                  for t in traj.turns)
    return LoggedTrajectory(run="oracle", algorithm="oracle", env_id=traj.task.env_id, iteration=0, task_index=traj.task.task_index,
                            success=traj.success, seq_advantage=0.0, turns=turns, group=traj.task.group_id)


def expert_turn_gains(traj: Trajectory | LoggedTrajectory, env: gym.Env, max_turns: int, fatal_gain: float | None = None) -> list[float]:
    """g_k for every turn of ``traj``: the expert's remaining path before the turn minus after it.

    Replayed on ``env`` (train split, the run's turn limit) from the task index, every observation
    checked against the log. A fatal turn gets ``-fatal_gain`` (None: ``max_turns - k``, the turns left
    in the episode's budget before turn k); a turn in an already lost state 0.
    """
    record = traj if isinstance(traj, LoggedTrajectory) else logged(traj)
    path = replayed_path(env, record, max_turns)
    gains = []
    for k, (before, after) in enumerate(zip(path[:-1], path[1:])):
        if before >= 0 and after < 0:
            gains.append(-float(max_turns - k if fatal_gain is None else fatal_gain))
        else:
            gains.append(expert_gain(before, after))
    return gains


def replayed_path(env: gym.Env, record: LoggedTrajectory, max_turns: int) -> list[int]:
    """d(s_0) .. d(s_K) along a replay of ``record``: :func:`agentopsd.study.groundtruth.replay` then ``expert_path``, with
    the same checks (every observation against the log, the outcome), but one env stepped in place (each
    ``expert_remaining`` runs on its own copy): half the deep copies, which are most of the time."""
    state = start(env, record.task_index)
    path = [expert_remaining(state)]
    for turn in record.turns:
        if state.done or state.turn >= max_turns:
            raise ValueError(f"task {record.task_index}: the replay ended before logged turn {turn.k}; is max_turns={max_turns} the run's?")
        advance(state, turn.action if turn.stepped else None, turn.action, turn.observation)
        if state.observation != turn.observation:
            raise ValueError(f"task {record.task_index} turn {turn.k}: replayed observation differs from the log "
                             f"({state.observation[-80:]!r} vs {turn.observation[-80:]!r}); wrong env id, kwargs or max_turns?")
        path.append(expert_remaining(state))
    if state.won != record.success:
        raise ValueError(f"task {record.task_index}: replay success {state.won} but logged {record.success}")
    return path


def matched_scale(evidence: Tensor, gains: Tensor, mask: Tensor, spread: float | None = None) -> Tensor:
    """``s`` with std(s g) = std(e) over ``mask`` (population std), or = ``spread`` when given.

    0-d tensor; 0 when the gains do not vary (the multipliers are then 1 whatever the scale) or nothing is masked.
    """
    g = gains[mask].double()
    if g.numel() == 0:
        return torch.zeros((), dtype=gains.dtype, device=gains.device)
    g_std = g.std(unbiased=False)
    target = torch.tensor(float(spread), dtype=torch.float64, device=g.device) if spread is not None else evidence[mask].double().std(unbiased=False)
    scale = torch.where(g_std > 0, target / g_std.clamp_min(1e-12), torch.zeros_like(g_std))
    return scale.to(gains.dtype)


def oracle_env(env_id: str, max_turns: int, env_kwargs: Mapping[str, Any] | None) -> gym.Env:
    """The replay env of a run (as ``studies/credit_quality.py`` builds it: BabyAI skips its reset-time expert path)."""
    kwargs = dict(env_kwargs or {})
    if "BabyAI" in env_id:
        kwargs.setdefault("compute_expert_steps", False)
    return make_env(env_id, max_turns, kwargs)


@dataclass(frozen=True)
class OracleOPSD(AgentOPSD):
    """AgentOPSD with ``e_k`` replaced by the expert's path saved by the turn, at the evidence's spread (a study mode)."""

    name: str = "oracle"
    max_turns: int = 0
    """The run's ``env.max_turns`` (the replay's turn limit; required)."""
    env_kwargs: Mapping[str, Any] | None = None
    """The run's ``env.kwargs``."""
    fatal_gain: float | None = None
    """g of a fatal turn is ``-fatal_gain``; None: minus the turns left in the episode's budget before the turn."""
    spread: float | None = None
    """None: scale the gains to the teacher-student gaps' std on the same rollouts; a number: to this std
    (then no teacher view is needed)."""
    _envs: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_turns < 1:
            raise ValueError(f"algorithm.max_turns must be the run's env.max_turns (>= 1), got {self.max_turns}")
        if self.token_level:
            raise ValueError("the oracle replaces turn evidence: token_level is not supported")
        if self.spread is not None and self.spread < 0:
            raise ValueError(f"algorithm.spread must be >= 0 or null, got {self.spread}")
        if self.fatal_gain is not None and self.fatal_gain < 0:
            raise ValueError(f"algorithm.fatal_gain must be >= 0 or null (the gain is its negative), got {self.fatal_gain}")

    @property
    def needs_teacher(self) -> bool:  # type: ignore[override]
        return self.spread is None  # the evidence's spread is measured on the teacher view's gaps

    def _env(self, env_id: str) -> gym.Env:
        if env_id not in self._envs:
            self._envs[env_id] = oracle_env(env_id, self.max_turns, self.env_kwargs)
        return self._envs[env_id]

    def gains(self, trajectories: Sequence[Trajectory], active: Sequence[bool], shape: tuple[int, int]) -> Tensor:
        """``[B, K]`` g_k of the active trajectories (0 elsewhere and on padded turns)."""
        out = torch.zeros(shape, dtype=torch.float32)
        for i, (traj, on) in enumerate(zip(trajectories, active)):
            if on:
                g = expert_turn_gains(traj, self._env(traj.task.env_id), self.max_turns, self.fatal_gain)
                out[i, : len(g)] = torch.tensor(g, dtype=torch.float32)
        return out

    def credit(self, batch: Mapping | object, step: int) -> dict[str, Tensor]:
        trajectories = _opt(batch, "trajectories")
        seq_adv = _get(batch, "seq_advantages")
        if isinstance(batch, Mapping) and batch.get("token_turn") is not None or not trajectories:
            raise ValueError("the oracle replays each trajectory: give a RolloutBatch (row layout) with its trajectories")
        if len(trajectories) != seq_adv.shape[0]:
            raise ValueError(f"{len(trajectories)} trajectories for {seq_adv.shape[0]} sequence advantages")
        view = turn_view(batch, with_gaps=self.needs_teacher)
        lengths = view.mask.sum(1).tolist()
        for i, traj in enumerate(trajectories):
            if len(traj.turns) != lengths[i]:
                raise ValueError(f"trajectory {i} has {len(traj.turns)} turns but {lengths[i]} turn rows")
        active = seq_adv != 0  # A_seq = 0 gives 0 whatever the multiplier: no replay needed
        gains = self.gains(trajectories, active.tolist(), tuple(view.mask.shape)).to(view.gaps.device)
        acts = view.mask & active[:, None]
        scale = matched_scale(view.gaps.float(), gains, acts, self.spread)
        evidence = gains * scale
        beliefs, revisions, w = self._multipliers(seq_adv, evidence, view.mask, batch)
        _write_turns(batch, view, mix_advantages(seq_adv, w, self.mult_lambda))
        credit = {"beliefs": beliefs, "revisions": revisions, "multipliers": w, "evidence": evidence, "turn_mask": view.mask,
                  "teacher_evidence": view.gaps, "expert_gain": gains, "oracle_scale": scale}
        _set(batch, "credit", credit)
        return credit
