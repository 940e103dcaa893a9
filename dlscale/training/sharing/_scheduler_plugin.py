"""The control plane of gradient sharing, on the scheduler: the ``dlscale_sharing_*`` handlers around
each session's bookkeeping (``_leases``), and the training panel's rows of its trainers.

Trainers pull minibatches a few at a time and acknowledge them when fitted; a lost trainer's
unacknowledged minibatches go to the others, a trainer on a retiring worker leaves on purpose (see
``_leases``). Updates themselves never pass through the scheduler. The trainers' handlers reply with
records in plain form, or a refusal (``_messages``); the driver's (``open``, ``progress``, ``close``,
``fail``, ``drain``) with plain dicts. What every master's plugin does alike (the handlers registered,
the replies, the cluster's events) is ``dlscale.training._plugins``'.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.core import Status

from dlscale.monitor import panel
from dlscale.training._plugins import SessionSchedulerPlugin
from dlscale.training.sharing._leases import Session
from dlscale.training.sharing._messages import Ack, Handout, View

logger = logging.getLogger("dlscale.training.sharing")

NAME = "dlscale-sharing"


class SharingSchedulerPlugin(SessionSchedulerPlugin[Session]):
    """Installs the ``dlscale_sharing_*`` handlers on the scheduler and keeps every session."""

    name = NAME
    prefix = "sharing"
    approach = "gradient sharing"
    ops = ("join", "next", "finish", "status", "leave", "drain")
    logger = logger

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
