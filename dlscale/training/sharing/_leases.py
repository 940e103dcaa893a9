"""The bookkeeping of a gradient-sharing session on the scheduler: its trainers alive, the minibatches
left, those handed out to each trainer (leased) and those acknowledged, and when the session has ended.

Trainers pull minibatches a few at a time and acknowledge them when fitted, so a trainer that is lost
(its worker removed) leaves its unacknowledged minibatches to the others: they go back to the front of
the queue, in order. A trainer whose worker is retiring leaves on purpose instead: it hands back what it
holds and is *retired*, its peers waiting for its last updates as for a finished trainer's. The
membership has a version that grows with every loss or departure; trainers read it with every reply and
route their updates around the nodes gone.

A :class:`Session` is the bookkeeping alone, with no Dask in it: it raises a
:class:`~dlscale.training._errors.SessionStoppedError` for a trainer whose session has stopped, which the
scheduler's plugin (``_scheduler_plugin``) turns into a refusal.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from dlscale.training._errors import SessionAbortedError, TrainerLostError, check_first_start
from dlscale.training.sharing._messages import Ack, Handout, View

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
    abandoned: list[int] = field(default_factory=list)  # items lost trainers held unacknowledged: for the driver
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
        abandoned, self.abandoned = self.abandoned, []
        retired, self.retired_stats = self.retired_stats, []
        view = self.view()
        state = "abort" if self.failed is not None else "end" if view.done else "run"
        return {
            "reports": reports,
            "abandoned": abandoned,
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
        check_first_start(self.joined, trainer, self.name)
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
        self.abandoned += self._hand_back(gone)
        for t in gone:
            self.alive.discard(t)
            self.lost.append(t)
        if gone:
            self.version += 1
        return gone

    def _hand_back(self, trainers: list[str]) -> list[int]:
        """Put the items ``trainers`` hold and have not acknowledged back at the front of the queue, in
        order; returns them."""
        back = sorted(set().union(*(self.assigned.get(t, ()) for t in trainers)))
        for t in trainers:
            self.assigned[t] = set()
        self.pending.extendleft(reversed(back))
        return back

    def _check_member(self, trainer: str) -> None:
        if trainer not in self.alive:
            raise TrainerLostError(f"trainer {trainer} is not a member of session {self.name}")

    def _check_running(self) -> None:
        if self.failed is not None:
            raise SessionAbortedError(f"session {self.name} stopped: {self.failed}")
