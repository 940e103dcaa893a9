"""Which device a worker's trainers and inference copies compute on.

``DLSCALE_DEVICE`` (or the setting ``dlscale.device``) chooses, as DL4J's backend priority variables
choose between its CPU and CUDA backends: ``auto`` (a GPU where the worker's torch sees one, else the
CPU), ``cpu``, ``cuda`` (a GPU, or an error naming the worker) or ``cuda:N`` (that GPU). Where a
machine has several GPUs, the workers on it and the trainers in each take them in turn, so that one
trainer per GPU needs nothing more than ``workers_per_node`` or one worker per GPU. The driver needs
no GPU: networks and results travel as CPU tensors.
"""

from __future__ import annotations

import os
import threading

import dask.config
import torch
from distributed.utils import sync

from dlscale.errors import DeviceError
from dlscale.runtime.tasks import this_worker, where

CHOICES = ("auto", "cpu", "cuda", "cuda:N")

_RANK: dict[str, int] = {}
_RANK_LOCK = threading.Lock()


def setting() -> str:
    """The device setting in force here: ``DLSCALE_DEVICE``, else ``dlscale.device``."""
    value = os.environ.get("DLSCALE_DEVICE") or dask.config.get("dlscale.device", "auto")
    value = str(value).strip().lower()
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise ValueError(f"DLSCALE_DEVICE (or dlscale.device) must be one of {', '.join(CHOICES)}, got {value!r}")


def _host_rank() -> int:
    """This worker's place among the workers on its host (by address), asked of the scheduler once
    per worker; 0 outside a worker."""
    worker = this_worker()
    if worker is None:
        return 0
    with _RANK_LOCK:
        if worker.address not in _RANK:
            info = sync(worker.loop, worker.scheduler.identity)
            host = info["workers"][worker.address]["host"]
            peers = sorted(a for a, w in info["workers"].items() if w["host"] == host)
            _RANK[worker.address] = peers.index(worker.address)
        return _RANK[worker.address]


def device_for(local: int = 0, per_worker: int = 1) -> torch.device:
    """The device for the ``local``-th of ``per_worker`` trainers (or network copies) of this process."""
    value = setting()
    if value == "cpu" or (value == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no GPU visible"
        raise DeviceError(
            f"DLSCALE_DEVICE={value} but {where()} has no usable GPU (torch {torch.__version__}, "
            f"{build}); set DLSCALE_DEVICE=auto or cpu to train on its CPU"
        )
    count = torch.cuda.device_count()
    if value.startswith("cuda:"):
        index = int(value[5:])
        if index >= count:
            raise DeviceError(f"DLSCALE_DEVICE={value} but {where()} sees only {count} GPU(s)")
        return torch.device("cuda", index)
    index = 0 if count == 1 else (_host_rank() * per_worker + local) % count
    return torch.device("cuda", index)
