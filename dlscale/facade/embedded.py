"""The embedded cluster of ``local[N]``: Dask's ``LocalCluster`` with each nanny in a fresh interpreter.

``LocalCluster`` runs its nannies in the driver, and they start their workers with multiprocessing's
``spawn``, which re-runs the driver's main script in every worker: a script without an
``if __name__ == "__main__":`` guard would start a cluster from each of its workers. Here each nanny
is a ``python -m dask spec`` process (distributed's ``SubprocessWorker``), whose main module is
Dask's own, so its worker imports nothing of the script; functions defined in the script reach the
workers by value, as cloudpickle sends everything of ``__main__``. The rest is ``LocalCluster``'s:
the scheduler and dashboard in the driver, nannies that restart their worker and enforce its memory
limit, everything bound to 127.0.0.1, a graceful close (which here also closes the connections that
browsers keep open to the dashboard). A nanny process also ends when the driver ends without closing
it (a crash, ``SIGKILL``): see :mod:`dlscale.runtime.lifeline`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import warnings
from typing import Any

import dask.config
from dask.utils import parse_timedelta
from distributed import Scheduler
from distributed.deploy.cluster import Cluster
from distributed.deploy.spec import SpecCluster
from distributed.deploy.subprocess import SubprocessWorker

logger = logging.getLogger("dlscale")

_HOST = "127.0.0.1"
_CLOSE_TIMEOUT = 10.0  # seconds a nanny process has to close gracefully before it is killed


class NannyProcess(SubprocessWorker):
    """A ``distributed.Nanny`` in its own ``python -m dask spec`` process, in a session of its own
    (a Ctrl-C reaches the driver, which closes the cluster), with the driver's ``sys.path`` and Dask
    configuration, and standard input as its lifeline to the driver."""

    def __init__(self, scheduler: str, name: str | int, worker_kwargs: dict[str, Any], env: dict[str, str]) -> None:
        super().__init__(scheduler, name=name, worker_kwargs={**worker_kwargs, "name": name})
        self.env = env

    async def _start(self) -> None:
        spec = json.dumps({"cls": self.worker_class, "opts": self.worker_kwargs})
        # -P: the driver's sys.path, given in PYTHONPATH, is the whole path (no current directory first)
        self.process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-P", "-m", "dask", "spec", self.scheduler, "--spec", spec),
            stdin=asyncio.subprocess.PIPE,
            env=self.env,
            start_new_session=True,
        )

    async def close(self) -> None:
        """Close the nanny as ``SIGTERM`` does (it closes its worker first), killing what is left
        after ``_CLOSE_TIMEOUT``."""
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), _CLOSE_TIMEOUT)
        await super().close()

    def exited(self) -> int | None:
        """The nanny process's exit code, ``None`` while it runs."""
        return None if self.process is None else self.process.returncode


def _environment(config: dict[str, Any]) -> dict[str, str]:
    """This process's environment, its ``sys.path`` and its Dask configuration with ``config`` merged
    over it, for a nanny process (what multiprocessing's ``spawn`` hands a child, minus the main module)."""
    paths = [p or os.getcwd() for p in sys.path if isinstance(p, str)]
    # distributed's messages at warning from the start, as the nanny's ``silence_logs`` leaves them
    ours = {"logging": {"distributed": "warning"}}
    if dask.config.get("dlscale.worker.forkserver") and dask.config.get("dlscale.worker.imports"):
        # workers forked from a server that holds their imports (dlscale.runtime.forkserver)
        ours["distributed"] = {"worker": {"multiprocessing-method": "forkserver"}}
    settings = dask.config.merge(dask.config.config, ours, config)
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
        "DASK_INTERNAL_INHERIT_CONFIG": dask.config.serialize(_json_only(settings)),
    }


def _json_only(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` without the values JSON cannot carry (a callable set in code, say)."""
    kept = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            kept[key] = _json_only(value)
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        kept[key] = value
    return kept


class EmbeddedCluster(SpecCluster):
    """A scheduler (and dashboard) in this process and ``n_workers`` nanny processes, each with one
    worker of ``threads_per_worker`` threads and ``memory_limit``; ``config`` is merged over this
    process's Dask configuration for them. Returns once every worker has joined the scheduler.

    A dashboard port already taken (another cluster's 8787, say) gives way to a free one, with a
    one-line notice on the ``dlscale`` logger."""

    def __init__(
        self,
        n_workers: int,
        *,
        threads_per_worker: int,
        memory_limit: str | int | float,
        dashboard_address: str | None,
        resources: dict[str, float] | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        scheduler = {
            "cls": Scheduler,
            "options": {
                "host": _HOST,
                "port": 0,
                "protocol": "tcp://",
                "dashboard": dashboard_address is not None,
                "dashboard_address": dashboard_address,
            },
        }
        nanny = {
            "host": _HOST,
            "protocol": "tcp://",
            "nthreads": threads_per_worker,
            "memory_limit": memory_limit,
            "dashboard": False,
            "silence_logs": logging.WARN,
            "preload_nanny": ["dlscale.runtime.lifeline", "dlscale.runtime.forkserver"],
            "preload": ["dlscale.runtime.warmup"],
            **({"resources": resources} if resources else {}),
        }
        worker = {"cls": NannyProcess, "options": {"worker_kwargs": nanny, "env": _environment(config or {})}}
        self._losses: dict[str | int, int] = {}  # losses of a worker of each name so far
        # the scheduler, in this process, reads the same settings as it starts (its tick among them)
        with warnings.catch_warnings(), dask.config.set(dask.config.merge(dask.config.config, config or {})):
            # distributed moves to a free port itself, warning in three lines: one is said below
            warnings.filterwarnings("ignore", message="Port .* is already in use", category=UserWarning)
            super().__init__(
                workers={i: worker for i in range(n_workers)},
                scheduler=scheduler,
                worker=worker,
                silence_logs=logging.WARN,
                name="EmbeddedCluster",
            )
        wanted = dashboard_address and int(dashboard_address.rpartition(":")[2] or 0)
        if wanted and self.scheduler.http_server.port != wanted:
            logger.info("dashboard port %d is taken; the dashboard is at %s", wanted, self.dashboard_link)

    def _update_worker_status(self, op: str, msg: Any) -> None:
        """``SpecCluster``'s, but a lost worker's nanny is closed only when the *last* loss of a worker
        of its name is ``distributed.deploy.lost-worker-timeout`` old and no worker of that name is back.

        ``SpecCluster`` times every loss on its own, so the timer of an earlier loss, long since
        replaced, fires while the nanny starts the replacement of a later one, closes a nanny at work,
        and the cluster stays a worker short for good (a worker killed twice within the timeout)."""
        if op != "remove":
            super()._update_worker_status(op, msg)
            return
        name = self.scheduler_info["workers"][msg]["name"]
        loss = self._losses[name] = self._losses.get(name, 0) + 1

        def close_if_still_lost() -> None:
            if self._losses.get(name) != loss or name not in self.workers:
                return  # lost again since (that loss has its own timer), or closed already
            if any(w["name"] == name for w in self.scheduler_info["workers"].values()):
                return
            self._futures.add(asyncio.ensure_future(self.workers.pop(name).close()))

        delay = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout"))
        asyncio.get_running_loop().call_later(delay, close_if_still_lost)
        Cluster._update_worker_status(self, op, msg)  # the bookkeeping, without SpecCluster's timer

    async def _correct_state_internal(self) -> None:
        await super()._correct_state_internal()
        # a nanny process is started once it runs; the cluster, once its worker has joined
        while missing := set(self.workers) - {ws.name for ws in self.scheduler.workers.values()}:
            for name in missing:
                if (code := self.workers[name].exited()) is not None:
                    raise RuntimeError(f"the process of worker {name} exited with code {code} before it joined")
            await asyncio.sleep(0.05)

    async def _close(self) -> None:
        dashboard = getattr(self.scheduler, "http_server", None)
        await super()._close()
        if dashboard is not None:
            # The scheduler stops listening but leaves the browsers' keep-alive connections open, and
            # nothing answers on them: a browser's next request to this port, to the dashboard of the
            # next cluster started there, would go down one and wait for ever.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(dashboard.close_all_connections(), _CLOSE_TIMEOUT)
