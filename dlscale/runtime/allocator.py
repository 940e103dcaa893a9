"""The C allocator of a worker process, set for training: large tensors reused from the heap, not mapped
afresh at every step.

Dask's nanny starts each worker with ``MALLOC_TRIM_THRESHOLD_=65536`` (its
``distributed.nanny.pre-spawn-environ``), so that memory a task frees goes back to the system. Setting any
of glibc's thresholds also turns off glibc's sliding mmap threshold, which stays at 128 KiB: every tensor
above it is a fresh ``mmap`` that the kernel faults in page by page, and unmaps when freed. A training step
allocates its activations and gradients anew each time, so on compare's MLP (5.8M parameters) a plain
step in a Dask worker took 26% longer than in a plain process, with 7x the page faults. This sets glibc's
mmap threshold to ``dlscale.worker.malloc-mmap-threshold`` (at most 32 MiB, glibc's ceiling) and its trim
threshold to ``dlscale.worker.malloc-trim-threshold``: what a step frees is reused by the next, and free
memory above the trim threshold at the top of a heap still goes back to the system, so a worker holds at
most that much freed memory per heap. Only glibc's allocator has these settings; elsewhere this does
nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import threading

from dask.utils import parse_bytes

from dlscale import config

logger = logging.getLogger("dlscale")

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_MMAP_CEILING = 32 * 2**20  # glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 on 64-bit

_lock = threading.Lock()
_done = False


def tune() -> None:
    """Set this process's allocator from ``dlscale.worker.malloc-*`` once (a null setting is left alone).

    Raises:
        ValueError: the mmap threshold is above 32 MiB, which glibc refuses.
    """
    global _done
    with _lock:
        if _done:
            return
        if platform.libc_ver()[0] == "glibc":
            mmap_threshold, trim_threshold = (
                None if value is None else parse_bytes(value)
                for value in (config.get("worker.malloc-mmap-threshold"), config.get("worker.malloc-trim-threshold"))
            )
            if mmap_threshold is not None and not 0 <= mmap_threshold <= _MMAP_CEILING:
                raise ValueError(
                    f"dlscale.worker.malloc-mmap-threshold is {mmap_threshold} bytes: glibc takes 0 to 32 MiB"
                )
            libc = ctypes.CDLL(None)
            for name, parameter, value in (
                ("mmap-threshold", _M_MMAP_THRESHOLD, mmap_threshold),
                ("trim-threshold", _M_TRIM_THRESHOLD, trim_threshold),
            ):
                if value is not None and libc.mallopt(parameter, ctypes.c_int(value)) != 1:
                    logger.warning("glibc refused dlscale.worker.malloc-%s = %d bytes", name, value)
        _done = True
