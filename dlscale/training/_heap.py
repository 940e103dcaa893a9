"""Large allocations on the heap while a training task runs.

Dask starts workers with ``MALLOC_TRIM_THRESHOLD_=65536``, which also fixes glibc's mmap threshold
at 128 KiB: every tensor above that is a fresh ``mmap`` that page-faults on first touch and is
unmapped when freed. A training step allocates and frees tens of megabytes of temporaries, so
that costs a large share of a step (the parameter-averaging benchmark measures it). While a training
task runs, allocations up to 32 MiB stay on the heap and free memory is returned beyond 256 MiB;
when the last one ends, Dask's settings come back and the heap is trimmed, so memory held by the
rest of the worker (cached partitions) is returned to the system as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading
from collections.abc import Iterator

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_TRAINING_MMAP = 32 * 2**20
_TRAINING_TRIM = 256 * 2**20
_DEFAULT_MMAP = str(128 * 2**10)  # glibc's defaults
_DEFAULT_TRIM = str(128 * 2**10)

_lock = threading.Lock()
_active = 0


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.mallopt  # noqa: B018 - glibc only
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()


@contextlib.contextmanager
def training_heap() -> Iterator[None]:
    """Keep large allocations on the heap for the duration (nested and concurrent uses count)."""
    global _active
    if _LIBC is None:
        yield
        return
    with _lock:
        _active += 1
        if _active == 1:
            _LIBC.mallopt(_M_MMAP_THRESHOLD, _TRAINING_MMAP)
            _LIBC.mallopt(_M_TRIM_THRESHOLD, _TRAINING_TRIM)
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                _LIBC.mallopt(_M_TRIM_THRESHOLD, int(os.environ.get("MALLOC_TRIM_THRESHOLD_", _DEFAULT_TRIM)))
                _LIBC.mallopt(_M_MMAP_THRESHOLD, int(os.environ.get("MALLOC_MMAP_THRESHOLD_", _DEFAULT_MMAP)))
                _LIBC.malloc_trim(0)
