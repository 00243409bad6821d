"""Credit quality: how well a credit signal orders the turns of a trajectory as the ground truth does.

A credit method acts within a trajectory (every turn of it shares one A_seq; the method moves
weight between its turns), so its quality is measured within trajectories and then averaged:

- rank correlation: Spearman's rho between the signal and the ground truth over the turns of one
  trajectory (average ranks for ties);
- pairwise accuracy: over the pairs of turns of one trajectory whose ground truth differs by more
  than ``margin``, the share the signal orders the same way. A tie in the signal counts one half,
  so a signal constant within the trajectory (GRPO's uniform credit) scores exactly 0.5: the
  chance line.

Each trajectory is one unit: the summary is the mean of the per-trajectory values, and its 95%
interval is a percentile bootstrap over trajectories. Pure numpy; no torch, no config.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

CHANCE = 0.5
"""Pairwise accuracy of a signal that orders no pair (constant within every trajectory)."""


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``x`` [n], tied values sharing the mean of their ranks."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=float)
    sorted_x = x[order]
    start = 0
    while start < len(x):
        end = start
        while end + 1 < len(x) and sorted_x[end + 1] == sorted_x[start]:
            end += 1
        ranks[order[start:end + 1]] = (start + end) / 2.0 + 1.0
        start = end + 1
    return ranks


def spearman(signal: Sequence[float], truth: Sequence[float]) -> float | None:
    """Spearman's rho of one trajectory's turns [K], or None when the truth is constant (or K < 2).

    A signal constant within the trajectory orders nothing: rho is defined as 0 there, not NaN,
    so GRPO's uniform credit sits at 0 exactly.
    """
    s, t = np.asarray(signal, dtype=float), np.asarray(truth, dtype=float)
    if s.shape != t.shape or s.ndim != 1:
        raise ValueError(f"signal and truth must be 1-D of one length, got {s.shape} and {t.shape}")
    if len(t) < 2 or np.all(t == t[0]):
        return None
    if np.all(s == s[0]):
        return 0.0
    rs, rt = average_ranks(s) - (len(s) + 1) / 2.0, average_ranks(t) - (len(t) + 1) / 2.0
    return float(np.sum(rs * rt) / np.sqrt(np.sum(rs * rs) * np.sum(rt * rt)))


def pairwise_accuracy(signal: Sequence[float], truth: Sequence[float], margin: float = 0.0,
                      among: Sequence[bool] | None = None) -> tuple[float, int] | None:
    """(accuracy, number of pairs) over the pairs (i, j) of one trajectory with |truth_i - truth_j| > margin.

    A pair counts 1 when the signal orders it as the truth does, 0 when reversed, 1/2 when the
    signal ties. None when no pair qualifies (the trajectory says nothing about ordering).
    ``among`` [K]: only the pairs with at least one of their two turns marked count (for example the
    turns where the teacher view knew something the student view did not).
    """
    s, t = np.asarray(signal, dtype=float), np.asarray(truth, dtype=float)
    if s.shape != t.shape or s.ndim != 1:
        raise ValueError(f"signal and truth must be 1-D of one length, got {s.shape} and {t.shape}")
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    dt = t[:, None] - t[None, :]
    ds = s[:, None] - s[None, :]
    upper = np.triu(np.ones_like(dt, dtype=bool), k=1)
    eligible = upper & (np.abs(dt) > margin)
    if among is not None:
        marked = np.asarray(among, dtype=bool)
        if marked.shape != t.shape:
            raise ValueError(f"among must mark the {t.shape[0]} turns, got shape {marked.shape}")
        eligible &= marked[:, None] | marked[None, :]
    n = int(eligible.sum())
    if n == 0:
        return None
    score = np.where(np.sign(ds) == np.sign(dt), 1.0, np.where(ds == 0, 0.5, 0.0))
    return float(score[eligible].sum() / n), n


def pair_classes(signal: Sequence[float], truth: Sequence[float], kinds: Sequence[str], margin: float = 0.0,
                 routine: str = "routine") -> dict[tuple[str, str], list[float]]:
    """The pairs of one trajectory that touch an informed turn, by class, each with its score.

    A class is ``("<kind>:<sign>", "<kind>:<sign>")``: the informed turn's kind (its situation) and the sign of
    its truth (``+``, ``0``, ``-``), then the other turn's (``routine`` when the teacher view knew nothing
    there). Of two informed turns the earlier comes first. Pairs qualify as in :func:`pairwise_accuracy`
    (truths differing by more than ``margin``); a score is 1 when the signal orders the pair as the truth
    does, 0 when reversed, 1/2 when the signal ties. Which classes the signal gets wrong says why an
    accuracy is low: a sharp evidence at informed turns against exactly 0 on routine ones orders every
    informed-against-routine pair by the informed turn alone.
    """
    s, t = np.asarray(signal, dtype=float), np.asarray(truth, dtype=float)
    if not (s.shape == t.shape == (len(kinds),)):
        raise ValueError(f"signal, truth and kinds must be 1-D of one length, got {s.shape}, {t.shape} and {len(kinds)}")

    def name(k: int) -> str:
        return f"{kinds[k]}:{'+' if t[k] > 0 else '-' if t[k] < 0 else '0'}"

    out: dict[tuple[str, str], list[float]] = {}
    for i in range(len(t)):
        for j in range(i + 1, len(t)):
            if abs(t[i] - t[j]) <= margin or (kinds[i] == routine and kinds[j] == routine):
                continue
            a, b = (j, i) if kinds[i] == routine else (i, j)
            right = np.sign(s[i] - s[j]) == np.sign(t[i] - t[j])
            out.setdefault((name(a), name(b)), []).append(1.0 if right else 0.5 if s[i] == s[j] else 0.0)
    return out


@dataclass(frozen=True)
class Estimate:
    """A mean over trajectories with its 95% bootstrap interval."""

    mean: float
    low: float
    high: float
    n: int
    """Trajectories that entered (those with a defined value)."""

    def fmt(self, digits: int = 3) -> str:
        if self.n == 0:
            return "n/a"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def bootstrap(stat, samples: Sequence, draws: int = 5000, seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """``stat`` of ``samples`` and its percentile bootstrap interval (resampling the samples, e.g. seeds), the one
    helper of the experiment scripts. (nan, nan) as the interval for fewer than 2 samples or no finite draw."""
    point = stat(samples)
    rng = random.Random(seed)
    vals = sorted(v for v in (stat(rng.choices(samples, k=len(samples))) for _ in range(draws)) if v == v)
    if len(samples) < 2 or not vals:
        return point, float("nan"), float("nan")
    tail = (1 - level) / 2
    return point, vals[int(tail * len(vals))], vals[min(len(vals) - 1, int((1 - tail) * len(vals)))]


def bootstrap_mean(values: Sequence[float], *, resamples: int = 2000, seed: int = 0, level: float = 0.95) -> Estimate:
    """Mean of per-trajectory ``values`` [N] and its percentile bootstrap interval (resampling trajectories).

    Identical values give a zero-width interval (GRPO's 0.5 stays exactly 0.5).
    """
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    if resamples < 1 or not 0 < level < 1:
        raise ValueError(f"need resamples >= 1 and 0 < level < 1, got {resamples} and {level}")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(resamples, v.size))].mean(axis=1)
    alpha = (1 - level) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    # the mean of identical values is exact: do not let float summation leak out of it
    if np.all(v == v[0]):
        low = high = float(v[0])
    return Estimate(float(v.mean()), float(low), float(high), int(v.size))


@dataclass(frozen=True)
class CreditQuality:
    """Both metrics of one credit signal over a set of trajectories."""

    rank_correlation: Estimate
    pairwise_accuracy: Estimate
    pairs: int
    """Turn pairs that entered the pairwise accuracy, over all trajectories."""


def credit_quality(
    signals: Sequence[Sequence[float]], truths: Sequence[Sequence[float]], *, margin: float = 0.0,
    resamples: int = 2000, seed: int = 0, among: Sequence[Sequence[bool]] | None = None,
) -> CreditQuality:
    """Per-trajectory Spearman and pairwise accuracy, averaged over trajectories with 95% intervals.

    ``signals[i]`` and ``truths[i]``: the valid turns [K_i] of trajectory i, in turn order. ``among[i]``
    (optional): the turns whose pairs count in the pairwise accuracy (``pairwise_accuracy``).
    """
    if len(signals) != len(truths) or (among is not None and len(among) != len(truths)):
        raise ValueError(f"got {len(signals)} signal rows, {len(truths)} truth rows"
                         + ("" if among is None else f" and {len(among)} turn masks"))
    rhos, accs, pairs = [], [], 0
    for i, (s, t) in enumerate(zip(signals, truths)):
        rho = spearman(s, t)
        if rho is not None:
            rhos.append(rho)
        acc = pairwise_accuracy(s, t, margin, None if among is None else among[i])
        if acc is not None:
            accs.append(acc[0])
            pairs += acc[1]
    return CreditQuality(
        rank_correlation=bootstrap_mean(rhos, resamples=resamples, seed=seed),
        pairwise_accuracy=bootstrap_mean(accs, resamples=resamples, seed=seed),
        pairs=pairs,
    )


def paired_accuracy_difference(
    signal_a: Sequence[Sequence[float]], signal_b: Sequence[Sequence[float]], truths: Sequence[Sequence[float]], *,
    margin: float = 0.0, clusters: Sequence[Hashable] | None = None, resamples: int = 2000, seed: int = 0,
    among: Sequence[Sequence[bool]] | None = None,
) -> Estimate:
    """Mean over trajectories of pairwise accuracy of ``signal_a`` minus that of ``signal_b``, with its 95% interval.

    Both signals are scored on the same turns and the same pairs, so the difference is paired per
    trajectory. ``clusters`` (one label per trajectory, e.g. its run) makes the interval a cluster
    bootstrap: whole clusters are resampled, since the trajectories of one run are not independent.
    ``among[i]`` (optional): the turns of trajectory i whose pairs count (``pairwise_accuracy``).
    """
    if not len(signal_a) == len(signal_b) == len(truths):
        raise ValueError(f"got {len(signal_a)}, {len(signal_b)} and {len(truths)} rows")
    if clusters is not None and len(clusters) != len(truths):
        raise ValueError(f"got {len(clusters)} cluster labels for {len(truths)} trajectories")
    diffs, labels = [], []
    for i, (a, b, t) in enumerate(zip(signal_a, signal_b, truths)):
        mask = None if among is None else among[i]
        acc_a, acc_b = pairwise_accuracy(a, t, margin, mask), pairwise_accuracy(b, t, margin, mask)
        if acc_a is not None:  # the same truth and margin: both are defined or neither
            diffs.append(acc_a[0] - acc_b[0])
            labels.append(clusters[i] if clusters is not None else i)
    if clusters is None:
        return bootstrap_mean(diffs, resamples=resamples, seed=seed)
    return cluster_bootstrap_mean(diffs, labels, resamples=resamples, seed=seed)


def cluster_bootstrap_mean(values: Sequence[float], clusters: Sequence[Hashable], *, resamples: int = 2000, seed: int = 0,
                           level: float = 0.95) -> Estimate:
    """Mean of ``values`` with a percentile bootstrap that resamples whole clusters (``n`` = clusters)."""
    v = np.asarray(values, dtype=float)
    if v.size != len(clusters):
        raise ValueError(f"got {v.size} values and {len(clusters)} cluster labels")
    if v.size == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    if resamples < 1 or not 0 < level < 1:
        raise ValueError(f"need resamples >= 1 and 0 < level < 1, got {resamples} and {level}")
    index: dict[Hashable, int] = {}
    ids = np.asarray([index.setdefault(c, len(index)) for c in clusters])
    sums, counts = np.bincount(ids, weights=v), np.bincount(ids).astype(float)
    draw = np.random.default_rng(seed).integers(0, len(index), size=(resamples, len(index)))
    means = sums[draw].sum(axis=1) / counts[draw].sum(axis=1)
    alpha = (1 - level) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    if np.all(v == v[0]):
        low = high = float(v[0])
    return Estimate(float(v.mean()), float(low), float(high), len(index))

