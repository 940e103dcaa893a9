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
import secrets
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
from distributed import Future

from dlscale.facade.persist import StorageLevel
from dlscale.monitor import panel
from dlscale.monitor.progress import Progress
from dlscale.monitor.stats import RoundStats, TrainingStats, WorkerRound
from dlscale.runtime.tasks import check_count
from dlscale.training import _sources, _worker
from dlscale.training.master import (
    TrainingMaster,
    check_source,
)

if TYPE_CHECKING:
    from dlscale.training.sparknet import SparkNet

REPARTITION = ("always", "never", "num_partitions_workers_differs")


@dataclasses.dataclass
class ParameterAveragingTrainingMaster(TrainingMaster):
    """Synchronous data-parallel training by periodic parameter averaging.

    ``repartition`` applies to ``rdd_training_approach="direct"``: "never" trains every minibatch on the
    worker that holds it, "always" spreads the minibatches evenly over the workers, and
    "num_partitions_workers_differs" does the latter only when the RDD does not have exactly one
    partition per worker. Exported files are read by whichever worker trains them.
    ``export_directory`` (default ``_training/`` under the storage root) receives the exported files;
    :meth:`delete_temp_files` removes them. ``rng_seed`` fixes the order of minibatches in every
    epoch (otherwise it is random).
    """

    batch_size_per_worker: int
    averaging_frequency: int = 5
    worker_prefetch_num_batches: int = 2
    save_updater: bool = True
    aggregation_depth: int = 2
    repartition: str = "always"
    rdd_training_approach: str = "export"
    export_directory: str | None = None
    storage_level: StorageLevel = StorageLevel.MEMORY_ONLY_SER
    collect_training_stats: bool = False
    rng_seed: int | None = None
    storage_options: dict[str, Any] | None = None
    _exports: _sources.ExportCache = dataclasses.field(default_factory=_sources.ExportCache, init=False, repr=False)

    def __post_init__(self) -> None:
        check_count("batch_size_per_worker", self.batch_size_per_worker)
        check_count("averaging_frequency", self.averaging_frequency)
        check_count("worker_prefetch_num_batches", self.worker_prefetch_num_batches, 0)
        check_count("aggregation_depth", self.aggregation_depth)
        if self.repartition not in REPARTITION:
            raise ValueError(f"repartition must be one of {REPARTITION}, got {self.repartition!r}")
        check_source(self.rdd_training_approach, self.storage_level)

    def _train(
        self,
        net: SparkNet,
        blob: bytes,
        batches: _sources.Minibatches,
        epochs: int,
        *,
        partitions: int | None = None,
        probe: bool = False,
    ) -> None:
        local = partitions is not None and (
            self.repartition == "never"
            or (self.repartition == "num_partitions_workers_differs" and partitions == len(_workers(net)))
        )
        _Run(self, net, blob, batches, local).train(epochs, probe=probe)


def _workers(net: SparkNet) -> list[str]:
    workers = sorted(net.sc.client.scheduler_info(n_workers=-1)["workers"])
    if not workers:
        raise RuntimeError("the cluster has no workers to train on")
    return workers


class _Run:
    """One ``fit``: the network sent once, then the rounds of every epoch."""

    def __init__(
        self,
        master: ParameterAveragingTrainingMaster,
        net: SparkNet,
        blob: bytes,
        batches: _sources.Minibatches,
        local: bool,
    ) -> None:
        self.master, self.net, self.batches, self.local = master, net, batches, local
        self.client = net.sc.client
        self.workers = _workers(net)
        self.blob = self.client.scatter([blob], hash=False)[0]
        self.key = self.blob.key
        seed = master.rng_seed if master.rng_seed is not None else secrets.randbits(63)
        self.seed = seed
        self.tag = uuid.uuid4().hex[:8]
        self.fit_id: str | None = None  # in the live panel
        self.stats = (
            TrainingStats("parameter averaging", len(self.workers), batches.seconds)
            if master.collect_training_stats
            else None
        )

    def train(self, epochs: int, probe: bool = False) -> None:
        network = self.net.network
        counters = network.iteration, network.epoch
        try:
            if probe:
                self.client.submit(
                    _worker.probe, self.key, self.blob, self.batches.refs[0], self.batches.loader, pure=False
                ).result()
            states = self.client.scatter([_worker.state_of(network, self.master.save_updater)], hash=False)
            self.fit_id = panel.open_fit(self.client, "parameter averaging", epochs * len(self.batches.refs))
            self.progress = Progress(
                "parameter averaging",
                len(self.batches.refs),
                epochs,
                network.epoch,
                panel_url=panel.url(self.client, self.fit_id),
            )
            for _ in range(epochs):
                states = self._epoch(states, network.epoch)
                network.epoch += 1
            _worker.apply_state(network, _worker.average(*self.client.gather(states)))
        except BaseException:
            network.iteration, network.epoch = counters  # the network is as it was before the fit
            raise
        finally:
            panel.close_fit(self.client, self.fit_id)
            self.client.run(_worker.drop_replica, self.key)
            self.blob.release()
        if self.stats is not None:
            self.net._add_stats(self.stats)

    def _epoch(self, states: list[Future], epoch: int) -> list[Future]:
        """Submit every round of the epoch, then follow them; returns the last level of the last
        round's averaging tree (the states whose average is the network's new state)."""
        rounds = self._plan(np.random.default_rng([self.seed, epoch]))
        summaries = []
        for r, shares in enumerate(rounds):
            parts = [self._fit(states, worker, idx, epoch, r, j) for j, (worker, idx) in enumerate(shares)]
            states = self._reduce(parts)
            summaries.append([self.client.submit(_worker.summary, s, pure=False) for s in states])
        last = time.perf_counter()
        try:
            for r, futures in enumerate(summaries):
                info = _worker.combine(self.client.gather(futures))
                now = time.perf_counter()
                self._done(epoch, r, info, now - last)
                last = now
                summaries[r] = []  # drop the futures: nothing waits on them any more
        except BaseException as e:
            self.client.cancel([f for futures in summaries for f in futures] + states)
            if isinstance(e, Exception):
                e.add_note(f"while training round {r} of epoch {epoch}")
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
            key=f"dlscale-fit-{self.tag}-e{epoch}-r{r}-{j}",
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
        network = self.net.network
        network.iteration += info["batches"]
        self.progress.advance(sum(len(s["batches"]) for s in info["shares"]), info["examples"], info["score"])
        panel.record(
            self.client,
            self.fit_id,
            [
                {
                    "row": s["worker"],
                    "worker": s["worker"],
                    "minibatches": len(s["batches"]),
                    "examples": s["examples"],
                    "loss": s["score"],
                }
                for s in info["shares"]
            ],
        )
        for listener in self.net.listeners:
            listener.iteration_done(network, network.iteration, epoch, info["score"], info["examples"])
        if self.stats is not None:
            self.stats.rounds.append(
                RoundStats(
                    epoch, r, seconds, info["examples"], info["score"], [WorkerRound(**s) for s in info["shares"]]
                )
            )
