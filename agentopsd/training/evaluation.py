"""Evaluation: the fixed task list, and success overall, by task type and by horizon bucket (torchmetrics)
pooled over every rank's episodes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchmetrics.aggregation import MeanMetric

from agentopsd.training import distributed
from agentopsd.types import TaskSpec, Trajectory

HORIZON_BUCKETS = ((1, 5), (6, 10), (11, 20), (21, 40), (41, 10_000))


def horizon_bucket(expert_steps: int) -> str:
    """The bucket name of an expert path length, e.g. ``6-10``; ``unknown`` when the env could not say."""
    for low, high in HORIZON_BUCKETS:
        if low <= expert_steps <= high:
            return f"{low}-{high}" if high < 10_000 else f"{low}+"
    return "unknown"


@dataclass(frozen=True)
class EpisodeOutcome:
    """What the metrics need of one episode: small and picklable, so ranks can pool their shards."""

    success: bool
    score: float
    turns: int
    task_type: str
    expert_steps: int
    faulted: bool

    @classmethod
    def of(cls, t: Trajectory) -> EpisodeOutcome:
        return cls(bool(t.success), float(t.score), len(t.turns), t.task_type or "unknown", int(t.expert_steps), t.fault is not None)


def evaluate_trajectories(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``eval/success``, ``eval/score``, ``eval/turns``, ``eval/success/type/<t>``, ``eval/success/horizon/<b>``,
    ``eval/success/expert_steps/<n>``."""
    return evaluate_outcomes([EpisodeOutcome.of(t) for t in trajectories])


def evaluate_outcomes(outcomes: Sequence[EpisodeOutcome]) -> dict[str, float]:
    """The metrics of :func:`evaluate_trajectories` from episode outcomes (e.g. pooled over ranks)."""
    overall, score, turns = MeanMetric(), MeanMetric(), MeanMetric()
    by_type: dict[str, MeanMetric] = {}
    by_horizon: dict[str, MeanMetric] = {}
    by_steps: dict[int, MeanMetric] = {}
    for t in outcomes:
        won = torch.tensor(float(t.success))
        overall.update(won)
        score.update(torch.tensor(float(t.score)))
        turns.update(torch.tensor(float(t.turns)))
        by_type.setdefault(t.task_type, MeanMetric()).update(won)
        by_horizon.setdefault(horizon_bucket(t.expert_steps), MeanMetric()).update(won)
        if t.expert_steps > 0:
            by_steps.setdefault(t.expert_steps, MeanMetric()).update(won)
    if not outcomes:
        return {"eval/success": 0.0, "eval/episodes": 0.0}
    out = {
        "eval/success": float(overall.compute()),
        "eval/score": float(score.compute()),
        "eval/turns": float(turns.compute()),
        "eval/episodes": float(len(outcomes)),
        "eval/faults": float(sum(t.faulted for t in outcomes)),
    }
    out.update({f"eval/success/type/{k}": float(m.compute()) for k, m in sorted(by_type.items())})
    out.update({f"eval/success/horizon/{k}": float(m.compute()) for k, m in sorted(by_horizon.items())})
    # episodes per bucket: a rate over 2 episodes and one over 60 are not the same evidence
    out.update({f"eval/episodes/horizon/{k}": float(m.update_count) for k, m in sorted(by_horizon.items())})
    # the exact path lengths too: success lost per extra expert turn is a slope over these (a bucket of 11-20 turns
    # hides it), each weighted by its episodes
    out.update({f"eval/success/expert_steps/{k}": float(m.compute()) for k, m in sorted(by_steps.items())})
    out.update({f"eval/episodes/expert_steps/{k}": float(m.update_count) for k, m in sorted(by_steps.items())})
    return out


def eval_task_list(env_id: str, env_kwargs: dict, num_tasks: int | None) -> list[TaskSpec]:
    """The first ``num_tasks`` of the environment's eval split (None: all of it), one group each."""
    import gymnasium as gym

    env = gym.make(env_id, split="eval", disable_env_checker=True, **env_kwargs)
    size = int(env.unwrapped.num_tasks)
    n = size if num_tasks is None else min(num_tasks, size)
    env.close()
    # seed = task index: the same list on every machine and every run
    return [TaskSpec(env_id, "eval", i, i, group_id=i) for i in range(n)]


def pooled_metrics(greedy: Sequence[Trajectory], sampled: Sequence[Trajectory]) -> dict[str, float]:
    """The metrics of every rank's episodes, the same on every rank (one collective): the greedy list's as
    ``eval/...``, the sampled copies' (when any rank played some) as ``eval/sampled/...``."""
    shards = distributed.gather_objects(([EpisodeOutcome.of(t) for t in greedy], [EpisodeOutcome.of(t) for t in sampled]),
                                        "evaluation/outcomes")
    metrics = evaluate_outcomes([o for greedy_shard, _ in shards for o in greedy_shard])
    sampled_all = [o for _, more in shards for o in more]
    if sampled_all:
        metrics.update({k.replace("eval/", "eval/sampled/", 1): v for k, v in evaluate_outcomes(sampled_all).items()})
    return metrics
