"""Dask's sampling profiler paused on a worker while it trains.

Every ``distributed.worker.profile.interval`` (10 ms) a worker's event loop samples the stack of each
thread running a task, for the dashboard's Profile page; a trainer is one long task, so each sample
takes the interpreter's lock from it and walks its stack (``benchmarks.profiler``: a step of
compare's MLP took 1.14x as long with the sampling, the median of three alternations). While any
trainer runs on a worker, its profiler is paused, unless
``dlscale.worker.profile-training`` is true (then the Profile page shows the training, at that cost).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import dask
from distributed.core import Status

_lock = threading.Lock()
_trainers: dict[int, int] = {}  # id(worker): its trainers running


@contextlib.contextmanager
def profiler_paused(worker: Any) -> Iterator[None]:
    """Pause ``worker``'s sampling profiler for the duration (nested and concurrent uses count)."""
    callback = worker.periodic_callbacks.get("profile")
    if callback is None or dask.config.get("dlscale.worker.profile-training"):
        yield
        return
    key = id(worker)
    with _lock:
        _trainers[key] = _trainers.get(key, 0) + 1
        if _trainers[key] == 1:
            worker.loop.add_callback(callback.stop)  # periodic callbacks belong to the event loop
    try:
        yield
    finally:
        with _lock:
            _trainers[key] -= 1
            if not _trainers[key]:
                del _trainers[key]
                worker.loop.add_callback(_resume, worker, callback)


def _resume(worker: Any, callback: Any) -> None:
    if worker.status in (Status.running, Status.paused) and not _trainers.get(id(worker)):
        callback.start()
