"""The training page of the Dask dashboard: what every fit on the cluster is doing, live.

A scheduler plugin keeps, for each fit, one row per trainer (gradient sharing) or worker (parameter
averaging): minibatches, examples, loss and, for gradient sharing, the threshold, sparsity and bytes
of its updates, with the whole run's history in a bounded number of points (:class:`History`).
Gradient-sharing trainers report with the acknowledgements they send the scheduler anyway; parameter
averaging's driver reports the rounds settled since it last looked, in one call (a round of a small
model takes milliseconds, and a call per round cost the driver more CPU than the rest of its work);
the driver adds each row's phase shares when the fit collects statistics. A row that has fitted
nothing for ``dlscale.stall-warning`` while others progress is marked stalled and warned about in
the log, naming its worker.

The page itself is a Bokeh application of the scheduler's dashboard (:mod:`dlscale.monitor.dashboard`),
added when the plugin starts; the same state is served as JSON at ``/dlscale/training.json``. Both come
from the scheduler's own web server, so they work for an embedded cluster and a remote scheduler alike.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import dask.config
import tornado.web
from distributed.diagnostics.plugin import SchedulerPlugin

from dlscale import config
from dlscale.monitor.stats import PHASES, TrainingStats
from dlscale.registry import Registry
from dlscale.runtime.extensions import Extension, install

if TYPE_CHECKING:
    from distributed import Client
    from distributed.scheduler import Scheduler

logger = logging.getLogger("dlscale")
_announced: weakref.WeakSet[Client] = weakref.WeakSet()  # clients whose first fit logged the address

NAME = "dlscale-panel"
PAGE = "/training"  # the page in the dashboard's menu
PLOT = "/individual-dlscale-training"  # its charts alone, among the dashboard's individual plots
JSON = "/dlscale/training.json"
HISTORY = 512  # points kept per row (even): older reports are merged into buckets of equal size
RATE_WINDOW = 10.0  # seconds over which throughput is measured
LOSS_SMOOTHING = 0.1  # weight of each report in a row's smoothed loss (an exponential moving average)


class Point(NamedTuple):
    """One bucket of a row's reports: the first report's ``time``; the counts after its last report;
    ``loss`` the mean over its examples and ``smoothed`` the moving average after its last report;
    the last ``threshold`` and ``sparsity``; ``weight`` the examples its loss is the mean of."""

    time: float
    minibatches: int
    examples: int
    loss: float
    smoothed: float
    threshold: float | None
    sparsity: float | None
    bytes_sent: int
    weight: int

    def merge(self, later: Point) -> Point:
        """One bucket of this one and the ``later`` one that follows it."""
        weight = self.weight + later.weight
        losses = [(p.loss, p.weight) for p in (self, later) if math.isfinite(p.loss)]
        if losses and sum(w for _, w in losses) > 0:
            loss = sum(v * w for v, w in losses) / sum(w for _, w in losses)
        else:
            loss = later.loss if math.isfinite(later.loss) else self.loss
        return later._replace(time=self.time, loss=loss, weight=weight)


class History:
    """A whole run's reports in at most ``capacity`` points, every point a bucket of the same number
    (:attr:`width`) of consecutive reports, so that the run is covered evenly from its first report.

    Each report becomes a point while there is room; a full history merges its points in adjacent
    pairs (every bucket of ``width`` reports becomes one of ``2 * width``, the first report's time
    kept) and later reports are gathered ``width`` at a time before they become a point. The
    unfinished bucket is :attr:`pending`. :attr:`generation` counts the merges, so that a page that
    has shown the points can tell whether to append the new ones or redraw."""

    def __init__(self, capacity: int = HISTORY) -> None:
        if capacity < 2 or capacity % 2:
            raise ValueError(f"a history's capacity is an even number of at least 2, not {capacity!r}")
        self.capacity = capacity
        self.width = 1
        self.points: list[Point] = []
        self.pending: Point | None = None
        self.pending_reports = 0
        self.generation = 0

    def add(self, point: Point) -> None:
        self.pending = point if self.pending is None else self.pending.merge(point)
        self.pending_reports += 1
        if self.pending_reports < self.width:
            return
        self.points.append(self.pending)
        self.pending, self.pending_reports = None, 0
        if len(self.points) == self.capacity:
            self.points = [a.merge(b) for a, b in zip(self.points[::2], self.points[1::2], strict=True)]
            self.width *= 2
            self.generation += 1


@dataclass
class _Row:
    worker: str
    since: float  # when the row last fitted a minibatch (or appeared)
    minibatches: int = 0
    examples: int = 0
    loss: float = math.nan
    smoothed: float = math.nan
    threshold: float | None = None
    sparsity: float | None = None
    bytes_sent: int = 0
    stalled: bool = False
    history: History = field(default_factory=History)
    recent: deque[tuple[float, int, int]] = field(default_factory=deque)  # (time, examples, bytes) in the window
    phases: dict[str, float] = field(default_factory=dict)  # seconds by phase, when statistics are collected

    def rates(self) -> tuple[float, float]:
        """Examples and bytes sent per second over the last :data:`RATE_WINDOW` seconds of reports."""
        if len(self.recent) < 2:
            return math.nan, math.nan
        (t0, e0, b0), (t1, e1, b1) = self.recent[0], self.recent[-1]
        return ((e1 - e0) / (t1 - t0), (b1 - b0) / (t1 - t0)) if t1 > t0 else (math.nan, math.nan)


@dataclass
class Fit:
    """One fit's record on the scheduler."""

    approach: str
    minibatches: int  # in the whole fit
    started: float
    stall_after: float
    ended: float | None = None
    rows: dict[str, _Row] = field(default_factory=dict)
    rounds: list[tuple[float, float]] = field(default_factory=list)  # parameter averaging: (reported, seconds)
    exactly_once: dict[str, int] | None = None  # the finished fit's tally, summed over its epochs
    receipt: str | None = None  # what the finished fit's master chose, why, predicted and measured

    def done(self) -> int:
        return sum(r.minibatches for r in self.rows.values())

    def view(self, now: float) -> dict[str, Any]:
        elapsed = (self.ended or now) - self.started
        return {
            "approach": self.approach,
            "started": self.started,
            "ended": self.ended,
            "minibatches": self.minibatches,
            "done": self.done(),
            "examples": sum(r.examples for r in self.rows.values()),
            "seconds": elapsed,
            "rounds": [seconds for _, seconds in self.rounds],
            "exactly_once": self.exactly_once,
            "receipt": self.receipt,
            "rows": {
                name: {
                    "worker": r.worker,
                    "minibatches": r.minibatches,
                    "examples": r.examples,
                    "examples_per_second": _finite(r.rates()[0]),
                    "loss": _finite(r.loss),
                    "threshold": r.threshold,
                    "sparsity": r.sparsity,
                    "bytes_sent": r.bytes_sent,
                    "stalled_seconds": now - r.since if r.stalled else None,
                    "phases": r.phases,
                }
                for name, r in self.rows.items()
            },
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


class TrainingPanel(SchedulerPlugin):
    """The training page's state on the scheduler, its ``dlscale_panel_*`` handlers and its pages.
    ``clock`` gives the time of each report (Unix seconds)."""

    name = NAME
    idempotent = True

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.fits: OrderedDict[str, Fit] = OrderedDict()
        self.clock = clock

    async def start(self, scheduler: Scheduler) -> None:
        scheduler.handlers.update(
            {
                "dlscale_panel_begin": self.begin,
                "dlscale_panel_record": self.record,
                "dlscale_panel_phases": self.set_phases,
                "dlscale_panel_end": self.end,
            }
        )
        app = getattr(scheduler, "http_application", None)
        if app is not None:
            app.add_handlers(r".*", [(JSON, _Json, {"panel": self})])
            from dlscale.monitor import dashboard  # Bokeh, which only the scheduler's page needs

            dashboard.add_pages(scheduler, self)

    def begin(self, fit: str, approach: str, minibatches: int, stall_after: float = 60.0, keep: int = 64) -> None:
        """Start recording ``fit`` of ``minibatches`` in all, keeping the last ``keep`` fits."""
        self.fits[fit] = Fit(approach, minibatches, self.clock(), stall_after)
        while len(self.fits) > keep:
            self.fits.popitem(last=False)

    def record(self, fit: str, rows: list[dict[str, Any]], rounds: Sequence[float] = ()) -> None:
        """Add reports, in order: each names its ``row`` and ``worker`` and counts ``minibatches`` and
        ``examples`` fitted with mean ``loss``; gradient sharing adds the ``threshold`` and
        ``sparsity`` of its last update and the ``bytes_sent`` since its last report. ``rounds``: the
        seconds of each parameter-averaging round that these reports end."""
        f = self.fits.get(fit)
        if f is None:
            return
        now = self.clock()
        for report in rows:
            row = f.rows.get(report["row"])
            if row is None:
                row = f.rows[report["row"]] = _Row(report["worker"], since=now)
            row.worker = report["worker"]
            examples = report["examples"]
            row.minibatches += report["minibatches"]
            row.examples += examples
            row.loss = report["loss"]
            if math.isfinite(row.loss) and examples:
                alpha = LOSS_SMOOTHING
                row.smoothed = (
                    row.loss if not math.isfinite(row.smoothed) else (1 - alpha) * row.smoothed + alpha * row.loss
                )
            row.threshold = report.get("threshold", row.threshold)
            row.sparsity = report.get("sparsity", row.sparsity)
            row.bytes_sent += report.get("bytes_sent", 0)
            if report["minibatches"]:
                row.since = now
                if row.stalled:
                    row.stalled = False
                    logger.info("%s fits again", _label(report["row"], row.worker))
            if not report["minibatches"]:
                continue  # a row announced before its first minibatch
            row.recent.append((now, row.examples, row.bytes_sent))
            while len(row.recent) > 2 and row.recent[1][0] <= now - RATE_WINDOW:
                row.recent.popleft()
            row.history.add(
                Point(
                    now,
                    row.minibatches,
                    row.examples,
                    row.loss,
                    row.smoothed,
                    row.threshold,
                    row.sparsity,
                    row.bytes_sent,
                    examples,
                )
            )
        f.rounds.extend((now, seconds) for seconds in rounds)
        if any(report["minibatches"] for report in rows):
            self._check_stalls(f, now)

    def _check_stalls(self, f: Fit, now: float) -> None:
        """Others progress: mark (and warn about, once) each row that has fitted nothing for the fit's
        ``stall_after`` seconds."""
        for name, row in f.rows.items():
            if not row.stalled and now - row.since >= f.stall_after:
                row.stalled = True
                logger.warning(
                    "%s has fitted no minibatch for %.0f s while others progress",
                    _label(name, row.worker),
                    now - row.since,
                )

    def set_phases(self, fit: str, phases: dict[str, dict[str, float]]) -> None:
        """Each row's seconds by phase (from the fit's statistics)."""
        f = self.fits.get(fit)
        if f is None:
            return
        for name, seconds in phases.items():
            if name in f.rows:
                f.rows[name].phases = seconds

    def end(self, fit: str, exactly_once: dict[str, int] | None = None, receipt: str | None = None) -> None:
        """``fit`` finished, with its exactly-once tally (``planned``, ``once``, ``redone``, ``lost``,
        ``duplicated`` minibatches and ``workers_lost``), or failed (``None``); ``receipt``: what its
        master chose, why, and the speedup predicted beside the one measured, if it chose."""
        f = self.fits.get(fit)
        if f is not None:
            f.ended, f.exactly_once, f.receipt = self.clock(), exactly_once, receipt

    def view(self) -> dict[str, Any]:
        """Every kept fit, newest first, as plain data (the JSON page)."""
        now = self.clock()
        return {fit: f.view(now) for fit, f in reversed(self.fits.items())}


def _label(row: str, worker: str) -> str:
    """A row in a message: a trainer and its worker (gradient sharing), or a worker (parameter averaging)."""
    return f"worker {worker}" if row == worker else f"trainer {row} on worker {worker}"


PANEL = Extension(NAME, scheduler_plugin=TrainingPanel)

REGISTRY: Registry[Extension] = Registry("dashboard_page", Extension)
"""Pages a :class:`~dlscale.SparkContext` adds to its cluster's dashboard as it starts."""
REGISTRY.register("training", PANEL)


class _Json(tornado.web.RequestHandler):
    def initialize(self, panel: TrainingPanel) -> None:
        self.panel = panel

    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(self.panel.view()))


# -- the driver's side -------------------------------------------------------------------------
def open_fit(client: Client, approach: str, minibatches: int, fit: str | None = None) -> str | None:
    """Install the panel on the scheduler (once) and start a fit's record; returns the fit's id, or
    ``None`` where ``dlscale.panel`` is off. The first fit through a client logs the page's address
    (as Spark logs its UI's)."""
    if not config.get("panel"):
        return None
    fit = fit or f"{approach.replace(' ', '-')}-{uuid.uuid4().hex[:8]}"
    install(client, PANEL)
    stall_after = dask.utils.parse_timedelta(config.get("stall-warning"), default="s")
    client.sync(
        client.scheduler.dlscale_panel_begin,
        fit=fit,
        approach=approach,
        minibatches=minibatches,
        stall_after=stall_after,
        keep=config.get("panel-fits"),
    )
    if client not in _announced and (address := url(client, fit)) is not None:
        _announced.add(client)
        logger.info("training panel at %s", address)
    return fit


def record(client: Client, fit: str | None, rows: list[dict[str, Any]], rounds: Sequence[float]) -> None:
    """Send the reports of parameter-averaging rounds and their seconds (see :meth:`TrainingPanel.record`)
    from the driver."""
    if fit is not None:
        client.sync(client.scheduler.dlscale_panel_record, fit=fit, rows=rows, rounds=list(rounds))


class RowPhases:
    """Each panel row's seconds by phase so far, from a fit's statistics: a trainer's
    :data:`~dlscale.monitor.stats.PHASES`, or a worker's fitting and waiting for data over its rounds.
    Rounds are added to the totals as they are recorded, each once: a call costs the rounds since the
    last, not the whole fit's."""

    def __init__(self, stats: TrainingStats) -> None:
        self.stats = stats
        self.counted = 0  # the statistics' rounds already in the totals
        self.totals: dict[str, dict[str, float]] = {}

    def __call__(self) -> dict[str, dict[str, float]]:
        for r in self.stats.rounds[self.counted :]:
            for w in r.workers:
                seconds = self.totals.setdefault(w.worker, {"fit": 0.0, "wait": 0.0})
                seconds["fit"] += w.fit_seconds - w.wait_seconds
                seconds["wait"] += w.wait_seconds
        self.counted = len(self.stats.rounds)
        trainers = {t.trainer: {p: t.seconds(p) for p in PHASES} for t in self.stats.trainers}
        return {**trainers, **{row: dict(seconds) for row, seconds in self.totals.items()}}


def record_phases(client: Client, fit: str | None, phases: dict[str, dict[str, float]]) -> None:
    """Send each row's seconds by phase so far (:class:`RowPhases`) from the driver."""
    if fit is not None and phases:
        client.sync(client.scheduler.dlscale_panel_phases, fit=fit, phases=phases)


def close_fit(
    client: Client, fit: str | None, exactly_once: dict[str, int] | None = None, receipt: str | None = None
) -> None:
    """End ``fit``'s record: finished with its exactly-once tally and its master's receipt (see
    :meth:`TrainingPanel.end`), or failed."""
    if fit is not None:
        client.sync(client.scheduler.dlscale_panel_end, fit=fit, exactly_once=exactly_once, receipt=receipt)


def url(client: Client, fit: str | None = "") -> str | None:
    """The training page's address in the dashboard; ``None`` without a dashboard, or for a fit the
    panel does not record (``fit`` None, as :func:`open_fit` returns with the panel off)."""
    if fit is None or not client.scheduler_info().get("services", {}).get("dashboard"):
        return None
    return client.dashboard_link.rsplit("/", 1)[0] + PAGE


def in_scheduler(scheduler: Scheduler) -> TrainingPanel | None:
    """The panel, from code running in the scheduler (gradient sharing's control plane)."""
    return scheduler.plugins.get(NAME)
