"""Staleness of asynchronous rollouts (``rollout.max_staleness``): how many updates old the weights that
generated each turn are, the bound's check, and the metrics that show it.

A turn's policy version is the number of updates done when its weights were loaded into the generator
(:attr:`agentopsd.types.Turn.policy_version`); the update of iteration ``i`` trains on weights of version ``i``,
so a turn's staleness is ``i - version``: 0 in lockstep, at most ``max_staleness`` with the producer ahead.
"""

from __future__ import annotations

from collections.abc import Sequence


def turn_staleness(iteration: int, versions: Sequence[int]) -> list[int]:
    """Updates between each turn's generating weights and the update of ``iteration``: ``iteration - version``."""
    return [iteration - v for v in versions]


def check_staleness(iteration: int, versions: Sequence[int], max_staleness: int) -> None:
    """Raise when a turn is staler than ``max_staleness``, or newer than the update that trains on it (a version
    from the future is a bookkeeping bug: the producer cannot hold weights the trainer has not made yet)."""
    staleness = turn_staleness(iteration, versions)
    if not staleness:
        return
    worst, newest = max(staleness), min(staleness)
    if newest < 0:
        raise RuntimeError(f"iteration {iteration}: a turn carries policy version {iteration - newest}, newer than "
                           f"the update's weights (staleness {newest}): the producer's weight versions are miscounted")
    if worst > max_staleness:
        raise RuntimeError(f"iteration {iteration}: a turn is {worst} updates stale, beyond rollout.max_staleness="
                           f"{max_staleness}: the rollout producer ran ahead of its bound")


def staleness_metrics(iteration: int, versions: Sequence[int], max_staleness: int) -> dict[str, float]:
    """``rollout/staleness_mean``, ``rollout/staleness_max`` and, for each s in 0..max_staleness,
    ``rollout/staleness_share_{s}``: the share of turns s updates stale (the shares sum to 1 when every turn is
    within the bound; :func:`check_staleness` guards that). No turns: zeros."""
    staleness = turn_staleness(iteration, versions)
    n = len(staleness)
    metrics = {
        "rollout/staleness_mean": sum(staleness) / n if n else 0.0,
        "rollout/staleness_max": float(max(staleness)) if n else 0.0,
    }
    for s in range(max_staleness + 1):
        metrics[f"rollout/staleness_share_{s}"] = staleness.count(s) / n if n else 0.0
    return metrics


def spanning_share(per_episode_versions: Sequence[Sequence[int]]) -> float:
    """The share of episodes whose turns carry more than one policy version (the weights changed mid-episode:
    ``rollout/episodes_spanning_update``). No episodes: 0."""
    if not per_episode_versions:
        return 0.0
    return sum(len(set(versions)) > 1 for versions in per_episode_versions) / len(per_episode_versions)
