"""A worker preload that sets the worker's allocator for training (:mod:`dlscale.runtime.allocator`) and
imports the modules of ``dlscale.worker.imports`` before the worker joins.

A fresh worker process imports torch and dlscale's training modules on its first task, and torch's
optimizers import ``torch._dynamo`` on first use: about 2.5 s on one core, which made the first fit of
a context several times slower than the next. Imported as the worker starts, before it takes tasks,
they cost the first fit nothing. The embedded cluster's workers run this preload; on any other
cluster, start workers with ``--preload dlscale.runtime.warmup`` (``dask worker``, or a
dask-jobqueue cluster's ``worker_extra_args``).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from dlscale import config
from dlscale.runtime import allocator

logger = logging.getLogger("dlscale")


def dask_setup(worker: Any) -> None:
    """Dask's preload hook: set the allocator for training, its kept memory given back whenever the
    worker's memory is high (:mod:`dlscale.runtime.allocator`), and import the configured modules; what
    fails is logged, not raised (a fit raises the error itself)."""
    try:
        allocator.tune(worker)
    except ValueError as e:
        logger.warning("worker left its allocator as it started: %s", e)
    for name in config.get("worker.imports"):
        try:
            importlib.import_module(name)
        except Exception as e:
            logger.warning("worker could not import %s ahead of its tasks: %s: %s", name, type(e).__name__, e)
