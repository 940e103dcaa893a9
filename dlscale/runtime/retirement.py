"""Graceful retirement: a worker that leaves on purpose finishes its dlscale work first, and the fits it
took part in can tell it from a worker that was lost.

Dask retires a worker (``Client.retire_workers``, adaptive scale-down, ``cluster.scale(n)``) by moving
its data elsewhere and removing it at once: the tasks it is running are computed again elsewhere, and
a long-lived task (a gradient-sharing trainer) is cut off. Once this extension is installed, the
scheduler's ``retire_workers`` first marks the workers as closing gracefully (they start no new task,
and a trainer on them hands its work back and leaves its session), waits until their running tasks
have ended (at most ``dlscale.worker.retire-timeout``), and only then lets Dask retire them. It also
takes the worker names that ``cluster.scale`` passes where Dask expects addresses (and so retires
nothing, closing the processes with their data). A worker that closes itself (a batch job ending)
tells the scheduler it is closing before it goes, and its trainers leave as it closes; a worker
killed tells nothing. The scheduler remembers which workers left in
either orderly way, and a fit asks (:func:`retired`) before it warns about a lost worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from dask.utils import parse_timedelta
from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin

from dlscale import config
from dlscale.runtime.extensions import Extension, install

if TYPE_CHECKING:
    from distributed import Client
    from distributed.scheduler import Scheduler, WorkerState

NAME = "dlscale-retirement"

LEAVING = frozenset({Status.closing_gracefully, Status.closing, Status.closed})
"""The statuses of a worker on its way out: its trainers leave their sessions."""

_REMEMBERED = 1024  # retired workers the scheduler remembers, the oldest forgotten first


def retire_timeout() -> float:
    """``dlscale.worker.retire-timeout`` in seconds: how long a retiring worker's work may take to end."""
    return parse_timedelta(config.get("worker.retire-timeout"))


class RetirementPlugin(SchedulerPlugin):
    """Wraps the scheduler's ``retire_workers`` handler and remembers the workers that left in order."""

    name = NAME
    idempotent = True

    def __init__(self) -> None:
        self.leaving: set[str] = set()  # workers that said they are closing, or that are being retired
        self.retired: dict[str, float] = {}  # worker -> when it left in order

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._retire = scheduler.retire_workers
        scheduler.handlers["retire_workers"] = self.retire_workers
        scheduler.handlers["dlscale_retired"] = self.retired_of

    async def retire_workers(
        self,
        workers: list[str] | None = None,
        *,
        names: Collection[Any] | None = None,
        stimulus_id: str | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Dask's ``retire_workers``, after the retiring workers' running tasks have ended (or
        ``dlscale.worker.retire-timeout`` has passed)."""
        s = self.scheduler
        given = {"workers": workers, "names": names, "stimulus_id": stimulus_id, **kwargs}
        if workers is not None and names is None:  # a SpecCluster (cluster.scale) passes its workers' names here
            by_name = {str(ws.name): a for a, ws in s.workers.items()}
            workers = [w if w in s.workers else by_name.get(str(w), w) for w in workers]
        if names is not None and workers is None:
            wanted = {str(n) for n in names}
            workers = [a for a, ws in s.workers.items() if str(ws.name) in wanted]
        elif workers is None and names is None:
            keys = ("n", "memory_ratio", "key", "minimum", "target", "attribute")
            workers = s.workers_to_close(**{k: kwargs.pop(k) for k in keys if k in kwargs})
        stimulus_id = stimulus_id or f"dlscale-retire-workers-{time.time()}"
        wss = [s.workers[a] for a in workers or () if a in s.workers and s.workers[a].status == Status.running]
        if not wss or not any(ws not in wss for ws in s.running):  # nowhere for their work to go (a cluster closing)
            return await self._retire(**given)
        for ws in wss:
            self._status(ws, Status.closing_gracefully, stimulus_id)
        deadline = time.monotonic() + retire_timeout()
        while any(ws.processing for ws in wss) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        try:
            result = await self._retire(workers=workers, stimulus_id=stimulus_id, **kwargs)
        finally:
            for ws in wss:  # a worker Dask would not retire (its data has nowhere to go) goes on
                if s.workers.get(ws.address) is ws and ws.status == Status.closing_gracefully:
                    self._status(ws, Status.running, stimulus_id)
        return result

    def _status(self, ws: WorkerState, status: Status, stimulus_id: str) -> None:
        """Set a worker's status on the scheduler and tell the worker, as Dask's ``retire_workers`` does."""
        self.scheduler.handle_worker_status_change(status, ws, stimulus_id)
        self.scheduler.stream_comms[ws.address].send(
            {"op": "worker-status-change", "status": status.name, "stimulus_id": stimulus_id}
        )

    def log_event(self, topic: str, msg: Any) -> None:
        if isinstance(msg, dict) and msg.get("action") == "worker-status-change" and isinstance(topic, str):
            if Status[msg["status"]] in LEAVING:
                self.leaving.add(topic)
            else:
                self.leaving.discard(topic)

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        if worker in self.leaving:
            self.leaving.discard(worker)
            self.retired[worker] = time.time()
            while len(self.retired) > _REMEMBERED:
                del self.retired[next(iter(self.retired))]

    def retired_of(self, workers: list[str]) -> list[str]:
        """Those of ``workers`` that left in order (retired, or closed themselves)."""
        return [w for w in workers if w in self.retired]


RETIREMENT = Extension(NAME, scheduler_plugin=RetirementPlugin)


def retired(client: Client, workers: Collection[str]) -> set[str]:
    """Those of ``workers``, gone from the cluster of ``client``, that left in order rather than being lost."""
    if not workers:
        return set()
    install(client, RETIREMENT)
    return set(client.sync(client.scheduler.dlscale_retired, workers=sorted(workers)))
