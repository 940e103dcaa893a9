"""The C allocator of a worker process, set for training: what a step frees is reused by the next step,
not handed back to the system and faulted in again; and handed back as Dask would have it whenever
the worker's memory is high.

Dask's nanny starts each worker with ``MALLOC_TRIM_THRESHOLD_=65536`` (its
``distributed.nanny.pre-spawn-environ``), so that memory a task frees goes back to the system at once;
setting it also turns off glibc's sliding mmap threshold, which then stays at 128 KiB. A training step
allocates its activations and gradients anew each time, so every step faulted them in again, page by
page: on compare's MLP (5.8M parameters) a plain step in a Dask worker took 1.28x as long as in a
plain process, with 6,700 page faults a step against none (``benchmarks.allocator``). This sets glibc's
mmap threshold (tensors below it come from the heap; at most 32 MiB, glibc's ceiling), its trim
threshold (free memory at the top of a heap beyond it goes back to the system) and its top pad (what a
thread's heap grows by, and keeps, beyond a request) from ``dlscale.worker.malloc-*``. Without the pad a
thread's heap still gave back and faulted in 16 MiB a step.

Memory so kept is invisible to Dask's memory manager: it is neither data it can spill nor memory that
its evictions free. A worker near its memory limit would spill every key and still stay above its
thresholds, or pause with nothing to spill, for good. So wherever this sets the allocator, the worker
watches its process memory at Dask's ``distributed.worker.memory.monitor-interval`` and after every
full garbage collection (which Dask's spilling runs when what it evicted did not show): above the lowest
of Dask's memory thresholds (``target``, ``spill``, ``pause``), the allocator goes back to the settings
the process started with (Dask's) and gives back what it keeps (glibc's ``malloc_trim``), before Dask
spills or pauses; once the worker's memory is below that threshold by what the allocator would keep
again (its trim threshold and top pad), the settings for training come back. Only glibc's allocator has
these settings; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import platform
import threading
import weakref
from typing import Any

from dask.utils import parse_bytes
from tornado.ioloop import PeriodicCallback

from dlscale import config

logger = logging.getLogger("dlscale")

PARAMETERS = {"trim-threshold": -1, "top-pad": -2, "mmap-threshold": -3}
"""``dlscale.worker.malloc-<name>`` -> glibc's ``mallopt`` parameter (``malloc.h``)."""
_ENVIRONMENT = {name: f"MALLOC_{name.replace('-', '_').upper()}_" for name in PARAMETERS}
_GLIBC_DEFAULT = 128 * 2**10  # each of the three, where the environment does not set it
_MMAP_CEILING = 32 * 2**20  # glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 on 64-bit

GIVE_BACK = "dlscale-give-back"
"""The name of the worker's periodic callback that watches its memory (``Worker.periodic_callbacks``)."""

_lock = threading.Lock()
_done = False
_training: dict[str, int] = {}  # the settings made for training, by name
_started: dict[str, int] = {}  # the same settings as the process started with
_pressed = False  # whether the process has the settings it started with, for want of memory


def tune(worker: Any = None) -> None:
    """Set this process's allocator from ``dlscale.worker.malloc-*`` once (a null setting is left alone),
    and have ``worker``, this process's Dask worker (``None`` outside one), give what the allocator keeps
    back whenever its memory is high.

    Raises:
        ValueError: the mmap threshold is above 32 MiB, which glibc refuses.
    """
    global _done
    if platform.libc_ver()[0] != "glibc":
        return
    with _lock:
        if not _done:
            settings = {name: config.get(f"worker.malloc-{name}") for name in PARAMETERS}
            values = {name: parse_bytes(value) for name, value in settings.items() if value is not None}
            if not 0 <= values.get("mmap-threshold", 0) <= _MMAP_CEILING:
                raise ValueError(
                    f"dlscale.worker.malloc-mmap-threshold is {values['mmap-threshold']} bytes: glibc takes 0 to 32 MiB"
                )
            _training.update(values)
            _started.update({name: int(os.environ.get(_ENVIRONMENT[name], _GLIBC_DEFAULT)) for name in values})
            _set(_training)
            _done = True
        if _training and worker is not None and GIVE_BACK not in worker.periodic_callbacks:
            _watch(worker)


def _set(values: dict[str, int]) -> None:
    libc = ctypes.CDLL(None)
    for name, value in values.items():
        if libc.mallopt(PARAMETERS[name], ctypes.c_int(value)) != 1:
            logger.warning("glibc refused dlscale.worker.malloc-%s = %d bytes", name, value)


def _press(pressed: bool) -> None:
    """The settings the process started with (``pressed``), or those for training."""
    global _pressed
    with _lock:
        if pressed != _pressed:
            _set(_started if pressed else _training)
            _pressed = pressed


def _watch(worker: Any) -> None:
    """Watch ``worker``'s process memory against the lowest of Dask's memory thresholds, at Dask's
    memory monitor's interval and after each full garbage collection (nothing without a memory limit)."""
    manager = worker.memory_manager
    fractions = [manager.memory_target_fraction, manager.memory_spill_fraction, manager.memory_pause_fraction]
    fractions = [f for f in fractions if f]
    if not manager.memory_limit or not fractions:
        return
    threshold = min(fractions) * manager.memory_limit
    room = threshold - _training.get("trim-threshold", 0) - _training.get("top-pad", 0)
    trim = ctypes.CDLL(None).malloc_trim
    monitor = worker.monitor

    def check() -> None:
        memory = monitor.get_process_memory()
        if memory > threshold:
            _press(True)
            trim(0)
        elif memory < room:
            _press(False)

    alive = weakref.ref(worker)  # gc's callbacks live as long as the process; a worker of threads may not

    def after_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            this = alive()
            if this is not None and this.status.name != "closed":
                check()

    gc.callbacks.append(after_collection)
    worker.periodic_callbacks[GIVE_BACK] = PeriodicCallback(check, manager.memory_monitor_interval * 1000)
    if worker.status.name in ("running", "paused"):  # a preload's worker starts its callbacks as it starts
        worker.loop.add_callback(worker.start_periodic_callbacks)
