"""The control plane of gradient sharing, on the scheduler: which trainers are alive, which
minibatches are left, and when a fit has ended.

Trainers pull minibatches a few at a time and acknowledge them when fitted, so a trainer that is
lost (its worker removed) leaves its unacknowledged minibatches to the others. The membership has a
version that grows with every loss; trainers read it with every call and route their updates
around the lost nodes. Updates themselves never pass through the scheduler.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from dlscale.monitor import panel

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler, WorkerState

logger = logging.getLogger("dlscale.training.sharing")

NAME = "dlscale-sharing"


@dataclass
class _Session:
    worker_of: dict[str, str]  # trainer -> worker address
    pending: collections.deque[int]  # work items not yet handed out, in order
    alive: set[str]
    assigned: dict[str, set[int]] = field(default_factory=dict)
    joined: set[str] = field(default_factory=set)
    finished: dict[str, int] = field(default_factory=dict)  # trainer -> messages it sent
    reports: list[tuple[int, int, float]] = field(default_factory=list)  # (item, examples, score) for the driver
    lost: list[str] = field(default_factory=list)  # trainers lost, in order
    failed: str | None = None
    version: int = 0

    def nodes(self) -> list[str]:
        return sorted({self.worker_of[t] for t in self.alive})

    def state(self) -> str:
        if self.failed is not None:
            return "abort"
        if self.pending or any(self.assigned.get(t) for t in self.alive):
            return "run"
        return "end"

    def view(self) -> dict[str, Any]:
        return {
            "state": self.state(),
            "version": self.version,
            "nodes": self.nodes(),
            "alive": sorted(self.alive),
            "finished": {t: n for t, n in self.finished.items() if t in self.alive},
        }


class SharingSchedulerPlugin(SchedulerPlugin):
    """Installs the ``dlscale_sharing_*`` handlers on the scheduler and keeps every session's state."""

    name = NAME
    idempotent = True

    def __init__(self) -> None:
        self.sessions: dict[str, _Session] = {}

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
                "dlscale_sharing_fail": self.fail,
                "dlscale_sharing_progress": self.progress,
            }
        )

    # -- the driver's calls --------------------------------------------------------------
    def open_session(self, session: str, worker_of: dict[str, str], order: list[int]) -> None:
        """Start a session: its trainers (by the worker each is placed on) and its work items in order."""
        alive = {t for t, w in worker_of.items() if w in self._workers}
        self.sessions[session] = _Session(
            dict(worker_of), collections.deque(order), alive, {t: set() for t in worker_of}
        )
        self.sessions[session].lost.extend(sorted(set(worker_of) - alive))
        live = panel.in_scheduler(self.scheduler)
        if live is not None:  # every trainer gets its row before its first report
            live.record(
                session,
                [
                    {"row": t, "worker": w, "minibatches": 0, "examples": 0, "loss": float("nan")}
                    for t, w in sorted(worker_of.items())
                ],
            )

    def close_session(self, session: str) -> None:
        self.sessions.pop(session, None)

    def progress(self, session: str) -> dict[str, Any]:
        """The acknowledgements since the last call, the trainers lost so far and the session's view."""
        s = self.sessions[session]
        reports, s.reports = s.reports, []
        return {"reports": reports, "lost": list(s.lost), "failed": s.failed, **s.view()}

    # -- the trainers' calls -------------------------------------------------------------
    def join(self, session: str, trainer: str) -> dict[str, Any]:
        """A trainer starting; ``ok`` is False for one lost before it started or started a second time
        (its task rerun elsewhere after its worker was lost)."""
        s = self.sessions.get(session)
        ok = s is not None and trainer in s.alive and trainer not in s.joined
        if ok:
            s.joined.add(trainer)
        return {"ok": ok, **(s.view() if s is not None else {})}

    def next(self, session: str, trainer: str, acks: list[list[Any]], want: int) -> dict[str, Any]:
        """Acknowledge fitted items (``[item, examples, score, threshold, sparsity, bytes sent]``)
        and hand out up to ``want`` more."""
        s = self.sessions.get(session)
        if s is None or trainer not in s.alive:
            return {"state": "lost", "items": []}
        mine = s.assigned[trainer]
        fresh = [ack for ack in acks if ack[0] in mine]
        for item, examples, score, *_ in fresh:
            mine.discard(item)
            s.reports.append((item, examples, score))
        if fresh:
            self._to_panel(session, s.worker_of[trainer], trainer, fresh)
        items = []
        if s.failed is None:
            while s.pending and len(items) < want:
                items.append(s.pending.popleft())
        mine.update(items)
        return {"items": items, **s.view()}

    def _to_panel(self, session: str, worker: str, trainer: str, acks: list[list[Any]]) -> None:
        live = panel.in_scheduler(self.scheduler)
        if live is None:
            return
        examples = sum(a[1] for a in acks)
        loss = sum(a[1] * a[2] for a in acks) / examples if examples else float("nan")
        live.record(
            session,
            [
                {
                    "row": trainer,
                    "worker": worker,
                    "minibatches": len(acks),
                    "examples": examples,
                    "loss": loss,
                    "threshold": acks[-1][3],
                    "sparsity": acks[-1][4],
                    "bytes_sent": sum(a[5] for a in acks),
                }
            ],
        )

    def finish(self, session: str, trainer: str, sent: int) -> dict[str, Any]:
        """A trainer done with its minibatches, having sent ``sent`` updates."""
        s = self.sessions.get(session)
        if s is None or trainer not in s.alive:
            return {"state": "lost"}
        s.finished[trainer] = sent
        return s.view()

    def status(self, session: str, trainer: str | None = None) -> dict[str, Any]:
        s = self.sessions.get(session)
        if s is None or (trainer is not None and trainer not in s.alive):
            return {"state": "lost"}
        return s.view()

    def fail(self, session: str, trainer: str, error: str) -> None:
        """A trainer raised: every other trainer stops at its next call."""
        s = self.sessions.get(session)
        if s is not None and s.failed is None:
            s.failed = f"{trainer}: {error}"

    # -- the cluster's events ------------------------------------------------------------
    @property
    def _workers(self) -> set[str]:
        return set(self.scheduler.workers)

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        """Drop the trainers of ``worker`` and hand their unacknowledged minibatches to the others."""
        for sid, s in self.sessions.items():
            gone = sorted(t for t in s.alive if s.worker_of[t] == worker)
            if not gone:
                continue
            for t in gone:
                s.alive.discard(t)
                s.pending.extendleft(sorted(s.assigned.pop(t, set()), reverse=True))
                s.lost.append(t)
            s.version += 1
            logger.warning(
                "gradient sharing session %s lost worker %s (trainers %s); %d trainers go on",
                sid,
                worker,
                ", ".join(gone),
                len(s.alive),
            )

    def valid_workers_downscaling(self, scheduler: Scheduler, workers: list[WorkerState]) -> list[WorkerState]:
        """Keep adaptive scaling from retiring a worker whose trainers are still training."""
        busy = {s.worker_of[t] for s in self.sessions.values() if s.state() == "run" for t in s.alive}
        return [w for w in workers if w.address not in busy]
