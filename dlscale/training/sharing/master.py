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

import dataclasses
import logging
import warnings
from typing import Any, ClassVar

from distributed import Future, get_worker

from dlscale.data.loaders import keep_loaded, prefetch
from dlscale.encoding import Compressor, ResidualPostProcessor, ThresholdAlgorithm, compressor
from dlscale.encoding.registry import DEFAULT as DEFAULT_COMPRESSOR
from dlscale.errors import TrainerLostWarning
from dlscale.monitor.stats import TrainerStats
from dlscale.nn.listeners import SentUpdate
from dlscale.runtime.tasks import check_count
from dlscale.training import _sources, _worker
from dlscale.training._driver import FitRun
from dlscale.training._parking import Arrival, Warm
from dlscale.training._session import SessionRun
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
        _Session(self, run, batches).train(probe)


def _probe_parked(session: str, local: int, ref: Any, loader: Any) -> None:
    """Load one minibatch and compute the loss on it with a parked trainer's replica (what
    :func:`dlscale.training._worker.probe` does with a shipped one)."""
    network = plugin(get_worker()).parked[session][local].network
    network.score(next(prefetch([ref], loader, 0)))


class _Session(SessionRun):
    """One ``fit``'s gradient-sharing sessions: its trainers, the scheduler's and the workers' parts."""

    prefix = "sharing"
    extension = SHARING

    def place(self, nodes: list[str]) -> dict[str, tuple[str, int]]:
        """The trainers, ``workers_per_node`` on each worker, on as many workers as
        ``dlscale.training.sharing.max-trainers`` allows (at least one)."""
        per, cap = self.master.workers_per_node, self.config.max_trainers
        placed = nodes if cap is None else nodes[: max(1, cap // per)]
        return {f"{w}#{i}": (w, i) for w in placed for i in range(per)}

    def begin(self, probe: bool, left: Warm | None) -> None:
        run, b = self.run, self.batches
        if self.warm is None:
            self._replicas()
            if probe:
                run.probe()
        elif probe and not left.trained_on(b.refs[0], b.loader):
            w, i = next(iter(self.trainers.values()))
            run.pauses.result(
                self.client.submit(_probe_parked, self.warm, i, b.refs[0], b.loader, workers=[w], pure=False)
            )
        if self.master.encoding_debug_mode:
            self.client.subscribe_topic(_trainer.DEBUG_TOPIC, _log_debug)

    def _replicas(self) -> None:
        self.run.replicas = [f"{self.run.blob.key}/{i}" for i in range(self.master.workers_per_node)]

    def resend(self) -> None:
        super().resend()
        self._replicas()

    def end(self) -> None:
        if self.master.encoding_debug_mode:
            self.client.unsubscribe_topic(_trainer.DEBUG_TOPIC)

    def opened(self, order: list[int]) -> dict[str, Any]:
        self.spec = self._spec()
        self.retired: list[dict[str, Any]] = []  # the statistics of the trainers that left as their workers retired
        self.taken_back: list[int] = []
        self.drained = False
        self.due: list[Any] = []
        self.progress: dict[str, Any] = {}
        return {"order": order}

    def node_args(self) -> tuple[Any, ...]:
        return self.master.workers_per_node, self.master.mesh_build_mode, self.config

    def _spec(self) -> _trainer.TrainerSpec:
        """What every trainer of a segment is told: the master's settings, the network's iteration count
        and the session of the parked trainers that go on (:attr:`warm`), if any."""
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
            self.warm,
        )

    def submit(self, trainer: str, worker: str, local: int, k: int) -> Future:
        blob = None if self.warm is not None else self.run.blob  # the last fit's trainers go on: nothing to send
        return self.client.submit(
            _trainer.run,
            self.session,
            trainer,
            local,
            None if blob is None else blob.key,
            blob,
            self.batches.refs,
            self.batches.loader,
            self.spec,
            workers=[worker],
            allow_other_workers=True,
            pure=False,
            key=f"{self.session}-trainer-{k}",
        )

    def segment_length(self, order: list[int]) -> int:
        """Up to the next checkpoint by iterations or epochs: the segment ends there, its state whole."""
        return self.run.steps_to_checkpoint([item // self.n for item in order])

    def progressed(self, progress: dict[str, Any], pending: bool) -> list[Any]:
        """Report the minibatches acknowledged, and take back the items not yet handed out once a
        checkpoint is due or a worker joined (with room for its trainers)."""
        self.progress = progress
        self.retired.extend(progress["retired"])
        before = self.epochs_done()
        for item, examples, score, threshold, sparsity, sent, at in progress["reports"]:
            update = SentUpdate(sent, threshold, sparsity)
            self.run.step(item // self.n, 1, examples, score, iterations=1, at=at, update=update)
            self.reported([item], score)
        after = self.epochs_done()
        ended = after if after > before else None
        if not self.drained and pending:
            self.due = self.run.checkpoints_due(ended)
            room = self.config.max_trainers is None or len(self.trainers) < self.config.max_trainers
            if self.due or (progress["newcomers"] and room):
                self.taken_back, self.drained = self.call("drain"), True  # a checkpoint, or the newcomers' trainers
        elif not self.drained:  # the end of the segment
            self.due = self.run.checkpoints_due(ended)
        return self.due

    def conclude(self, futures: dict[str, Future], closed: Any, seconds: float) -> list[int]:
        """The trainers' states made one on a worker beside them (the driver takes one state, not one per
        trainer), on its way to the driver's network (``_parking.Arrival``: fetched in the background,
        taken when the network is read), and their statistics; returns the items taken back."""
        finished = [f for f in futures.values() if f.status == "finished"]
        combined = self.client.submit(_combine, *finished, pure=False) if finished else None
        told = _told(_combine()) if combined is None else self.run.pauses.result(self.client.submit(_told, combined))
        states = told["trainers"]
        self.complete = len(states) == len(self.trainers)  # and so parked, every one
        lost = self.progress["lost"]
        if told["dense_bytes"] is None:
            raise RuntimeError(f"every gradient-sharing trainer was lost ({', '.join(lost)}); the network is unchanged")
        if lost:
            warnings.warn(
                f"gradient sharing lost trainer(s) {', '.join(lost)} with their workers; their "
                f"minibatches were trained by the {len(states)} others",
                TrainerLostWarning,
                stacklevel=6,
            )
        self.run.network.arriving(Arrival([self.client.submit(_state, combined)], f"fit {self.fit}"))
        if self.run.stats is not None:  # a fit of several segments (checkpoints) has a record per trainer and segment
            self.run.stats.trainers.extend(TrainerStats(**s) for s in [r["stats"] for r in states] + self.retired)
            self.run.stats.dense_bytes = told["dense_bytes"]
        minibatches = sum(r["batches"] for r in states) + sum(s["minibatches"] for s in self.retired)
        logger.debug(  # a segment's: the fit's closing line is SessionRun's
            "gradient sharing: %d minibatches in %.2f s on %d trainers",
            minibatches,
            seconds,
            len(states),
        )
        return self.taken_back


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


def _told(combined: dict[str, Any]) -> dict[str, Any]:
    """What the driver reads of the combined results at once (on their worker): what each trainer
    reports of itself, and the bytes of the parameters (``None`` when no trainer returned a state)."""
    state = combined["state"]
    dense = None if state is None else state["params"].numel() * state["params"].element_size()
    return {"trainers": combined["trainers"], "dense_bytes": dense}


def _state(combined: dict[str, Any]) -> dict[str, Any]:
    """The combined state alone: what the driver's network takes when read."""
    return combined["state"]


def _log_debug(event: tuple[float, dict[str, Any]]) -> None:
    _, info = event
    logger.info(_trainer.DEBUG_FORMAT, info)
