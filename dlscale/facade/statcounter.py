"""Running count, mean, variance, min and max that merge across partitions (PySpark's StatCounter)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


def _py(x: Any) -> Any:
    """numpy scalars as Python numbers; arrays (element-wise statistics) unchanged."""
    return x.item() if isinstance(x, np.generic) else x


class StatCounter:
    """Numerically stable summary statistics (Welford/Chan), mergeable across partitions.

    Values may be numbers or numpy arrays (statistics are then element-wise), as in PySpark.
    """

    def __init__(self, values: Iterable[Any] | None = None) -> None:
        self.n = 0
        self.mu = 0.0
        self.m2 = 0.0
        self.maxValue = float("-inf")
        self.minValue = float("inf")
        for v in values if values is not None else ():
            self.merge(v)

    def merge(self, value: Any) -> StatCounter:
        """Add one value."""
        delta = value - self.mu
        self.n += 1
        self.mu += delta / self.n
        self.m2 += delta * (value - self.mu)
        self.maxValue = np.maximum(self.maxValue, value)
        self.minValue = np.minimum(self.minValue, value)
        return self

    def mergeStats(self, other: StatCounter) -> StatCounter:
        """Add every value summarised by ``other``."""
        if not isinstance(other, StatCounter):
            raise TypeError(f"Can only merge StatCounter but got {type(other)}")
        if other is self:
            return self.mergeStats(other.copy())
        if self.n == 0:
            self.mu, self.m2, self.n = other.mu, other.m2, other.n
            self.maxValue, self.minValue = other.maxValue, other.minValue
        elif other.n != 0:
            delta = other.mu - self.mu
            if other.n * 10 < self.n:
                self.mu += (delta * other.n) / (self.n + other.n)
            elif self.n * 10 < other.n:
                self.mu = other.mu - (delta * self.n) / (self.n + other.n)
            else:
                self.mu = (self.mu * self.n + other.mu * other.n) / (self.n + other.n)
            self.m2 += other.m2 + (delta * delta * self.n * other.n) / (self.n + other.n)
            self.maxValue = np.maximum(self.maxValue, other.maxValue)
            self.minValue = np.minimum(self.minValue, other.minValue)
            self.n += other.n
        return self

    def copy(self) -> StatCounter:
        """An independent copy."""
        c = StatCounter()
        c.n, c.mu, c.m2, c.maxValue, c.minValue = self.n, self.mu, self.m2, self.maxValue, self.minValue
        return c

    def count(self) -> int:
        return int(self.n)

    def mean(self) -> Any:
        return _py(self.mu)

    def sum(self) -> Any:
        return _py(self.n * self.mu)

    def min(self) -> Any:
        return _py(self.minValue)

    def max(self) -> Any:
        return _py(self.maxValue)

    def variance(self) -> Any:
        """Population variance (divides by n)."""
        return float("nan") if self.n == 0 else _py(self.m2 / self.n)

    def sampleVariance(self) -> Any:
        """Sample variance (divides by n - 1)."""
        return float("nan") if self.n <= 1 else _py(self.m2 / (self.n - 1))

    def stdev(self) -> Any:
        return _py(np.sqrt(self.variance()))

    def sampleStdev(self) -> Any:
        return _py(np.sqrt(self.sampleVariance()))

    def asDict(self, sample: bool = False) -> dict[str, Any]:
        """The statistics as a dict. As in PySpark, ``stdev`` and ``variance`` are the sample ones by
        default (dividing by n - 1) and the population ones with ``sample=True``: the flag's name reads
        backwards, and programs written for PySpark rely on what it does."""
        return {
            "count": self.count(),
            "mean": self.mean(),
            "sum": self.sum(),
            "min": self.min(),
            "max": self.max(),
            "stdev": self.stdev() if sample else self.sampleStdev(),
            "variance": self.variance() if sample else self.sampleVariance(),
        }

    def __repr__(self) -> str:
        return (
            f"(count: {self.count()}, mean: {self.mean()}, stdev: {self.stdev()}, max: {self.max()}, min: {self.min()})"
        )
