"""Student t intervals over paired seeds, exact to the t distribution without SciPy (the study drivers share them)."""

from __future__ import annotations

import math
import statistics


def t_coverage(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with an integer ``df``: the closed-form finite sums for odd and even degrees of
    freedom (Abramowitz and Stegun 26.7.3-4), exact to rounding; scipy is not a dependency."""
    if t <= 0:
        return 0.0
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd: (2/pi) [theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)]
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= (2 * k) / (2 * k + 1) * c2
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    term, total = 1.0, 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
    for k in range(1, df // 2):
        term *= (2 * k - 1) / (2 * k) * c2
        total += term
    return math.sin(theta) * total


def t_quantile(coverage: float, df: int) -> float:
    """The t at which a two-sided Student t interval with ``df`` degrees of freedom covers ``coverage`` (0.95: the
    0.975 quantile), by bisection on ``t_coverage``."""
    if not 0 < coverage < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0 < coverage < 1 and df >= 1, got {coverage}, {df}")
    lo, hi = 0.0, 1.0
    while t_coverage(hi, df) < coverage:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_coverage(mid, df) < coverage else (lo, mid)
        if hi - lo < 1e-10:
            break
    return (lo + hi) / 2


def t_interval(samples: list[float], bounds: tuple[float, float] | None = None,
               coverage: float = 0.95) -> tuple[float, float, float]:
    """Mean and its Student t interval over seeds (95% unless ``coverage`` says otherwise). Used for paired
    differences and slopes, which may take any sign: with 4 seeds a percentile bootstrap's interval is about as
    narrow as the seeds' range and covers far less than 95%; the t interval is honest at small n (success rates
    keep the bootstrap, which stays in 0-100).
    ``bounds``: the range the mean can take (a difference of two rates: -1 to 1); the interval is cut to it, which
    keeps its coverage (the true mean is inside the bounds) and keeps it readable."""
    vals = [v for v in samples if v == v]
    if not vals:
        return (float("nan"),) * 3
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return mean, float("nan"), float("nan")
    half = t_quantile(coverage, len(vals) - 1) * statistics.stdev(vals) / len(vals) ** 0.5
    lo, hi = mean - half, mean + half
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    return mean, lo, hi
