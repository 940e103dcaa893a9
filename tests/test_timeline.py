"""Training statistics as a Bokeh report (HTML) and a PNG: well-formed, escaped, faithful totals, bounded
data for long runs, parameter averaging, saving to URLs, and the message when matplotlib is missing."""

from __future__ import annotations

import io
import random
import re
import sys
from html.parser import HTMLParser
from typing import Any

import pytest
from bokeh.models import Line, Quad, Scatter

from dlscale.monitor import timeline
from dlscale.monitor.stats import PHASES, RoundStats, TrainerStats, TrainingStats, WorkerRound

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0
NAMES = ["alpha", "b<&>\"'", "gamma"]
VOID = {"meta", "br", "img", "hr", "input", "link", "area", "base", "col", "embed", "source", "track", "wbr"}


class Page(HTMLParser):
    """Checks that tags nest and close, and keeps every element's attributes and the text of table cells."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.rows: list[tuple[dict[str, str | None], list[tuple[dict[str, str | None], str]]]] = []
        self._cell: list[str] | None = None
        self.feed(text)
        self.close()
        if self.stack:
            self.errors.append(f"unclosed {self.stack}")

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.elements.append((tag, a))
        if tag == "tr":
            self.rows.append((a, []))
        if tag == "td":
            self._cell = []
            self.rows[-1][1].append((a, ""))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
            return
        self.stack.pop()
        if tag == "td" and self._cell is not None:
            a, _ = self.rows[-1][1][-1]
            self.rows[-1][1][-1] = (a, "".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def find(self, tag: str, **attrs: str) -> list[dict[str, str | None]]:
        return [a for t, a in self.elements if t == tag and all(a.get(k) == v for k, v in attrs.items())]


def trainer(
    name: str,
    steps: int,
    start: float,
    fit: float = 0.004,
    encode: float = 0.0005,
    send: float = 0.0002,
    apply: float = 0.0003,
    wait_every: int = 0,
    wait: float = 0.0,
    seed: int = 0,
) -> TrainerStats:
    """A trainer of ``steps`` steps, each fit, encode, send and apply (times jittered by ``seed``), and a
    wait every ``wait_every`` steps."""
    rng = random.Random(seed)
    t = TrainerStats(
        name,
        f"tcp://127.0.0.1:{4000 + seed}",
        minibatches=steps,
        examples=32 * steps,
        messages_sent=steps,
        bytes_sent=100 * steps,
        messages_received=2 * steps,
        bytes_received=200 * steps,
    )
    now = start
    for i in range(steps):
        for phase, seconds in (("fit", fit), ("encode", encode), ("send", send), ("apply", apply)):
            s = seconds * (0.5 + rng.random()) if seed else seconds
            t.phases.append((phase, now, s))
            now += s
        if wait_every and i % wait_every == wait_every - 1:
            t.phases.append(("wait", now, wait))
            now += wait
        t.steps.append((now, 1e-3 * (1 + i % 5), 10 ** -(1 + i % 4), 32 + 4 * (i % 50)))
    return t


def gradient_sharing() -> TrainingStats:
    trainers = [
        trainer(NAMES[0], 200, T0, wait_every=50, wait=0.05),
        trainer(NAMES[1], 150, T0 + 0.01, fit=0.006, send=0.002, seed=1),
        trainer(NAMES[2], 100, T0 + 0.02, encode=0.001, wait_every=10, wait=0.01, seed=2),
    ]
    return TrainingStats("gradient sharing", 3, trainers=trainers)


def parameter_averaging() -> TrainingStats:
    rounds = []
    for r in range(4):
        shares = [
            WorkerRound(
                f"tcp://w{j}<x>",
                [f"batch-{r}-{j}-{k}" for k in range(5)],
                160,
                1.0 / (r + 1),
                fit_seconds=0.8,
                wait_seconds=0.1 * (j + 1),
                start=T0 + r + 0.05 * j,
                end=T0 + r + 0.8,
            )
            for j in range(2)
        ]
        rounds.append(RoundStats(0, r, 1.0, 320, 1.0 / (r + 1), shares))
    return TrainingStats("parameter averaging", 2, prepare_seconds=0.5, rounds=rounds)


def figures(stats: TrainingStats) -> tuple[Page, dict[str, Any]]:
    """The report's text (its tables, parsed) and its figures by title."""
    layout = timeline.report(stats)
    head, *rest = layout.children
    return Page(head.text), {f.title.text: f for f in rest}


def glyphs(fig: Any, kind: type) -> list[dict[str, list]]:
    """The data of every renderer of ``fig`` drawing ``kind`` (Line, Quad, Scatter)."""
    return [r.data_source.data for r in fig.renderers if isinstance(r.glyph, kind)]


def test_html_is_well_formed_escaped_and_self_contained() -> None:
    stats = gradient_sharing()
    page, figs = figures(stats)
    assert page.errors == []
    assert list(figs) == ["Timeline", "Sparsity", "Threshold", "Bytes per step"]
    labels = figs["Timeline"].yaxis.major_label_overrides
    assert [labels[k] for k in sorted(labels)] == NAMES  # one timeline row per trainer, in order, from the top
    for name in ("Sparsity", "Threshold", "Bytes per step"):  # one line per trainer
        assert [d["label"][0] for d in glyphs(figs[name], Line)] == NAMES
    # names are escaped in the tables: never raw, always as entities
    text = "".join(t for _, cells in page.rows for _, t in cells)
    assert "b<&>\"'" in text and "b&lt;&amp;&gt;" in timeline.report(stats).children[0].text
    html = timeline.to_html(stats)
    assert html.startswith("<!DOCTYPE html>") and "b<&>" not in html
    # nothing is fetched: Bokeh's scripts are inline, no external references
    assert not re.search(r"<script[^>]*\bsrc=|<link\b|@import", html)


def test_table_has_the_phase_totals() -> None:
    stats = gradient_sharing()
    page, _ = figures(stats)
    rows = {a["data-trainer"]: cells for a, cells in page.rows if a.get("class") == "trainer"}
    assert list(rows) == NAMES
    for t in stats.trainers:
        expected = {p: 0.0 for p in PHASES}
        for phase, _, seconds in t.phases:
            expected[phase] += seconds
        total = sum(expected.values())
        cells = rows[t.trainer]
        assert cells[2][1] == f"{len(t.steps):,}" and cells[8][1] == f"{t.bytes_received:,}"
        for (attrs, text), phase in zip(cells[-len(PHASES) :], PHASES, strict=True):
            assert float(attrs["data-seconds"]) == pytest.approx(expected[phase], rel=1e-9, abs=1e-12)
            assert text == f"{expected[phase]:.3f} s ({expected[phase] / total:.1%})"
    assert rows["alpha"][-1][1].startswith("0.200 s")  # alpha waited 4 × 0.05 s
    totals = [cells for a, cells in page.rows if a.get("class") == "total"]
    assert len(totals) == 1
    fit = sum(s for t in stats.trainers for p, _, s in t.phases if p == "fit")
    assert float(totals[0][-len(PHASES)][0]["data-seconds"]) == pytest.approx(fit)


def test_long_runs_are_downsampled(monkeypatch: pytest.MonkeyPatch) -> None:
    # 100k steps, five phases each with jittered times: 400k spans for one trainer, plus two short ones
    big = trainer("big", 100_000, T0, wait_every=1000, wait=0.5, seed=3)
    stats = TrainingStats(
        "gradient sharing", 3, trainers=[big, trainer("small", 50, T0, seed=4), trainer("tiny", 1, T0 + 10)]
    )
    page, figs = figures(stats)
    assert page.errors == []
    (bars,) = glyphs(figs["Timeline"], Quad)
    assert len(bars["left"]) <= timeline._TIMELINE_BARS
    for name in ("Sparsity", "Threshold", "Bytes per step"):
        assert all(len(d["x"]) <= timeline._PLOT for d in glyphs(figs[name], Line))
        # "small" (0.3 s) and "tiny" (one step) lie in one column of a 700 s run: a dot each
        assert [d["label"][0] for d in glyphs(figs[name], Scatter)] == ["small", "tiny"]
    # the stacked columns keep the phases' shares of the time (area of each colour, big row only)
    area = {p: 0.0 for p in PHASES}
    for left, right, bottom, top, phase, row in zip(
        bars["left"], bars["right"], bars["bottom"], bars["top"], bars["phase"], bars["row"], strict=True
    ):
        if row.startswith("big on"):
            area[phase] += (right - left) * (top - bottom)
    seconds = {p: big.seconds(p) for p in PHASES}
    for p in PHASES:
        assert area[p] / sum(area.values()) == pytest.approx(seconds[p] / sum(seconds.values()), abs=0.03)
    # a tighter budget: fewer, wider columns
    monkeypatch.setattr(timeline, "_TIMELINE_BARS", 300)
    (bars,) = glyphs(figures(stats)[1]["Timeline"], Quad)
    assert len(bars["left"]) <= 300 and set(bars["phase"]) == set(PHASES)


def test_parameter_averaging_renders_rounds() -> None:
    stats = parameter_averaging()
    page, figs = figures(stats)
    assert page.errors == [] and list(figs) == ["Timeline", "Score per round"]
    labels = figs["Timeline"].yaxis.major_label_overrides
    assert [labels[k] for k in sorted(labels)] == ["tcp://w0<x>", "tcp://w1<x>"]  # drawn as text, not HTML
    assert "w0<x>" not in timeline.report(stats).children[0].text
    workers = {a["data-worker"]: cells for a, cells in page.rows if "data-worker" in a}
    assert [c for _, c in workers["tcp://w1<x>"]] == ["tcp://w1<x>", "4", "20", "640", "3.200", "0.800", "25.0%"]
    (bars,) = glyphs(figs["Timeline"], Quad)
    phases = [p.split()[0] for p in bars["phase"]]
    assert phases.count("fit") == 8 and phases.count("wait") == 8  # one bar per task, 2 workers × 4 rounds
    (score,) = glyphs(figs["Score per round"], Line)
    assert list(score["y"]) == [1.0, 0.5, 1 / 3, 0.25]
    assert "4 rounds" in timeline.report(stats).children[0].text  # summary()
    to = io.BytesIO()
    timeline.to_png(stats, to)
    assert to.getvalue().startswith(PNG_SIGNATURE)


def test_empty_stats_render() -> None:
    stats = TrainingStats("gradient sharing", 2)
    page, figs = figures(stats)
    assert page.errors == [] and figs == {}
    assert timeline.to_html(stats).startswith("<!DOCTYPE html>")
    to = io.BytesIO()
    timeline.to_png(stats, to)
    assert to.getvalue().startswith(PNG_SIGNATURE)


def test_save_html_and_png(tmp_path) -> None:
    image = pytest.importorskip("matplotlib.image")
    stats = gradient_sharing()
    stats.save_html(str(tmp_path / "out" / "stats.html"))  # a local path
    stats.save_png(f"file://{tmp_path}/out/stats.png")  # an fsspec URL
    saved = (tmp_path / "out" / "stats.html").read_text(encoding="utf-8")
    assert saved.startswith("<!DOCTYPE html>") and "<title>Training statistics: gradient sharing</title>" in saved
    assert all(name in saved for name in ("alpha", "gamma", "Bytes per step"))  # the tables and the figures
    data = (tmp_path / "out" / "stats.png").read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    pixels = image.imread(io.BytesIO(data), format="png")
    height, width = pixels.shape[:2]
    assert 500 <= width <= 2000 and 300 <= height <= 3000
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["stats.html", "stats.png"]  # no temporaries


def test_missing_matplotlib_says_what_to_install(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    stats = gradient_sharing()
    with pytest.raises(ImportError, match=re.escape('pip install "dlscale[plot]"')):
        timeline.to_png(stats, io.BytesIO())
    with pytest.raises(ImportError, match=re.escape('pip install "dlscale[plot]"')):
        stats.save_png(str(tmp_path / "stats.png"))
    assert not list(tmp_path.iterdir())  # nothing written
    stats.save_html(str(tmp_path / "stats.html"))  # the HTML report needs no matplotlib
    assert (tmp_path / "stats.html").exists()
