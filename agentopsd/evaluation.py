"""Evaluation metrics: success overall, by task type and by horizon bucket (torchmetrics)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchmetrics.aggregation import MeanMetric

from agentopsd.types import Trajectory

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
    """``eval/success``, ``eval/score``, ``eval/turns``, ``eval/success/type/<t>``, ``eval/success/horizon/<b>``."""
    return evaluate_outcomes([EpisodeOutcome.of(t) for t in trajectories])


def evaluate_outcomes(outcomes: Sequence[EpisodeOutcome]) -> dict[str, float]:
    """The metrics of :func:`evaluate_trajectories` from episode outcomes (e.g. pooled over ranks)."""
    overall, score, turns = MeanMetric(), MeanMetric(), MeanMetric()
    by_type: dict[str, MeanMetric] = {}
    by_horizon: dict[str, MeanMetric] = {}
    for t in outcomes:
        won = torch.tensor(float(t.success))
        overall.update(won)
        score.update(torch.tensor(float(t.score)))
        turns.update(torch.tensor(float(t.turns)))
        by_type.setdefault(t.task_type, MeanMetric()).update(won)
        by_horizon.setdefault(horizon_bucket(t.expert_steps), MeanMetric()).update(won)
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
    return out
