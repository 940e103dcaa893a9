"""Gradient sharing (DL4J's ``SharedTrainingMaster``): asynchronous SGD with compressed updates
exchanged peer to peer (Strom, Interspeech 2015; Lin et al., ICLR 2018).

The driver places ``workers_per_node`` long-lived trainers on every worker, opens a session on the
scheduler (membership, minibatches) and on every worker (inboxes, links), and then only follows
progress: updates go from worker to worker, never through the driver or the scheduler. At the end
the trainers' states are averaged on a worker (they hold the same parameters when no peer was lost;
batch-norm statistics and momentum are per trainer and averaged) and the updates still in their
residuals are added, so nothing a trainer computed is dropped; the driver takes that one state.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
import uuid
import warnings
from typing import Any, ClassVar

import numpy as np
from distributed import Future, get_worker, wait

from dlscale.data.loaders import keep_loaded, prefetch
from dlscale.encoding import Compressor, ResidualPostProcessor, ThresholdAlgorithm, compressor
from dlscale.encoding.registry import DEFAULT as DEFAULT_COMPRESSOR
from dlscale.errors import TrainerLostWarning
from dlscale.monitor.stats import TrainerStats
from dlscale.nn.listeners import SentUpdate
from dlscale.runtime.cluster import cluster_workers
from dlscale.runtime.extensions import install
from dlscale.runtime.tasks import check_count
from dlscale.training import _sources, _worker
from dlscale.training._config import SessionConfig
from dlscale.training._driver import FitRun, workers
from dlscale.training._parking import Warm
from dlscale.training._sources import HeldMinibatch
from dlscale.training.checkpoints import FitPosition
from dlscale.training.master import TrainingMaster
from dlscale.training.sharing import _mesh, _trainer
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
    (``dlscale.training.sharing.mesh-fanout``) so that no node talks to
    more than a few others. ``encoding_debug_mode`` logs each trainer's threshold, sparsity, message
    form and residual at every step (on the workers, and on the driver under
    ``dlscale.training.sharing``). ``prefetch`` minibatches are read ahead by each trainer. The
    ``dlscale.training`` settings are read on the driver when a fit starts. The settings every master
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


def _parked(session: str, dask_worker: Any = None) -> list[int]:
    return plugin(dask_worker).parked_trainers(session)


def _forget_parked(session: str, dask_worker: Any = None) -> None:
    plugin(dask_worker).forget(session)


def _probe_parked(session: str, local: int, ref: Any, loader: Any) -> None:
    """Load one minibatch and compute the loss on it with a parked trainer's replica (what
    :func:`dlscale.training._worker.probe` does with a shipped one)."""
    network = plugin(get_worker()).parked[session][local].network
    network.score(next(prefetch([ref], loader, 0)))


def _open_node(session: str, trainers: int, mode: str, config: SessionConfig, dask_worker: Any = None) -> None:
    plugin(dask_worker).open(session, trainers, mode, config)


def _close_node(session: str, dask_worker: Any = None) -> None:
    plugin(dask_worker).close(session)


class _Session:
    """One ``fit``'s gradient-sharing session: its trainers, the scheduler's and the workers' parts."""

    def __init__(self, master: SharedTrainingMaster, run: FitRun, batches: _sources.Minibatches, held: bool) -> None:
        self.master, self.run, self.batches = master, run, batches
        self.client, self.workers = run.client, run.workers
        self.config = SessionConfig.from_dask()
        self.fit = self.session = f"dlscale-sharing-{uuid.uuid4().hex[:12]}"  # a segment's session: fit-N
        self.trainers = self._place()
        self.complete = False  # whether every trainer of the last segment returned its state (and parked)
        self.warm: str | None = None  # the session of the last fit's trainers, when they go on in this one
        self.held: dict[str, Future] = {}
        if held:  # minibatches in worker memory: published for the trainers, fetched by name
            self.held = dict(zip(batches.names, batches.refs))
            loader = HeldMinibatch(f"{self.session}-minibatches", self.config.end_timeout)
            self.batches = dataclasses.replace(batches, refs=list(batches.names), loader=loader)

    def _place(self) -> dict[str, tuple[str, int]]:
        """The trainers, ``workers_per_node`` on each worker, on as many workers as
        ``dlscale.training.sharing.max-trainers`` allows (at least one)."""
        per, cap = self.master.workers_per_node, self.config.max_trainers
        placed = self.workers if cap is None else self.workers[: max(1, cap // per)]
        return {f"{w}#{i}": (w, i) for w in placed for i in range(per)}

    def _nodes(self) -> list[str]:
        """The workers with trainers."""
        return sorted({w for w, _ in self.trainers.values()})

    def _call(self, op: str, **kwargs: Any) -> Any:
        return self.client.sync(getattr(self.client.scheduler, f"dlscale_sharing_{op}"), session=self.session, **kwargs)

    def _order(self, start: int = 0) -> list[int]:
        """Work items, epoch after epoch from the fit's epoch ``start``: item ``e * n + i`` is minibatch ``i``
        in the fit's epoch ``e``, whose order depends on the seed and the epoch alone."""
        n, seed, first = len(self.batches.refs), self.run.seed, self.run.first_epoch
        return [
            e * n + int(i)
            for e in range(start, self.run.epochs)
            for i in np.random.default_rng([seed, first + e]).permutation(n)
        ]

    def _resumed(self, position: FitPosition) -> list[int]:
        """The work items left at a checkpoint's ``position``, for this fit's epochs (which may be more or
        fewer than those of the fit that wrote it)."""
        n = len(self.batches.refs)
        left = [item for item in position.remaining or () if item // n < self.run.epochs]
        return left + self._order(start=position.epochs)

    def train(self, probe: bool) -> None:
        master, client, run = self.master, self.client, self.run
        install(client, SHARING)
        left, b = master._warm, self.batches  # what the last fit left, taken back or forgotten below
        warm = self.warm = self._take_parked()
        if warm is None:
            run.replicas = [f"{run.blob.key}/{i}" for i in range(master.workers_per_node)]
            if probe:
                run.probe()
        elif probe and not left.trained_on(b.refs[0], b.loader):
            w, i = next(iter(self.trainers.values()))
            run.pauses.result(client.submit(_probe_parked, warm, i, b.refs[0], b.loader, workers=[w], pure=False))
        spec = self._spec(warm)
        if master.encoding_debug_mode:
            client.subscribe_topic(_trainer.DEBUG_TOPIC, _log_debug)
        run.show_progress(fit=self.fit)
        remaining = self._order() if run.resume is None else self._resumed(run.resume)
        self.left = collections.Counter(item // len(self.batches.refs) for item in remaining)  # items, by epoch
        kept = False
        try:
            if self.held:
                client.publish_dataset(**{self.batches.loader.dataset: self.held})
            segment = 0
            while remaining:
                if segment:  # the fit goes on from its checkpoint: the network and the workers there now
                    self._forget()
                    run.reship()
                    run.replicas = [f"{run.blob.key}/{i}" for i in range(master.workers_per_node)]
                    self.workers = workers(client)
                    self.trainers = self._place()
                    spec = dataclasses.replace(spec, iteration=run.network.iteration, warm=None)
                self.session = f"{self.fit}-{segment}" if segment else self.fit
                remaining, due = self._segment(remaining, spec)
                n = len(self.batches.refs)
                epoch = min(remaining) // n if remaining else run.epochs
                run.write_checkpoint(due, run.position(epoch, remaining=tuple(remaining)), lambda network: None)
                segment += 1
            if self.complete and self.config.keep_trainers:  # every trainer parked: the next fit can go on with them
                first = (self.batches.refs[0], self.batches.loader) if run.resume is None else None
                trainers = tuple(sorted(self.trainers.items()))
                master._warm = Warm.left(self.session, run.network, repr(master), trainers, first)
                kept = True
        finally:
            if not kept:
                self._forget()
            if master.encoding_debug_mode:
                client.unsubscribe_topic(_trainer.DEBUG_TOPIC)
            if self.held:
                client.unpublish_dataset(self.batches.loader.dataset)

    def _spec(self, warm: str | None) -> _trainer.TrainerSpec:
        """What every trainer of the fit is told: the master's settings, the network's iteration count
        and the session of the parked trainers that go on (``warm``), if any."""
        master = self.master
        return _trainer.TrainerSpec(
            master.compressor,
            master.aggregation,
            master.workers_per_node,
            master.prefetch,
            master.encoding_debug_mode,
            master.collect_training_stats,
            master.worker_gc_frequency_ms / 1000 if master.worker_periodic_gc else None,
            master.momentum_masking,
            keep_loaded(),
            self.run.network.iteration,
            warm,
        )

    def _take_parked(self) -> str | None:
        """The session whose trainers, parked on the workers by the last fit, go on in this one: the
        network and the master are as that fit left them, and every trainer is where it was. Otherwise
        ``None``, and the parked trainers are forgotten."""
        warm, self.master._warm = self.master._warm, None
        if warm is None:
            return None
        nodes = sorted({w for _, (w, _) in warm.trainers})
        alive = set(cluster_workers(self.client))
        usable = (
            self.run.resume is None
            and alive.issuperset(nodes)
            and self.run.parked_network
            and warm.trainers == tuple(sorted(self.trainers.items()))
        )
        if usable:
            held = self.client.run(_parked, warm.session, workers=nodes)
            usable = all(held[w] == sorted(i for _, (v, i) in warm.trainers if v == w) for w in nodes)
        if not usable:
            self.client.run(_forget_parked, warm.session, workers=[w for w in nodes if w in alive], on_error="ignore")
            return None
        return warm.session

    def _forget(self) -> None:
        """Drop what this fit's session parked on its workers, and what is left of the last fit's
        (its trainers take it as they start: nothing, unless this fit failed before)."""
        with contextlib.suppress(Exception):  # after a failure, the failure matters, not this
            alive = set(cluster_workers(self.client))
            for session in {self.session, self.warm} - {None}:
                self.client.run(
                    _forget_parked, session, workers=[w for w in self._nodes() if w in alive], on_error="ignore"
                )

    def _segment(self, order: list[int], spec: _trainer.TrainerSpec) -> tuple[list[int], list[Any]]:
        """Train the work items ``order`` in one session, until they are done or a checkpoint is due; then
        the trainers' states go to the driver's network. Returns the items left (taken back for a
        checkpoint) and the checkpoint listeners that want one now."""
        master, client, run = self.master, self.client, self.run
        t0 = time.perf_counter()
        self._call(
            "open",
            worker_of={t: w for t, (w, _) in self.trainers.items()},
            order=order,
            fit=self.fit,
            client=client.id,
        )
        blob = None if spec.warm is not None else run.blob  # the last fit's trainers go on: nothing to send
        try:
            client.run(
                _open_node,
                self.session,
                master.workers_per_node,
                master.mesh_build_mode,
                self.config,
                workers=self._nodes(),
            )
            futures = {
                t: client.submit(
                    _trainer.run,
                    self.session,
                    t,
                    i,
                    None if blob is None else blob.key,
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
            combined, progress, left, due = self._follow(futures)
        finally:
            self._call("close")
            alive = set(cluster_workers(client))  # a lost worker would take a timeout
            client.run(_close_node, self.session, workers=[w for w in self._nodes() if w in alive], on_error="ignore")
        self._conclude(combined, progress, time.perf_counter() - t0, last=not left)
        return left, due

    def _follow(self, futures: dict[str, Future]) -> tuple[dict[str, Any], dict[str, Any], list[int], list[Any]]:
        """Wait for the trainers, reporting to the run as minibatches are acknowledged, and take back the
        items not yet handed out once a checkpoint is due; returns the results of the trainers that
        finished, made one (:func:`_combine`), the session's last progress report, the items taken back
        and the listeners that want the checkpoint."""
        n = len(self.batches.refs)
        progress: dict[str, Any] = {}
        self.retired: list[dict[str, Any]] = []  # the statistics of the trainers that left as their workers retired
        pending = set(futures.values())
        left: list[int] = []
        due: list[Any] = []
        drained = False
        while True:
            with contextlib.suppress(TimeoutError):
                wait(pending, timeout=self.config.poll_interval * 10, return_when="FIRST_COMPLETED")
            pending = {f for f in pending if not f.done()}
            self.run.pauses.check()
            progress = self._call("progress")
            self.retired.extend(progress["retired"])
            epochs_done = self._epochs_done()
            for item, examples, score, threshold, sparsity, sent, at in progress["reports"]:
                update = SentUpdate(sent, threshold, sparsity)
                self.run.step(item // n, 1, examples, score, iterations=1, at=at, update=update)
                self.left[item // n] -= 1
            if not drained and pending:
                due = self.run.checkpoints_due(self._epochs_done(epochs_done))
                room = self.config.max_trainers is None or len(self.trainers) < self.config.max_trainers
                if due or (progress["newcomers"] and room):
                    left, drained = self._call("drain"), True  # a checkpoint, or trainers for the newcomers
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
        finished = [f for f in futures.values() if f.status == "finished"]
        # made one on a worker beside their states: the driver takes one state, not one per trainer
        if finished:
            combined = self.run.pauses.result(self.client.submit(_combine, *finished, pure=False))
        else:
            combined = _combine()
        if not drained:  # the end of the fit
            due = self.run.checkpoints_due(self._epochs_done(epochs_done))
        return combined, progress, left, due

    def _epochs_done(self, before: int | None = None) -> int | None:
        """The fit's epochs whose every minibatch is fitted, counted from its first; with ``before``, the
        count before, only when it has grown since (``None`` otherwise)."""
        done = next((e for e in range(self.run.epochs) if self.left[e] > 0), self.run.epochs)
        return done if before is None or done > before else None

    def _abort(self, futures: dict[str, Future]) -> None:
        """Stop every trainer (they stop at their next call to the scheduler) and wait for them."""
        self._call("fail", trainer="driver", error="stopped by the driver")
        with contextlib.suppress(TimeoutError):
            wait(list(futures.values()), timeout=self.config.end_timeout)
        self.client.cancel([f for f in futures.values() if not f.done()])

    def _conclude(self, combined: dict[str, Any], progress: dict[str, Any], seconds: float, last: bool) -> None:
        states = combined["trainers"]
        self.complete = len(states) == len(self.trainers)  # and so parked, every one
        lost = progress["lost"]
        if combined["state"] is None:
            raise RuntimeError(f"every gradient-sharing trainer was lost ({', '.join(lost)}); the network is unchanged")
        if lost:
            warnings.warn(
                f"gradient sharing lost trainer(s) {', '.join(lost)} with their workers; their "
                f"minibatches were trained by the {len(states)} others",
                TrainerLostWarning,
                stacklevel=6,
            )
        _worker.apply_state(self.run.network, combined["state"], copy=False)
        if self.run.stats is not None:  # a fit of several segments (checkpoints) has a record per trainer and segment
            self.run.stats.trainers.extend(TrainerStats(**s) for s in [r["stats"] for r in states] + self.retired)
            params = self.run.network.params()
            self.run.stats.dense_bytes = params.numel() * params.element_size()
        minibatches = sum(r["batches"] for r in states) + sum(s["minibatches"] for s in self.retired)
        logger.log(  # a segment that ends for a checkpoint or a newcomer is not news; the fit's last is
            logging.INFO if last else logging.DEBUG,
            "gradient sharing: %d minibatches in %.2f s on %d trainers",
            minibatches,
            seconds,
            len(states),
        )


def _combine(*results: dict[str, Any]) -> dict[str, Any]:
    """The trainers' results made one (on a worker): ``state``, the mean of the states of the trainers
    that fitted minibatches plus every residual (``None`` when no trainer returned a state), and
    ``trainers``, what each trainer that returned a state reports of itself, its state left out."""
    # a retired trainer sent its residual to its peers as it left: it has no state to add
    states = [r for r in results if not (r.get("lost") or r.get("aborted") or r.get("retired"))]
    if not states:
        return {"state": None, "trainers": []}
    fitted = [s for s in states if s["examples"]] or states[:1]  # an idle trainer's optimizer has no state
    state = _worker.average(*fitted)
    # a residual holds updates already weighted by the aggregation (1 / live trainers for "mean"),
    # as every message was: adding them all applies each unsent update as its sent part was
    params = state["params"].clone()
    for s in states:
        params.add_(s["residual"])
    kept = ("params", "buffers", "optimizer", "residual")
    return {
        "state": {"params": params, "buffers": state["buffers"], "optimizer": state["optimizer"]},
        "trainers": [{k: v for k, v in s.items() if k not in kept} for s in states],
    }


def _lost_worker(future: Future) -> bool:
    """Whether ``future`` failed because its worker died rather than through its own error."""
    from distributed.scheduler import KilledWorker

    return isinstance(future.exception(), KilledWorker)


def _log_debug(event: tuple[float, dict[str, Any]]) -> None:
    _, info = event
    logger.info(_trainer.DEBUG_FORMAT, info)
