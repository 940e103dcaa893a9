"""Synchronous parameter averaging (DL4J's ``ParameterAveragingTrainingMaster``).

Training runs in rounds. In each, the current state (parameters, buffers, optimizer state) goes to
every worker once, each worker fits ``averaging_frequency`` minibatches of ``batch_size_per_worker``
examples on its replica of the network, and the resulting states are averaged, weighted by
examples, in a tree of depth ``aggregation_depth``. Rounds are ordinary Dask tasks chained by their
states: an epoch's rounds are submitted at once, each state moves worker to worker, and the driver
reads only a few numbers per round until the end.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
import warnings
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from distributed import Future

from dlscale.errors import TrainerLostWarning
from dlscale.monitor.stats import RoundStats, WorkerRound
from dlscale.runtime.cluster import cluster_workers
from dlscale.runtime.replicas import keep_newest_copied
from dlscale.runtime.retirement import retired
from dlscale.runtime.tasks import check_count
from dlscale.training import _sources, _worker
from dlscale.training._driver import FitRun, workers
from dlscale.training.master import TrainingMaster

if TYPE_CHECKING:
    from dlscale.nn.network import Network

REPARTITION = ("always", "never", "num_partitions_workers_differs")


@dataclasses.dataclass
class ParameterAveragingTrainingMaster(TrainingMaster):
    """Synchronous data-parallel training by periodic parameter averaging.

    Each worker fits ``averaging_frequency`` minibatches per round, reading ``worker_prefetch_num_batches``
    ahead; the states (with the optimizer's when ``save_updater``) are averaged in a tree of depth
    ``aggregation_depth``. ``repartition`` applies to ``rdd_training_approach="direct"``: "never" trains
    every minibatch on the worker that holds it, "always" spreads the minibatches evenly over the
    workers, and "num_partitions_workers_differs" does the latter only when the RDD does not have
    exactly one partition per worker. Exported files are read by whichever worker trains them;
    :meth:`delete_temp_files` removes them. The settings every master has are described on
    :class:`~dlscale.training.master.TrainingMaster`.
    """

    approach: ClassVar[str] = "parameter averaging"

    averaging_frequency: int = 5
    worker_prefetch_num_batches: int = 2
    save_updater: bool = True
    aggregation_depth: int = 2
    repartition: str = "always"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("averaging_frequency", self.averaging_frequency)
        check_count("worker_prefetch_num_batches", self.worker_prefetch_num_batches, 0)
        check_count("aggregation_depth", self.aggregation_depth)
        if self.repartition not in REPARTITION:
            raise ValueError(f"repartition must be one of {REPARTITION}, got {self.repartition!r}")

    def _train(
        self, run: FitRun, batches: _sources.Minibatches, *, partitions: int | None = None, probe: bool = False
    ) -> None:
        local = partitions is not None and (
            self.repartition == "never"
            or (self.repartition == "num_partitions_workers_differs" and partitions == len(run.workers))
        )
        _Rounds(self, run, batches, local).train(probe)


class _Rounds:
    """One ``fit``'s rounds: the network sent once, then the rounds of every epoch.

    The driver holds the states of the last rounds it has seen complete (its *checkpoints*) until a
    newer one is on two workers; the next round's tasks copy a round's states to every worker they
    run on, and the memory manager is kept from dropping those copies. A lost worker then costs only
    the rounds since the newest checkpoint it did not take: Dask recomputes a lost state from the
    tasks that made it, back to a checkpoint at most, and the tasks of a lost worker run on the others."""

    def __init__(
        self, master: ParameterAveragingTrainingMaster, run: FitRun, batches: _sources.Minibatches, local: bool
    ) -> None:
        self.master, self.run, self.batches, self.local = master, run, batches, local
        self.client, self.workers, self.blob = run.client, run.workers, run.blob
        self.key = run.replicas[0]
        self.tag = uuid.uuid4().hex[:8]
        self.checkpoints: list[list[Future]] = []  # oldest first
        self.seen, self.lost = set(self.workers), set()  # the workers of the fit so far, and those that left

    def train(self, probe: bool) -> None:
        run = self.run
        if probe:
            run.probe()
        state = _worker.state_of(run.network, self.master.save_updater)
        states = self.client.scatter([state], broadcast=True, hash=False)  # every first task needs it
        self._keep(states)
        run.show_progress()
        try:
            start, skip = (run.resume.epoch, run.resume.rounds) if run.resume is not None else (0, 0)
            for epoch in range(start, run.epochs):
                self.workers = workers(self.client)  # a lost worker's share goes to those left
                self._note_lost(self.workers)
                states = self._epoch(states, epoch, skip if epoch == start else 0)
            _worker.apply_state(run.network, _worker.average(*self.client.gather(states)))
        except Exception as e:
            lost = sorted(set(run.workers) - set(cluster_workers(self.client)))
            if lost:
                e.add_note(f"worker(s) {', '.join(lost)} left the cluster during the fit")
            raise

    def _note_lost(self, alive: list[str]) -> None:
        """Warn once about each worker of the fit that was lost (not retired): its tasks run on the others."""
        gone = set(self.seen) - set(alive) - self.lost
        self.seen.update(alive)
        self.lost.update(gone)
        gone = sorted(gone - retired(self.client, gone))
        if gone:
            warnings.warn(
                f"parameter averaging lost worker(s) {', '.join(gone)}; their minibatches are trained by the "
                f"{len(alive)} worker(s) left",
                TrainerLostWarning,
                stacklevel=2,
            )

    def _apply_average(self, states: list[Future], network: Network) -> None:
        """Set ``network`` to the average of ``states`` (a round's last level: the fit's state after it)."""
        _worker.apply_state(network, _worker.average(*self.client.gather(states)))

    def _keep(self, states: list[Future]) -> None:
        """Add ``states`` to the checkpoints, and let go of those older than the newest on two workers."""
        self.checkpoints.append(states)
        del self.checkpoints[: keep_newest_copied(self.client, self.checkpoints, 2)]

    def _epoch(self, states: list[Future], epoch: int, skip: int = 0) -> list[Future]:
        """Submit every round of the fit's ``epoch``-th epoch after the first ``skip`` (done before the
        checkpoint a fit resumes from), then follow them; returns the last level of the last round's
        averaging tree (the states whose average is the network's new state)."""
        rounds = self._plan(np.random.default_rng([self.run.seed, self.run.first_epoch + epoch]))
        summaries, ends = [], []
        for r, shares in enumerate(rounds):
            if r < skip:
                summaries.append([])
                ends.append([])
                continue
            parts = [self._fit(states, worker, idx, epoch, r, j) for j, (worker, idx) in enumerate(shares)]
            states = self._reduce(parts)
            ends.append(states)
            summaries.append([self.client.submit(_worker.summary, s, pure=False) for s in states])
        last = time.perf_counter()
        try:
            for r, futures in enumerate(summaries):
                if r < skip:
                    continue
                info = _worker.combine(self.client.gather(futures))
                now = time.perf_counter()
                self._done(epoch, r, info, now - last)
                self._note_lost(list(cluster_workers(self.client)))
                last = now
                self._keep(ends[r])
                done = r + 1 == len(rounds)
                self.run.checkpoint(
                    self.run.position(epoch + 1) if done else self.run.position(epoch, r + 1),
                    partial(self._apply_average, ends[r]),
                )
                summaries[r] = ends[r] = []  # drop the futures: nothing waits on them any more
        except BaseException as e:
            self.client.cancel([f for futures in summaries for f in futures] + states)
            if isinstance(e, Exception):
                e.add_note(f"while training round {r} of epoch {self.run.first_epoch + epoch}")
            raise
        return states

    def _plan(self, rng: np.random.Generator) -> list[list[tuple[str, list[int]]]]:
        """Rounds, each a list of ``(worker, minibatch indices)``."""
        n, per = len(self.batches.refs), self.master.averaging_frequency
        if self.local:
            own: dict[str, list[int]] = {w: [] for w in self.workers}
            for i, holder in enumerate(self.batches.holders):
                own[holder if holder in own else self.workers[i % len(self.workers)]].append(i)
            for idx in own.values():
                rng.shuffle(idx)
            count = max(math.ceil(len(idx) / per) for idx in own.values())
            return [
                [(w, idx[r * per : (r + 1) * per]) for w, idx in own.items() if idx[r * per : (r + 1) * per]]
                for r in range(count)
            ]
        order = rng.permutation(n).tolist()
        step = per * len(self.workers)
        rounds = []
        for start in range(0, n, step):
            chunk = order[start : start + step]
            shares = np.array_split(np.array(chunk), min(len(self.workers), len(chunk)))
            rounds.append([(self.workers[j], s.tolist()) for j, s in enumerate(shares)])
        return rounds

    def _fit(self, states: list[Future], worker: str, idx: list[int], epoch: int, r: int, j: int) -> Future:
        b = self.batches
        return self.client.submit(
            _worker.fit_share,
            self.key,
            self.blob,
            states,
            [b.refs[i] for i in idx],
            [b.names[i] for i in idx],
            b.loader,
            self.master.worker_prefetch_num_batches,
            self.master.save_updater,
            workers=[worker],
            allow_other_workers=True,
            pure=False,
            key=f"dlscale-fit-{self.tag}-e{self.run.first_epoch + epoch}-r{r}-{j}",
        )

    def _reduce(self, parts: list[Future]) -> list[Future]:
        """Average ``parts`` in a tree of depth ``aggregation_depth``, all but its last level: the next
        round's tasks (or the driver, after the last) average that level themselves."""
        fan_in = max(2, math.ceil(len(parts) ** (1 / self.master.aggregation_depth)))
        while len(parts) > fan_in:
            parts = [
                self.client.submit(_worker.average, *parts[i : i + fan_in], pure=False)
                if len(parts[i : i + fan_in]) > 1
                else parts[i]
                for i in range(0, len(parts), fan_in)
            ]
        return parts

    def _done(self, epoch: int, r: int, info: dict[str, Any], seconds: float) -> None:
        shares = info["shares"]
        rows = [
            {
                "row": s["worker"],
                "worker": s["worker"],
                "minibatches": len(s["batches"]),
                "examples": s["examples"],
                "loss": s["score"],
            }
            for s in shares
        ]
        minibatches = sum(len(s["batches"]) for s in shares)
        self.run.step(epoch, minibatches, info["examples"], info["score"], iterations=info["batches"], rows=rows)
        if self.run.stats is not None:
            self.run.stats.rounds.append(
                RoundStats(
                    self.run.first_epoch + epoch,
                    r,
                    seconds,
                    info["examples"],
                    info["score"],
                    [WorkerRound(**s) for s in shares],
                )
            )
