"""The C allocator of a worker process, set for training: what a step frees is reused by the next step,
not handed back to the system and faulted in again.

Dask's nanny starts each worker with ``MALLOC_TRIM_THRESHOLD_=65536`` (its
``distributed.nanny.pre-spawn-environ``), so that memory a task frees goes back to the system at once;
setting it also turns off glibc's sliding mmap threshold, which then stays at 128 KiB. A training step
allocates its activations and gradients anew each time, so every step faulted them in again, page by
page: on compare's MLP (5.8M parameters) a plain step in a Dask worker took 1.28x as long as in a
plain process, with 6,700 page faults a step against none (``benchmarks.allocator``). This sets glibc's
mmap threshold (tensors below it come from the heap; at most 32 MiB, glibc's ceiling), its trim
threshold (free memory at the top of a heap beyond it goes back to the system) and its top pad (what a
thread's heap grows by, and keeps, beyond a request) from ``dlscale.worker.malloc-*``. Without the pad a
thread's heap still gave back and faulted in 16 MiB a step. A worker so holds at most the trim threshold
and the pad of freed memory per heap. Only glibc's allocator has these settings; elsewhere this does
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

PARAMETERS = {"trim-threshold": -1, "top-pad": -2, "mmap-threshold": -3}
"""``dlscale.worker.malloc-<name>`` -> glibc's ``mallopt`` parameter (``malloc.h``)."""
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
            settings = {name: config.get(f"worker.malloc-{name}") for name in PARAMETERS}
            values = {name: parse_bytes(value) for name, value in settings.items() if value is not None}
            if not 0 <= values.get("mmap-threshold", 0) <= _MMAP_CEILING:
                raise ValueError(
                    f"dlscale.worker.malloc-mmap-threshold is {values['mmap-threshold']} bytes: glibc takes 0 to 32 MiB"
                )
            libc = ctypes.CDLL(None)
            for name, value in values.items():
                if libc.mallopt(PARAMETERS[name], ctypes.c_int(value)) != 1:
                    logger.warning("glibc refused dlscale.worker.malloc-%s = %d bytes", name, value)
        _done = True
