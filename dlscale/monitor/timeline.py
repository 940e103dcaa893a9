"""Training statistics as pictures: a self-contained HTML report (Bokeh) and a PNG (matplotlib).

:func:`report` lays out a summary table, a timeline of where every trainer's time went, and charts of
the sparsity, threshold and message size of every step as a Bokeh document; :func:`to_html` writes it
as one page with Bokeh's scripts inline (it opens offline and can be mailed or archived as is).
:func:`to_png` draws the same timeline and charts with matplotlib (the ``plot`` extra). Both downsample
to a fixed number of columns, so a run of a hundred thousand steps gives as much to draw as a short one.
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
from bokeh.embed import file_html
from bokeh.layouts import column
from bokeh.models import ColumnDataSource, Div, LayoutDOM
from bokeh.plotting import figure
from bokeh.resources import INLINE

from dlscale.monitor.stats import PHASES, TrainerStats, TrainingStats

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes

PHASE_COLOURS = {"fit": "#4e79a7", "encode": "#f28e2b", "send": "#e15759", "apply": "#59a14f", "wait": "#bab0ac"}
"""One colour per phase of :data:`dlscale.monitor.stats.PHASES`, shared by the HTML and the PNG."""

_SERIES_COLOURS = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#79706e",
)
_PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}

# Downsampling: time is cut into at most _PLOT columns (about a pixel each of a 1000-pixel page).
_PLOT = 810
_ROW = 18  # a timeline row's height in the units of _bars' fractions
_TIMELINE_BARS = 3000  # rectangles the whole timeline may use (unless that leaves too few columns)
_MIN_COLUMNS = 25
_LABEL_CHARS = 24

_CSS = """
:host{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #ccc;padding:2px 6px}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.total td{font-weight:bold}pre{background:#f7f7f7;padding:.6em;overflow-x:auto}
"""


# -- data: spans and series reduced to a bounded number of columns -----------------------------------
@dataclass(frozen=True)
class _Trainer:
    """A trainer's record as arrays, made once per picture: phases (index into :data:`PHASES`, Unix start,
    seconds; unknown phases left out), steps as an ``(n, 4)`` array and the seconds spent in each phase."""

    stats: TrainerStats
    codes: np.ndarray
    starts: np.ndarray
    seconds: np.ndarray
    steps: np.ndarray
    totals: list[float]


def _trainers(stats: TrainingStats) -> list[_Trainer]:
    out = []
    for t in stats.trainers:
        codes, starts, seconds = np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
        if t.phases:
            names, begin, length = zip(*t.phases, strict=True)
            codes = np.fromiter((_PHASE_INDEX.get(p, -1) for p in names), np.int64, len(names))
            known = codes >= 0
            codes, starts, seconds = codes[known], np.asarray(begin, float)[known], np.asarray(length, float)[known]
        steps = np.asarray(t.steps, float)
        steps = steps.reshape(-1, 4) if steps.size else np.zeros((0, 4))
        totals = np.bincount(codes, weights=seconds, minlength=len(PHASES)).tolist()
        out.append(_Trainer(t, codes, starts, seconds, steps, totals))
    return out


_Bar = tuple[int, float, float, float, float]
"""A timeline rectangle: phase index, start and end (seconds from the first event), and its bottom and
top as fractions of the row's height."""


def _bars(codes: np.ndarray, starts: np.ndarray, seconds: np.ndarray, t0: float, span: float, cols: int) -> list[_Bar]:
    """The rectangles that draw one row of ``(phase, start, seconds)`` spans, ``cols`` columns wide.

    A span of a column or more is drawn as it is, full height (one less than a column from the previous
    span of its phase joins it). Shorter spans, the many steps of a long run, are pooled by column: each
    column is a stack of the phases' shares of its time, in whole pixels of the row's height, and
    neighbouring columns with the same stack are drawn as one. A step of 4 ms fitting and 1 ms sending
    thus shows as four fifths fit and one fifth send, however many steps a column holds.
    """
    ok = np.isfinite(starts) & np.isfinite(seconds) & (seconds > 0)
    if not ok.any():
        return []
    codes, begin, seconds = codes[ok], starts[ok] - t0, seconds[ok]
    col = span / cols
    long = seconds >= col
    merged: list[list[Any]] = []
    order = np.argsort(begin[long], kind="stable")
    for code, b, e in zip(
        codes[long][order].tolist(),
        begin[long][order].tolist(),
        (begin[long] + seconds[long])[order].tolist(),
        strict=True,
    ):
        if merged and merged[-1][0] == code and b - merged[-1][2] < col:
            merged[-1][2] = max(merged[-1][2], e)
        else:
            merged.append([code, b, e])
    if len(merged) > 2 * cols:  # overlapping spans: pool them all
        return _pooled(codes, begin, seconds, col, cols)
    return _pooled(codes[~long], begin[~long], seconds[~long], col, cols) + [(c, b, e, 0.0, 1.0) for c, b, e in merged]


def _pooled(codes: np.ndarray, begin: np.ndarray, seconds: np.ndarray, col: float, cols: int) -> list[_Bar]:
    """Spans pooled by column, drawn as stacks of the phases' shares of each column's time.

    A span shorter than a column lies in at most two: each gets its own part of the span's time.
    """
    if not len(codes):
        return []
    first = np.clip(np.floor(begin / col).astype(np.int64), 0, cols - 1)
    second = np.minimum(first + 1, cols - 1)
    in_first = np.clip((first + 1) * col - begin, 0.0, seconds)
    time = np.bincount(
        np.concatenate([first, second]) * len(PHASES) + np.concatenate([codes, codes]),
        weights=np.concatenate([in_first, seconds - in_first]),
        minlength=cols * len(PHASES),
    )
    cumulative = np.minimum(np.cumsum(time.reshape(cols, len(PHASES)), axis=1) / col, 1.0)
    top = np.rint(cumulative * _ROW).astype(np.int64)
    top = np.where(cumulative > 0, np.maximum(top, 1), top)  # a column where anything ran shows at least a pixel
    bottom = np.concatenate([np.zeros((cols, 1), np.int64), top[:, :-1]], axis=1)
    bars: list[_Bar] = []
    runs: list[list[int]] = []  # [first column, last column]
    for c in np.flatnonzero(top[:, -1] > 0).tolist():
        if runs and runs[-1][1] == c - 1 and np.array_equal(top[c], top[c - 1]):
            runs[-1][1] = c
        else:
            runs.append([c, c])
    for first, last in runs:
        for k in np.flatnonzero(top[first] > bottom[first]).tolist():
            bars.append((k, first * col, (last + 1) * col, bottom[first, k] / _ROW, top[first, k] / _ROW))
    return bars


def _series(
    times: np.ndarray, values: np.ndarray, t0: float, span: float, cols: int, log: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Points of a line at most ``cols`` long: the mean time and value of the points in each column
    (the geometric mean on a log scale, where values that are not positive are left out)."""
    keep = np.isfinite(times) & np.isfinite(values)
    if log:
        keep &= values > 0
    t, v = times[keep] - t0, values[keep]
    if not len(t):
        return np.zeros(0), np.zeros(0)
    v = np.log10(v) if log else v
    where = np.clip((t / span * cols).astype(np.int64), 0, cols - 1)
    n = np.bincount(where, minlength=cols)
    used = n > 0
    xs = np.bincount(where, weights=t, minlength=cols)[used] / n[used]
    ys = np.bincount(where, weights=v, minlength=cols)[used] / n[used]
    return xs, (10.0**ys if log else ys)


def _extent(stats: TrainingStats, trainers: list[_Trainer]) -> tuple[float, float]:
    """The first and last moment recorded (Unix times); the span is at least a millisecond."""
    lo, hi = math.inf, -math.inf
    for t in trainers:
        for a in (t.starts, t.starts + t.seconds, t.steps[:, 0]):
            a = a[np.isfinite(a)]
            if len(a):
                lo, hi = min(lo, float(a.min())), max(hi, float(a.max()))
    for r in stats.rounds:
        for w in r.workers:
            lo, hi = min(lo, w.start), max(hi, w.end)
    if not math.isfinite(lo):
        return 0.0, 1.0
    return lo, max(hi, lo + 1e-3)


def _worker_rows(stats: TrainingStats) -> dict[str, list[tuple[float, float, float]]]:
    """Parameter averaging: per worker (in order of first appearance), its tasks as (start, end, wait seconds)."""
    rows: dict[str, list[tuple[float, float, float]]] = {}
    for r in stats.rounds:
        for w in r.workers:
            rows.setdefault(w.worker, []).append((w.start, w.end, w.wait_seconds))
    return rows


def _row_bars(
    stats: TrainingStats, trainers: list[_Trainer], t0: float, span: float
) -> list[tuple[str, str, list[_Bar]]]:
    """Per timeline row: label, tooltip and rectangles, about ``_TIMELINE_BARS`` of them in all.

    Rows start a pixel a column; while they need more rectangles than that, the columns are halved.
    Parameter averaging draws each task full height and its wait share in the lower half.
    """
    sources: list[tuple[str, str, list[tuple[np.ndarray, np.ndarray, np.ndarray, float]]]] = []
    for t in trainers:
        totals = ", ".join(f"{p} {s:.3f} s" for p, s in zip(PHASES, t.totals, strict=True))
        sources.append(
            (t.stats.trainer, f"{t.stats.trainer} on {t.stats.worker}: {totals}", [(t.codes, t.starts, t.seconds, 1.0)])
        )
    fit, wait = _PHASE_INDEX["fit"], _PHASE_INDEX["wait"]
    for worker, tasks in _worker_rows(stats).items():
        s = np.asarray([a for a, _, _ in tasks], float)
        d = np.asarray([max(0.0, b - a) for a, b, _ in tasks], float)
        w = np.minimum(np.asarray([x for _, _, x in tasks], float), d)
        tip = f"{worker}: {len(tasks)} tasks, {d.sum():.3f} s fitting, {w.sum():.3f} s of it waiting for data"
        sources.append((worker, tip, [(np.full(len(s), fit), s, d, 1.0), (np.full(len(s), wait), s, w, 0.5)]))
    cols = _PLOT
    while True:
        rows = [
            (
                label,
                tip,
                [
                    (c, b, e, lo * h, hi * h)
                    for codes, starts, seconds, h in parts
                    for c, b, e, lo, hi in _bars(codes, starts, seconds, t0, span, cols)
                ],
            )
            for label, tip, parts in sources
        ]
        if cols <= _MIN_COLUMNS or sum(len(bars) for _, _, bars in rows) <= _TIMELINE_BARS:
            return rows
        cols = max(_MIN_COLUMNS, cols // 2)


# -- HTML ------------------------------------------------------------------------------------------
def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _short(label: str) -> str:
    return label if len(label) <= _LABEL_CHARS else label[: _LABEL_CHARS - 1] + "\u2026"


def _num(n: float) -> str:
    return f"{n:,}" if isinstance(n, int) else f"{n:,.0f}"


def _phase_cell(seconds: float, total: float) -> str:
    share = seconds / total if total > 0 else 0.0
    return f'<td class="num" data-seconds="{seconds!r}">{seconds:.3f} s ({share:.1%})</td>'


def _trainer_table(trainers: list[_Trainer]) -> str:
    head = [
        "trainer",
        "worker",
        "steps",
        "minibatches",
        "examples",
        "messages sent",
        "bytes sent",
        "messages received",
        "bytes received",
        *(f"{p} s (share)" for p in PHASES),
    ]
    out = ['<table class="trainers"><thead><tr>' + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr></thead><tbody>"]

    def row(cls: str, name: str, worker: str, counts: list[int], seconds: list[float]) -> str:
        total = sum(seconds)
        cells = "".join(f'<td class="num">{_num(c)}</td>' for c in counts)
        phases = "".join(_phase_cell(s, total) for s in seconds)
        return (
            f'<tr class="{cls}" data-trainer="{_e(name)}"><td>{_e(name)}</td><td>{_e(worker)}</td>{cells}{phases}</tr>'
        )

    sums = [0] * 7
    times = [0.0] * len(PHASES)
    for trainer in trainers:
        t = trainer.stats
        counts = [
            len(t.steps),
            t.minibatches,
            t.examples,
            t.messages_sent,
            t.bytes_sent,
            t.messages_received,
            t.bytes_received,
        ]
        sums = [a + b for a, b in zip(sums, counts, strict=True)]
        times = [a + b for a, b in zip(times, trainer.totals, strict=True)]
        out.append(row("trainer", t.trainer, t.worker, counts, trainer.totals))
    if len(trainers) > 1:
        out.append(row("total", "all trainers", "", sums, times))
    out.append("</tbody></table>")
    return "\n".join(out)


def _worker_table(stats: TrainingStats) -> str:
    head = ["worker", "tasks", "minibatches", "examples", "fit s", "wait s", "wait share"]
    out = ['<table class="workers"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"]
    per: dict[str, list[float]] = {}
    for r in stats.rounds:
        for w in r.workers:
            acc = per.setdefault(w.worker, [0, 0, 0, 0.0, 0.0])
            for i, v in enumerate((1, len(w.batches), w.examples, w.fit_seconds, w.wait_seconds)):
                acc[i] += v
    for worker, (tasks, batches, examples, fit, wait) in per.items():
        share = wait / fit if fit > 0 else 0.0
        out.append(
            f'<tr data-worker="{_e(worker)}"><td>{_e(worker)}</td><td class="num">{_num(tasks)}</td>'
            f'<td class="num">{_num(batches)}</td><td class="num">{_num(examples)}</td>'
            f'<td class="num" data-seconds="{fit!r}">{fit:.3f}</td>'
            f'<td class="num" data-seconds="{wait!r}">{wait:.3f}</td><td class="num">{share:.1%}</td></tr>'
        )
    out.append("</tbody></table>")
    return "\n".join(out)


def _step_lines(
    trainers: list[_Trainer], t0: float, span: float
) -> dict[str, list[tuple[str, str, np.ndarray, np.ndarray]]]:
    """Per step chart (sparsity, threshold, bytes per step): one downsampled line per trainer."""
    cols = _PLOT
    charts: dict[str, list[tuple[str, str, np.ndarray, np.ndarray]]] = {
        "sparsity": [],
        "threshold": [],
        "bytes per step": [],
    }
    for i, t in enumerate(trainers):
        colour = _SERIES_COLOURS[i % len(_SERIES_COLOURS)]
        for name, index in (("threshold", 1), ("sparsity", 2), ("bytes per step", 3)):
            line = _series(t.steps[:, 0], t.steps[:, index], t0, span, cols, True)
            charts[name].append((t.stats.trainer, colour, *line))
    return charts


def _round_scores(stats: TrainingStats, t0: float) -> tuple[np.ndarray, np.ndarray]:
    """Parameter averaging: each round's score at the end of its last task, in seconds from ``t0``."""
    points = [(max(w.end for w in r.workers) - t0, r.score) for r in stats.rounds if r.workers]
    if not points:
        return np.zeros(0), np.zeros(0)
    xs, ys = zip(*points, strict=True)
    return np.asarray(xs, float), np.asarray(ys, float)


def report(stats: TrainingStats) -> LayoutDOM:
    """The report of ``stats`` as a Bokeh layout (what :func:`to_html` writes).

    Gradient sharing gets a table of what every trainer sent, received and spent its time on, a timeline
    row per trainer coloured by phase, and charts of each step's sparsity, threshold and message size
    (log scales). Parameter averaging gets a table per worker, a timeline row per worker: its tasks
    (fitting) with, in the lower half, the share of each task spent waiting for minibatches, and the
    score of each round. Long runs are downsampled to a bounded number of rectangles and points.
    """
    trainers = _trainers(stats)
    t0, t1 = _extent(stats, trainers)
    span = t1 - t0
    recorded = bool(stats.trainers or stats.rounds)
    when = (
        f"started {datetime.fromtimestamp(t0, UTC).isoformat(timespec='seconds')}, {span:.3f} s recorded"
        if recorded
        else "nothing recorded"
    )
    parts = [
        f"<h1>Training statistics: {_e(stats.approach)}</h1>",
        f"<p>{_e(stats.workers)} workers; {_e(when)}; {stats.prepare_seconds:.3f} s preparing minibatches.</p>",
    ]
    if stats.rounds:
        parts.append(f"<pre>{_e(stats.summary())}</pre>")
    if stats.trainers:
        parts += ["<h2>Trainers</h2>", _trainer_table(trainers)]
    if stats.rounds:
        parts += ["<h2>Workers</h2>", _worker_table(stats)]
    items: list[LayoutDOM] = [Div(text="\n".join(parts), stylesheets=[_CSS], sizing_mode="stretch_width")]
    if recorded:
        items.append(_timeline_figure(stats, trainers, t0, span))
    if stats.trainers:
        for name, lines in _step_lines(trainers, t0, span).items():
            items.append(_chart(name.capitalize(), lines, span, log=True))
    if stats.rounds:
        xs, ys = _round_scores(stats, t0)
        items.append(_chart("Score per round", [("score", _SERIES_COLOURS[0], xs, ys)], span, log=False))
    return column(*items, sizing_mode="stretch_width")


def to_html(stats: TrainingStats) -> str:
    """One self-contained HTML page of ``stats`` (:func:`report`), Bokeh's scripts inline, so that it
    opens offline and can be mailed or archived as is."""
    return file_html(report(stats), INLINE, title=f"Training statistics: {stats.approach}")


def _timeline_figure(stats: TrainingStats, trainers: list[_Trainer], t0: float, span: float) -> figure:
    """A row per trainer (or worker) from the top, its rectangles coloured by phase."""
    rows = _row_bars(stats, trainers, t0, span)
    data: dict[str, list[Any]] = {k: [] for k in ("left", "right", "bottom", "top", "phase", "colour", "row")}
    for i, (_, tip, bars) in enumerate(rows):
        for code, start, end, lo, hi in bars:
            phase = PHASES[code]
            if not stats.trainers:
                phase = "fit (task)" if phase == "fit" else "wait (share of the task waiting for data)"
            data["left"].append(start)
            data["right"].append(end)
            data["bottom"].append(i + 0.1 + 0.8 * (1 - hi))
            data["top"].append(i + 0.1 + 0.8 * (1 - lo))
            data["phase"].append(phase)
            data["colour"].append(PHASE_COLOURS[PHASES[code]])
            data["row"].append(tip)
    fig = figure(
        title="Timeline",
        height=max(170, 60 + 24 * len(rows)),  # room for the legend of five phases
        sizing_mode="stretch_width",
        x_range=(0, span),
        y_range=(len(rows), 0),
        x_axis_label="seconds from the start",
        tools="pan,xwheel_zoom,box_zoom,reset,save",
        tooltips=[("", "@row"), ("phase", "@phase"), ("seconds", "@left{0.000} to @right{0.000}")],
    )
    fig.quad("left", "right", "top", "bottom", source=ColumnDataSource(data), color="colour", legend_field="phase")
    fig.yaxis.ticker = [i + 0.5 for i in range(len(rows))]
    fig.yaxis.major_label_overrides = {i + 0.5: _short(label) for i, (label, _, _) in enumerate(rows)}
    fig.ygrid.visible = False
    if data["phase"]:
        fig.add_layout(fig.legend[0], "right")
    return fig


def _chart(title: str, lines: list[tuple[str, str, np.ndarray, np.ndarray]], span: float, log: bool) -> figure:
    fig = figure(
        title=title,
        height=240,
        sizing_mode="stretch_width",
        x_range=(0, span),
        y_axis_type="log" if log else "linear",
        x_axis_label="seconds from the start",
        tools="pan,wheel_zoom,box_zoom,reset,save",
        tooltips=[("", "@label"), ("s", "@x{0.000}"), (title.lower(), "@y{0.000a}")],
    )
    for label, colour, xs, ys in lines:
        if len(ys):
            source = ColumnDataSource({"x": xs, "y": ys, "label": [label] * len(xs)})
            fig.line("x", "y", source=source, color=colour, legend_label=_short(label))
            if len(ys) == 1:
                fig.scatter("x", "y", source=source, color=colour, size=5)
    if fig.legend:
        fig.add_layout(fig.legend[0], "right")
        fig.legend.click_policy = "hide"
    return fig


# -- PNG -------------------------------------------------------------------------------------------
def to_png(stats: TrainingStats, path_or_file: str | os.PathLike[str] | BinaryIO) -> None:
    """Draw the timeline and the per-step charts of ``stats`` as a PNG, to a local path or a binary file.

    Uses matplotlib's Agg canvas directly (pyplot and its global backend are left alone), so it works on
    a headless driver and from threads. Needs matplotlib: ``pip install "dlscale[plot]"``.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(f'to_png needs matplotlib: pip install "dlscale[plot]" ({e})') from e
    trainers = _trainers(stats)
    t0, t1 = _extent(stats, trainers)
    span = t1 - t0
    rows = _row_bars(stats, trainers, t0, span)
    charts = _png_charts(stats, trainers, t0, span)
    heights = [max(1.2, 0.3 * len(rows) + 0.8)] + [2.0] * len(charts)
    fig = Figure(figsize=(10, sum(heights) + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"Training statistics: {stats.approach}")
    axes = fig.subplots(len(heights), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    shown = PHASES if stats.trainers else ("fit", "wait")
    _draw_timeline(axes[0], rows, [Patch(color=PHASE_COLOURS[p], label=p) for p in shown])
    for ax, (name, lines) in zip(axes[1:], charts, strict=True):
        _draw_chart(ax, name, lines)
    axes[-1].set_xlabel("seconds from the start")
    axes[-1].set_xlim(0, span)
    fig.savefig(path_or_file, format="png")


def _png_charts(
    stats: TrainingStats, trainers: list[_Trainer], t0: float, span: float
) -> list[tuple[str, list[tuple[str, str, np.ndarray, np.ndarray]]]]:
    """The PNG's charts below the timeline, each a name and its lines: sparsity, threshold and bytes per
    step (gradient sharing), the score of each round (parameter averaging)."""
    charts = list(_step_lines(trainers, t0, span).items()) if trainers else []
    if stats.rounds:
        xs, ys = _round_scores(stats, t0)
        charts.append(("score", [("score", _SERIES_COLOURS[0], xs, ys)]))
    return charts


def _draw_timeline(ax: Axes, rows: list[tuple[str, str, list[_Bar]]], legend: list[Artist]) -> None:
    """The PNG's timeline on ``ax``: the rows of :func:`_row_bars` from the top, labelled, with ``legend``
    (the phases shown) beside them, or a note where nothing was recorded."""
    nrows = len(rows)
    for i, (_, _, bars) in enumerate(rows):
        _draw_timeline_row(ax, nrows - 1 - i, bars)
    ax.set_yticks(range(nrows), [_short(label) for label, *_ in reversed(rows)])
    ax.set_ylim(-0.6, max(nrows, 1) - 0.4)
    ax.set_title("timeline", fontsize=10, loc="left")
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if not nrows:
        ax.text(0.5, 0.5, "no statistics recorded", ha="center", va="center", transform=ax.transAxes)


def _draw_timeline_row(ax: Axes, y: int, bars: list[_Bar]) -> None:
    """One timeline row, centred on ``y``: its rectangles as horizontal bars, one call per phase (matplotlib
    draws a call's bars together, which keeps thousands of rectangles quick)."""
    for code, phase in enumerate(PHASES):
        mine = np.asarray([bar[1:] for bar in bars if bar[0] == code], float).reshape(-1, 4)
        if len(mine):
            ax.bar(
                mine[:, 0],
                (mine[:, 3] - mine[:, 2]) * 0.8,
                mine[:, 1] - mine[:, 0],
                y - 0.4 + mine[:, 2] * 0.8,
                align="edge",
                color=PHASE_COLOURS[phase],
                linewidth=0,
            )


def _draw_chart(ax: Axes, name: str, lines: list[tuple[str, str, np.ndarray, np.ndarray]]) -> None:
    """One chart of :func:`_png_charts` on ``ax``: a line per trainer (a dot where it has one point), on a log
    scale except for the score, with a legend where there are a dozen lines or fewer."""
    for label, colour, xs, ys in lines:
        if len(ys):
            ax.plot(
                xs,
                ys,
                color=colour,
                linewidth=1,
                label=_short(label),
                marker="o" if len(ys) == 1 else None,
                markersize=3,
            )
    if name != "score" and any(len(ys) for *_, ys in lines):
        ax.set_yscale("log")
    ax.set_title(name, fontsize=10, loc="left")
    ax.grid(True, color="#e6e6e6", linewidth=0.6)
    if len(lines) <= 12 and any(len(ys) for *_, ys in lines):
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
