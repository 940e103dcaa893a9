"""Gradient sharing (DL4J's ``SharedTrainingMaster``): asynchronous SGD with compressed updates
exchanged peer to peer (Strom, Interspeech 2015; Lin et al., ICLR 2018).

The driver places ``workers_per_node`` long-lived trainers on every worker, opens a session on the
scheduler (membership, minibatches) and on every worker (inboxes, links), and then only follows
progress: updates go from worker to worker, never through the driver or the scheduler. At the end
the trainers' states are averaged (they hold the same parameters when no peer was lost; batch-norm
statistics and momentum are per trainer and averaged) and the updates still in their residuals are
added, so nothing a trainer computed is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
import warnings
from typing import Any, ClassVar

import numpy as np
import torch
from distributed import Future, wait

from dlscale.encoding import Compressor, ResidualPostProcessor, ThresholdAlgorithm, compressor
from dlscale.encoding.compressors import DEFAULT as DEFAULT_COMPRESSOR
from dlscale.errors import TrainerLostWarning
from dlscale.monitor.stats import TrainerStats
from dlscale.nn.listeners import SentUpdate
from dlscale.runtime.cluster import cluster_workers
from dlscale.runtime.extensions import install
from dlscale.runtime.tasks import check_count
from dlscale.training import _sources, _worker
from dlscale.training._driver import FitRun
from dlscale.training.master import TrainingMaster
from dlscale.training.sharing import _mesh, _trainer
from dlscale.training.sharing._config import SharingConfig
from dlscale.training.sharing._extension import SHARING
from dlscale.training.sharing._worker_plugin import plugin

logger = logging.getLogger("dlscale.training.sharing")

AGGREGATIONS = ("sum", "mean")
"""How the trainers' updates combine: ``"sum"`` applies each whole (DL4J's; every minibatch makes one
step of the learning rate, as in one process), ``"mean"`` weighs each by one over the live trainers
(the step of a round of N minibatches is their mean, as with DDP: N times fewer steps an epoch)."""


@dataclasses.dataclass
class SharedTrainingMaster(TrainingMaster):
    """Asynchronous data-parallel training with compressed updates shared between trainers.

    Each of ``workers_per_node`` trainers per worker fits minibatches of ``batch_size_per_worker``
    examples, handed out by the scheduler as trainers ask for them (so faster trainers fit more, and
    a lost worker's minibatches go to the others). ``compressor`` (an instance or a registered name:
    "topk", "dl4j", "dense") turns each update into a message; ``aggregation`` ("mean" or "sum", see
    :data:`AGGREGATIONS`) says how the trainers' updates combine. ``threshold_algorithm`` and
    ``residual_post_processor`` (an instance or a registered name: "adaptive", "fixed",
    "target_sparsity"; "clipping", "none") configure the "dl4j" compressor and only it.
    ``mesh_build_mode`` "plain" sends every update to every peer, "mesh" relays it along a tree
    (``dlscale.sharing.mesh-fanout``) so that no node talks to
    more than a few others. ``encoding_debug_mode`` logs each trainer's threshold, sparsity, message
    form and residual at every step (on the workers, and on the driver under
    ``dlscale.training.sharing``). ``prefetch`` minibatches are read ahead by each trainer. The
    ``dlscale.sharing`` settings are read on the driver when a fit starts. The settings every master
    has are described on :class:`~dlscale.training.master.TrainingMaster`.
    """

    approach: ClassVar[str] = "gradient sharing"

    compressor: Compressor | str = DEFAULT_COMPRESSOR
    aggregation: str = "sum"
    threshold_algorithm: ThresholdAlgorithm | str | None = None
    residual_post_processor: ResidualPostProcessor | str | None = None
    workers_per_node: int = 1
    mesh_build_mode: str = "plain"
    encoding_debug_mode: bool = False
    worker_periodic_gc: bool = True
    worker_gc_frequency_ms: int = 5000
    momentum_masking: bool = True
    prefetch: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("workers_per_node", self.workers_per_node)
        check_count("prefetch", self.prefetch, 0)
        check_count("worker_gc_frequency_ms", self.worker_gc_frequency_ms)
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        dl4j = {
            name: value
            for name in ("threshold_algorithm", "residual_post_processor")
            if (value := getattr(self, name)) is not None
        }
        if dl4j and self.compressor != "dl4j":
            raise ValueError(
                f"{' and '.join(dl4j)} configure the 'dl4j' compressor, not compressor {self.compressor!r}: pass "
                f"compressor='dl4j' with them, or give a configured compressor instance alone"
            )
        self.compressor = compressor(self.compressor, **dl4j)
        if self.mesh_build_mode not in _mesh.MODES:
            raise ValueError(f"mesh_build_mode must be one of {_mesh.MODES}, got {self.mesh_build_mode!r}")

    def _train(
        self, run: FitRun, batches: _sources.Minibatches, *, partitions: int | None = None, probe: bool = False
    ) -> None:
        _Session(self, run, batches, held=partitions is not None).train(probe)


def _open_node(session: str, trainers: int, mode: str, config: SharingConfig, dask_worker: Any = None) -> None:
    plugin(dask_worker).open(session, trainers, mode, config)


def _close_node(session: str, dask_worker: Any = None) -> None:
    plugin(dask_worker).close(session)


class _Session:
    """One ``fit``'s gradient-sharing session: its trainers, the scheduler's and the workers' parts."""

    def __init__(self, master: SharedTrainingMaster, run: FitRun, batches: _sources.Minibatches, held: bool) -> None:
        self.master, self.run, self.batches = master, run, batches
        self.client, self.workers = run.client, run.workers
        self.config = SharingConfig.from_dask()
        self.session = f"dlscale-sharing-{uuid.uuid4().hex[:12]}"
        self.trainers = {f"{w}#{i}": (w, i) for w in self.workers for i in range(master.workers_per_node)}
        self.held: dict[str, Future] = {}
        if held:  # minibatches in worker memory: published for the trainers, fetched by name
            self.held = dict(zip(batches.names, batches.refs))
            loader = _trainer.HeldMinibatch(f"{self.session}-minibatches", self.config.end_timeout)
            self.batches = dataclasses.replace(batches, refs=list(batches.names), loader=loader)

    def _call(self, op: str, **kwargs: Any) -> Any:
        return self.client.sync(getattr(self.client.scheduler, f"dlscale_sharing_{op}"), session=self.session, **kwargs)

    def _order(self) -> list[int]:
        """Work items, epoch after epoch: item ``e * n + i`` is minibatch ``i`` in the fit's epoch ``e``."""
        n, seed, first = len(self.batches.refs), self.run.seed, self.run.first_epoch
        return [
            e * n + int(i)
            for e in range(self.run.epochs)
            for i in np.random.default_rng([seed, first + e]).permutation(n)
        ]

    def train(self, probe: bool) -> None:
        master, client, run = self.master, self.client, self.run
        install(client, SHARING)
        blob = run.blob
        run.replicas = [f"{blob.key}/{i}" for i in range(master.workers_per_node)]
        if probe:
            run.probe()
        spec = _trainer.TrainerSpec(
            master.compressor,
            master.aggregation,
            master.workers_per_node,
            master.prefetch,
            master.encoding_debug_mode,
            master.collect_training_stats,
            master.worker_gc_frequency_ms / 1000 if master.worker_periodic_gc else None,
            master.momentum_masking,
        )
        t0 = time.perf_counter()
        if master.encoding_debug_mode:
            client.subscribe_topic(_trainer.DEBUG_TOPIC, _log_debug)
        run.show_progress(fit=self.session)
        self._call("open", worker_of={t: w for t, (w, _) in self.trainers.items()}, order=self._order())
        try:
            if self.held:
                client.publish_dataset(**{self.batches.loader.dataset: self.held})
            client.run(
                _open_node,
                self.session,
                master.workers_per_node,
                master.mesh_build_mode,
                self.config,
                workers=self.workers,
            )
            futures = {
                t: client.submit(
                    _trainer.run,
                    self.session,
                    t,
                    i,
                    blob.key,
                    blob,
                    self.batches.refs,
                    self.batches.loader,
                    spec,
                    workers=[w],
                    allow_other_workers=True,
                    pure=False,
                    key=f"{self.session}-trainer-{k}",
                )
                for k, (t, (w, i)) in enumerate(self.trainers.items())
            }
            results, progress = self._follow(futures)
        finally:
            if master.encoding_debug_mode:
                client.unsubscribe_topic(_trainer.DEBUG_TOPIC)
            self._call("close")
            if self.held:
                client.unpublish_dataset(self.batches.loader.dataset)
            alive = set(cluster_workers(client))  # a lost worker would take a timeout
            client.run(_close_node, self.session, workers=[w for w in self.workers if w in alive], on_error="ignore")
        self._conclude(results, progress, time.perf_counter() - t0)

    def _follow(self, futures: dict[str, Future]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Wait for the trainers, reporting to the run as minibatches are acknowledged; returns the
        results of the trainers that finished and the session's last progress report."""
        n = len(self.batches.refs)
        progress: dict[str, Any] = {}
        pending = set(futures.values())
        while True:
            with contextlib.suppress(TimeoutError):
                wait(pending, timeout=self.config.poll_interval * 10, return_when="FIRST_COMPLETED")
            pending = {f for f in pending if not f.done()}
            progress = self._call("progress")
            for item, examples, score, threshold, sparsity, sent, at in progress["reports"]:
                update = SentUpdate(sent, threshold, sparsity)
                self.run.step(item // n, 1, examples, score, iterations=1, at=at, update=update)
            failed = [f for f in futures.values() if f.status == "error" and not _lost_worker(f)]
            if progress["failed"] and not failed and progress["failed_by"] in futures:
                # the trainer that failed tells the scheduler just before its task ends with the error itself
                culprit = futures[progress["failed_by"]]
                with contextlib.suppress(TimeoutError):
                    wait([culprit], timeout=self.config.end_timeout)
                failed = [culprit] if culprit.status == "error" and not _lost_worker(culprit) else []
            if failed or progress["failed"]:
                error = failed[0].exception() if failed else None
                trace = failed[0].traceback() if failed else None
                self._abort(futures)
                if error is not None:
                    raise error.with_traceback(trace)
                raise RuntimeError(f"gradient sharing stopped: {progress['failed']}")
            if not pending:
                break
        results = [f.result() for f in futures.values() if f.status == "finished"]
        return results, progress

    def _abort(self, futures: dict[str, Future]) -> None:
        """Stop every trainer (they stop at their next call to the scheduler) and wait for them."""
        self._call("fail", trainer="driver", error="stopped by the driver")
        with contextlib.suppress(TimeoutError):
            wait(list(futures.values()), timeout=self.config.end_timeout)
        self.client.cancel([f for f in futures.values() if not f.done()])

    def _conclude(self, results: list[dict[str, Any]], progress: dict[str, Any], seconds: float) -> None:
        states = [r for r in results if not r.get("lost") and not r.get("aborted")]
        lost = progress["lost"]
        if not states:
            raise RuntimeError(f"every gradient-sharing trainer was lost ({', '.join(lost)}); the network is unchanged")
        if lost:
            warnings.warn(
                f"gradient sharing lost trainer(s) {', '.join(lost)} with their workers; their "
                f"minibatches were trained by the {len(states)} others",
                TrainerLostWarning,
                stacklevel=6,
            )
        fitted = [s for s in states if s["examples"]] or states[:1]  # an idle trainer's optimizer has no state
        state = _worker.average(*fitted)
        # a residual holds updates already weighted by the aggregation (1 / live trainers for "mean"),
        # as every message was: adding them all applies each unsent update as its sent part was
        state = dict(state, params=state["params"] + torch.stack([s["residual"] for s in states]).sum(0))
        _worker.apply_state(self.run.network, state)
        if self.run.stats is not None:
            self.run.stats.trainers = [TrainerStats(**r["stats"]) for r in states]
            params = self.run.network.params()
            self.run.stats.dense_bytes = params.numel() * params.element_size()
        minibatches = self.run.epochs * len(self.batches.refs)
        logger.info("gradient sharing: %d minibatches in %.2f s on %d trainers", minibatches, seconds, len(states))


def _lost_worker(future: Future) -> bool:
    """Whether ``future`` failed because its worker died rather than through its own error."""
    from distributed.scheduler import KilledWorker

    return isinstance(future.exception(), KilledWorker)


def _log_debug(event: tuple[float, dict[str, Any]]) -> None:
    _, info = event
    logger.info(_trainer.DEBUG_FORMAT, info)
