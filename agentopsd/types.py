"""Typed records of the data flow: tasks, turns, trajectories and the tensor batch.

Layout of a :class:`RolloutBatch`: ``B`` trajectories, ``M`` turn samples (one row per turn
of every trajectory, the unit of the policy update), ``L`` token positions of a row
(prompt + action, right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor


@dataclass(frozen=True)
class TaskSpec:
    """One task copy of a group: G copies share ``task_index`` and ``seed``."""

    env_id: str
    """Registered Gymnasium id, e.g. ``agentopsd/BabyAI-GoToLocal-v0``."""
    split: str
    """``train`` or ``eval``."""
    task_index: int
    """Index into the environment's task list of that split."""
    seed: int
    """Seed passed to ``env.reset``."""
    group_id: int
    """GRPO group: the copies of one task in one batch."""


@dataclass(frozen=True)
class Turn:
    """One agent turn: the prompt it saw, the action it generated, what came back."""

    index: int
    """Turn number k within its trajectory, from 0."""
    prompt_ids: tuple[int, ...]
    """Student view of the context h_k."""
    teacher_prompt_ids: tuple[int, ...]
    """Teacher view h+_k: the same context with the skill block inserted."""
    action_ids: tuple[int, ...]
    """Generated tokens a_k (end-of-action marker included, padding excluded)."""
    behaviour_logprobs: tuple[float, ...]
    """log pi_old(a_k,t) reported by the generator, one per action token."""
    action_text: str
    """Decoded generation."""
    parsed_action: str
    """What was sent to the environment ('' when the output did not parse)."""
    observation: str
    """Observation after the action."""
    reward: float
    """Environment reward of this step (logged; the update's reward is the trajectory's outcome)."""
    valid: bool
    """The output parsed and the environment accepted the action."""
    penalty: float
    """Shaping charged to this turn's tokens alone: ``env.invalid_penalty`` when the output did not
    parse or the action was invalid, else 0. Never part of the outcome reward."""
    state: str
    """The observation the action was taken on: the environment state (GiGPO's anchor state)."""
    policy_version: int = 0
    """Weight version that generated this turn: updates done before its weights were published (under
    ``rollout.max_staleness`` > 0 an episode in flight at an update carries on with the new weights, so its
    turns' versions can differ). Lockstep rollouts: the iteration's own index."""
    teacher_logprobs: tuple[float, ...] = ()
    """The teacher view's log-probs of ``action_ids``, scored by the rollout engine right after it generated them,
    with the same weights (``rollout.teacher_scoring=worker``); empty when the trainer scores the teacher view."""


@dataclass(frozen=True)
class Trajectory:
    """A finished episode."""

    task: TaskSpec
    turns: tuple[Turn, ...]
    success: bool
    """``info['won']`` at the end: the bit GRPO and the belief prior use."""
    score: float
    """Environment score (WebShop's partial score; equals ``success`` elsewhere)."""
    task_type: str
    expert_steps: int
    """Expert path length from the start (-1 when unknown): the horizon bucket."""
    skill_text: str
    """The skill block of the teacher view ('' when none was retrieved)."""
    fault: str | None
    """Environment error that ended the episode; faulted trajectories are excluded from updates."""
    truncated: bool
    """Ran out of turns without finishing."""
    reward: float
    """The outcome reward R behind A_seq: the success bit (the paper's), or ``score`` under
    ``env.reward=score``. Penalties are per turn (``Turn.penalty``), never in R."""

    @property
    def total_penalty(self) -> float:
        return sum(t.penalty for t in self.turns)


@dataclass
class RolloutBatch:
    """Tensors of one iteration's rollouts, ready for the update.

    Built by :func:`agentopsd.training.data.collate_trajectories`; the teacher forward fills
    ``teacher_logprobs``/``student_logprobs`` and the credit callback fills the advantages.
    """

    input_ids: Tensor  # [M, L] student prompt + action, right-padded
    attention_mask: Tensor  # [M, L]
    action_mask: Tensor  # [M, L] bool, True where the *target* token at that position is an action token
    old_logprobs: Tensor  # [M, L] behaviour log-probs at action positions, 0 elsewhere
    teacher_input_ids: Tensor  # [M, L2] teacher prompt + the same action tokens
    teacher_attention_mask: Tensor  # [M, L2]
    teacher_action_mask: Tensor  # [M, L2] bool
    turn_traj: Tensor  # [M] long: trajectory of each turn row
    turn_index: Tensor  # [M] long: turn number k of each row
    turn_valid: Tensor  # [M] bool: the turn's action parsed and was accepted
    turn_penalties: Tensor  # [M] float: shaping charged to each turn's own tokens (subtracted from its advantage)
    turn_state: Tensor  # [M] long: id of the observation text each turn acted on (equal ids = identical states)
    success: Tensor  # [B] float 0/1
    rewards: Tensor  # [B] float: the outcome reward R (success bit, or the graded score under env.reward=score)
    group_ids: Tensor  # [B] long
    seq_advantages: Tensor  # [B] float: GRPO A_seq
    num_turns: Tensor  # [B] long
    trajectories: tuple[Trajectory, ...] = field(default=(), repr=False)
    # Filled later in the iteration:
    student_logprobs: Tensor | None = None  # [M, L] no-grad recompute under the student view
    teacher_logprobs: Tensor | None = None  # [M, L] teacher view, aligned to the student positions
    engine_teacher_logprobs: Tensor | None = None  # [M, L] the teacher view scored by the rollout engine (Turn.teacher_logprobs)
    ref_logprobs: Tensor | None = None  # [M, L] frozen reference policy (only when the KL penalty is on)
    is_weights: Tensor | None = None  # [M, L] truncated importance-sampling weights (engine/trainer mismatch; optim.tis_cap)
    turn_advantages: Tensor | None = None  # [M] At_k per turn row (credit callback)
    advantages: Tensor | None = None  # [M, L] per-token advantages used by the objective
    credit: dict[str, Tensor] = field(default_factory=dict, repr=False)  # B_k, dB_k, w_k for logging
    teacher_scored: Tensor | None = None  # [B] bool: trajectories whose teacher view was scored (None: all; rollout.teacher_skip_zero_advantage)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trajectories(self) -> int:
        return int(self.success.shape[0])

    def to(self, device: torch.device | str) -> RolloutBatch:
        """Move every tensor in place and return self (Lightning's batch transfer calls this)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                setattr(self, f.name, value.to(device))
        self.credit = {k: v.to(device) for k, v in self.credit.items()}
        return self

    def __getitem__(self, key: str) -> object:
        # mapping-style access lets the credit callback treat our batch and foreign dicts alike
        return getattr(self, key)

    def __setitem__(self, key: str, value: object) -> None:
        setattr(self, key, value)

    def __contains__(self, key: str) -> bool:
        return getattr(self, key, None) is not None
