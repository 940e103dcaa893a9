"""Gradient sharing (DL4J's ``SharedTrainingMaster``): asynchronous SGD with threshold-encoded
updates exchanged peer to peer (Strom, Interspeech 2015).

The driver places ``workers_per_node`` long-lived trainers on every worker, opens a session on the
scheduler (membership, minibatches) and on every worker (inboxes, links), and then only follows
progress: updates go from worker to worker, never through the driver or the scheduler. At the end
the trainers' states are averaged (they hold the same parameters when no peer was lost) and the
updates still in their residuals are added, so nothing a trainer computed is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time
import uuid
import warnings
from typing import TYPE_CHECKING, Any

import dask.config
import numpy as np
import torch
from dask.utils import parse_timedelta
from distributed import Future, wait

from dlscale.encoding import (
    AdaptiveThresholdAlgorithm,
    ResidualClippingPostProcessor,
    ResidualPostProcessor,
    ThresholdAlgorithm,
    residual_post_processor,
    threshold_algorithm,
)
from dlscale.errors import TrainerLostWarning
from dlscale.facade.persist import StorageLevel
from dlscale.monitor import panel
from dlscale.monitor.progress import Progress
from dlscale.monitor.stats import TrainerStats, TrainingStats
from dlscale.runtime.tasks import check_count
from dlscale.training import _sources, _worker
from dlscale.training.master import (
    TrainingMaster,
    check_source,
)
from dlscale.training.sharing import _mesh, _trainer
from dlscale.training.sharing._scheduler_plugin import SharingSchedulerPlugin
from dlscale.training.sharing._worker_plugin import SharingWorkerPlugin, plugin

if TYPE_CHECKING:
    from dlscale.training.sparknet import SparkNet

logger = logging.getLogger("dlscale.training.sharing")


@dataclasses.dataclass
class SharedTrainingMaster(TrainingMaster):
    """Asynchronous data-parallel training with threshold-encoded updates shared between trainers.

    Each of ``workers_per_node`` trainers per worker fits minibatches of ``batch_size_per_worker``
    examples, handed out by the scheduler as trainers ask for them (so faster trainers fit more, and
    a lost worker's minibatches go to the others). ``threshold_algorithm`` and
    ``residual_post_processor`` take an instance or a registered name ("adaptive", "fixed",
    "target_sparsity"; "clipping", "none"). ``mesh_build_mode`` "plain" sends every update to every
    peer, "mesh" relays it along a tree (``dlscale.sharing.mesh-fanout``) so that no node talks to
    more than a few others. ``encoding_debug_mode`` logs each trainer's threshold, sparsity, message
    form and residual at every step (on the workers, and on the driver under
    ``dlscale.training.sharing``). ``prefetch`` minibatches are read ahead by each trainer.
    """

    batch_size_per_worker: int
    threshold_algorithm: ThresholdAlgorithm | str = dataclasses.field(default_factory=AdaptiveThresholdAlgorithm)
    residual_post_processor: ResidualPostProcessor | str = dataclasses.field(
        default_factory=ResidualClippingPostProcessor
    )
    workers_per_node: int = 1
    mesh_build_mode: str = "plain"
    encoding_debug_mode: bool = False
    rng_seed: int | None = None
    collect_training_stats: bool = False
    worker_periodic_gc: bool = True
    worker_gc_frequency_ms: int = 5000
    momentum_masking: bool = True
    rdd_training_approach: str = "export"
    storage_level: StorageLevel = StorageLevel.MEMORY_ONLY_SER
    prefetch: int = 2
    export_directory: str | None = None
    storage_options: dict[str, Any] | None = None
    _exports: _sources.ExportCache = dataclasses.field(default_factory=_sources.ExportCache, init=False, repr=False)

    def __post_init__(self) -> None:
        check_count("batch_size_per_worker", self.batch_size_per_worker)
        check_count("workers_per_node", self.workers_per_node)
        check_count("prefetch", self.prefetch, 0)
        check_count("worker_gc_frequency_ms", self.worker_gc_frequency_ms)
        self.threshold_algorithm = threshold_algorithm(self.threshold_algorithm)
        self.residual_post_processor = residual_post_processor(self.residual_post_processor)
        if self.mesh_build_mode not in _mesh.MODES:
            raise ValueError(f"mesh_build_mode must be one of {_mesh.MODES}, got {self.mesh_build_mode!r}")
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
        if partitions is None:
            _Run(self, net, blob, batches).train(epochs, probe=probe)
            return
        keyed = dataclasses.replace(batches, refs=[f.key for f in batches.refs], loader=_trainer.HeldMinibatch())
        _Run(self, net, blob, keyed).train(epochs)  # batches holds the minibatches until it returns


def _ensure_plugins(client: Any) -> None:
    """Install the sharing plugins on the scheduler and the workers, once per cluster."""

    def installed(dask_scheduler: Any) -> tuple[bool, bool]:
        return (
            SharingSchedulerPlugin.name in dask_scheduler.plugins,
            SharingWorkerPlugin.name in dask_scheduler.worker_plugins,
        )

    on_scheduler, on_workers = client.run_on_scheduler(installed)
    if not on_scheduler:
        client.register_plugin(SharingSchedulerPlugin())
    if not on_workers:
        client.register_plugin(SharingWorkerPlugin())


def _open_node(session: str, trainers: int, mode: str, dask_worker: Any = None) -> None:
    plugin(dask_worker).open(session, trainers, mode)


def _close_node(session: str, keys: list[str], dask_worker: Any = None) -> None:
    plugin(dask_worker).close(session)
    for key in keys:
        _worker.drop_replica(key)


class _Run:
    """One ``fit`` with gradient sharing."""

    def __init__(self, master: SharedTrainingMaster, net: SparkNet, blob: bytes, batches: _sources.Minibatches) -> None:
        self.master, self.net, self.batches = master, net, batches
        self.client = net.sc.client
        self.workers = sorted(self.client.scheduler_info(n_workers=-1)["workers"])
        if not self.workers:
            raise RuntimeError("the cluster has no workers to train on")
        self.blob = blob
        self.session = f"dlscale-sharing-{uuid.uuid4().hex[:12]}"
        self.trainers = {f"{w}#{i}": (w, i) for w in self.workers for i in range(master.workers_per_node)}
        seed = master.rng_seed if master.rng_seed is not None else secrets.randbits(63)
        self.seed = seed
        self.poll = parse_timedelta(dask.config.get("dlscale.sharing.poll-interval"))

    def _call(self, op: str, **kwargs: Any) -> Any:
        return self.client.sync(getattr(self.client.scheduler, f"dlscale_sharing_{op}"), session=self.session, **kwargs)

    def _order(self, epochs: int) -> list[int]:
        """Work items, epoch after epoch: item ``e * n + i`` is minibatch ``i`` in epoch ``e``."""
        n = len(self.batches.refs)
        return [e * n + int(i) for e in range(epochs) for i in np.random.default_rng([self.seed, e]).permutation(n)]

    def train(self, epochs: int, probe: bool = False) -> None:
        master, client = self.master, self.client
        _ensure_plugins(client)
        blob = client.scatter([self.blob], hash=False, broadcast=False)[0]
        keys = [f"{blob.key}/{i}" for i in range(master.workers_per_node)]
        if probe:
            client.submit(
                _worker.probe, f"{blob.key}/0", blob, self.batches.refs[0], self.batches.loader, pure=False
            ).result()
        spec = _trainer.TrainerSpec(
            master.threshold_algorithm,
            master.residual_post_processor,
            master.workers_per_node,
            master.prefetch,
            master.encoding_debug_mode,
            master.collect_training_stats,
            master.worker_gc_frequency_ms / 1000 if master.worker_periodic_gc else None,
            master.momentum_masking,
        )
        n = len(self.batches.refs)
        t0 = time.perf_counter()
        if master.encoding_debug_mode:
            client.subscribe_topic(_trainer.DEBUG_TOPIC, _log_debug)
        fit = panel.open_fit(client, "gradient sharing", epochs * n, fit=self.session)
        self._call("open", worker_of={t: w for t, (w, _) in self.trainers.items()}, order=self._order(epochs))
        try:
            client.run(_open_node, self.session, master.workers_per_node, master.mesh_build_mode, workers=self.workers)
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
            bar = Progress("gradient sharing", n, epochs, self.net.network.epoch, panel_url=panel.url(client, fit))
            results, progress = self._follow(futures, n, bar)
        finally:
            if master.encoding_debug_mode:
                client.unsubscribe_topic(_trainer.DEBUG_TOPIC)
            self._call("close")
            panel.close_fit(client, fit)
            alive = set(client.scheduler_info(n_workers=-1)["workers"])  # a lost worker would take a timeout
            client.run(
                _close_node, self.session, keys, workers=[w for w in self.workers if w in alive], on_error="ignore"
            )
            blob.release()
        self._conclude(results, progress, epochs, n, time.perf_counter() - t0)

    def _follow(self, futures: dict[str, Future], n: int, bar: Progress) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Wait for the trainers, calling listeners and advancing the progress bar as minibatches
        are acknowledged; returns the results of the trainers that finished and the session's last
        progress report."""
        network = self.net.network
        iteration = network.iteration
        progress: dict[str, Any] = {}
        pending = set(futures.values())
        while True:
            with contextlib.suppress(TimeoutError):
                wait(pending, timeout=self.poll * 10, return_when="FIRST_COMPLETED")
            pending = {f for f in pending if not f.done()}
            progress = self._call("progress")
            for item, examples, score in progress["reports"]:
                iteration += 1
                bar.advance(1, examples, score)
                for listener in self.net.listeners:
                    listener.iteration_done(network, iteration, network.epoch + item // n, score, examples)
            failed = [f for f in futures.values() if f.status == "error" and not _lost_worker(f)]
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
            wait(list(futures.values()), timeout=parse_timedelta(dask.config.get("dlscale.sharing.end-timeout")))
        self.client.cancel([f for f in futures.values() if not f.done()])

    def _conclude(
        self, results: list[dict[str, Any]], progress: dict[str, Any], epochs: int, n: int, seconds: float
    ) -> None:
        network = self.net.network
        states = [r for r in results if not r.get("lost") and not r.get("aborted")]
        lost = progress["lost"]
        if not states:
            raise RuntimeError(f"every gradient-sharing trainer was lost ({', '.join(lost)}); the network is unchanged")
        if lost:
            warnings.warn(
                f"gradient sharing lost trainer(s) {', '.join(lost)} with their workers; their "
                f"minibatches were trained by the {len(states)} others",
                TrainerLostWarning,
                stacklevel=4,
            )
        fitted = [s for s in states if s["examples"]] or states[:1]  # an idle trainer's optimizer has no state
        state = _worker.average(*fitted)
        state = dict(state, params=state["params"] + torch.stack([s["residual"] for s in states]).sum(0))
        _worker.apply_state(network, state)
        network.iteration += epochs * n
        network.epoch += epochs
        if self.master.collect_training_stats:
            stats = TrainingStats("gradient sharing", len(self.workers), self.batches.seconds)
            stats.trainers = [TrainerStats(**r["stats"]) for r in states]
            self.net._add_stats(stats)
        logger.info("gradient sharing: %d minibatches in %.2f s on %d trainers", epochs * n, seconds, len(states))


def _lost_worker(future: Future) -> bool:
    """Whether ``future`` failed because its worker died rather than through its own error."""
    from distributed.scheduler import KilledWorker

    return isinstance(future.exception(), KilledWorker)


def _log_debug(event: tuple[float, dict[str, Any]]) -> None:
    _, info = event
    logger.info(_trainer.DEBUG_FORMAT, info)
