"""Synchronous parameter averaging (DL4J's ``ParameterAveragingTrainingMaster``): local SGD, with DiLoCo's
outer step as an option.

Training runs in rounds on resident trainers, one per worker, that stay for the whole fit: in each round
every trainer fits ``averaging_frequency`` minibatches on its own replica, then the trainers average
their states (parameters, buffers and, with ``save_updater``, the optimizer's state) weighted by
examples, peer to peer (an allreduce over Dask's comms, ``_exchange``), never through the scheduler or
the driver. The driver plans the rounds, opens a session on the scheduler (``_scheduler_plugin``) and
follows the settled rounds' reports; at the end it takes the trainers' common state, and the trainers
park their replicas for the next fit of the network (``dlscale.training._parking``): a loop of one
``fit`` per epoch sends the network once. A lost trainer's
share goes to the others and the round completes with the survivors' states; a checkpoint due, or a
worker that joined, ends a *segment* at a round's end: the driver takes the state there and goes on
with a new session on the workers there are.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch
from distributed import Future, get_worker

from dlscale.data.loaders import keep_loaded, prefetch
from dlscale.errors import TrainerLostWarning
from dlscale.monitor.stats import RoundStats, WorkerRound
from dlscale.runtime.cluster import cluster_workers
from dlscale.runtime.retirement import retired
from dlscale.runtime.tasks import check_count
from dlscale.training import _sources
from dlscale.training._config import setting
from dlscale.training._driver import FitRun
from dlscale.training._errors import TrainingConfigError
from dlscale.training._parking import Arrival, Warm
from dlscale.training._session import Placement, SessionRun
from dlscale.training.averaging import _choice, _trainer
from dlscale.training.averaging._exchange import DTYPES
from dlscale.training.averaging._extension import AVERAGING
from dlscale.training.averaging._rounds import plan_rounds
from dlscale.training.averaging._worker_plugin import plugin
from dlscale.training.master import TrainingMaster

logger = logging.getLogger("dlscale.training.averaging")

REPARTITION = ("always", "never", "num_partitions_workers_differs")


@dataclasses.dataclass
class ParameterAveragingTrainingMaster(TrainingMaster):
    """Synchronous data-parallel training by periodic parameter averaging (local SGD).

    Each worker's trainer fits ``averaging_frequency`` minibatches per round, reading
    ``worker_prefetch_num_batches`` ahead; then the trainers average their states, weighted by examples
    (with the optimizer's state when ``save_updater``; without, the optimizer starts afresh every
    round). Without an ``averaging_frequency`` (the default) the fit chooses it: the longest rounds
    that ``dlscale.training.averaging.frequency-bounds`` (the quality guard) allow, at most once an
    epoch and about even, since in the cost model of a round
    (:mod:`~dlscale.training.averaging._choice`) longer rounds are never slower; its first averaged
    round measures a step, a round and its averaging, from which the model predicts the fit's
    speedup (the next fit of the same master predicts from the last fit's measures, and trains on one
    worker alone where they predict its trainers slower than one). The choice, why, and its predicted
    and measured speedups are the fit's closing line and ``TrainingStats.choice``.
    ``averaging_frequency=5`` is DL4J's default. ``streaming=True`` overlaps
    each round's averaging with the next round's steps (Streaming DiLoCo, arXiv 2501.18512): a trainer
    fits round ``k + 1`` from its own state while round ``k``'s averaging is in flight, and takes round
    ``k``'s average, keeping the progress made since, as soon as it is whole (after half of round
    ``k + 1`` at the latest), so a round costs its steps and not its communication; the last round's
    average is taken whole, every trainer ends with the same state. Without ``streaming`` (the
    default) rounds stream when their frequency, given or chosen, is at least the bounds' lower end
    (an average taken half a round late costs little in rounds that long; in short ones it cost a
    point, and a chosen frequency is that short only where a trainer's share of an epoch is), and,
    once a fit of the master has measured what streaming costs, only where the cost model predicts
    it faster than waiting for the averaging (:func:`~dlscale.training.averaging._choice.streams`).
    ``outer_optimizer`` (DiLoCo, arXiv 2311.08105) is a factory of a torch optimizer, such as
    ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)``, stepped once a round
    with the averaged change of the parameters, negated, as their gradient; ``None`` (the default) moves
    them by the averaged change: plain averaging, DL4J's semantics. ``exchange_dtype`` ("float32",
    "float16", "bfloat16", "int8": blocks of 1,024 values scaled by their largest magnitude) is the
    precision the states' parts travel in. ``repartition`` applies to
    ``rdd_training_approach="direct"``: "never" trains every minibatch on the worker that holds it,
    "always" spreads the minibatches evenly over the workers, and "num_partitions_workers_differs" does
    the latter only when the RDD does not have exactly one partition per worker. Exported files are
    read by whichever worker trains them; :meth:`delete_temp_files` removes them. The settings every
    master has are described on :class:`~dlscale.training.master.TrainingMaster`.
    """

    approach: ClassVar[str] = "parameter averaging"

    averaging_frequency: int | None = None
    worker_prefetch_num_batches: int = 2
    save_updater: bool = True
    repartition: str = "always"
    outer_optimizer: Callable[..., torch.optim.Optimizer] | None = None
    exchange_dtype: str = "float32"
    streaming: bool | None = None
    _measures: _choice.Measures | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.averaging_frequency is not None:
            check_count("averaging_frequency", self.averaging_frequency)
        check_count("worker_prefetch_num_batches", self.worker_prefetch_num_batches, 0)
        if self.repartition not in REPARTITION:
            raise ValueError(f"repartition must be one of {REPARTITION}, got {self.repartition!r}")
        if self.streaming is not None and not isinstance(self.streaming, bool):
            raise TypeError(f"streaming must be True, False or None (chosen), got {self.streaming!r}")
        if self.exchange_dtype not in DTYPES:
            raise ValueError(f"exchange_dtype must be one of {tuple(DTYPES)}, got {self.exchange_dtype!r}")
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise TypeError(
                "outer_optimizer must be a factory of a torch optimizer given the parameters, such as "
                f"functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True), got {self.outer_optimizer!r}"
            )

    def _check_settings(self) -> None:
        super()._check_settings()
        if self.averaging_frequency is None:
            frequency_bounds()

    def _train(
        self, run: FitRun, batches: _sources.Minibatches, *, partitions: int | None = None, probe: bool = False
    ) -> None:
        local = partitions is not None and (
            self.repartition == "never"
            or (self.repartition == "num_partitions_workers_differs" and partitions == len(run.workers))
        )
        _Averaging(self, run, batches, local).train(probe)


def frequency_bounds() -> tuple[int, int]:
    """``dlscale.training.averaging.frequency-bounds``: the frequencies a fit may choose from."""
    bounds = setting("training.averaging.frequency-bounds")
    if (
        not isinstance(bounds, (list, tuple))
        or len(bounds) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in bounds)
        or bounds[0] > bounds[1]
    ):
        raise TrainingConfigError(
            f"dlscale.training.averaging.frequency-bounds must be two positive integers, low then high, got {bounds!r}"
        )
    return bounds[0], bounds[1]


def _probe_parked(session: str, ref: Any, loader: Any) -> None:
    """Load one minibatch and compute the loss on it with the replica parked here (what
    ``_worker.probe`` does with a network sent)."""
    network = plugin(get_worker()).parked[session]
    network.score(next(prefetch([ref], loader, 0)))


def _take_snapshot(session: str, round: int, dask_worker: Any = None) -> dict[str, Any] | None:
    """Round ``round``'s averaged state, which this worker's trainer kept aside for a checkpoint, taken
    away with any older one."""
    return plugin(dask_worker).take_snapshot(session, round)


async def _drop_snapshot(session: str, round: int, dask_worker: Any = None) -> None:
    """Drop round ``round``'s kept average (with any older) on this worker once another worker's was
    taken: a coroutine, since Dask's ``run`` goes on without waiting only for those."""
    plugin(dask_worker).take_snapshot(session, round)


def _stepping(member: dict[str, Any]) -> float:
    """The seconds a round's member spent in its steps: fitting, neither reading minibatches (the
    first epoch's, before they are kept loaded) nor taking an average."""
    return max(0.0, member["fit_seconds"] - member["averaging_seconds"] - member["wait_seconds"])


def _holds_state(result: dict[str, Any]) -> bool:
    """Whether a trainer's result holds the session's state (told on its worker, not fetched)."""
    return "params" in result


class _Averaging(SessionRun):
    """One ``fit``'s rounds, in one or more segments (sessions)."""

    prefix = "averaging"
    extension = AVERAGING

    def __init__(
        self, master: ParameterAveragingTrainingMaster, run: FitRun, batches: _sources.Minibatches, local: bool
    ) -> None:
        super().__init__(master, run, batches)
        self.owner = dict(enumerate(batches.holders)) if local and batches.holders else None
        self.seen, self.lost = set(run.workers), set()
        self.rounds_done: collections.Counter[int] = collections.Counter()  # rounds reported, by epoch of the fit
        self._fitted = 0  # minibatches reported in the current segment
        self.bounds = frequency_bounds()
        given = master.averaging_frequency
        self.frequency: int = given or _choice.choose(math.ceil(self.n / max(1, len(run.workers))), self.bounds)
        # the last fit's measures, what this fit's choices are predicted from (a lone trainer averages nothing)
        last = master._measures if len(run.workers) > 1 else None
        self.streaming = master.streaming
        if self.streaming is None:  # rounds long enough that an average taken half a round late costs little
            self.streaming = self.frequency >= self.bounds[0]
            if self.streaming and last is not None:
                self.streaming = _choice.streams(last, self.frequency)
        self.choice: _choice.Choice | None = None  # the receipt of a chosen frequency
        # predicted from this fit's first rounds (a lone trainer never averages: nothing to predict)
        self.measuring = given is None and master._measures is None and len(run.workers) > 1
        # over every trainer's rounds: seconds stepping and minibatches fitted; of them, with the last
        # round's averaging in flight (streaming), and the trainers' rounds that had such steps
        self.steps = [0.0, 0]
        self.late = [0.0, 0, 0]
        self.timed: list[tuple[float, int, float]] = []  # rounds after a segment's first: seconds, frequency, averaging
        self.first_start: float | None = None  # when the fit's first round began (time.time())
        self.state_bytes = master._measures.state_bytes if master._measures is not None else 0
        self.alone = False  # one trainer, where the last fit's measures predict more of them slower
        if given is None and last is not None:  # predicted at once
            self._predict(last, "the last fit")
            if _choice.alone_faster(self.choice.measures, self.frequency, self.streaming, self.n * run.epochs):
                self.alone, self.seen = True, set(run.workers[:1])  # the other workers are not lost: unused
                self.choice.alone, self.choice.predicted = self.choice.predicted, 1.0
        self.spec = _trainer.TrainerSpec(
            master.save_updater,
            master.worker_prefetch_num_batches,
            master.outer_optimizer,
            master.exchange_dtype,
            self.config.poll_interval * 10,
            self.config.end_timeout,
            self.config.keep_trainers,
            keep_loaded(),
            self.streaming,
        )

    def place(self, nodes: list[str]) -> Placement:
        """A trainer a worker; one in all (on the first) where the fit chose to train :attr:`alone`."""
        return super().place(nodes[:1] if self.alone else nodes)

    def begin(self, probe: bool, left: Warm | None) -> None:
        b = self.batches
        if probe and self.warm is None:
            self.run.probe()
        elif probe and not left.trained_on(b.refs[0], b.loader):
            probed = self.client.submit(
                _probe_parked, self.warm, b.refs[0], b.loader, workers=self.nodes()[:1], pure=False
            )
            self.run.pauses.result(probed)

    def opened(self, order: list[int]) -> dict[str, Any]:
        nodes = self.nodes()
        self._note_lost(nodes)
        plan = plan_rounds(order, nodes, self.frequency, self.n, self.owner)
        self.due: list[Any] = []
        self.stopped = False
        self._fitted = 0
        self.segment_order = order  # the work items of the segment, in order
        self.last = time.time()  # the end of the round before the next one reported, by the members' clocks
        # checkpoints at an epoch's end are written from the average its last round's trainers keep aside,
        # while they go on (a lone trainer averages nothing: its segment ends there)
        run = self.run
        epochs = range(run.epochs) if len(nodes) > 1 else ()
        kept = [e for e in epochs if any(c.wants_epoch_end(run.first_epoch + e + 1) for c in run.checkpointers)]
        return {"plan": plan, "stop_at": self._stop_before(plan, kept), "snapshot_epochs": kept, "per_epoch": self.n}

    def submit(self, trainer: str, worker: str, local: int, k: int) -> Future:
        """The trainer on ``worker``: on the network sent, or (:attr:`warm`) on the replica parked there."""
        b, warm = self.batches, self.warm
        blob, key = (self.run.blob, self.run.replicas[0]) if warm is None else (None, None)
        spec = dataclasses.replace(self.spec, warm=warm)
        return self.client.submit(
            _trainer.run,
            self.session,
            trainer,
            key,
            blob,
            b.refs,
            b.names,
            b.loader,
            spec,
            workers=[worker],
            allow_other_workers=True,
            pure=False,
            key=f"{self.session}-trainer-{k}",
        )

    def follow_every(self) -> float:
        return self.config.poll_interval * 5

    def progressed(self, progress: dict[str, Any], pending: bool) -> list[Any]:
        """Report the settled rounds, and stop the session at a round's end when a checkpoint by time is
        due or a worker joined; the listeners due are kept until the segment ends."""
        run = self.run
        for report in progress["reports"]:
            end = max((m["end"] for m in report["members"]), default=self.last)
            seconds = max(0.0, end - self.last)
            self._time(report["members"], seconds)
            done_before = self.epochs_done()
            self._report(report["members"], seconds, end)
            if self.measuring and not self.stopped:  # from the round's end, its items fitted
                self._measure(report, seconds, end)
            self.last = max(self.last, end)
            done_after = self.epochs_done()
            # an epoch's end seen in this batch of reports stays due
            ended = done_after if done_after > done_before else None
            due = [c for c in run.checkpoints_due(ended) if c not in self.due]
            if due and (self.stopped or not self._write_snapshot(report, due)):
                self.due += due
        run.send_rounds()
        if progress["lost"]:
            self._note_lost(list(cluster_workers(self.client)))
        if not self.stopped and pending and (self.due or progress["newcomers"]):
            self.call("stop")
            self.stopped = True
        return self.due

    def conclude(self, futures: dict[str, Future], closed: Any, seconds: float) -> list[int]:
        """The trainers' common state on its way to the driver's network (``_parking.Arrival``: fetched in
        the background from the trainers that ended with it, taken when the network is read; one that
        left, was stopped or was lost returns a few fields, told apart on its worker); the segment is
        complete when every trainer finished (and so parked its replica)."""
        finished = {t: f for t, f in futures.items() if f.status == "finished"}
        told = self.client.gather(
            [
                self.client.submit(_holds_state, f, workers=[self.trainers[t][0]], allow_other_workers=True, pure=False)
                for t, f in finished.items()
            ]
        )
        holding = [f for f, held in zip(finished.values(), told, strict=True) if held]
        if not holding:
            raise RuntimeError("every parameter-averaging trainer was lost; the network is unchanged")
        self.complete = len(finished) == len(futures)
        # every trainer that parks its replica parks this state: an evaluation before the next fit is sent it from there
        parked = (self.extension.name, self.session, self.nodes())
        self.run.network.arriving(Arrival(holding, f"fit {self.fit}", parked))
        logger.debug(
            "parameter averaging: %d minibatches in %.2f s on %d trainers",
            self._fitted,
            seconds,
            len(futures),
        )
        return closed

    def _note_lost(self, alive: list[str]) -> None:
        """Warn once about each worker of the fit that was lost (not retired): the others train its share."""
        gone = set(self.seen) - set(alive) - self.lost
        self.seen.update(alive)
        self.lost.update(gone)
        gone = sorted(gone - retired(self.client, gone))
        if gone:
            warnings.warn(
                f"parameter averaging lost worker(s) {', '.join(gone)}; their minibatches are trained by the "
                f"{len(alive)} worker(s) left",
                TrainerLostWarning,
                stacklevel=6,
            )

    def _write_snapshot(self, report: dict[str, Any], due: list[Any]) -> bool:
        """Write the checkpoints ``due`` at the end of the settled round ``report`` from the average its
        trainers kept aside, taken from one of them; returns whether one held it (a round that did not
        end an epoch a checkpoint wants, or one whose holders lag or were lost, did not keep it)."""
        session, k = self.session, report["round"]
        members = list(dict.fromkeys(m["worker"] for m in report["members"]))
        for worker in members:
            held = self.client.run(_take_snapshot, session, k, workers=[worker], on_error="return")
            state = held.get(worker)
            if isinstance(state, dict):
                others = [w for w in members if w != worker]  # their copies dropped, without waiting
                if others:
                    self.client.run(_drop_snapshot, session, k, workers=others, on_error="ignore", wait=False)
                self.write_checkpoint(due, [i for i in self.segment_order if not self.fitted[i]], state)
                logger.debug("parameter averaging: a checkpoint from round %d of session %s", k, session)
                return True
        return False

    def _stop_before(self, plan: list[dict[str, list[int]]], kept: list[int]) -> int | None:
        """The round of ``plan`` to stop before: after the first whose end a checkpoint listener wants (by
        iterations or epochs, as the plan foretells them; one by time is seen as rounds settle), but the
        end of an epoch in ``kept``, whose checkpoint is written from its last round's average."""
        if not self.run.checkpointers:
            return None
        iteration, left = self.run.network.iteration, collections.Counter(self.left)
        done = self.epochs_done()
        for k, shares in enumerate(plan):
            iteration += max(len(s) for s in shares.values())
            for s in shares.values():
                for item in s:
                    left[item // self.n] -= 1
            now = next((e for e in range(self.run.epochs) if left[e] > 0), self.run.epochs)
            epochs_done = self.run.first_epoch + now if now > done and now - 1 not in kept else None
            done = now
            if any(c.due(iteration, epochs_done) for c in self.run.checkpointers):
                return k + 1
        return None

    def _time(self, members: list[dict[str, Any]], seconds: float) -> None:
        """Keep a round's measures for the choice and the whole fit's (:meth:`receipt`): the state's
        size, the seconds stepped and minibatches fitted, and the round's timing."""
        if self.first_start is None:
            self.first_start = min((m["start"] for m in members), default=time.time())
        fitted = sum(len(m["items"]) for m in members)
        if fitted:
            self.state_bytes = self._state_bytes(members) or self.state_bytes
            self.steps[0] += sum(_stepping(m) for m in members)
            self.steps[1] += fitted
            self.late[0] += sum(m["late_seconds"] for m in members)
            self.late[1] += sum(m["late_steps"] for m in members)
            self.late[2] += sum(1 for m in members if m["late_steps"])
        times = [m["last_exchange_seconds"] for m in members]
        if self._fitted and members and all(t == t for t in times):  # not a segment's first; NaN: no averaging yet
            self.timed.append((seconds, max(len(m["items"]) for m in members), min(times)))

    def _measure(self, report: dict[str, Any], seconds: float, end: float) -> None:
        """Predict the fit's speedup from the first round whose members report their last averaging's time
        (the one before it: NaN until a first averaging), timed by the member that came to it last
        (the others' include waiting for it); streaming, as long as its parts were in flight. The rest
        of the fit is predicted from the round's ``end``: the rounds after it, not the time since, in
        which the next ones went on and may be heard of with this one. The round's overhead leaves out
        what the member that ended it waited for minibatches: an early round reads minibatches that
        later ones find kept loaded (by hand, in three fits of the small model, the second round's
        overhead was 6.5-27 ms of its 42-91 ms, and its members waited 4.4-27 ms for minibatches in
        it); what reading costs every round stays in the overhead the whole fit measures for the next."""
        members = report["members"]
        fitted = [m for m in members if m["items"]]
        times = [m["last_exchange_seconds"] for m in members]
        if len(members) < 2 or not fitted or not all(t == t for t in times):
            return
        paces = [_choice.pace(_stepping(m), len(m["items"]), m["late_seconds"], m["late_steps"]) for m in fitted]
        step, contention = (float(np.median(p)) for p in zip(*paces, strict=True))
        frequency = max(len(m["items"]) for m in members)
        reading = max(members, key=lambda m: m["end"])["wait_seconds"]
        measures = _choice.Measures.of_round(
            len(members), step, min(times), self.state_bytes, frequency, self.streaming, seconds - reading, contention
        )
        self._predict(measures, "this fit", end - self.run.began)

    def _state_bytes(self, members: list[dict[str, Any]]) -> int:
        """The bytes of a trainer's state as a round's averaging sends it."""
        values = max(m.get("state_values", 0) for m in members)
        width = {"float32": 4, "float16": 2, "bfloat16": 2}.get(self.master.exchange_dtype, 1 + 4 / 1024)
        return int(values * width)

    def _predict(self, measures: _choice.Measures, source: str, elapsed: float | None = None) -> None:
        """The fit's speedup at the chosen frequency as the cost model predicts it from ``measures`` (on
        as many trainers as this fit has), for the receipt: from the fit's start, or (``elapsed``) from
        the seconds it took to fit the items reported so far."""
        measures = dataclasses.replace(measures, trainers=max(1, len(self.run.workers)))
        self.measuring = False
        items = len(self.planned) or self.n * self.run.epochs
        remaining, elapsed = (items, 0.0) if elapsed is None else (sum(self.left.values()), elapsed)
        predicted = _choice.fit_speedup(measures, self.frequency, self.streaming, items, remaining, elapsed)
        self.choice = _choice.Choice(self.frequency, self.streaming, measures, source, predicted, self.bounds)
        if self.run.stats is not None:
            self.run.stats.averaging_frequency = self.frequency
        logger.debug("parameter averaging: %s", self.choice.line())

    def receipt(self) -> str | None:
        """The choice with the fit's measured speedup over one trainer (its minibatches at the pace its
        trainers stepped with no averaging in flight, against the seconds since the fit began); the whole
        fit's measures, of two trainers or more, are kept for the next fit of the master to choose from."""
        spent, fitted = self.steps
        step, contention = _choice.pace(spent, fitted, self.late[0], self.late[1])
        contention /= max(1, self.late[2])
        last = self.master._measures
        if not self.late[2] and last is not None:  # no round streamed: what streaming cost when it last did
            contention = last.contention
        seconds = time.time() - self.run.began
        if self.timed and fitted and self.first_start is not None and len(self.nodes()) > 1:
            averaging = float(np.median([a for _, _, a in self.timed]))
            m = _choice.Measures(len(self.run.workers), step, averaging, self.state_bytes, 0.0, 0.0, 0.0, contention)
            overhead = [s - m.round_at(h, self.streaming) for s, h, _ in self.timed]  # m's overhead is 0
            self.master._measures = dataclasses.replace(
                m,
                overhead=max(0.0, float(np.median(overhead))),
                start=max(0.0, self.first_start - self.run.began),
                end=max(0.0, time.time() - self.last),
            )
        if self.choice is None:
            return None
        if fitted and seconds > 0:
            self.choice.measured = fitted * step / seconds
        if self.run.stats is not None:
            self.run.stats.choice = self.choice.to_dict()
        return self.choice.line()

    def _report(self, members: list[dict[str, Any]], seconds: float, end: float) -> None:
        """A settled round, which ended at ``end`` (``time.time()`` of its last member): the run's step
        (progress, listeners, panel) and its statistics."""
        items = [i for m in members for i in m["items"]]
        if not items:
            return
        epoch = items[0] // self.n
        examples = sum(m["examples"] for m in members)
        fitted = [m for m in members if m["examples"]]
        score = sum(m["score"] * m["examples"] for m in fitted) / examples if examples else float("nan")
        self.reported(items, score)
        self._fitted += len(items)
        rows = [
            {
                "row": m["worker"],
                "worker": m["worker"],
                "minibatches": len(m["items"]),
                "examples": m["examples"],
                "loss": m["score"],
            }
            for m in fitted
        ]
        iterations = max(len(m["items"]) for m in members)
        self.run.step(epoch, len(items), examples, score, iterations, round_rows=rows, round_seconds=seconds, at=end)
        if self.run.stats is not None:
            r = self.rounds_done[epoch]
            self.run.stats.rounds.append(
                RoundStats(
                    self.run.first_epoch + epoch,
                    r,
                    seconds,
                    examples,
                    score,
                    [
                        WorkerRound(
                            m["worker"],
                            [self.batches.names[i % self.n] for i in m["items"]],
                            m["examples"],
                            m["score"],
                            m["fit_seconds"],
                            m["wait_seconds"],
                            m["start"],
                            m["end"],
                            m["late_steps"],
                            m["averaging_seconds"],
                        )
                        for m in fitted
                    ],
                )
            )
        self.rounds_done[epoch] += 1
