"""A live training panel in the Dask dashboard: ``<dashboard>/dlscale/training``.

A scheduler plugin keeps, for the last few fits, one row per trainer (gradient sharing) or worker
(parameter averaging): minibatches, examples, throughput, loss and, for gradient sharing, the
threshold, sparsity and bytes of its updates, with a bounded history of each. Gradient-sharing
trainers report with the acknowledgements they send the scheduler anyway; parameter averaging's
driver reports each round. The page (self-contained HTML, refreshed every few seconds while a fit
runs) and its JSON (``/dlscale/training.json``) are served by the scheduler's own web server, so
they work for an embedded cluster and for a remote scheduler alike.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import tornado.web
from distributed.diagnostics.plugin import SchedulerPlugin

from dlscale import config
from dlscale.monitor.timeline import _CSS, _SERIES_COLOURS, _chart_svg, _e, _legend
from dlscale.runtime.extensions import Extension, install

if TYPE_CHECKING:
    from distributed import Client
    from distributed.scheduler import Scheduler

logger = logging.getLogger("dlscale")
_announced: weakref.WeakSet[Client] = weakref.WeakSet()  # clients whose first fit logged the address

NAME = "dlscale-panel"
PATH = "/dlscale/training"
FITS_KEPT = 4
HISTORY = 400  # points kept per row; older ones are thinned to every other one
RATE_WINDOW = 10.0  # seconds over which a row's current throughput is measured
REFRESH_SECONDS = 2


@dataclass
class _Row:
    worker: str
    minibatches: int = 0
    examples: int = 0
    loss: float = math.nan
    threshold: float | None = None
    sparsity: float | None = None
    bytes_sent: int = 0
    # (time, examples so far, loss, threshold, sparsity)
    points: list[tuple[float, int, float, float | None, float | None]] = field(default_factory=list)

    def rate(self) -> float:
        """Examples per second over the last :data:`RATE_WINDOW` seconds of reports."""
        if len(self.points) < 2:
            return math.nan
        t, n = self.points[-1][:2]
        since = next((p for p in self.points if p[0] >= t - RATE_WINDOW), self.points[0])
        if since is self.points[-1]:
            since = self.points[-2]
        return (n - since[1]) / (t - since[0]) if t > since[0] else math.nan


@dataclass
class _Fit:
    approach: str
    minibatches: int  # in the whole fit
    started: float = field(default_factory=time.time)
    ended: float | None = None
    rows: dict[str, _Row] = field(default_factory=dict)

    def view(self) -> dict[str, Any]:
        done = sum(r.minibatches for r in self.rows.values())
        elapsed = (self.ended or time.time()) - self.started
        return {
            "approach": self.approach,
            "started": self.started,
            "ended": self.ended,
            "minibatches": self.minibatches,
            "done": done,
            "examples": sum(r.examples for r in self.rows.values()),
            "seconds": elapsed,
            "rows": {
                name: {
                    "worker": r.worker,
                    "minibatches": r.minibatches,
                    "examples": r.examples,
                    "examples_per_second": _finite(r.rate()),
                    "loss": _finite(r.loss),
                    "threshold": r.threshold,
                    "sparsity": r.sparsity,
                    "bytes_sent": r.bytes_sent,
                }
                for name, r in self.rows.items()
            },
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


class TrainingPanel(SchedulerPlugin):
    """The panel's state on the scheduler, its ``dlscale_panel_*`` handlers and its web pages."""

    name = NAME
    idempotent = True

    def __init__(self) -> None:
        self.fits: OrderedDict[str, _Fit] = OrderedDict()

    async def start(self, scheduler: Scheduler) -> None:
        scheduler.handlers.update(
            {
                "dlscale_panel_begin": self.begin,
                "dlscale_panel_record": self.record,
                "dlscale_panel_end": self.end,
                "dlscale_panel_view": self.view,
            }
        )
        app = getattr(scheduler, "http_application", None)
        if app is not None:
            app.add_handlers(r".*", [(PATH, _Page, {"panel": self}), (PATH + r"\.json", _Json, {"panel": self})])

    def begin(self, fit: str, approach: str, minibatches: int) -> None:
        self.fits[fit] = _Fit(approach, minibatches)
        while len(self.fits) > FITS_KEPT:
            self.fits.popitem(last=False)

    def record(self, fit: str, rows: list[dict[str, Any]]) -> None:
        """Add reports: each names its ``row`` and ``worker`` and counts ``minibatches`` and
        ``examples`` fitted with mean ``loss``; gradient sharing adds the ``threshold`` and
        ``sparsity`` of its last update and the ``bytes_sent`` since its last report."""
        f = self.fits.get(fit)
        if f is None:
            return
        now = time.time()
        for report in rows:
            row = f.rows.setdefault(report["row"], _Row(report["worker"]))
            row.worker = report["worker"]
            row.minibatches += report["minibatches"]
            row.examples += report["examples"]
            row.loss = report["loss"]
            row.threshold = report.get("threshold", row.threshold)
            row.sparsity = report.get("sparsity", row.sparsity)
            row.bytes_sent += report.get("bytes_sent", 0)
            row.points.append((now, row.examples, row.loss, row.threshold, row.sparsity))
            if len(row.points) > HISTORY:
                row.points = row.points[::2]

    def end(self, fit: str) -> None:
        f = self.fits.get(fit)
        if f is not None:
            f.ended = time.time()

    def view(self) -> dict[str, Any]:
        """Every kept fit, newest first, as plain data (the JSON page)."""
        return {fit: f.view() for fit, f in reversed(self.fits.items())}

    def page(self) -> str:
        running = any(f.ended is None for f in self.fits.values())
        out = [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            *([f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">'] if running else []),
            "<title>dlscale training</title>",
            f"<style>{_CSS}</style>",
            "</head>",
            "<body>",
            "<h1>dlscale training</h1>",
        ]
        if not self.fits:
            out.append("<p>No fit has started on this cluster yet.</p>")
        for fit, f in reversed(self.fits.items()):
            out += _fit_html(fit, f)
        out += ["</body>", "</html>", ""]
        return "\n".join(out)


PANEL = Extension(NAME, scheduler_plugin=TrainingPanel)


def _fit_html(fit: str, f: _Fit) -> list[str]:
    v = f.view()
    state = "running" if f.ended is None else "finished"
    share = v["done"] / f.minibatches if f.minibatches else 0.0
    out = [
        f"<h2>{_e(f.approach)}: {state}</h2>",
        (
            f'<p data-fit="{_e(fit)}">{v["done"]:,} of {f.minibatches:,} minibatches ({share:.0%}), '
            f"{v['examples']:,} examples in {v['seconds']:.1f} s "
            f"({v['examples'] / max(v['seconds'], 1e-9):,.0f} examples/s).</p>"
        ),
    ]
    sharing = any(r.threshold is not None for r in f.rows.values())
    head = ["", "worker", "minibatches", "examples", "examples/s", "loss"]
    head += ["threshold", "sparsity", "bytes sent"] if sharing else []
    out.append("<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>")
    for name, r in sorted(f.rows.items()):
        cells = [_e(name), _e(r.worker), f"{r.minibatches:,}", f"{r.examples:,}", f"{r.rate():,.0f}", f"{r.loss:.4f}"]
        if sharing:
            cells += [
                f"{r.threshold:.3g}" if r.threshold is not None else "",
                f"{r.sparsity:.3g}" if r.sparsity is not None else "",
                f"{r.bytes_sent:,}",
            ]
        out.append(
            f'<tr data-row="{_e(name)}"><td>'
            + cells[0]
            + "</td><td>"
            + cells[1]
            + "</td>"
            + "".join(f'<td class="num">{c}</td>' for c in cells[2:])
            + "</tr>"
        )
    out.append("</table>")
    span = max((r.points[-1][0] for r in f.rows.values() if r.points), default=f.started) - f.started
    if span <= 0:
        return out
    colours = {name: _SERIES_COLOURS[i % len(_SERIES_COLOURS)] for i, name in enumerate(sorted(f.rows))}
    charts = [("loss", 2, False), ("examples/s", None, False)]
    charts += [("threshold", 3, True), ("sparsity", 4, True)] if sharing else []
    for title, column, log in charts:
        lines = []
        for name, r in sorted(f.rows.items()):
            xs, ys = _series(r, column, f.started)
            keep = np.isfinite(ys) & ((ys > 0) if log else True)
            lines.append((name, colours[name], xs[keep], ys[keep]))
        out += [f"<h3>{_e(title)}</h3>", _chart_svg(title, lines, span, log=log)]
    out.append(_legend([(name, colours[name]) for name in sorted(f.rows)]))
    return out


def _series(row: _Row, column: int | None, t0: float) -> tuple[np.ndarray, np.ndarray]:
    """A row's history: one column of its points, or (``None``) its throughput between points."""
    pts = row.points
    times = np.array([p[0] for p in pts], dtype=float) - t0
    if column is not None:
        return times, np.array([math.nan if p[column] is None else p[column] for p in pts], dtype=float)
    examples = np.array([p[1] for p in pts], dtype=float)
    dt = np.diff(times)
    with np.errstate(divide="ignore", invalid="ignore"):
        rates = np.where(dt > 0, np.diff(examples) / dt, math.nan)
    return times[1:], rates


class _Page(tornado.web.RequestHandler):
    def initialize(self, panel: TrainingPanel) -> None:
        self.panel = panel

    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(self.panel.page())


class _Json(_Page):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(self.panel.view()))


# -- the driver's side -------------------------------------------------------------------------
def open_fit(client: Client, approach: str, minibatches: int, fit: str | None = None) -> str | None:
    """Install the panel on the scheduler (once) and start a fit's record; returns the fit's id, or
    ``None`` where ``dlscale.panel`` is off. The first fit through a client logs the panel's address
    (as Spark logs its UI's)."""
    if not config.get("panel"):
        return None
    fit = fit or f"{approach.replace(' ', '-')}-{uuid.uuid4().hex[:8]}"
    install(client, PANEL)
    client.sync(client.scheduler.dlscale_panel_begin, fit=fit, approach=approach, minibatches=minibatches)
    if client not in _announced and (address := url(client, fit)) is not None:
        _announced.add(client)
        logger.info("training panel at %s", address)
    return fit


def record(client: Client, fit: str | None, rows: list[dict[str, Any]]) -> None:
    """Send reports (see :meth:`TrainingPanel.record`) from the driver."""
    if fit is not None:
        client.sync(client.scheduler.dlscale_panel_record, fit=fit, rows=rows)


def close_fit(client: Client, fit: str | None) -> None:
    if fit is not None:
        client.sync(client.scheduler.dlscale_panel_end, fit=fit)


def url(client: Client, fit: str | None = "") -> str | None:
    """The panel's address, next to the dashboard's; ``None`` without a dashboard, or for a fit the
    panel does not record (``fit`` None, as :func:`open_fit` returns with the panel off)."""
    if fit is None or not client.scheduler_info().get("services", {}).get("dashboard"):
        return None
    return client.dashboard_link.rsplit("/", 1)[0] + PATH


def in_scheduler(scheduler: Scheduler) -> TrainingPanel | None:
    """The panel, from code running in the scheduler (gradient sharing's control plane)."""
    return scheduler.plugins.get(NAME)
