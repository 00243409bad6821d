"""Evaluation metrics: success overall, by task type and by horizon bucket (torchmetrics)."""

from __future__ import annotations

from collections.abc import Sequence

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


def evaluate_trajectories(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``eval/success``, ``eval/score``, ``eval/turns``, ``eval/success/type/<t>``, ``eval/success/horizon/<b>``."""
    overall, score, turns = MeanMetric(), MeanMetric(), MeanMetric()
    by_type: dict[str, MeanMetric] = {}
    by_horizon: dict[str, MeanMetric] = {}
    for t in trajectories:
        won = torch.tensor(float(t.success))
        overall.update(won)
        score.update(torch.tensor(float(t.score)))
        turns.update(torch.tensor(float(len(t.turns))))
        by_type.setdefault(t.task_type or "unknown", MeanMetric()).update(won)
        by_horizon.setdefault(horizon_bucket(t.expert_steps), MeanMetric()).update(won)
    if not trajectories:
        return {"eval/success": 0.0, "eval/episodes": 0.0}
    out = {
        "eval/success": float(overall.compute()),
        "eval/score": float(score.compute()),
        "eval/turns": float(turns.compute()),
        "eval/episodes": float(len(trajectories)),
        "eval/faults": float(sum(t.fault is not None for t in trajectories)),
    }
    out.update({f"eval/success/type/{k}": float(m.compute()) for k, m in sorted(by_type.items())})
    out.update({f"eval/success/horizon/{k}": float(m.compute()) for k, m in sorted(by_horizon.items())})
    # episodes per bucket: a rate over 2 episodes and one over 60 are not the same evidence
    out.update({f"eval/episodes/horizon/{k}": float(m.update_count) for k, m in sorted(by_horizon.items())})
    return out
