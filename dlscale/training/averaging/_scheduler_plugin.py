"""The control plane of parameter averaging, on the scheduler: each session's rounds (``_rounds``), the
trainers alive, and the settled rounds the driver has not yet heard of. States never pass through the
scheduler: trainers average them among themselves (``_exchange``).

Trainers call the ``dlscale_averaging_*`` handlers and get plain replies with a ``status`` (``"OK"``, or
the reason their session stopped for them, as gradient sharing's do); the driver's handlers reply with
plain dicts. What every master's plugin does alike (the handlers registered, the replies, the cluster's
events) is ``dlscale.training._plugins``'.
"""

from __future__ import annotations

import logging
from typing import Any

from dlscale.training._messages import unpacked
from dlscale.training._plugins import SessionSchedulerPlugin
from dlscale.training.averaging._rounds import Rounds

logger = logging.getLogger("dlscale.training.averaging")

NAME = "dlscale-averaging"


class AveragingSession(Rounds):
    """A session's rounds, with what the cluster and the driver add: the trainers' workers, the driver's
    client, the fit it is part of, the trainers lost, and workers that joined since it opened."""

    def __init__(
        self,
        name: str,
        plan: list[dict[str, list[int]]],
        worker_of: dict[str, str],
        workers: Any,
        fit: str,
        client: str | None,
    ) -> None:
        alive = {t for t, w in worker_of.items() if w in workers}
        super().__init__(name, plan, alive)
        self.worker_of, self.fit, self.client = dict(worker_of), fit, client
        self.lost = sorted(set(worker_of) - alive)
        self.newcomers: list[str] = []

    def training(self) -> bool:
        """Whether its trainers are still at work: a round to train in it has not settled."""
        return not self.settled()

    def remove_worker(self, worker: str) -> list[str]:
        """Drop the trainers of ``worker``: their shares go to the others (see ``_rounds``); returns
        those dropped."""
        gone = []
        for t in sorted(t for t, w in self.worker_of.items() if w == worker):
            if self.lose(t):
                gone.append(t)
                self.lost.append(t)
        return gone

    def progress(self) -> dict[str, Any]:
        reports, self.reports = self.reports, []
        abandoned, self.abandoned = self.abandoned, []
        return {
            "reports": reports,
            "abandoned": abandoned,
            "lost": list(self.lost),
            "failed": self.failed,
            "failed_by": self.failed_by,
            "alive": sorted(self.alive),
            "newcomers": list(self.newcomers),
        }


class AveragingSchedulerPlugin(SessionSchedulerPlugin[AveragingSession]):
    """Installs the ``dlscale_averaging_*`` handlers on the scheduler and keeps every session."""

    name = NAME
    prefix = "averaging"
    approach = "parameter averaging"
    ops = ("stop", "join", "begin", "sync", "commit", "leave")
    logger = logger

    # -- the driver's calls --------------------------------------------------------------
    def open_session(
        self,
        session: str,
        plan: list[dict[str, list[int]]],
        worker_of: dict[str, str],
        stop_at: int | None = None,
        snapshot_epochs: list[int] = (),
        per_epoch: int = 0,
        fit: str | None = None,
        client: str | None = None,
    ) -> None:
        """Start a session: its rounds, its trainers (by worker), the round it stops before (a checkpoint
        due then), the epochs of the fit (``per_epoch`` items each) at whose end its trainers keep the
        average for a checkpoint, the fit it is part of and the driver's ``client``. The driver, which
        hears of every settled round, writes the training page's rows."""
        s = AveragingSession(session, plan, worker_of, self.scheduler.workers, fit or session, client)
        s.stop_at = stop_at
        s.snapshot_epochs, s.per_epoch = set(snapshot_epochs), per_epoch
        self.sessions[session] = s

    def close_session(self, session: str) -> list[int]:
        """End a session; returns the items of its rounds not committed, in order."""
        s = self.sessions.pop(session, None)
        return [] if s is None else s.left()

    def stop(self, session: str) -> None:
        """End the session at the next round's end (a checkpoint is due, or a worker joined)."""
        s = self.sessions[session]
        at = s.first_stoppable()
        s.stop_at = at if s.stop_at is None else min(s.stop_at, at)

    # -- the trainers' calls -----------------------------------------------------------------
    def join(self, session: str, trainer: str) -> dict[str, Any]:
        return self._reply(session, lambda s: s.join(trainer) or {})

    def begin(self, session: str, trainer: str, round: int, ahead: int = 0) -> dict[str, Any]:
        return self._reply(session, lambda s: s.begin(trainer, round, ahead))

    def sync(self, session: str, trainer: str, round: int) -> dict[str, Any]:
        return self._reply(session, lambda s: s.sync(trainer, round))

    def commit(
        self, session: str, trainer: str, round: int, attempt: int, report: bytes, ahead: int = 0
    ) -> dict[str, Any]:
        """A trainer's commit; ``report`` (what each member fitted) comes :func:`packed`: a trainer commits
        every round, and its worker's event loop, which the trainer shares the interpreter with, would
        otherwise walk the nested reports to size the message."""
        reports = unpacked(report)
        return self._reply(session, lambda s: s.commit(trainer, round, attempt, reports, ahead))

    def leave(self, session: str, trainer: str, round: int) -> dict[str, Any]:
        return self._reply(session, lambda s: {"outcome": s.leave(trainer, round)})
