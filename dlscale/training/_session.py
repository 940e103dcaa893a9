"""A fit's session lifecycle, once for every master: the driver's :class:`SessionRun` and the trainer
task's envelope, :func:`run_trainer` (as ``distributed.shuffle``'s ``ShuffleRun`` holds a run's
lifecycle for every kind of shuffle).

A fit trains its work items (item ``e * n + i``: minibatch ``i`` in the fit's epoch ``e``, each epoch
in an order of the seed and the epoch alone) in one or more *segments*, each a session named
``<fit>-<segment>``: the driver opens it on the scheduler (``dlscale_<prefix>_open``) and on the
workers' plugins, submits one long-lived task a trainer, follows the scheduler's progress reports
until every trainer has returned, and closes it on both. A checkpoint due, or a worker that joined,
ends a segment early: the driver takes the trainers' state there and goes on with a new session on
the workers there are then. A trainer that fails stops the session (``dlscale_<prefix>_fail``) and
the fit raises its error; a lost worker's share goes to the others. When every trainer of the last
segment returned the state, they stay *parked* on their workers (``dlscale.training._parking``), and
the next fit of the same network, unchanged, goes on with them.

A master extends :class:`SessionRun` with only what varies: its trainers' placement and task, what
the scheduler and the workers are told as a session opens, what a progress report means (rounds
settled, minibatches acknowledged) and how the trainers' results become the network's state.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
from distributed import Future, get_client, secede, wait

from dlscale.data.loaders import KeptLoader
from dlscale.monitor import record
from dlscale.monitor.stats import EpochTally, tally_line
from dlscale.runtime.cluster import cluster_workers
from dlscale.runtime.extensions import Extension, install
from dlscale.runtime.profiling import profiler_paused
from dlscale.training._config import SessionConfig
from dlscale.training._driver import FitRun, workers
from dlscale.training._errors import SessionAbortedError, SessionClosedError, SessionStoppedError
from dlscale.training._parking import Warm
from dlscale.training._sources import HeldMinibatch, Minibatches

logger = logging.getLogger("dlscale.training")

Placement = dict[str, tuple[str, int]]  # a trainer's name: its worker and its index there


class SessionRun:
    """One ``fit`` of a master, in one or more segments (sessions); a master's subclass says what varies."""

    prefix: ClassVar[str]  # the master's name in handlers (``dlscale_<prefix>_<op>``) and sessions
    extension: ClassVar[Extension]  # its scheduler and worker plugins

    def __init__(self, master: Any, run: FitRun, batches: Minibatches) -> None:
        self.master, self.run, self.batches = master, run, batches
        self.client = run.client
        self.config = SessionConfig.from_dask()
        self.fit = f"dlscale-{self.prefix}-{uuid.uuid4().hex[:12]}"
        self.session = self.fit  # the session of the segment at hand: <fit>-<segment>
        self.n = len(batches.refs)
        self.left: collections.Counter[int] = collections.Counter()  # items not yet reported, by epoch of the fit
        self.planned: set[int] = set()  # the fit's work items
        self.fitted: collections.Counter[int] = collections.Counter()  # times each item was reported fitted
        self.abandoned: set[int] = set()  # items a lost trainer held, its work on them dropped or unreported
        self.lost_workers: set[str] = set()  # workers with trainers of this fit that were lost
        self.score = float("nan")  # the last loss reported
        self.trainers: Placement = {}
        self.warm: str | None = None  # the session of the last fit's trainers, when they go on in this one
        self.parked: dict[str, list[str]] = {}  # a session of this fit's (or the last's): the workers it parked on
        self.complete = False  # whether every trainer of the last segment returned the state (and parked)
        self.held: dict[str, Future] = {}
        if batches.holders is not None:  # minibatches in worker memory: published for the trainers, fetched by name
            self.held = dict(zip(batches.names, batches.refs))
            loader = HeldMinibatch(f"{self.fit}-minibatches", self.config.end_timeout)
            self.batches = dataclasses.replace(batches, refs=list(batches.names), loader=loader)

    # -- what a master says ------------------------------------------------------------------------

    def place(self, nodes: list[str]) -> Placement:
        """The trainers of a segment on ``nodes``: one a worker unless a master says otherwise."""
        return {w: (w, 0) for w in nodes}

    def begin(self, probe: bool, left: Warm | None) -> None:
        """Before the first segment: with ``probe``, the loss of the first minibatch on a trainer's replica
        (the parked one when :attr:`warm`, unless ``left`` shows it was trained on that minibatch)."""
        raise NotImplementedError

    def opened(self, order: list[int]) -> dict[str, Any]:
        """What the scheduler's ``open`` is told of a segment that trains ``order``, beyond the session,
        the fit, the client and the trainers' workers."""
        raise NotImplementedError

    def node_args(self) -> tuple[Any, ...]:
        """What a worker's plugin is told as a session opens there, after its name."""
        return ()

    def submit(self, trainer: str, worker: str, local: int, k: int) -> Future:
        """The task of trainer ``trainer``, the ``k``-th of the segment, ``local``-th on ``worker``."""
        raise NotImplementedError

    def segment_length(self, order: list[int]) -> int:
        """How many of the work items ``order`` the next segment trains: all of them unless a master
        ends its segments where checkpoints fall."""
        return len(order)

    def follow_every(self) -> float:
        """Seconds between two progress reports."""
        return self.config.poll_interval * 10

    def progressed(self, progress: dict[str, Any], pending: bool) -> list[Any]:
        """A progress report taken in: reports to the run, the segment stopped early where due; returns
        the checkpoint listeners due at the segment's end so far (``pending``: trainers still at work)."""
        raise NotImplementedError

    def receipt(self) -> str | None:
        """What the fit's closing line adds: a master's choices, if it made any."""
        return None

    def conclude(self, futures: dict[str, Future], closed: Any, seconds: float) -> list[int]:
        """The segment's end: the trainers' state onto the driver's network, :attr:`complete` set, the
        work items left returned (``closed``: the scheduler's reply to ``close``)."""
        raise NotImplementedError

    def resend(self) -> None:
        """Before a segment after the first: the driver's network as it is now goes to the workers."""
        self.run.reship()

    def end(self) -> None:
        """After the fit, whatever its outcome."""

    # -- the order of work ---------------------------------------------------------------------------

    def order(self, start: int = 0) -> list[int]:
        """Work items epoch after epoch from the fit's epoch ``start``."""
        n, seed, first = self.n, self.run.seed, self.run.first_epoch
        return [
            e * n + int(i)
            for e in range(start, self.run.epochs)
            for i in np.random.default_rng([seed, first + e]).permutation(n)
        ]

    def remaining(self) -> list[int]:
        """The work items of the fit: all of them, or those a resumed checkpoint's position left (for this
        fit's epochs, which may be more or fewer than those of the fit that wrote it)."""
        resume = self.run.resume
        if resume is None:
            return self.order()
        if resume.remaining is not None:
            return [i for i in resume.remaining if i // self.n < self.run.epochs] + self.order(resume.epochs)
        return self.order(resume.epoch)

    def reported(self, items: list[int], score: float) -> None:
        """Work items ``items`` reported fitted (with mean loss ``score``), as the trainers tell them."""
        for item in items:
            self.left[item // self.n] -= 1
            self.fitted[item] += 1
        self.score = score

    def tally(self) -> list[EpochTally]:
        """Exactly once, per epoch of the fit, from what was reported fitted (:class:`EpochTally`), in one
        pass over the reports (a long fit reports hundreds of thousands of items)."""
        planned = collections.Counter(item // self.n for item in self.planned)
        fitted, redone, duplicated = collections.Counter(), collections.Counter(), collections.Counter()
        for item, times in self.fitted.items():
            epoch = item // self.n
            if item not in self.planned:  # reported, never planned: counted with what was fitted twice
                duplicated[epoch] += 1
                continue
            fitted[epoch] += 1
            redone[epoch] += item in self.abandoned
            duplicated[epoch] += times > 1
        return [
            EpochTally(
                self.run.first_epoch + e,
                planned[e],
                fitted[e] - redone[e],
                redone[e],
                planned[e] - fitted[e],
                duplicated[e],
            )
            for e in sorted(planned)
        ]

    def epochs_done(self) -> int:
        """The fit's epochs whose every work item is reported, counted from its first."""
        return next((e for e in range(self.run.epochs) if self.left[e] > 0), self.run.epochs)

    # -- the lifecycle ---------------------------------------------------------------------------------

    def train(self, probe: bool) -> None:
        """The whole fit: its segments, the checkpoints between them, and its trainers parked at the end."""
        run, client = self.run, self.client
        install(client, self.extension)
        self.trainers = self.place(run.workers)
        left = self.master._warm  # what the last fit left, taken back or forgotten here
        self.warm = self._take_parked()
        self.begin(probe, left)
        run.show_progress(fit=self.fit)
        remaining = self.remaining()
        self.left.update(item // self.n for item in remaining)
        self.planned = set(remaining)
        started, kept = time.perf_counter(), False
        try:
            if self.held:
                client.publish_dataset(**{self.batches.loader.dataset: self.held})
            segment = 0
            while remaining:
                if segment:  # the fit goes on from a segment's end
                    self._go_on()
                self.session = f"{self.fit}-{segment}"
                remaining, due = self._segment(remaining)
                self.write_checkpoint(due, remaining)
                segment += 1
            self._close(time.perf_counter() - started)
            if self.complete and self.config.keep_trainers:  # every trainer parked: the next fit goes on with them
                first = (self.batches.refs[0], self.batches.loader) if run.resume is None else None
                trainers = tuple(sorted(self.trainers.items()))
                self.master._warm = Warm.left(self.session, run.network, repr(self.master), trainers, first)
                kept = True
        except Exception as e:
            gone = sorted(set(run.workers) - set(cluster_workers(client)))
            if gone:
                e.add_note(f"worker(s) {', '.join(gone)} left the cluster during the fit")
            raise
        finally:
            self._forget(keep=self.session if kept else None)
            self.end()
            if self.held:
                client.unpublish_dataset(self.batches.loader.dataset)

    def write_checkpoint(self, due: list[Any], remaining: list[int], state: dict[str, Any] | None = None) -> None:
        """Write the checkpoints ``due`` with the work items ``remaining`` (in order) left to train: the
        driver's network as the last segment left it, or ``state`` (see ``FitRun.write_checkpoint``)."""
        epoch = min(remaining) // self.n if remaining else self.run.epochs
        self.run.write_checkpoint(due, self.run.position(epoch, remaining=tuple(remaining)), state)

    def _close(self, seconds: float) -> None:
        """The fit's closing line (its minibatches, seconds and trainers, all its segments; the receipt of
        what the master chose), and its exactly-once tally: into its statistics, a line when a worker
        was lost or anything was redone or lost, and the run's record (:mod:`dlscale.monitor.record`)."""
        receipt = self.run.receipt = self.receipt()
        logger.info(
            "%s: %d minibatches in %.2f s on %d trainers%s",
            self.master.approach,
            sum(self.fitted.values()),
            seconds,
            len(self.trainers),
            f"; {receipt}" if receipt else "",
        )
        tallies = self.tally()
        if self.run.stats is not None:
            self.run.stats.exactly_once.extend(tallies)
        fields = ("planned", "once", "redone", "lost", "duplicated")
        self.run.exactly_once = {f: sum(getattr(t, f) for t in tallies) for f in fields}
        self.run.exactly_once["workers_lost"] = len(self.lost_workers)
        wrong = any(t.lost or t.duplicated for t in tallies)
        if wrong or self.lost_workers or any(t.redone for t in tallies):
            line = tally_line(tallies, len(self.lost_workers))
            logger.log(logging.WARNING if wrong else logging.INFO, "%s: %s", self.master.approach, line)
        record.append(
            "fit",
            approach=self.master.approach,
            seconds=seconds,
            workers_lost=sorted(self.lost_workers),
            score=self.score if math.isfinite(self.score) else None,
            epochs=[dataclasses.asdict(t) for t in tallies],
        )

    def nodes(self) -> list[str]:
        """The workers with trainers."""
        return sorted({w for w, _ in self.trainers.values()})

    def call(self, op: str, **kwargs: Any) -> Any:
        """The scheduler's ``dlscale_<prefix>_<op>`` for the session at hand."""
        handler = getattr(self.client.scheduler, f"dlscale_{self.prefix}_{op}")
        return self.client.sync(handler, session=self.session, **kwargs)

    def _segment(self, order: list[int]) -> tuple[list[int], list[Any]]:
        """Train the work items ``order`` in one session until they are done or the segment ends early;
        returns the items left and the checkpoint listeners due."""
        client, nodes, name = self.client, self.nodes(), self.extension.name
        t0 = time.perf_counter()
        later = order[self.segment_length(order) :]
        order = order[: len(order) - len(later)]
        worker_of = {t: w for t, (w, _) in self.trainers.items()}
        self.call("open", worker_of=worker_of, fit=self.run.fit_id, client=client.id, **self.opened(order))
        try:
            opened = client.run(_open_node, name, self.session, *self.node_args(), workers=nodes, on_error="return")
            alive = set(cluster_workers(client))
            failed = [e for w, e in opened.items() if isinstance(e, Exception) and w in alive]
            if failed:  # a worker lost meanwhile is the scheduler's to tell: its trainers are lost
                raise failed[0]
            self.parked[self.session] = nodes
            futures = {t: self.submit(t, w, i, k) for k, (t, (w, i)) in enumerate(self.trainers.items())}
            due = self._follow(futures)
        finally:
            closed = self.call("close")
            alive = set(cluster_workers(client))  # a lost worker would take a timeout
            client.run(_close_node, name, self.session, workers=[w for w in nodes if w in alive], on_error="ignore")
        return [*self.conclude(futures, closed, time.perf_counter() - t0), *later], due

    def _follow(self, futures: dict[str, Future]) -> list[Any]:
        """Follow the session until every trainer has returned; a trainer's error (or the failure the
        scheduler was told of) stops the others and is raised here."""
        pending = set(futures.values())
        while True:
            with contextlib.suppress(TimeoutError):
                wait(pending, timeout=self.follow_every(), return_when="FIRST_COMPLETED")
            pending = {f for f in pending if not f.done()}
            self.run.pauses.check()
            progress = self.call("progress")
            self.abandoned.update(progress["abandoned"])
            self.lost_workers.update(self.trainers[t][0] for t in progress["lost"] if t in self.trainers)
            due = self.progressed(progress, bool(pending))
            failed = [f for f in futures.values() if f.status == "error" and not lost_worker(f)]
            if progress["failed"] and not failed:
                # the trainer that failed tells the scheduler just before its task ends with the error itself
                culprit = futures.get(progress.get("failed_by"))
                with contextlib.suppress(TimeoutError):
                    wait([culprit] if culprit is not None else list(pending), timeout=self.config.end_timeout)
                failed = [f for f in futures.values() if f.status == "error" and not lost_worker(f)]
            if failed or progress["failed"]:
                self._abort(futures)
                if failed:
                    raise failed[0].exception().with_traceback(failed[0].traceback())
                raise RuntimeError(f"{self.master.approach} stopped: {progress['failed']}")
            if not pending:
                return due

    def _abort(self, futures: dict[str, Future]) -> None:
        """Stop every trainer (they stop at their next call to the scheduler) and wait for them."""
        with contextlib.suppress(Exception):
            self.call("fail", trainer="driver", error="stopped by the driver")
        with contextlib.suppress(TimeoutError):
            wait(list(futures.values()), timeout=self.config.end_timeout)
        self.client.cancel([f for f in futures.values() if not f.done()])

    # -- parking ---------------------------------------------------------------------------------------

    def _take_parked(self) -> str | None:
        """The session whose trainers, parked by the last fit, go on in this one: the network and the
        master are as that fit left them, and every trainer is where it was, its replica there.
        Otherwise ``None``, and the parked trainers are forgotten."""
        warm, self.master._warm = self.master._warm, None
        if warm is None:
            return None
        self.parked[warm.session] = sorted({w for _, (w, _) in warm.trainers})
        usable = (
            self.run.resume is None
            and self.run.parked_network
            and warm.trainers == tuple(sorted(self.trainers.items()))
            and self._held(warm.session)
        )
        if not usable:
            self._forget(keep=None)
            return None
        return warm.session

    def _go_on(self) -> None:
        """Before a segment after the first: its trainers go on with the replicas the last segment's
        parked, if every one of them returned the state now on the driver's network (a checkpoint is
        written from a copy) and they are where the new segment would place them; otherwise the
        driver's network goes to the workers there now (a worker joined, one was lost)."""
        trainers = self.place(workers(self.client))
        if self.complete and self.config.keep_trainers and trainers == self.trainers and self._held(self.session):
            self._forget(keep=self.session)
            self.warm = self.session
            return
        self._forget(keep=None)
        self.resend()
        self.warm = None
        self.trainers = trainers

    def _held(self, session: str) -> bool:
        """Whether the workers of :attr:`trainers` are alive and hold the replicas ``session`` parked for
        them (a worker restarted holds none)."""
        nodes = self.nodes()
        if not set(cluster_workers(self.client)).issuperset(nodes):
            return False
        held = self.client.run(_parked_here, self.extension.name, session, workers=nodes)
        return all(held[w] == sorted(i for v, i in self.trainers.values() if v == w) for w in nodes)

    def _forget(self, keep: str | None) -> None:
        """Drop what the sessions of this fit (and the last fit's) parked on their workers, but ``keep``'s."""
        dropped = {session: nodes for session, nodes in self.parked.items() if session != keep}
        with contextlib.suppress(Exception):  # after a failure, the failure matters, not this
            alive = set(cluster_workers(self.client))
            for session, nodes in dropped.items():
                on = [w for w in nodes if w in alive]
                self.client.run(_forget_parked, self.extension.name, session, workers=on, on_error="ignore")
        for session in dropped:
            del self.parked[session]


def lost_worker(future: Future) -> bool:
    """Whether ``future`` failed because its worker died rather than through its own error."""
    from distributed.scheduler import KilledWorker

    return isinstance(future.exception(), KilledWorker)


# -- calls on the workers' plugins (by the extension's name) -------------------------------------------


def _open_node(name: str, session: str, *args: Any, dask_worker: Any = None) -> None:
    dask_worker.plugins[name].open(session, *args)


def _close_node(name: str, session: str, dask_worker: Any = None) -> None:
    dask_worker.plugins[name].close(session)


def _parked_here(name: str, session: str, dask_worker: Any = None) -> list[int]:
    return dask_worker.plugins[name].parked_trainers(session)


def _forget_parked(name: str, session: str, dask_worker: Any = None) -> None:
    dask_worker.plugins[name].forget(session)


# -- the trainer task's envelope -----------------------------------------------------------------------


def run_trainer(
    worker: Any,
    plugin: Any,
    session: str,
    trainer: str,
    join: Callable[[], Any],
    fail: Callable[[str], Any],
    loader: Callable[[Any], Any],
    keep_loaded: float,
    train: Callable[[Any, Callable[[Any], Any]], dict[str, Any]],
    approach: str,
) -> dict[str, Any]:
    """A trainer's task around ``train(joined, loader)``: it joins its session (``join``'s reply is
    ``joined``), leaves its worker's task slot, and returns what ``train`` returns, or
    ``{"lost": True}`` for a trainer no longer a member (its worker was lost: the task then runs again
    elsewhere and stops at once) and ``{"aborted": True}`` for one stopped by another's failure. Its
    own error tells the scheduler (``fail``), so that the others stop, and is raised."""
    try:
        joined = join()
    except SessionStoppedError as e:
        return _stopped(trainer, e)
    if isinstance(loader, HeldMinibatch):
        loader = loader.bind(get_client())
    secede()  # a trainer runs for the whole fit: it should not hold one of the worker's task slots
    try:
        with profiler_paused(worker), KeptLoader(loader, keep_loaded) as kept:
            return train(joined, kept)
    except SessionClosedError as e:  # the session ended under it: its driver is gone
        plugin.close(session)
        return _stopped(trainer, e)
    except SessionStoppedError as e:
        return _stopped(trainer, e)
    except BaseException as e:
        with contextlib.suppress(Exception):  # the original error matters, not this one
            fail(f"{type(e).__name__}: {e}")
        e.add_note(f"in {approach} trainer {trainer} on worker {worker.address}")
        raise


def _stopped(trainer: str, error: SessionStoppedError) -> dict[str, Any]:
    aborted = isinstance(error, SessionAbortedError)
    return {"trainer": trainer, "lost": not aborted, "aborted": aborted}
