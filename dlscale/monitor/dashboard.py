"""The training page as a Bokeh application of the scheduler's dashboard.

:func:`add_pages` adds two applications to the dashboard's Bokeh server while the scheduler runs, as
``distributed.dashboard.scheduler.applications`` would before it starts: ``/training``, a page of the
dashboard's menu with its navigation bar, and ``/individual-dlscale-training``, the same charts alone,
listed among the individual plots (``individual-plots.json``, the "More..." menu, JupyterLab's dask
extension). Each open page is a Bokeh document on the scheduler's event loop that reads the panel's
state every second and sends only what is new: points appended to its ``ColumnDataSource``\\ s, or the
whole series of a row whose history has just been merged. The fit menu, the status line and the table
are the models named ``dlscale-fit``, ``dlscale-status`` and ``dlscale-table``, for scripts that read the
page in a browser (``tests/test_browser.py``).
"""

from __future__ import annotations

import bisect
import functools
import html
import math
import time
from typing import TYPE_CHECKING, Any

from bokeh.application import Application
from bokeh.application.handlers.function import FunctionHandler
from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, Div, HoverTool, Select
from bokeh.palettes import Category10_10
from bokeh.plotting import figure
from bokeh.server.contexts import ApplicationContext
from bokeh.server.tornado import BokehTornado, create_static_handler
from bokeh.server.urls import per_app_patterns
from bokeh.server.views.ws import WSHandler
from distributed.dashboard.components.scheduler import BOKEH_THEME, env
from distributed.dashboard.scheduler import template_variables
from distributed.dashboard.utils import update

from dlscale.monitor.panel import PAGE, PLOT, RATE_WINDOW, Fit, Point, TrainingPanel, _Row
from dlscale.monitor.stats import PHASES
from dlscale.monitor.timeline import PHASE_COLOURS

if TYPE_CHECKING:
    from bokeh.document import Document
    from distributed.scheduler import Scheduler

UPDATE_MS = 1000  # how often an open page reads the panel
_TOOLS = "pan,wheel_zoom,box_zoom,reset,save"
_SERIES = ("loss", "smoothed", "rate", "bytes_rate", "threshold", "sparsity")


def add_pages(scheduler: Scheduler, panel: TrainingPanel) -> None:
    """Add the training page and its individual plot to the dashboard of ``scheduler`` (once; nothing
    without a dashboard) and list the page in the dashboard's menu."""
    server = next((a for a in scheduler.http_application.applications if isinstance(a, BokehTornado)), None)
    if server is None or PAGE in server.app_paths:
        return
    variables = template_variables(scheduler)  # the dashboard's menu, shared by its pages
    extra = {"prefix": server.prefix.rstrip("/") + "/", **variables}
    for path, make in ((PAGE, _page), (PLOT, _plot)):
        context = ApplicationContext(Application(FunctionHandler(functools.partial(make, panel, extra))), url=path)
        context._loop = server._loop
        server._applications[path] = context
        routes = []
        for pattern, handler in per_app_patterns:
            options: dict[str, Any] = {"application_context": context}
            if issubclass(handler, WSHandler):
                options.update(compression_level=None, mem_level=None)
            routes.append((server.prefix + path + pattern, handler, options))
        websocket = next(r for r, *_ in routes if r.endswith("/ws"))
        for _, _, options in routes:
            options["bokeh_websocket_path"] = websocket
        routes.append(create_static_handler(server.prefix, path, context.application))
        server.add_handlers(r".*", routes)
    variables["pages"].append(PAGE.strip("/"))
    variables["plots"].append({"url": PLOT.strip("/"), "name": "dlscale Training"})
    variables["plots"].sort(key=lambda d: d["name"].lower())


def _page(panel: TrainingPanel, extra: dict[str, Any], doc: Document) -> None:
    doc.title = "Dask: dlscale training"
    TrainingDocument(panel, doc)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def _plot(panel: TrainingPanel, extra: dict[str, Any], doc: Document) -> None:
    doc.title = "Dask: dlscale training"
    TrainingDocument(panel, doc)
    doc.theme = BOKEH_THEME


class TrainingDocument:
    """One open page: a choice of fit, a table of its rows and their charts, updated every second."""

    def __init__(self, panel: TrainingPanel, doc: Document) -> None:
        self.panel = panel
        self.select = Select(title="Fit", options=[], width=520, name="dlscale-fit")
        self.select.on_change("value", lambda attr, old, new: self._show(new))
        self.status = Div(sizing_mode="stretch_width", name="dlscale-status")
        self.table = Div(sizing_mode="stretch_width", stylesheets=[_TABLE_CSS], name="dlscale-table")
        self.body = column(sizing_mode="stretch_width")
        self.fit: str | None = None
        self.follow = True  # show each new fit until another is chosen
        self.shown: dict[str, tuple[int, int]] = {}  # row: (history generation, points sent)
        self.sources: dict[str, ColumnDataSource] = {}
        doc.add_root(column(row(self.select, self.status), self.body, sizing_mode="stretch_width"))
        self.update()
        doc.add_periodic_callback(self.update, UPDATE_MS)

    # -- what is shown --------------------------------------------------------------------------
    def update(self) -> None:
        fits = self.panel.fits
        options = [(fit, _fit_label(f)) for fit, f in reversed(fits.items())]
        if options != self.select.options:
            self.select.options = options
        newest = options[0][0] if options else None
        if self.fit not in fits or (self.follow and self.fit != newest):
            if self.select.value != (newest or ""):
                self.select.value = newest or ""  # which shows it
            else:
                self._show(newest)
            return
        f = fits[self.fit]
        if set(f.rows) != set(self.shown):
            self._show(self.fit)
            return
        self._refresh(f)

    def _show(self, fit: str | None) -> None:
        """Draw ``fit`` from scratch (a fit chosen, or new rows)."""
        fits = self.panel.fits
        if fit != self.fit and fit in fits and self.fit is not None:
            self.follow = fit == next(reversed(fits), None)
        self.fit = fit if fit in fits else None
        self.shown, self.sources = {}, {}
        if self.fit is None:
            self.status.text = "<b>Waiting for a fit</b>: nothing has been trained on this cluster yet."
            self.body.children = []
            return
        f = fits[self.fit]
        names = sorted(f.rows)
        colours = {name: Category10_10[i % 10] for i, name in enumerate(names)}
        self.sources = {name: ColumnDataSource({"t": [], "row": [], **{s: [] for s in _SERIES}}) for name in names}
        self.phase_source = ColumnDataSource(_phases(f))
        self.round_source = ColumnDataSource(_rounds(f))
        sharing = any(r.threshold is not None for r in f.rows.values()) or f.approach == "gradient sharing"
        charts = [
            self._lines("Loss (smoothed; points: per report)", "smoothed", colours, log=True, dots="loss"),
            self._lines(f"Examples/s over {RATE_WINDOW:.0f} s", "rate", colours),
            self._phase_chart(names, PHASES if sharing else ("fit", "wait")),
        ]
        if sharing:
            charts += [
                self._lines(f"Bytes sent on the link per s, over {RATE_WINDOW:.0f} s", "bytes_rate", colours),
                self._lines("Threshold", "threshold", colours, log=True),
                self._lines("Sparsity of updates", "sparsity", colours, log=True),
            ]
        else:
            charts.append(self._round_chart())
        grid = [row(*charts[i : i + 2], sizing_mode="stretch_width") for i in range(0, len(charts), 2)]
        self.body.children = [self.table, *grid]
        self._refresh(f)

    def _refresh(self, f: Fit) -> None:
        """Send what is new of ``f``: points appended, or a row's series redrawn after a merge."""
        now = self.panel.clock()
        self.status.text = _status(f, now)
        self.table.text = _table(f, now)
        update(self.phase_source, _phases(f))
        update(self.round_source, _rounds(f))
        for name, r in f.rows.items():
            h = r.history
            generation, sent = self.shown.get(name, (-1, 0))
            if generation != h.generation:
                self.sources[name].data = _columns(name, h.points, 0, f.started)
            elif sent < len(h.points):
                self.sources[name].stream(_columns(name, h.points, sent, f.started))
            self.shown[name] = (h.generation, len(h.points))

    # -- charts ----------------------------------------------------------------------------------
    def _lines(
        self, title: str, series: str, colours: dict[str, str], log: bool = False, dots: str | None = None
    ) -> Any:
        fig = figure(
            title=title,
            height=260,
            sizing_mode="stretch_width",
            tools=_TOOLS,
            y_axis_type="log" if log else "linear",
            x_axis_label="seconds from the fit's start",
        )
        for name, colour in colours.items():
            source = self.sources[name]
            fig.line("t", series, source=source, color=colour, line_width=2, legend_label=_short(name))
            if dots is not None:
                fig.scatter("t", dots, source=source, color=colour, size=3, alpha=0.35)
        fig.add_tools(
            HoverTool(tooltips=[("", "@row"), ("s", "@t{0.0}"), (title.split(" (")[0], f"@{series}{{0.000a}}")])
        )
        if colours:
            fig.legend.location = "top_right"
            fig.legend.click_policy = "hide"
            fig.legend.label_text_font_size = "8pt"
        return fig

    def _phase_chart(self, names: list[str], phases: tuple[str, ...]) -> Any:
        fig = figure(
            title="Share of time by phase (with collect_training_stats=True)",
            y_range=[_short(n) for n in names] or [""],
            x_range=(0, 1),
            height=260,
            sizing_mode="stretch_width",
            tools="hover,save",
            tooltips="@row: $name @$name{0%}",
        )
        fig.hbar_stack(
            list(phases),
            y="label",
            height=0.7,
            source=self.phase_source,
            color=[PHASE_COLOURS[p] for p in phases],
            legend_label=list(phases),
        )
        for legend in fig.legend:
            legend.orientation = "horizontal"
            legend.label_text_font_size = "8pt"
            fig.add_layout(legend, "below")
        return fig

    def _round_chart(self) -> Any:
        fig = figure(
            title="Round times (parameter averaging)",
            height=260,
            sizing_mode="stretch_width",
            tools=_TOOLS,
            x_axis_label="round",
            y_axis_label="seconds",
        )
        fig.vbar(x="round", top="seconds", width=0.8, source=self.round_source, color=Category10_10[0])
        fig.add_tools(HoverTool(tooltips=[("round", "@round"), ("seconds", "@seconds{0.000}")]))
        return fig


# -- the data the charts show ----------------------------------------------------------------------
def _columns(name: str, points: list[Point], start: int, t0: float) -> dict[str, list[Any]]:
    """The series of ``points[start:]``: rates over :data:`RATE_WINDOW` measured back from each point."""
    times = [p.time for p in points]
    out: dict[str, list[Any]] = {"t": [], "row": [], **{s: [] for s in _SERIES}}
    for i in range(start, len(points)):
        p = points[i]
        j = min(bisect.bisect_left(times, p.time - RATE_WINDOW, 0, i), max(i - 1, 0))
        dt = p.time - points[j].time
        out["t"].append(p.time - t0)
        out["row"].append(name)
        out["loss"].append(_positive(p.loss))
        out["smoothed"].append(_positive(p.smoothed))
        out["rate"].append((p.examples - points[j].examples) / dt if dt > 0 else math.nan)
        out["bytes_rate"].append((p.bytes_sent - points[j].bytes_sent) / dt if dt > 0 else math.nan)
        out["threshold"].append(_positive(p.threshold))
        out["sparsity"].append(_positive(p.sparsity))
    return out


def _positive(x: float | None) -> float:
    """``x`` for a log axis: NaN (not drawn) unless it is a positive number."""
    return x if x is not None and math.isfinite(x) and x > 0 else math.nan


_TABLE_CSS = """
table { border-collapse: collapse; font-size: 12px; width: 100%; }
th, td { padding: 3px 8px; border-bottom: 1px solid #e6e6e6; text-align: right; white-space: nowrap; }
th:nth-child(-n+2), td:nth-child(-n+2), td:last-child, th:last-child { text-align: left; }
tr.stalled td { color: #d62728; font-weight: bold; }
"""
_HEAD = (
    "trainer / worker",
    "worker",
    "minibatches",
    "examples",
    "examples/s",
    "loss",
    "threshold",
    "sparsity",
    "bytes sent",
    "state",
)


def _table(f: Fit, now: float) -> str:
    """The rows of ``f`` as an HTML table, every text escaped."""
    out = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in _HEAD) + "</tr>"]
    for name, r in sorted(f.rows.items()):
        cells = (
            name,
            r.worker,
            f"{r.minibatches:,}",
            f"{r.examples:,}",
            _number(r.rates()[0], ",.0f"),
            _number(r.loss, ".4f"),
            _number(r.threshold, ".3g"),
            _number(r.sparsity, ".3g"),
            f"{r.bytes_sent:,}",
            _state(r, f, now),
        )
        cls = ' class="stalled"' if r.stalled else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return "".join(out) + "</table>"


def _number(x: float | None, spec: str) -> str:
    return "" if x is None or not math.isfinite(x) else format(x, spec)


def _state(r: _Row, f: Fit, now: float) -> str:
    if r.stalled:
        return f"stalled: nothing fitted for {now - r.since:.0f} s"
    return "finished" if f.ended is not None else "fitting"


def _phases(f: Fit) -> dict[str, list[Any]]:
    names = sorted(f.rows)
    out: dict[str, list[Any]] = {"label": [_short(n) for n in names], "row": names}
    totals = [sum(f.rows[n].phases.values()) for n in names]
    for p in PHASES:
        out[p] = [
            f.rows[n].phases.get(p, 0.0) / total if total > 0 else 0.0 for n, total in zip(names, totals, strict=True)
        ]
    return out


def _rounds(f: Fit) -> dict[str, list[Any]]:
    return {"round": list(range(1, len(f.rounds) + 1)), "seconds": [s for _, s in f.rounds]}


def _fit_label(f: Fit) -> str:
    started = time.strftime("%H:%M:%S", time.localtime(f.started))
    state = "running" if f.ended is None else "finished"
    return f"{f.approach}, started {started}, {state}"


def _status(f: Fit, now: float) -> str:
    done = f.done()
    seconds = (f.ended or now) - f.started
    examples = sum(r.examples for r in f.rows.values())
    share = done / f.minibatches if f.minibatches else 0.0
    text = (
        f"<b>{html.escape(f.approach)}: {'running' if f.ended is None else 'finished'}</b>, "
        f"{done:,} of {f.minibatches:,} minibatches ({share:.0%}), {examples:,} examples in {seconds:.1f} s"
    )
    if seconds > 0:
        text += f" ({examples / seconds:,.0f} examples/s)"
    if f.exactly_once is not None:
        t = f.exactly_once
        wrong = t["lost"] or t["duplicated"]
        color = "#d62728" if wrong else "#2ca02c"
        text += (
            f"<br><b style='color:{color}'>Exactly once</b>: {t['once']:,} fitted once, {t['redone']:,} redone "
            f"after {t['workers_lost']} worker{'s' * (t['workers_lost'] != 1)} lost, {t['lost']:,} lost"
        )
        if t["duplicated"]:
            text += f", {t['duplicated']:,} fitted twice"
    if f.receipt is not None:
        text += f"<br><b>Chosen</b>: {html.escape(f.receipt)}"
    stalled = [n for n, r in sorted(f.rows.items()) if r.stalled]
    if stalled:
        text += "<br><b style='color:#d62728'>Stalled</b>: " + ", ".join(
            html.escape(f"{n} on {f.rows[n].worker}" if n != f.rows[n].worker else n) for n in stalled
        )
    return text


def _short(name: str) -> str:
    return name if len(name) <= 28 else "…" + name[-27:]
