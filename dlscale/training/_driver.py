"""The driver's side of a fit, the same for every training master.

A master is handed a :class:`FitContext` (what it may use of the network's owner) and runs its fit
inside a :class:`FitRun`, which does what both masters do around their own rounds or trainers: list
the workers (and refuse an empty cluster), draw the seed, send the network once (when first
needed), check one minibatch on a worker, show progress (bar and dashboard panel), count iterations
and call the listeners after every step, tell of workers Dask paused while it waits on them, collect
the statistics, and on the way out drop the workers' copies of the network and, after a failure,
leave the network's counters as they were.
"""

from __future__ import annotations

import copy
import logging
import math
import secrets
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from dask.utils import format_time, parse_timedelta
from distributed import Client, Future

from dlscale import config
from dlscale.errors import WorkersUnavailableError
from dlscale.monitor import panel
from dlscale.monitor.progress import Progress
from dlscale.monitor.stats import TrainingStats
from dlscale.nn import shipping
from dlscale.nn.listeners import SentUpdate, StepReport, TrainingListener
from dlscale.nn.network import Network
from dlscale.runtime.cluster import PauseWatch, cluster_workers
from dlscale.runtime.extensions import install
from dlscale.runtime.retirement import RETIREMENT
from dlscale.training import _worker
from dlscale.training.checkpoints import CheckpointListener, FitPosition, checkpointers

if TYPE_CHECKING:
    from dlscale.training._sources import Minibatches
    from dlscale.training.master import TrainingMaster

logger = logging.getLogger("dlscale")

PANEL_INTERVAL = 0.25
"""Seconds at least between the driver's calls that send the panel parameter-averaging rounds as they
settle (a round of a small model takes milliseconds; a call per round cost the driver more CPU than
the rest of its work)."""


@dataclass(frozen=True)
class FitContext:
    """What a master uses for one fit: the cluster's ``client``, the ``network`` it trains (on the
    driver, updated in place), the ``listeners`` called after every step, and ``record_stats``, which
    receives the fit's :class:`~dlscale.monitor.stats.TrainingStats` when they were asked for."""

    client: Client
    network: Network
    listeners: Sequence[TrainingListener] = ()
    record_stats: Callable[[TrainingStats], None] = lambda stats: None


def workers(client: Client) -> list[str]:
    """The cluster's workers, sorted; an empty cluster is an error before anything is sent."""
    found = sorted(cluster_workers(client))
    if not found:
        raise RuntimeError("the cluster has no workers to train on")
    return found


def _listed(names: list[str], shown: int = 8) -> str:
    """``names`` for a message: the first ``shown`` of them, and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _check_resume(resume: FitPosition, approach: str, minibatches: int, epochs: int) -> None:
    """Refuse to resume a fit from a checkpoint of another fit, or one that is past the fit's end."""
    for what, theirs, ours in (
        ("training master", resume.approach, approach),
        ("number of minibatches", resume.minibatches, minibatches),
    ):
        if theirs != ours:
            raise ValueError(
                f"the checkpoint is of a fit with another {what} ({theirs!r}, this fit has {ours!r}): "
                "resume with the same master and data as the fit that wrote it"
            )
    if resume.epoch > epochs:
        raise ValueError(
            f"the checkpoint was written after epoch {resume.epoch} of its fit, past this fit's {epochs} epoch(s)"
        )


def wanted_workers(client: Client) -> int:
    """How many workers a fit waits for: ``dlscale.training.min-workers``, or by default every worker the
    cluster object was asked for (a ``LocalCluster``'s workers, a dask-jobqueue cluster's ``scale``), at
    least one; one on a cluster known only by its scheduler's address. A ``SpecCluster``'s asked-for
    workers are its ``worker_spec`` (a job of several processes counts each): ``scale`` sets it at once,
    where the cluster's own ``requested`` counts only the workers and jobs its event loop started since."""
    setting = config.get("training.min-workers")
    if setting is not None:
        if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
            raise ValueError(f"dlscale.training.min-workers must be an integer >= 1 or null, got {setting!r}")
        return setting
    spec = getattr(getattr(client, "cluster", None), "worker_spec", None)
    if not isinstance(spec, dict):
        return 1
    return max(1, sum(len(s["group"]) if isinstance(s, dict) and "group" in s else 1 for s in spec.values()))


def _pending(client: Client) -> str:
    """What the cluster object says of the workers not up yet: its jobs (or worker specs) none of whose
    workers has connected."""
    cluster = getattr(client, "cluster", None)
    spec = getattr(cluster, "worker_spec", None)
    if not spec:
        return ""
    names = {str(info.get("name")) for info in cluster_workers(client).values()}
    pending = sorted(str(job) for job in spec if not any(n == str(job) or n.startswith(f"{job}-") for n in names))
    if not pending:
        return ""
    cluster_name = type(cluster).__name__
    return f"; {cluster_name} has {len(pending)} job(s) not connected yet (pending or starting): {_listed(pending)}"


_told: weakref.WeakKeyDictionary[Client, list[str]] = weakref.WeakKeyDictionary()
"""The workers each client's last fit started on, as logged: a loop of one fit per epoch on the same
workers says which they are once, not once a fit (the debug log has every fit's)."""


def start_workers(client: Client) -> list[str]:
    """The workers a fit starts on, sorted, once :func:`wanted_workers` are up: on a batch system they join as
    their jobs start, and a fit that began with the first would leave the others idle. Waits up to
    ``dlscale.training.workers-timeout``, then fails naming how many are up and which jobs are pending.
    Logs them when they are not those of the client's last fit."""
    wanted = wanted_workers(client)
    timeout = parse_timedelta(config.get("training.workers-timeout"))
    start = time.monotonic()
    told = start
    while len(found := sorted(cluster_workers(client))) < wanted:
        now = time.monotonic()
        if now - start >= timeout:
            raise WorkersUnavailableError(
                f"the fit needs {wanted} worker(s) and {len(found)} are up after waiting {format_time(timeout)}"
                f"{_pending(client)}. Scale the cluster, wait for its jobs, or set "
                "dlscale.training.min-workers (and dlscale.training.workers-timeout)"
            )
        if now - told >= 30:
            logger.info("waiting for workers: %d of %d up%s", len(found), wanted, _pending(client))
            told = now
        time.sleep(0.2)
    level = logging.DEBUG if _told.get(client) == found else logging.INFO
    _told[client] = found
    logger.log(level, "training on %d worker%s: %s", len(found), "s" * (len(found) > 1), _listed(found))
    return found


class FitRun:
    """One fit of ``master`` on ``batches`` for ``epochs`` epochs, used as a context manager.

    The network (pickled in ``blob``; if that is ``None``, pickled when first needed, which a fit that
    goes on with the last fit's parked trainers never is) is sent once to every worker when first
    needed: :attr:`blob` is its future and :attr:`replicas` the keys under which workers keep an
    unpickled copy (a master that keeps several per worker lists them there). A step's report goes to
    :meth:`step`. On a clean exit the epoch counter moves on by ``epochs`` and the statistics are
    recorded; after an error the network's counters are restored (its parameters are only replaced by
    a master once training succeeded).
    """

    def __init__(
        self,
        context: FitContext,
        master: TrainingMaster,
        blob: bytes | None,
        batches: Minibatches,
        epochs: int,
        resume: FitPosition | None = None,
    ) -> None:
        self.began = time.time()  # the fit's start, as its caller times it once the minibatches are ready
        self.client, self.network, self.listeners = context.client, context.network, context.listeners
        self.context, self.master, self.batches, self.epochs = context, master, batches, epochs
        if resume is not None:
            _check_resume(resume, master.approach, len(batches.refs), epochs)
        self.resume = resume
        self.workers = start_workers(self.client)
        if resume is not None:
            self.seed = resume.seed
        else:
            self.seed = master.rng_seed if master.rng_seed is not None else secrets.randbits(63)
        self.checkpointers = checkpointers(self.listeners)
        for listener in self.checkpointers:
            listener.fit_started(self.network.iteration)
        self.stats = (
            TrainingStats(master.approach, len(self.workers), batches.seconds)
            if master.collect_training_stats
            else None
        )
        self._row_phases = panel.RowPhases(self.stats) if self.stats is not None else None
        self._blob = blob
        self.parked_network = blob is None  # the master found the network as the last fit's parked trainers left it
        self._counters = self.network.iteration, self.network.epoch
        self._first_epoch = resume.first_epoch if resume is not None else self.network.epoch
        self.fit_id: str | None = None
        self.exactly_once: dict[str, int] | None = None  # the fit's tally, summed (its master sets it)
        self.receipt: str | None = None  # what its master chose, why, predicted and measured (it sets it)
        self._progress: Progress | None = None
        self._panel: tuple[list[dict[str, Any]], list[float]] = [], []  # rounds' rows and seconds, not yet sent
        self._panel_sent = -math.inf  # when rounds last went to the panel (time.monotonic())
        self.pauses = PauseWatch(self.client)  # the driver waits: it tells of workers Dask paused

    def __enter__(self) -> FitRun:
        install(self.client, RETIREMENT)  # a worker retired during the fit ends its part in order
        self._shipped: Future | None = None
        self.replicas: list[str] = []
        return self

    @property
    def blob(self) -> Future:
        """The pickled network's future, held on every worker (one copy would die with its worker): sent
        when first asked for, so that a fit that trains networks the workers still hold sends nothing."""
        if self._shipped is None:
            if self._blob is None:
                self._blob = shipping.serialise(self.network)
            self._shipped = shipping.ship_blob(self.client, self._blob, waiting="the fit")
            self.replicas = [self._shipped.key]
        return self._shipped

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        try:
            if self._progress is not None:
                self._progress.close()
            if error is None:
                self.send_rounds(phases=True)
            if error is None:
                panel.close_fit(self.client, self.fit_id, self.exactly_once, self.receipt)
            else:
                panel.close_fit(self.client, self.fit_id)
            if self._shipped is not None:
                alive = set(cluster_workers(self.client))  # a lost worker would take a timeout
                self.client.run(
                    _worker.drop_replicas,
                    self.replicas,
                    workers=[w for w in self.workers if w in alive],
                    on_error="ignore",
                )
                self._shipped.release()
        finally:
            if error is not None:
                self.network.iteration, self.network.epoch = self._counters
            for listener in self.listeners:
                listener.fit_done(self.network)
        if error is None:
            self.network.epoch = self._first_epoch + self.epochs
            if self.stats is not None:
                self.context.record_stats(self.stats)

    @property
    def first_epoch(self) -> int:
        """The network's epoch counter when the fit began (a resumed fit: when the fit it resumes began):
        epoch ``e`` of the fit is its ``first_epoch + e``."""
        return self._first_epoch

    def position(self, epoch: int, rounds: int = 0, remaining: tuple[int, ...] | None = None) -> FitPosition:
        """The fit's position with ``epoch`` (of the fit) the next to train, ``rounds`` of it done."""
        return FitPosition(
            self.master.approach,
            self.seed,
            self.first_epoch,
            self.epochs,
            len(self.batches.refs),
            epoch,
            rounds,
            remaining,
        )

    def checkpoints_due(self, epochs_done: int | None = None) -> list[CheckpointListener]:
        """The checkpoint listeners that want a checkpoint now; ``epochs_done``: the fit's epochs done when
        one has just ended."""
        done = None if epochs_done is None else self.first_epoch + epochs_done
        return [c for c in self.checkpointers if c.due(self.network.iteration, done)]

    def steps_to_checkpoint(self, epochs: Sequence[int]) -> int:
        """Of the work items ahead, one step each (``epochs``: the fit's epoch of each, in order), how
        many are trained before a checkpoint by iterations or by epochs is due: all when none is. A
        segment that ends there writes it at that point, however far its driver lags its trainers."""
        ends = {}  # the fit's epoch -> how many items ahead are trained when it has ended
        for k, epoch in enumerate(epochs, 1):
            ends[epoch] = k
        bound, last = len(epochs), 0
        for epoch in sorted(ends):
            last = max(last, ends[epoch])
            if any(c.wants_epoch_end(self.first_epoch + epoch + 1) for c in self.checkpointers):
                bound = min(bound, last)
                break
        steps = [c.iterations_to_due(self.network.iteration) for c in self.checkpointers]
        return min([bound, *(s for s in steps if s is not None)])

    def write_checkpoint(
        self, due: list[CheckpointListener], position: FitPosition, state: dict[str, Any] | None = None
    ) -> None:
        """Write a checkpoint at ``position`` for the listeners ``due``: the driver's network as a segment
        of the fit left it, or with ``state`` (a network's state as its trainers hold it at ``position``,
        while they go on), on a copy counting the epochs done there."""
        if not due:
            return
        network = copy.deepcopy(self.network)
        if state is not None:
            _worker.apply_state(network, state, copy=False)
        network.epoch = max(network.epoch, self.first_epoch + position.epoch)
        for listener in due:
            listener.save(network, position)

    def reship(self) -> None:
        """Put the driver's network, as it is now, in place of the one the fit began with (a fit that
        goes on in a new segment after a checkpoint): :attr:`blob` then sends it."""
        if self._shipped is not None:
            alive = list(cluster_workers(self.client))  # one lost since holds nothing to drop
            self.client.run(_worker.drop_replicas, self.replicas, workers=alive, on_error="ignore")
            self._shipped.release()
        self._blob, self._shipped = shipping.serialise(self.network), None

    def probe(self, key: str | None = None) -> None:
        """Load the first minibatch on a worker and compute the loss on it, into the copy of the
        network kept under ``key`` (default: the first of :attr:`replicas`)."""
        blob, b = self.blob, self.batches
        key = self.replicas[0] if key is None else key
        try:
            self.pauses.result(self.client.submit(_worker.probe, key, blob, b.refs[0], b.loader, pure=False))
        except Exception as e:
            e.add_note(f"raised by the network on minibatch {b.names[0]}, before training")
            raise

    def show_progress(self, fit: str | None = None) -> None:
        """Open the fit's record in the dashboard panel (under ``fit``, or a new id) and its progress."""
        total = len(self.batches.refs)
        self.fit_id = panel.open_fit(self.client, self.master.approach, self.epochs * total, fit=fit)
        self._progress = Progress(self.master.approach, total, self.epochs, self.first_epoch)

    def send_rounds(self, phases: bool = False) -> None:
        """Send the panel the rounds :meth:`step` was given since the last call, in one call, and with
        them (or with ``phases``) every row's phases when the fit collects statistics."""
        rows, rounds = self._panel
        if rounds:
            self._panel, self._panel_sent = ([], []), time.monotonic()
            panel.record(self.client, self.fit_id, rows, rounds)
        if self._row_phases is not None and (rounds or phases):
            panel.record_phases(self.client, self.fit_id, self._row_phases())

    def step(
        self,
        epoch: int,
        minibatches: int,
        examples: int,
        score: float,
        iterations: int,
        round_rows: list[dict[str, Any]] | None = None,
        round_seconds: float = math.nan,
        at: float | None = None,
        update: SentUpdate | None = None,
    ) -> None:
        """A step done in epoch ``epoch`` of the fit: ``minibatches`` trained on ``examples`` examples
        with mean loss ``score``, moving the network on by ``iterations``; ``at`` is when it was
        reported (default now), ``update`` what it sent (gradient sharing). A parameter-averaging round
        gives its panel rows and its seconds: sent at once if none went for :data:`PANEL_INTERVAL`,
        else with the next :meth:`send_rounds`. Advances the progress, the network's counters and
        calls every listener."""
        network = self.network
        network.iteration += iterations
        network.epoch = max(network.epoch, self.first_epoch + epoch)
        at = time.time() if at is None else at
        if self._progress is not None:
            self._progress.advance(epoch, minibatches, examples, score, at)
        if round_rows is not None:
            self._panel[0].extend(round_rows)
            self._panel[1].append(round_seconds)
            if time.monotonic() - self._panel_sent >= PANEL_INTERVAL:  # before the listeners, which may take long
                self.send_rounds()
        report = StepReport(network.iteration, iterations, self.first_epoch + epoch, score, examples, at, update)
        for listener in self.listeners:
            listener.step_done(network, report)
