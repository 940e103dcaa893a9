"""Partitioning hash that agrees across processes.

Python salts ``hash(str)`` per process, so two workers would send the same string key to
different partitions. :func:`portable_hash` equals PySpark's for ``None``, ints, floats and
tuples of them (so ``partitionBy(...).glom()`` matches PySpark), and is stable for strings and
bytes without needing ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

from dask.base import tokenize


def _stable_digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def portable_hash(x: Any) -> int:
    """A hash of ``x`` that is the same in every process."""
    if x is None:
        return 0
    if isinstance(x, tuple):
        h = 0x345678
        for item in x:
            h ^= portable_hash(item)
            h *= 1000003
            h &= sys.maxsize
        h ^= len(x)
        return -2 if h == -1 else h
    if isinstance(x, (bool, int, float, complex)):
        return hash(x)
    if isinstance(x, str):
        return _stable_digest(x.encode("utf-8", "surrogatepass"))
    if isinstance(x, (bytes, bytearray, memoryview)):
        return _stable_digest(bytes(x))
    if isinstance(x, frozenset):
        return _stable_digest(b"".join(sorted(portable_hash(i).to_bytes(8, "little", signed=True) for i in x)))
    # other hashable objects: dask's deterministic token of their value
    return _stable_digest(tokenize(x).encode())
