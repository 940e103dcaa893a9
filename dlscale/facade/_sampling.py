"""Per-partition random sampling, the same algorithm and seeding as PySpark's.

With the same seed, ``sample``, ``randomSplit``, ``takeSample`` and ``sampleByKey`` select the same
elements as PySpark does for the same partitioning.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from typing import Any

from dlscale.facade._ops import pair


def _partition_random(seed: int, split: int) -> random.Random:
    rng = random.Random(seed ^ split)
    for _ in range(10):  # discard the first draws: seeds that differ by one start alike
        rng.randint(0, 1)
    return rng


def _poisson(rng: random.Random, mean: float) -> int:
    k = 0
    if mean < 20.0:
        limit = math.exp(-mean)
        p = rng.random()
        while p > limit:
            k += 1
            p *= rng.random()
    else:
        p = rng.expovariate(mean)
        while p < 1.0:
            k += 1
            p += rng.expovariate(mean)
    return k


class Sampler:
    """Bernoulli (without replacement) or Poisson (with replacement) sampling of a partition."""

    def __init__(self, with_replacement: bool, fraction: float, seed: int) -> None:
        self.with_replacement = with_replacement
        self.fraction = fraction
        self.seed = seed

    def __call__(self, split: int, items: Iterable[Any]) -> Iterator[Any]:
        rng = _partition_random(self.seed, split)
        if self.with_replacement:
            for x in items:
                for _ in range(_poisson(rng, self.fraction)):
                    yield x
        else:
            for x in items:
                if rng.random() < self.fraction:
                    yield x


class StratifiedSampler:
    """Sampling of ``(key, value)`` pairs at a rate per key (``sampleByKey``, PySpark's
    ``RDDStratifiedSampler``): Bernoulli or Poisson draws as :class:`Sampler`, at ``fractions[key]``."""

    def __init__(self, with_replacement: bool, fractions: dict[Any, float], seed: int) -> None:
        self.with_replacement = with_replacement
        self.fractions = fractions
        self.seed = seed

    def __call__(self, split: int, items: Iterable[Any]) -> Iterator[Any]:
        rng = _partition_random(self.seed, split)
        for kv in items:
            key, value = pair(kv)
            if self.with_replacement:
                for _ in range(_poisson(rng, self.fractions[key])):
                    yield key, value
            elif rng.random() < self.fractions[key]:
                yield key, value


class RangeSampler:
    """Keeps the elements whose uniform draw falls in ``[lower, upper)`` (one split of randomSplit)."""

    def __init__(self, lower: float, upper: float, seed: int) -> None:
        self.lower = lower
        self.upper = upper
        self.seed = seed

    def __call__(self, split: int, items: Iterable[Any]) -> Iterator[Any]:
        rng = _partition_random(self.seed, split)
        for x in items:
            if self.lower <= rng.random() < self.upper:
                yield x


def fraction_for_sample_size(size: int, total: int, with_replacement: bool) -> float:
    """A sampling fraction that yields at least ``size`` of ``total`` elements with high probability."""
    fraction = size / total
    if with_replacement:
        num_stdev = 9 if size < 12 else 5
        return fraction + num_stdev * math.sqrt(fraction / total)
    gamma = -math.log(0.00005) / total
    return min(1.0, fraction + gamma + math.sqrt(gamma * gamma + 2 * gamma * fraction))
