"""Training statistics as pictures: a self-contained HTML report and a PNG.

:func:`to_html` gives one page with no external scripts, styles or fonts (it opens offline and can be
mailed or archived as is): a summary table, a timeline of where every trainer's time went, and charts
of the sparsity, threshold and message size of every step. :func:`to_png` draws the same timeline and
charts with matplotlib (the ``plot`` extra). Both downsample to a fixed number of columns, so a run of
a hundred thousand steps gives a file of the same size as a short one.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, BinaryIO

import numpy as np

from dlscale.monitor.stats import PHASES, TrainerStats, TrainingStats

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

# Geometry of the SVG figures, in pixels.
_WIDTH = 1000
_LEFT = 170  # room for the row labels of the timeline and the y axis of the charts
_RIGHT = 20
_PLOT = _WIDTH - _LEFT - _RIGHT
_ROW = 18
_GAP = 6
_CHART_HEIGHT = 190
_TIMELINE_BARS = 3000  # rectangles the whole timeline may use (unless that leaves too few columns)
_MIN_COLUMNS = 25
_LABEL_CHARS = 24

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #ccc;padding:2px 6px}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.total td{font-weight:bold}pre{background:#f7f7f7;padding:.6em;overflow-x:auto}
.key{display:inline-block;margin-right:1.2em}.swatch{display:inline-block;width:.9em;height:.9em;
vertical-align:middle;margin-right:.3em;border:1px solid #888}
svg{display:block;margin:.4em 0}svg text{font-size:11px;fill:#333}.axis{stroke:#999;stroke-width:1}
.grid{stroke:#e6e6e6;stroke-width:1}.lane{fill:#f5f5f5}.series{fill:none;stroke-width:1.3}
""" + "".join(f".p-{p}{{fill:{c}}}" for p, c in PHASE_COLOURS.items())


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


def _ticks(lo: float, hi: float, n: int = 6) -> tuple[list[float], float]:
    """Round tick values from ``lo`` to ``hi``, about ``n`` of them, and their step."""
    if not hi > lo:
        return [lo], 1.0
    raw = (hi - lo) / n
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)], step


def _tick_label(v: float, step: float) -> str:
    digits = max(0, -math.floor(math.log10(step))) if step > 0 else 0
    return f"{v:.{digits}f}"


def _x_axis(span: float, top: float, bottom: float) -> list[str]:
    """Vertical grid lines and labels, in seconds from the start, below ``bottom``."""
    ticks, step = _ticks(0.0, span)
    out = []
    for v in ticks:
        x = _LEFT + v / span * _PLOT
        out.append(f'<line class="grid" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}"/>')
        out.append(f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle">{_tick_label(v, step)}</text>')
    out.append(f'<text x="{_LEFT + _PLOT}" y="{bottom + 28}" text-anchor="end">seconds from the start</text>')
    return out


def _timeline_svg(stats: TrainingStats, trainers: list[_Trainer], t0: float, span: float) -> str:
    rows = _row_bars(stats, trainers, t0, span)
    top = 8
    bottom = top + len(rows) * (_ROW + _GAP)
    out = [
        (
            f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{bottom + 34}" '
            f'viewBox="0 0 {_WIDTH} {bottom + 34}" role="img" aria-label="timeline">'
        )
    ]
    out += _x_axis(span, top, bottom)
    for i, (label, tip, bars) in enumerate(rows):
        y = top + i * (_ROW + _GAP) + _GAP / 2
        out.append(f'<g class="row" data-label="{_e(label)}"><title>{_e(tip)}</title>')
        out.append(f'<text x="{_LEFT - 6}" y="{y + _ROW - 5}" text-anchor="end">{_e(_short(label))}</text>')
        out.append(f'<rect class="lane" x="{_LEFT}" y="{y}" width="{_PLOT}" height="{_ROW}"/>')
        for code, b, e, lo, hi in bars:
            x, w = _LEFT + b / span * _PLOT, max((e - b) / span * _PLOT, 0.3)
            out.append(
                f'<rect class="p-{PHASES[code]}" x="{x:.1f}" y="{y + (1 - hi) * _ROW:.1f}" width="{w:.1f}" '
                f'height="{(hi - lo) * _ROW:.1f}"/>'
            )
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _y_scale(values: Sequence[np.ndarray], log: bool) -> tuple[float, float, list[float], list[str]]:
    """The y range of a chart (log10 of it on a log scale), with tick positions and labels."""
    finite = [v for v in values if len(v)]
    lo = min(float(v.min()) for v in finite)
    hi = max(float(v.max()) for v in finite)
    if log:
        lo, hi = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        hi = max(hi, lo + 1)
        every = max(1, math.ceil((hi - lo) / 8))
        ticks = [float(k) for k in range(int(lo), int(hi) + 1, every)]
        return lo, hi, ticks, [f"1e{int(k)}" for k in ticks]
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    ticks, step = _ticks(lo, hi, 4)
    return lo, hi, ticks, [f"{v:.{max(0, -math.floor(math.log10(step)))}f}" for v in ticks]


def _chart_svg(name: str, lines: list[tuple[str, str, np.ndarray, np.ndarray]], span: float, log: bool) -> str:
    """A line chart over the run's time: one ``(label, colour, xs, ys)`` line each, ``xs`` in seconds."""
    if not any(len(ys) for _, _, _, ys in lines):
        return f"<p>No {_e(name)} recorded.</p>"
    top, bottom = 10, _CHART_HEIGHT - 36
    lo, hi, ticks, labels = _y_scale([ys for _, _, _, ys in lines], log)

    def y_of(v: np.ndarray) -> np.ndarray:
        v = np.log10(v) if log else v
        return bottom - (v - lo) / (hi - lo) * (bottom - top)

    out = [
        (
            f'<svg class="chart" data-chart="{_e(name)}" xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" '
            f'height="{_CHART_HEIGHT}" viewBox="0 0 {_WIDTH} {_CHART_HEIGHT}" role="img" aria-label="{_e(name)}">'
        )
    ]
    out += _x_axis(span, top, bottom)
    for v, label in zip(ticks, labels, strict=True):
        y = float(y_of(np.asarray(10.0**v if log else v)))
        out.append(f'<line class="grid" x1="{_LEFT}" y1="{y:.1f}" x2="{_LEFT + _PLOT}" y2="{y:.1f}"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_e(label)}</text>')
    out.append(f'<line class="axis" x1="{_LEFT}" y1="{top}" x2="{_LEFT}" y2="{bottom}"/>')
    for label, colour, xs, ys in lines:
        if not len(ys):
            continue
        px, py = (_LEFT + xs / span * _PLOT).tolist(), y_of(ys).tolist()
        if len(px) == 1:  # a single column of steps: a dot, as a line needs two points
            out.append(
                f'<circle cx="{px[0]:.1f}" cy="{py[0]:.1f}" r="2.5" fill="{colour}"><title>{_e(label)}</title></circle>'
            )
            continue
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(px, py, strict=True))
        out.append(
            f'<polyline class="series" stroke="{colour}" points="{points}"><title>{_e(label)}</title></polyline>'
        )
    out.append("</svg>")
    return "\n".join(out)


def _legend(items: Sequence[tuple[str, str]]) -> str:
    keys = "".join(
        f'<span class="key"><span class="swatch" style="background:{c}"></span>{_e(label)}</span>' for label, c in items
    )
    return f'<p class="legend">{keys}</p>'


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
        for name, column in (("threshold", 1), ("sparsity", 2), ("bytes per step", 3)):
            line = _series(t.steps[:, 0], t.steps[:, column], t0, span, cols, True)
            charts[name].append((t.stats.trainer, colour, *line))
    return charts


def _round_scores(stats: TrainingStats, t0: float) -> tuple[np.ndarray, np.ndarray]:
    """Parameter averaging: each round's score at the end of its last task, in seconds from ``t0``."""
    points = [(max(w.end for w in r.workers) - t0, r.score) for r in stats.rounds if r.workers]
    if not points:
        return np.zeros(0), np.zeros(0)
    xs, ys = zip(*points, strict=True)
    return np.asarray(xs, float), np.asarray(ys, float)


def to_html(stats: TrainingStats) -> str:
    """One self-contained HTML page of ``stats``: tables, a timeline and per-step charts, all inline.

    Gradient sharing gets a table of what every trainer sent, received and spent its time on, a timeline
    row per trainer coloured by phase, and charts of each step's sparsity, threshold and message size
    (log scales). Parameter averaging gets a table per worker and a timeline row per worker: its tasks
    (fitting) with, in the lower half, the share of each task spent waiting for minibatches. Long runs
    are downsampled to a bounded number of SVG elements; all text is escaped.
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
    out = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f"<title>Training statistics: {_e(stats.approach)}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        f"<h1>Training statistics: {_e(stats.approach)}</h1>",
        f"<p>{_e(stats.workers)} workers; {_e(when)}; {stats.prepare_seconds:.3f} s preparing minibatches.</p>",
    ]
    if stats.rounds:
        out.append(f"<pre>{_e(stats.summary())}</pre>")
    if stats.trainers:
        out += ["<h2>Trainers</h2>", _trainer_table(trainers)]
    if stats.rounds:
        out += ["<h2>Workers</h2>", _worker_table(stats)]
    if recorded:
        out += [
            "<h2>Timeline</h2>",
            _legend(
                [(p, PHASE_COLOURS[p]) for p in PHASES]
                if stats.trainers
                else [
                    ("fit (task)", PHASE_COLOURS["fit"]),
                    ("wait (share of the task waiting for data, drawn from its start)", PHASE_COLOURS["wait"]),
                ]
            ),
            _timeline_svg(stats, trainers, t0, span),
        ]
    if stats.trainers:
        for name, lines in _step_lines(trainers, t0, span).items():
            out += [f"<h2>{_e(name.capitalize())}</h2>", _chart_svg(name, lines, span, log=True)]
        out.append(
            _legend([(t.trainer, _SERIES_COLOURS[i % len(_SERIES_COLOURS)]) for i, t in enumerate(stats.trainers)])
        )
    if stats.rounds:
        xs, ys = _round_scores(stats, t0)
        out += [
            "<h2>Score per round</h2>",
            _chart_svg("score", [("score", _SERIES_COLOURS[0], xs, ys)], span, log=False),
        ]
    out += ["</body>", "</html>", ""]
    return "\n".join(out)


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
    nrows = len(trainers) + len(_worker_rows(stats))
    charts = list(_step_lines(trainers, t0, span).items()) if trainers else []
    if stats.rounds:
        xs, ys = _round_scores(stats, t0)
        charts.append(("score", [("score", _SERIES_COLOURS[0], xs, ys)]))
    heights = [max(1.2, 0.3 * nrows + 0.8)] + [2.0] * len(charts)
    fig = Figure(figsize=(10, sum(heights) + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"Training statistics: {stats.approach}")
    axes = fig.subplots(len(heights), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    timeline = axes[0]
    rows = _row_bars(stats, trainers, t0, span)
    for i, (_, _, bars) in enumerate(rows):
        y = nrows - 1 - i
        for code, phase in enumerate(PHASES):
            mine = np.asarray([bar[1:] for bar in bars if bar[0] == code], float).reshape(-1, 4)
            if len(mine):
                timeline.bar(
                    mine[:, 0],
                    (mine[:, 3] - mine[:, 2]) * 0.8,
                    mine[:, 1] - mine[:, 0],
                    y - 0.4 + mine[:, 2] * 0.8,
                    align="edge",
                    color=PHASE_COLOURS[phase],
                    linewidth=0,
                )
    timeline.set_yticks(range(nrows), [_short(label) for label, *_ in reversed(rows)])
    timeline.set_ylim(-0.6, max(nrows, 1) - 0.4)
    timeline.set_title("timeline", fontsize=10, loc="left")
    shown = PHASES if stats.trainers else ("fit", "wait")
    timeline.legend(
        handles=[Patch(color=PHASE_COLOURS[p], label=p) for p in shown],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
    )
    if not nrows:
        timeline.text(0.5, 0.5, "no statistics recorded", ha="center", va="center", transform=timeline.transAxes)
    for ax, (name, lines) in zip(axes[1:], charts, strict=True):
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
    axes[-1].set_xlabel("seconds from the start")
    axes[-1].set_xlim(0, span)
    fig.savefig(path_or_file, format="png")
