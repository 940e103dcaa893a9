"""The control plane of parameter averaging, on the scheduler: each session's rounds (``_rounds``), the
trainers alive, and the settled rounds the driver has not yet heard of. States never pass through the
scheduler: trainers average them among themselves (``_exchange``).

Trainers call the ``dlscale_averaging_*`` handlers and get plain replies with a ``status`` (``"OK"``, or
the reason their session stopped for them, as gradient sharing's do); the driver's handlers reply with
plain dicts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from dlscale.training._errors import SessionClosedError, SessionStoppedError
from dlscale.training._messages import OK, refusal, unpacked
from dlscale.training.averaging._rounds import Rounds

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler, WorkerState

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

    def progress(self) -> dict[str, Any]:
        reports, self.reports = self.reports, []
        return {
            "reports": reports,
            "lost": list(self.lost),
            "failed": self.failed,
            "failed_by": self.failed_by,
            "alive": sorted(self.alive),
            "newcomers": list(self.newcomers),
        }


class AveragingSchedulerPlugin(SchedulerPlugin):
    """Installs the ``dlscale_averaging_*`` handlers on the scheduler and keeps every session."""

    name = NAME
    idempotent = True

    def __init__(self) -> None:
        self.sessions: dict[str, AveragingSession] = {}

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update(
            {
                "dlscale_averaging_open": self.open_session,
                "dlscale_averaging_close": self.close_session,
                "dlscale_averaging_progress": self.progress,
                "dlscale_averaging_stop": self.stop,
                "dlscale_averaging_replan": self.replan,
                "dlscale_averaging_fail": self.fail,
                "dlscale_averaging_join": self.join,
                "dlscale_averaging_begin": self.begin,
                "dlscale_averaging_sync": self.sync,
                "dlscale_averaging_commit": self.commit,
                "dlscale_averaging_leave": self.leave,
            }
        )

    # -- the driver's calls --------------------------------------------------------------
    def open_session(
        self,
        session: str,
        plan: list[dict[str, list[int]]],
        worker_of: dict[str, str],
        stop_at: int | None = None,
        fit: str | None = None,
        client: str | None = None,
    ) -> None:
        """Start a session: its rounds, its trainers (by worker), the round it stops before (a checkpoint
        due then), the fit it is part of and the driver's ``client``. The driver, which hears of every
        settled round, writes the training page's rows."""
        s = AveragingSession(session, plan, worker_of, self.scheduler.workers, fit or session, client)
        s.stop_at = stop_at
        self.sessions[session] = s

    def close_session(self, session: str) -> list[int]:
        """End a session; returns the items of its rounds not committed, in order."""
        s = self.sessions.pop(session, None)
        return [] if s is None else s.left()

    def progress(self, session: str) -> dict[str, Any]:
        return self.sessions[session].progress()

    def stop(self, session: str) -> None:
        """End the session at the next round's end (a checkpoint is due, or a worker joined)."""
        s = self.sessions[session]
        at = s.unplanned()
        s.stop_at = at if s.stop_at is None else min(s.stop_at, at)

    def replan(self, session: str, per_trainer: int, per_epoch: int, owner: dict[int, str] | None = None) -> None:
        """Rounds of ``per_trainer`` minibatches a trainer from the first round not handed out on."""
        owner = None if owner is None else {int(i): w for i, w in owner.items()}
        self.sessions[session].replan(per_trainer, per_epoch, owner)

    def fail(self, session: str, trainer: str, error: str) -> None:
        s = self.sessions.get(session)
        if s is not None:
            s.fail(trainer, error)

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

    def _reply(self, session: str, call: Callable[[AveragingSession], dict[str, Any]]) -> dict[str, Any]:
        try:
            s = self.sessions.get(session)
            if s is None:
                raise SessionClosedError(f"session {session} is not open")
            return {"status": OK, **call(s)}
        except SessionStoppedError as e:
            return refusal(e)

    # -- the cluster's events ------------------------------------------------------------
    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        """Drop the trainers of ``worker``: their shares go to the others (see ``_rounds``)."""
        for s in self.sessions.values():
            for t in sorted(t for t, w in s.worker_of.items() if w == worker):
                if s.lose(t):
                    s.lost.append(t)
                    logger.warning(
                        "parameter averaging session %s lost worker %s (trainer %s); %d trainers go on",
                        s.name,
                        worker,
                        t,
                        len(s.alive),
                    )

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        """Tell the drivers of running sessions about a worker that joined: it trains from the next round."""
        for s in self.sessions.values():
            if not s.settled() and worker not in s.worker_of.values() and worker not in s.newcomers:
                s.newcomers.append(worker)

    def remove_client(self, scheduler: Scheduler, client: str, **kwargs: Any) -> None:
        """A driver gone ends its sessions: their trainers stop at their next call."""
        for name in [name for name, s in self.sessions.items() if s.client == client]:
            del self.sessions[name]
            logger.warning("parameter averaging session %s ended: its driver (client %s) disconnected", name, client)

    def valid_workers_downscaling(self, scheduler: Scheduler, workers: list[WorkerState]) -> list[WorkerState]:
        """Keep adaptive scaling from retiring a worker whose trainer is still training."""
        busy = {s.worker_of[t] for s in self.sessions.values() if not s.settled() for t in s.alive}
        return [w for w in workers if w.address not in busy]
