"""Approximate results (``sumApprox``, ``meanApprox``, ``countApprox``): PySpark's ``BoundedFloat`` and
Spark's evaluators, which estimate a sum or a mean from the partitions finished before a timeout.

The formulas are those of Spark's ``SumEvaluator`` and ``MeanEvaluator`` (``org.apache.spark.partial``);
the confidence factor is Student's t quantile for at most 100 values and the normal one above, as there.
"""

from __future__ import annotations

import math
from statistics import NormalDist

from dlscale.facade.statcounter import StatCounter

__all__ = ["BoundedFloat", "check_confidence", "mean_bound", "sum_bound"]


class BoundedFloat(float):
    """An estimate with its confidence and the bounds of its confidence interval (PySpark's class)."""

    confidence: float
    low: float
    high: float

    def __new__(cls, mean: float, confidence: float, low: float, high: float) -> BoundedFloat:
        obj = float.__new__(cls, mean)
        obj.confidence = confidence
        obj.low = low
        obj.high = high
        return obj


def check_confidence(confidence: float) -> None:
    if not 0.0 <= confidence <= 1.0:
        raise ValueError(f"confidence ({confidence}) must be in [0,1]")


def _continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny = 1e-300
    c = 1.0
    d = 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for aa in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _continued_fraction(a, b, x) / a
    return 1.0 - front * _continued_fraction(b, a, 1.0 - x) / b


def _t_upper_tail(t: float, df: int) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom, t >= 0."""
    return 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def _confidence_factor(confidence: float, n: int) -> float:
    """The quantile at (1 + confidence) / 2: of Student's t with n - 1 degrees of freedom for n <= 100 values,
    of the standard normal distribution above."""
    q = (1.0 + confidence) / 2.0
    alpha = 1.0 - q  # the upper tail beyond the factor (from q, as Spark rounds it)
    if alpha <= 0.0:
        return math.inf
    if alpha >= 0.5:
        return 0.0
    if n > 100:
        return NormalDist().inv_cdf(q)
    df = n - 1
    lo, hi = 0.0, 1.0
    while _t_upper_tail(hi, df) > alpha:
        lo, hi = hi, hi * 2.0
    for _ in range(200):  # bisection to the last bit
        mid = (lo + hi) / 2.0
        if mid in (lo, hi):
            break
        if _t_upper_tail(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def sum_bound(counter: StatCounter, merged: int, total: int, confidence: float) -> BoundedFloat:
    """Spark's ``SumEvaluator``: the sum of the values of ``merged`` of ``total`` equal shares (partitions),
    summarised by ``counter``, with the rest estimated from them (exact once every share is in)."""
    if merged == total:
        s = counter.sum()
        return BoundedFloat(s, 1.0, s, s)
    n = counter.count()
    if merged == 0 or n == 0:
        return BoundedFloat(0.0, 0.0, -math.inf, math.inf)
    p = merged / total
    mean = counter.mean()
    count_rest = n * (1 - p) / p  # the values still to come
    sum_rest = mean * count_rest
    mean_var = counter.sampleVariance() / n
    if math.isnan(mean_var) or n == 1:
        return BoundedFloat(counter.sum() + sum_rest, confidence, -math.inf, math.inf)
    count_var = n * (1 - p) / (p * p)
    sum_stdev = math.sqrt(mean * mean * count_var + count_rest * count_rest * mean_var + mean_var * count_var)
    half = _confidence_factor(confidence, n) * sum_stdev
    done = counter.sum()
    return BoundedFloat(done + sum_rest, confidence, done + (sum_rest - half), done + (sum_rest + half))


def mean_bound(counter: StatCounter, merged: int, total: int, confidence: float) -> BoundedFloat:
    """Spark's ``MeanEvaluator``: the mean of the values of ``merged`` of ``total`` partitions, summarised by
    ``counter``, with the t (or normal) interval of a sample mean (exact once every partition is in)."""
    if merged == total:
        m = counter.mean()
        return BoundedFloat(m, 1.0, m, m)
    n = counter.count()
    if merged == 0 or n == 0:
        return BoundedFloat(0.0, 0.0, -math.inf, math.inf)
    mean = counter.mean()
    if n == 1:
        return BoundedFloat(mean, confidence, -math.inf, math.inf)
    half = _confidence_factor(confidence, n) * math.sqrt(counter.sampleVariance() / n)
    return BoundedFloat(mean, confidence, mean - half, mean + half)
