"""HyperLogLog sketches for ``RDD.countApproxDistinct``.

Spark counts with HyperLogLog++ (Heule, Nunkesser and Hall, 2013): 2^p registers, p chosen from the
relative accuracy asked for, a 64-bit hash per element. This module keeps that sketch and replaces the
paper's empirically fitted bias tables by Ertl's estimator ("New cardinality estimation algorithms for
HyperLogLog sketches", 2017), which needs no tables and is unbiased from zero up to 2^64 distinct
values. Each partition fills its registers; registers merge by element-wise maximum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from dlscale.facade._hash import portable_hash

MIN_RELATIVE_SD = 0.000017  # Spark's lower limit (p = 32)
_MASK64 = (1 << 64) - 1


def precision(relative_sd: float) -> int:
    """Spark's register count exponent for ``relative_sd``: ``ceil(2 log2(1.054 / relative_sd))``, at least 4,
    so that the standard error ``1.04 / sqrt(2^p)`` is within ``relative_sd``."""
    if not relative_sd > MIN_RELATIVE_SD:
        raise ValueError(f"relativeSD should be greater than 0.000017, got {relative_sd}")
    return max(4, math.ceil(2.0 * math.log(1.054 / relative_sd) / math.log(2)))


def _mix(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer: a bijection that spreads every input bit over every output bit
    (``portable_hash`` of small ints is the int itself)."""
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> np.uint64(33))


def _leading_zeros(w: np.ndarray) -> np.ndarray:
    """Leading zero bits of each 64-bit value (64 for zero), exact: each 32-bit half is exact in float64."""
    hi, lo = (w >> np.uint64(32)).astype(np.float64), (w & np.uint64(0xFFFFFFFF)).astype(np.float64)
    hi_exp, lo_exp = np.frexp(hi)[1], np.frexp(lo)[1]  # floor(log2(x)) + 1, and 0 for x == 0
    return np.where(hi > 0, 32 - hi_exp, np.where(lo > 0, 64 - lo_exp, 64))


def registers(p: int, items: Iterable[Any]) -> np.ndarray:
    """The 2^p registers of a partition: register ``i`` holds the largest rank (leading zeros + 1 of the
    bits after the first p) among the elements whose hash starts with ``i``."""
    hashes = _mix(np.fromiter((portable_hash(x) & _MASK64 for x in items), dtype=np.uint64))
    regs = np.zeros(1 << p, dtype=np.uint8)
    index = (hashes >> np.uint64(64 - p)).astype(np.intp)
    rank = np.minimum(_leading_zeros(hashes << np.uint64(p)) + 1, 64 - p + 1).astype(np.uint8)
    np.maximum.at(regs, index, rank)
    return regs


def merge(p: int, parts: Iterable[np.ndarray]) -> np.ndarray:
    """The registers of the union of the partitions (empty registers when there are none)."""
    out = np.zeros(1 << p, dtype=np.uint8)
    for regs in parts:
        np.maximum(out, regs, out=out)
    return out


def _sigma(x: float) -> float:
    if x == 1.0:
        return math.inf
    y, z = 1.0, x
    while True:
        x *= x
        before = z
        z += x * y
        y += y
        if z == before:
            return z


def _tau(x: float) -> float:
    if x in (0.0, 1.0):
        return 0.0
    y, z = 1.0, 1.0 - x
    while True:
        x = math.sqrt(x)
        before = z
        y *= 0.5
        z -= (1.0 - x) ** 2 * y
        if z == before:
            return z / 3.0


def estimate(regs: np.ndarray) -> int:
    """The number of distinct elements the registers have seen (Ertl's improved raw estimator)."""
    m = len(regs)
    q = 64 - (m.bit_length() - 1)
    counts = np.bincount(regs, minlength=q + 2).tolist()
    z = m * _tau(1.0 - counts[q + 1] / m)
    for k in range(q, 0, -1):
        z = 0.5 * (z + counts[k])
    z += m * _sigma(counts[0] / m)
    return round(m * m / (2.0 * math.log(2.0)) / z)
