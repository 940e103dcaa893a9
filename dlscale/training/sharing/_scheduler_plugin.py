"""The control plane of gradient sharing, on the scheduler: which trainers are alive, which
minibatches are left, and when a fit has ended.

Trainers pull minibatches a few at a time and acknowledge them when fitted, so a trainer that is
lost (its worker removed) leaves its unacknowledged minibatches to the others. A trainer whose worker
is retiring leaves on purpose instead: it hands back what it holds and is *retired*, its peers waiting
for its last updates as for a finished trainer's. The membership has a version that grows with every
loss or departure; trainers read it with every reply and route their updates around the nodes gone.
Updates themselves never pass through the scheduler.

A :class:`Session` is the bookkeeping alone and raises a :class:`SessionStoppedError` for a trainer
whose session has stopped; the plugin's handlers turn records and refusals into plain replies
(``_messages``). The driver's handlers (``open``, ``progress``, ``close``, ``fail``) reply with plain
dicts.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin

from dlscale.monitor import panel
from dlscale.training._errors import (
    SessionAbortedError,
    SessionClosedError,
    SessionStoppedError,
    TrainerLostError,
)
from dlscale.training._messages import Record, ok, refusal
from dlscale.training.sharing._messages import Ack, Handout, View

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler, WorkerState

logger = logging.getLogger("dlscale.training.sharing")

NAME = "dlscale-sharing"

Report = tuple[int, int, float, float, float, int, float]
"""An acknowledged step as the driver hears of it: ``(item, examples, score, threshold, sparsity,
bytes_sent, time)``, ``time`` when the scheduler received the acknowledgement (one clock for every
trainer)."""


@dataclass
class Session:
    """One session's state: its trainers (by the worker each is placed on) and its work items."""

    name: str
    worker_of: dict[str, str]  # trainer -> worker address
    pending: collections.deque[int]  # work items not yet handed out, in order
    alive: set[str]
    assigned: dict[str, set[int]] = field(default_factory=dict)
    joined: set[str] = field(default_factory=set)
    finished: dict[str, int] = field(default_factory=dict)  # trainer -> updates it sent
    reports: list[Report] = field(default_factory=list)  # for the driver
    lost: list[str] = field(default_factory=list)  # trainers lost, in order
    failed: str | None = None
    failed_by: str | None = None  # the trainer, or "driver", that stopped the session
    version: int = 0
    fit: str = ""  # the fit's record in the training panel: a fit's sessions (its segments) share it
    client: str | None = None  # the driver's client: the session ends when it goes
    newcomers: list[str] = field(default_factory=list)  # workers that joined the cluster since it opened
    retired: dict[str, int] = field(default_factory=dict)  # trainer that left on purpose -> updates it sent
    retired_stats: list[dict[str, Any]] = field(default_factory=list)  # their statistics, for the driver

    @classmethod
    def open(cls, name: str, worker_of: dict[str, str], order: list[int], workers: Collection[str]) -> Session:
        """A session whose trainers on ``workers`` (those the scheduler knows) are alive; the others are
        lost from the start."""
        alive = {t for t, w in worker_of.items() if w in workers}
        return cls(
            name,
            dict(worker_of),
            collections.deque(order),
            alive,
            {t: set() for t in worker_of},
            lost=sorted(set(worker_of) - alive),
        )

    # -- what the session is -----------------------------------------------------------------
    def nodes(self) -> list[str]:
        return sorted({self.worker_of[t] for t in self.alive})

    def work_left(self) -> bool:
        """Whether some item is not yet handed out, or handed to a live trainer and not acknowledged."""
        return bool(self.pending) or any(self.assigned.get(t) for t in self.alive)

    def training(self) -> bool:
        """Whether the session's trainers are still at work (not failed, work left)."""
        return self.failed is None and self.work_left()

    def view(self) -> View:
        return View(
            done=not self.work_left(),
            version=self.version,
            nodes=tuple(self.nodes()),
            alive=tuple(sorted(self.alive)),
            finished={**self.retired, **{t: n for t, n in self.finished.items() if t in self.alive}},
        )

    def progress(self) -> dict[str, Any]:
        """The driver's report: the acknowledgements and the statistics of trainers retired since the
        last one (:data:`Report`), the trainers lost so far, the failure if any, and the state of the
        session."""
        reports, self.reports = self.reports, []
        retired, self.retired_stats = self.retired_stats, []
        view = self.view()
        state = "abort" if self.failed is not None else "end" if view.done else "run"
        return {
            "reports": reports,
            "lost": list(self.lost),
            "failed": self.failed,
            "failed_by": self.failed_by,
            "state": state,
            "version": view.version,
            "nodes": list(view.nodes),
            "alive": list(view.alive),
            "finished": view.finished,
            "newcomers": list(self.newcomers),
            "retired": retired,
        }

    # -- the trainers' calls -----------------------------------------------------------------
    def join(self, trainer: str) -> View:
        """A trainer starting; one lost before it started, or started a second time (its task rerun
        elsewhere after its worker was lost), is refused."""
        self._check_member(trainer)
        if trainer in self.joined:
            raise TrainerLostError(f"trainer {trainer} of session {self.name} started a second time")
        self.joined.add(trainer)
        self._check_running()
        return self.view()

    def acknowledge(self, trainer: str, acks: list[Ack]) -> list[Ack]:
        """Record the fitted items that ``trainer`` still holds; returns those acknowledgements."""
        self._check_member(trainer)
        mine = self.assigned[trainer]
        fresh = [ack for ack in acks if ack.item in mine]
        now = time.time()
        for ack in fresh:
            mine.discard(ack.item)
            self.reports.append((ack.item, ack.examples, ack.score, ack.threshold, ack.sparsity, ack.bytes_sent, now))
        return fresh

    def hand_out(self, trainer: str, want: int) -> Handout:
        """Up to ``want`` more items for ``trainer``."""
        self._check_member(trainer)
        self._check_running()
        items = []
        while self.pending and len(items) < want:
            items.append(self.pending.popleft())
        self.assigned[trainer].update(items)
        return Handout(items=tuple(items), view=self.view())

    def finish(self, trainer: str, sent: int) -> View:
        """``trainer`` is done with its items, having sent ``sent`` updates."""
        self._check_member(trainer)
        self._check_running()
        self.finished[trainer] = sent
        return self.view()

    def leave(
        self, trainer: str, acks: list[Ack], sent: int, stats: dict[str, Any], running: Collection[str]
    ) -> tuple[list[Ack], View]:
        """``trainer``, whose worker is retiring, acknowledges ``acks`` and hands back the other items it
        holds; it leaves, having sent ``sent`` updates (``stats`` its statistics), unless no other live
        trainer is on a worker in ``running`` (the workers not leaving): the last one stays, to train
        the rest. Returns the acknowledgements recorded and the view (without ``trainer`` if it left)."""
        fresh = self.acknowledge(trainer, acks)
        self._hand_back([trainer])
        if any(self.worker_of[t] in running for t in self.alive if t != trainer):
            self.alive.discard(trainer)
            self.retired[trainer] = sent
            self.retired_stats.append(stats)
            self.version += 1
        return fresh, self.view()

    def status(self, trainer: str) -> View:
        self._check_member(trainer)
        self._check_running()
        return self.view()

    def fail(self, who: str, error: str) -> None:
        """``who`` (a trainer, or the driver) raised: every trainer stops at its next call."""
        if self.failed is None:
            self.failed, self.failed_by = f"{who}: {error}", who

    def drain(self) -> list[int]:
        """Take back the items not yet handed out (in order): the trainers finish those they hold and the
        session ends, its state whole, for a checkpoint; the driver trains the rest in a new session."""
        items = list(self.pending)
        self.pending.clear()
        return items

    # -- the cluster's events ----------------------------------------------------------------
    def remove_worker(self, worker: str) -> list[str]:
        """Drop the trainers of ``worker`` and hand their unacknowledged items back, to the front of
        the queue in order; returns the trainers dropped."""
        gone = sorted(t for t in self.alive if self.worker_of[t] == worker)
        self._hand_back(gone)
        for t in gone:
            self.alive.discard(t)
            self.lost.append(t)
        if gone:
            self.version += 1
        return gone

    def _hand_back(self, trainers: list[str]) -> None:
        """Put the items ``trainers`` hold and have not acknowledged back at the front of the queue, in order."""
        back = set().union(*(self.assigned.get(t, ()) for t in trainers))
        for t in trainers:
            self.assigned[t] = set()
        self.pending.extendleft(sorted(back, reverse=True))

    def _check_member(self, trainer: str) -> None:
        if trainer not in self.alive:
            raise TrainerLostError(f"trainer {trainer} is not a member of session {self.name}")

    def _check_running(self) -> None:
        if self.failed is not None:
            raise SessionAbortedError(f"session {self.name} stopped: {self.failed}")


class SharingSchedulerPlugin(SchedulerPlugin):
    """Installs the ``dlscale_sharing_*`` handlers on the scheduler and keeps every session."""

    name = NAME
    idempotent = True

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update(
            {
                "dlscale_sharing_open": self.open_session,
                "dlscale_sharing_close": self.close_session,
                "dlscale_sharing_join": self.join,
                "dlscale_sharing_next": self.next,
                "dlscale_sharing_finish": self.finish,
                "dlscale_sharing_status": self.status,
                "dlscale_sharing_leave": self.leave,
                "dlscale_sharing_fail": self.fail,
                "dlscale_sharing_progress": self.progress,
                "dlscale_sharing_drain": self.drain,
            }
        )

    # -- the driver's calls --------------------------------------------------------------
    def open_session(
        self,
        session: str,
        worker_of: dict[str, str],
        order: list[int],
        fit: str | None = None,
        client: str | None = None,
    ) -> None:
        """Start a session: its trainers (by the worker each is placed on), its work items in order, the
        panel record of its ``fit`` (by default its own) and the driver's ``client``."""
        self.sessions[session] = s = Session.open(session, worker_of, order, self.scheduler.workers)
        s.fit, s.client = fit or session, client
        live = panel.in_scheduler(self.scheduler)
        if live is not None:  # every trainer gets its row before its first report
            live.record(
                s.fit,
                [
                    {"row": t, "worker": w, "minibatches": 0, "examples": 0, "loss": float("nan")}
                    for t, w in sorted(worker_of.items())
                ],
            )

    def close_session(self, session: str) -> None:
        self.sessions.pop(session, None)

    def drain(self, session: str) -> list[int]:
        """The session's items not yet handed out, taken back (see :meth:`Session.drain`)."""
        return self.sessions[session].drain()

    def progress(self, session: str) -> dict[str, Any]:
        """The acknowledgements since the last call, the trainers lost so far and the session's state."""
        return self.sessions[session].progress()

    def fail(self, session: str, trainer: str, error: str) -> None:
        """A trainer raised, or the driver stops the session: every trainer stops at its next call."""
        s = self.sessions.get(session)
        if s is not None:
            s.fail(trainer, error)

    # -- the trainers' calls: records in plain form, or a refusal ------------------------
    def join(self, session: str, trainer: str) -> dict[str, Any]:
        return self._reply(session, lambda s: s.join(trainer))

    def next(self, session: str, trainer: str, acks: list[Any], want: int) -> dict[str, Any]:
        """Acknowledge fitted items (plain :class:`Ack` records) and hand out up to ``want`` more."""
        records = [Ack.from_plain(a) for a in acks]

        def call(s: Session) -> Handout:
            fresh = s.acknowledge(trainer, records)
            if fresh:
                self._to_panel(s.fit, s.worker_of[trainer], trainer, fresh)
            return s.hand_out(trainer, want)

        return self._reply(session, call)

    def finish(self, session: str, trainer: str, sent: int) -> dict[str, Any]:
        return self._reply(session, lambda s: s.finish(trainer, sent))

    def leave(self, session: str, trainer: str, acks: list[Any], sent: int, stats: dict[str, Any]) -> dict[str, Any]:
        """A trainer on a retiring worker leaves (see :meth:`Session.leave`)."""
        records = [Ack.from_plain(a) for a in acks]
        running = {a for a, ws in self.scheduler.workers.items() if ws.status == Status.running}

        def call(s: Session) -> View:
            fresh, view = s.leave(trainer, records, sent, stats, running)
            if fresh:
                self._to_panel(s.fit, s.worker_of[trainer], trainer, fresh)
            return view

        return self._reply(session, call)

    def status(self, session: str, trainer: str) -> dict[str, Any]:
        return self._reply(session, lambda s: s.status(trainer))

    def _reply(self, session: str, call: Callable[[Session], Record]) -> dict[str, Any]:
        try:
            s = self.sessions.get(session)
            if s is None:
                raise SessionClosedError(f"session {session} is not open")
            return ok(call(s))
        except SessionStoppedError as e:
            return refusal(e)

    def _to_panel(self, fit: str, worker: str, trainer: str, acks: list[Ack]) -> None:
        live = panel.in_scheduler(self.scheduler)
        if live is None:
            return
        examples = sum(a.examples for a in acks)
        loss = sum(a.examples * a.score for a in acks) / examples if examples else float("nan")
        live.record(
            fit,
            [
                {
                    "row": trainer,
                    "worker": worker,
                    "minibatches": len(acks),
                    "examples": examples,
                    "loss": loss,
                    "threshold": acks[-1].threshold,
                    "sparsity": acks[-1].sparsity,
                    "bytes_sent": sum(a.bytes_sent for a in acks),
                }
            ],
        )

    # -- the cluster's events ------------------------------------------------------------
    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        """Drop the trainers of ``worker`` and hand their unacknowledged minibatches to the others."""
        for s in self.sessions.values():
            gone = s.remove_worker(worker)
            if gone:
                logger.warning(
                    "gradient sharing session %s lost worker %s (trainers %s); %d trainers go on",
                    s.name,
                    worker,
                    ", ".join(gone),
                    len(s.alive),
                )

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        """Tell the drivers of running sessions about a worker that joined: they take it in at a segment's end."""
        for s in self.sessions.values():
            if s.training() and worker not in s.worker_of.values() and worker not in s.newcomers:
                s.newcomers.append(worker)

    def remove_client(self, scheduler: Scheduler, client: str, **kwargs: Any) -> None:
        """A driver gone (its process died, its connection lost) ends its sessions: their trainers stop at
        their next call to the scheduler and free their workers, instead of training for nobody."""
        for name in [name for name, s in self.sessions.items() if s.client == client]:
            del self.sessions[name]
            logger.warning("gradient sharing session %s ended: its driver (client %s) disconnected", name, client)

    def valid_workers_downscaling(self, scheduler: Scheduler, workers: list[WorkerState]) -> list[WorkerState]:
        """Keep adaptive scaling from retiring a worker whose trainers are still training."""
        busy = {s.worker_of[t] for s in self.sessions.values() if s.training() for t in s.alive}
        return [w for w in workers if w.address not in busy]
