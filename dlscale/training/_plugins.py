"""The Dask plumbing every master's plugins share, as ``distributed.shuffle``'s scheduler and worker
plugins serve every kind of shuffle: a master's plugins extend these with only what varies.

On the scheduler, :class:`SessionSchedulerPlugin` keeps the master's sessions by name, registers its
handlers by prefix (``dlscale_<prefix>_<op>`` for each op it declares, with the driver's ``open``,
``close``, ``progress`` and ``fail``), turns a trainer's call into a plain reply or a refusal
(``_messages``), and follows the cluster: a lost worker's trainers leave their sessions, a worker that
joins is told to the drivers of running sessions, a driver gone ends its sessions, and adaptive scaling
does not retire a worker whose trainers are at work. A master's session is its own bookkeeping
(:class:`Bookkeeping` says what the plugin reads of it).

On each worker, :class:`SessionWorkerPlugin` registers the master's handlers, opens the worker's own
connections for its messages (``dlscale.training._sockets``), keeps what its trainers park between fits
(``dlscale.training._parking``: one session's at most) and, as the worker closes, waits for its
trainers at work to leave their sessions; :meth:`SessionWorkerPlugin.on` finds it on a worker.

:func:`extension` makes a master's Dask extension of its two plugins.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, Self, TypeVar

from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

from dlscale.runtime.extensions import Extension
from dlscale.runtime.retirement import retire_timeout
from dlscale.training._errors import SessionClosedError, SessionStoppedError
from dlscale.training._messages import OK, Record, ok, refusal
from dlscale.training._sockets import Sockets, open_sockets

if TYPE_CHECKING:
    from distributed import Worker
    from distributed.scheduler import Scheduler, WorkerState


class Bookkeeping(Protocol):
    """What the scheduler's plugin reads of a master's session: its trainers (by the worker each is
    placed on), those alive, the driver's client and the workers that joined since it opened."""

    name: str
    worker_of: dict[str, str]
    alive: set[str]
    client: str | None
    newcomers: list[str]

    def training(self) -> bool:
        """Whether its trainers are still at work."""

    def remove_worker(self, worker: str) -> list[str]:
        """Drop the trainers of ``worker`` (their work goes to the others); returns those dropped."""

    def fail(self, who: str, error: str) -> None:
        """``who`` (a trainer, or the driver) raised: every trainer stops at its next call."""

    def progress(self) -> dict[str, Any]:
        """The driver's report since the last: at least ``reports`` (what the trainers reported fitted),
        ``abandoned`` (work items lost trainers held, to be fitted again), ``lost`` (the trainers lost so
        far) and ``failed`` (the failure, or ``None``)."""


S = TypeVar("S", bound=Bookkeeping)


class SessionSchedulerPlugin(SchedulerPlugin, Generic[S]):
    """Installs a master's ``dlscale_<prefix>_*`` handlers on the scheduler and keeps its sessions."""

    name: ClassVar[str]  # the plugin's, the worker plugin's and the extension's
    prefix: ClassVar[str]  # the master's name in handlers: dlscale_<prefix>_<op>
    approach: ClassVar[str]  # the master's name in messages
    ops: ClassVar[tuple[str, ...]] = ()  # the master's own handlers, each served by the method of its name
    logger: ClassVar[logging.Logger]
    idempotent = True

    def __init__(self) -> None:
        self.sessions: dict[str, S] = {}

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        served = {"open": self.open_session, "close": self.close_session, "progress": self.progress, "fail": self.fail}
        served.update({op: getattr(self, op) for op in self.ops})
        scheduler.handlers.update({f"dlscale_{self.prefix}_{op}": handler for op, handler in served.items()})

    # -- the driver's calls --------------------------------------------------------------
    def open_session(self, session: str, **kwargs: Any) -> Any:
        raise NotImplementedError

    def close_session(self, session: str) -> Any:
        raise NotImplementedError

    def progress(self, session: str) -> dict[str, Any]:
        """The driver's report on ``session`` (its session's ``progress``)."""
        return self.sessions[session].progress()

    def fail(self, session: str, trainer: str, error: str) -> None:
        """A trainer raised, or the driver stops the session: every trainer stops at its next call."""
        s = self.sessions.get(session)
        if s is not None:
            s.fail(trainer, error)

    # -- the trainers' calls: a reply in plain form, or a refusal ------------------------
    def _reply(self, session: str, call: Callable[[S], Record | dict[str, Any]]) -> dict[str, Any]:
        """``call`` on ``session``'s bookkeeping, its record (or fields) as a successful reply; a
        session that has stopped for the trainer (or is not open) refuses."""
        try:
            s = self.sessions.get(session)
            if s is None:
                raise SessionClosedError(f"session {session} is not open")
            got = call(s)
            return ok(got) if isinstance(got, Record) else {"status": OK, **got}
        except SessionStoppedError as e:
            return refusal(e)

    # -- the cluster's events ------------------------------------------------------------
    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        """Drop the trainers of ``worker``: their work goes to the others."""
        for s in self.sessions.values():
            gone = s.remove_worker(worker)
            if gone:
                self.logger.warning(
                    "%s session %s lost worker %s (%s %s); %d trainers go on",
                    self.approach,
                    s.name,
                    worker,
                    "trainer" if len(gone) == 1 else "trainers",
                    ", ".join(gone),
                    len(s.alive),
                )

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        """Tell the drivers of running sessions about a worker that joined: they take it in at a segment's
        end, or from the next round."""
        for s in self.sessions.values():
            if s.training() and worker not in s.worker_of.values() and worker not in s.newcomers:
                s.newcomers.append(worker)

    def remove_client(self, scheduler: Scheduler, client: str, **kwargs: Any) -> None:
        """A driver gone (its process died, its connection lost) ends its sessions: their trainers stop at
        their next call to the scheduler and free their workers, instead of training for nobody."""
        for name in [name for name, s in self.sessions.items() if s.client == client]:
            del self.sessions[name]
            self.logger.warning("%s session %s ended: its driver (client %s) disconnected", self.approach, name, client)

    def valid_workers_downscaling(self, scheduler: Scheduler, workers: list[WorkerState]) -> list[WorkerState]:
        """Keep adaptive scaling from retiring a worker whose trainers are still training."""
        busy = {s.worker_of[t] for s in self.sessions.values() if s.training() for t in s.alive}
        return [w for w in workers if w.address not in busy]


class SessionWorkerPlugin(WorkerPlugin):
    """Adds a master's handlers to a worker, its own connections for the master's messages, and keeps
    what its trainers park between fits."""

    name: ClassVar[str]
    prefix: ClassVar[str]  # the master's name in the connections' handler: dlscale_<prefix>_port
    approach: ClassVar[str]  # the master's name in messages
    handlers: ClassVar[dict[str, str]] = {}  # a worker handler's name: the method that serves it
    idempotent = True

    def __init__(self) -> None:
        self.parked: dict[str, Any] = {}  # session: what its trainers here left for the next fit
        self.busy: set[Any] = set()  # its trainers here at work (by session, or by trainer)
        self.sockets: Sockets | None = None

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        self._parking = threading.Lock()  # made here: the plugin is pickled to reach the worker
        for handler, method in self.handlers.items():
            worker.handlers[handler] = getattr(self, method)
        self.sockets = open_sockets(worker, self.prefix, self.is_open, self._delivered)

    async def teardown(self, worker: Worker) -> None:
        """A worker closing lets its trainers leave their sessions first (they see it closing: see the
        masters' ``_trainer``), at most ``dlscale.worker.retire-timeout``; then its sessions end here."""
        deadline = time.monotonic() + retire_timeout()
        while self.at_work() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.end()
        if self.sockets is not None:
            self.sockets.close()

    @classmethod
    def on(cls, worker: Worker) -> Self:
        """The plugin of ``worker``."""
        found = worker.plugins.get(cls.name)
        if found is None:
            raise RuntimeError(f"worker {worker.address} has no dlscale {cls.approach} plugin")
        return found

    # -- what a master says ------------------------------------------------------------------
    def open(self, session: str, *args: Any) -> Any:
        """The driver opens ``session`` here (what follows the name is the master's): nothing is kept for it
        unless a master says otherwise."""

    def close(self, session: str) -> None:
        """The driver closes ``session`` here (or its trainer found it closed)."""

    def is_open(self, session: str) -> bool:
        """Whether ``session`` is open here (a message for another is dropped unread)."""
        raise NotImplementedError

    def _delivered(self, session: str, sender: str, head: dict[str, Any], payload: Any) -> None:
        """A message read off this worker's own connections."""
        raise NotImplementedError

    def at_work(self) -> bool:
        """Whether a trainer here is at work: a closing worker waits for it to leave its session."""
        return bool(self.busy)

    def end(self) -> None:
        """The worker closes: its sessions end here."""

    # -- the trainers parked between fits ----------------------------------------------------
    def forget(self, session: str) -> None:
        """Drop what the trainers of ``session`` parked here."""
        with self._parking:
            self.parked.pop(session, None)

    def serialised(self, session: str) -> bytes:
        """The network ``session``'s trainer parked here, pickled without its optimizer, if it holds the
        state its fit ended with (a master whose replicas do); a ``LookupError`` otherwise."""
        raise LookupError(f"the {self.approach} trainers of session {session} park no copy of the fit's state")

    def parked_trainers(self, session: str) -> list[int]:
        """The local trainers of ``session`` parked here."""
        with self._parking:
            return self._trainers(self.parked[session]) if session in self.parked else []

    def _trainers(self, parked: Any) -> list[int]:
        """The local trainers whose parked state ``parked`` (a session's) holds: one a worker, unless a
        master says otherwise."""
        return [0]

    def _park_alone(self, session: str) -> None:
        """Forget every other session's parked trainers (the lock held): a worker parks one session's."""
        for other in [s for s in self.parked if s != session]:
            del self.parked[other]


def extension(scheduler_plugin: type[SessionSchedulerPlugin], worker_plugin: type[SessionWorkerPlugin]) -> Extension:
    """A master's Dask extension: its scheduler plugin (the control plane) and worker plugin (the data
    plane), installed together by :func:`dlscale.runtime.extensions.install` under their one name."""
    if scheduler_plugin.name != worker_plugin.name:
        raise ValueError(f"a master's plugins share a name: {scheduler_plugin.name} != {worker_plugin.name}")
    return Extension(scheduler_plugin.name, scheduler_plugin=scheduler_plugin, worker_plugin=worker_plugin)
