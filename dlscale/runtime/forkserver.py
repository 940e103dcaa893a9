"""Nanny preload of the embedded cluster: the nanny's worker processes are forked from a server that
has already imported what a worker imports (``dlscale.worker.imports``: torch, dlscale's training
modules), so that a worker killed or restarted is back in a fraction of a second.

A nanny starts its worker with multiprocessing (``distributed.worker.multiprocessing-method``). With
``spawn``, every new worker process imports torch and dlscale afresh: 3.5-4 s of a core, 6-13 s on a
busy two-core machine, during which a fit trains short-handed and the import takes the cores the
others train on. With ``forkserver``, one server process per nanny imports them once, and each
worker process is a fork of it: about 0.2 s from a ``SIGKILL`` to a worker back on the scheduler. The
server is forked before any thread or device is started in it (importing torch starts neither), and
each worker sets its own environment, threads and allocator as it starts, as under ``spawn``.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.utils import get_mp_context

from dlscale import config

logger = logging.getLogger("dlscale")


def dask_setup(nanny: Any) -> None:
    """Add the worker's modules to what the nanny's fork server imports before its first worker starts
    (Dask calls this as the nanny starts, before it starts its worker); nothing unless the nanny
    starts its workers with ``forkserver``."""
    context = get_mp_context()  # distributed's own preload (distributed and its dependencies) is set here
    if context.get_start_method() != "forkserver":
        return
    modules = ["distributed", "dlscale.runtime.warmup", *config.get("worker.imports")]
    context.set_forkserver_preload(list(dict.fromkeys(modules)))  # one it cannot import, it skips
