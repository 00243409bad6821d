"""The task stream (which tasks, which seeds, groups of G) and rollout collation."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence

import lightning as L
import numpy as np
import torch

from agentopsd.credit import grpo_advantages
from agentopsd.types import RolloutBatch, TaskSpec, Trajectory, Turn

log = logging.getLogger(__name__)


class TaskBatch:
    """What the loader yields: N tasks x G copies for one iteration (rollouts happen later, on-policy).

    A plain immutable class, not a dataclass: Lightning's precision plugins run every batch through
    ``apply_to_collection`` before any hook (``bf16-true`` converts float tensors that way), and
    that function rebuilds dataclasses field by field, which fails on frozen ones. A batch with no
    tensors has nothing to convert, so it must pass through untouched.
    """

    __slots__ = ("iteration", "tasks")

    def __init__(self, iteration: int, tasks: tuple[TaskSpec, ...]) -> None:
        object.__setattr__(self, "iteration", int(iteration))
        object.__setattr__(self, "tasks", tuple(tasks))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"TaskBatch is immutable: cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TaskBatch) and (self.iteration, self.tasks) == (other.iteration, other.tasks)

    def __hash__(self) -> int:
        return hash((self.iteration, self.tasks))

    def __repr__(self) -> str:
        return f"TaskBatch(iteration={self.iteration}, tasks=<{len(self.tasks)} TaskSpec>)"

    def to(self, device: object) -> TaskBatch:  # nothing to move: rollouts are made on the module's device
        return self


def sample_tasks(env_id: str, num_tasks: int, tasks_per_batch: int, group_size: int, iteration: int, seed: int) -> tuple[TaskSpec, ...]:
    """Deterministic tasks of one iteration: a function of (seed, iteration) only, so a resumed run
    sees exactly the stream it would have seen."""
    rng = np.random.default_rng([seed, iteration])
    replace = tasks_per_batch > num_tasks
    picks = rng.choice(num_tasks, size=tasks_per_batch, replace=replace)
    env_seeds = rng.integers(0, 2**31 - 1, size=tasks_per_batch)
    return tuple(
        TaskSpec(env_id=env_id, split="train", task_index=int(t), seed=int(s), group_id=iteration * tasks_per_batch + n)
        for n, (t, s) in enumerate(zip(picks, env_seeds))
        for _ in range(group_size)
    )


class TaskStream:
    """The object ``train_dataloader`` returns: sized, iterable, and stateful.

    Lightning saves loader state only for the object ``train_dataloader()`` returns and only when
    it has ``state_dict``/``load_state_dict``; a ``__len__`` keeps the resume exact.
    """

    def __init__(self, env_id: str, num_tasks: int, tasks_per_batch: int, group_size: int, num_iterations: int, seed: int) -> None:
        self.env_id, self.num_tasks = env_id, num_tasks
        self.tasks_per_batch, self.group_size = tasks_per_batch, group_size
        self.num_iterations, self.seed = num_iterations, seed
        self.position = 0
        """Index of the next batch to yield."""

    def __len__(self) -> int:
        return self.num_iterations

    def __iter__(self) -> Iterator[TaskBatch]:
        while self.position < self.num_iterations:
            i = self.position
            self.position += 1
            yield TaskBatch(i, self.tasks_of(i))
        self.position = 0  # the next epoch starts over

    def tasks_of(self, iteration: int) -> tuple[TaskSpec, ...]:
        """The tasks of any iteration, without moving the stream (an asynchronous producer plays ahead of it)."""
        return sample_tasks(self.env_id, self.num_tasks, self.tasks_per_batch, self.group_size, iteration, self.seed)

    def task_function(self) -> functools.partial:
        """:meth:`tasks_of` as a picklable function of the iteration (it crosses into a rollout worker process)."""
        return functools.partial(sample_tasks, self.env_id, self.num_tasks, self.tasks_per_batch, self.group_size, seed=self.seed)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed:
            log.warning("resuming a task stream saved with seed %s under seed %s", state.get("seed"), self.seed)
        self.position = int(state["position"])


class TaskDataModule(L.LightningDataModule):
    """Which tasks each iteration trains on: ``tasks_per_batch`` tasks x ``group_size`` copies."""

    def __init__(self, env_id: str, tasks_per_batch: int, group_size: int, num_iterations: int, seed: int = 0, num_tasks: int | None = None) -> None:
        super().__init__()
        if group_size < 1 or tasks_per_batch < 1:
            raise ValueError(f"data.group_size and data.tasks_per_batch must be >= 1, got {group_size} and {tasks_per_batch}")
        self.env_id, self.tasks_per_batch, self.group_size = env_id, tasks_per_batch, group_size
        self.num_iterations, self.seed, self.num_tasks = num_iterations, seed, num_tasks
        self.stream: TaskStream | None = None
        """The stream the trainer iterates (a stopped run rewinds it to replay an abandoned iteration)."""

    def setup(self, stage: str | None = None) -> None:
        if self.num_tasks is None:
            import gymnasium as gym

            env = gym.make(self.env_id, split="train", disable_env_checker=True)
            self.num_tasks = int(env.unwrapped.num_tasks)
            env.close()

    def train_dataloader(self) -> TaskStream:
        self.setup()
        self.stream = TaskStream(self.env_id, self.num_tasks, self.tasks_per_batch, self.group_size, self.num_iterations, self.seed)
        return self.stream


def engine_teacher_scored(turns: Sequence[Turn]) -> bool:
    """Did the rollout engine score every turn's teacher view (``rollout.teacher_scoring=worker``)? All or none: a
    batch half scored by the engine and half not would mix two evidence sources in one group."""
    scored = [len(t.teacher_logprobs) > 0 for t in turns]
    if any(scored) and not all(scored):
        raise ValueError(f"{sum(scored)} of {len(scored)} turns carry engine-scored teacher log-probs: all or none")
    for t in turns:
        if t.teacher_logprobs and len(t.teacher_logprobs) != len(t.action_ids):
            raise ValueError(f"a turn has {len(t.teacher_logprobs)} teacher log-probs for {len(t.action_ids)} action tokens")
    return bool(scored) and all(scored)


def collate_trajectories(trajectories: Sequence[Trajectory], pad_id: int) -> RolloutBatch:
    """Trajectories to the tensor batch, one row per turn; faulted trajectories are left out.

    GRPO advantages are computed over the remaining members of each group: an environment
    fault must not pass as a failure with a wrong reward.
    """
    kept = [t for t in trajectories if t.fault is None and t.turns]
    # no rows at all (every episode of this rank faulted): an empty batch, whose update issues only the
    # dummy passes the other ranks' rows need (the rank invariant), rather than an error on one rank
    rows = [(i, turn) for i, traj in enumerate(kept) for turn in traj.turns]
    width = max((len(t.prompt_ids) + len(t.action_ids) for _, t in rows), default=1)
    t_width = max((len(t.teacher_prompt_ids) + len(t.action_ids) for _, t in rows), default=1)
    m = len(rows)
    input_ids = torch.full((m, width), pad_id, dtype=torch.long)
    attention = torch.zeros((m, width), dtype=torch.long)
    action_mask = torch.zeros((m, width), dtype=torch.bool)
    old_lp = torch.zeros((m, width), dtype=torch.float32)
    t_ids = torch.full((m, t_width), pad_id, dtype=torch.long)
    t_attention = torch.zeros((m, t_width), dtype=torch.long)
    t_action = torch.zeros((m, t_width), dtype=torch.bool)
    engine_teacher = engine_teacher_scored([turn for _, turn in rows])
    engine_t_lp = torch.zeros((m, width), dtype=torch.float32) if engine_teacher else None
    for r, (_, turn) in enumerate(rows):
        p, a, tp = len(turn.prompt_ids), len(turn.action_ids), len(turn.teacher_prompt_ids)
        input_ids[r, : p + a] = torch.tensor(turn.prompt_ids + turn.action_ids)
        attention[r, : p + a] = 1
        action_mask[r, p : p + a] = True
        old_lp[r, p : p + a] = torch.tensor(turn.behaviour_logprobs, dtype=torch.float32)
        t_ids[r, : tp + a] = torch.tensor(turn.teacher_prompt_ids + turn.action_ids)
        t_attention[r, : tp + a] = 1
        t_action[r, tp : tp + a] = True
        if engine_t_lp is not None:
            engine_t_lp[r, p : p + a] = torch.tensor(turn.teacher_logprobs, dtype=torch.float32)
    success = torch.tensor([float(t.success) for t in kept])
    # the outcome reward alone drives A_seq; shaping penalties stay on their own turns (turn_penalties)
    rewards = torch.tensor([t.reward for t in kept], dtype=torch.float32)
    state_ids: dict[str, int] = {}
    group_ids = torch.tensor([t.task.group_id for t in kept], dtype=torch.long)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        action_mask=action_mask,
        old_logprobs=old_lp,
        teacher_input_ids=t_ids,
        teacher_attention_mask=t_attention,
        teacher_action_mask=t_action,
        engine_teacher_logprobs=engine_t_lp,
        turn_traj=torch.tensor([i for i, _ in rows], dtype=torch.long),
        turn_index=torch.tensor([t.index for _, t in rows], dtype=torch.long),
        turn_valid=torch.tensor([t.valid for _, t in rows], dtype=torch.bool),
        turn_penalties=torch.tensor([t.penalty for _, t in rows], dtype=torch.float32),
        turn_state=torch.tensor([state_ids.setdefault(t.state, len(state_ids)) for _, t in rows], dtype=torch.long),
        success=success,
        rewards=rewards,
        group_ids=group_ids,
        seq_advantages=grpo_advantages(rewards, group_ids),
        num_turns=torch.tensor([len(t.turns) for t in kept], dtype=torch.long),
        trajectories=tuple(kept),
    )
