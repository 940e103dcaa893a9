"""The training page of the dashboard: what it records for both masters, compared with the trainers'
and workers' own statistics and read over HTTP as a browser would; its history, its stall warnings
and the Bokeh document that streams it."""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
import time
import urllib.request

import dask
import distributed
import numpy as np
import pytest
import torch
from bokeh.document import Document

from dlscale import ParameterAveragingTrainingMaster, SharedTrainingMaster, SparkContext, SparkNet
from dlscale.data import DataSet
from dlscale.monitor.dashboard import TrainingDocument
from dlscale.monitor.panel import HISTORY, JSON, PAGE, PLOT, History, Point, TrainingPanel, close_fit, open_fit, url
from dlscale.monitor.stats import PHASES
from dlscale.nn import Network


def network() -> Network:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return Network(module, "cross_entropy", functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))


def batches(n: int = 800, size: int = 16) -> list[DataSet]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return [DataSet(x[i : i + size], y[i : i + size]) for i in range(0, n, size)]


def fetch(address: str) -> str:
    with urllib.request.urlopen(address, timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def newest(sc, approach: str) -> dict:
    fits = json.loads(fetch(url(sc.client).rsplit("/", 1)[0] + JSON))
    return next(f for f in fits.values() if f["approach"] == approach)


def test_gradient_sharing_rows_match_each_trainers_statistics(sc) -> None:
    data = batches()
    master = SharedTrainingMaster(batch_size_per_worker=16, workers_per_node=2, collect_training_stats=True)
    spark_net = SparkNet(sc, network(), master)
    spark_net.fit(sc.parallelize(data, 4), epochs=2)
    fit = newest(sc, "gradient sharing")
    stats = {t.trainer: t for t in spark_net.training_stats.trainers}
    assert fit["ended"] is not None and fit["done"] == fit["minibatches"] == 2 * len(data)
    planned = 2 * len(data)
    tally = {"planned": planned, "once": planned, "redone": 0, "lost": 0, "duplicated": 0, "workers_lost": 0}
    assert fit["exactly_once"] == tally
    assert fit["examples"] == 2 * sum(b.num_examples() for b in data)
    assert set(fit["rows"]) == set(stats)
    for name, row in fit["rows"].items():
        trainer = stats[name]
        assert row["worker"] == trainer.worker
        assert (row["minibatches"], row["examples"], row["bytes_sent"]) == (
            trainer.minibatches,
            trainer.examples,
            trainer.bytes_sent,
        )
        if trainer.steps:
            _, threshold, sparsity, _ = trainer.steps[-1]
            assert row["threshold"] == pytest.approx(threshold) and row["sparsity"] == pytest.approx(sparsity)
            assert row["loss"] > 0
        else:  # a trainer that got no minibatch still has its row
            assert row["loss"] is None and row["minibatches"] == 0

    assert all(sum(row["phases"].values()) > 0 for row in fit["rows"].values() if row["minibatches"])
    assert {name: row["phases"] for name, row in fit["rows"].items()} == {
        name: pytest.approx({p: t.seconds(p) for p in PHASES}) for name, t in stats.items()
    }


def test_parameter_averaging_rows_match_each_workers_rounds(sc, tmp_path) -> None:
    master = ParameterAveragingTrainingMaster(
        16, averaging_frequency=3, collect_training_stats=True, export_directory=str(tmp_path)
    )
    spark_net = SparkNet(sc, network(), master)
    spark_net.fit(sc.parallelize(batches(), 3), epochs=2)
    fit = newest(sc, "parameter averaging")
    rounds = spark_net.training_stats.rounds
    expected: dict[str, list] = {}
    for r in rounds:
        for w in r.workers:
            counts = expected.setdefault(w.worker, [0, 0, None])
            counts[0] += len(w.batches)
            counts[1] += w.examples
            counts[2] = w.score
    assert {
        name: [row["minibatches"], row["examples"], pytest.approx(row["loss"])] for name, row in fit["rows"].items()
    } == expected
    assert fit["done"] == fit["minibatches"] == sum(c[0] for c in expected.values())
    assert all(row["threshold"] is None for row in fit["rows"].values())
    # each round's seconds as the statistics have them, sent a poll's rounds at a time
    assert fit["rounds"] == pytest.approx([r.seconds for r in rounds]) and all(s > 0 for s in fit["rounds"])
    assert sum(fit["rounds"]) <= fit["seconds"]
    for name, row in fit["rows"].items():  # fitting and waiting for data, summed over the worker's rounds
        mine = [w for r in rounds for w in r.workers if w.worker == name]
        wait = sum(w.wait_seconds for w in mine)
        assert row["phases"] == pytest.approx({"fit": sum(w.fit_seconds for w in mine) - wait, "wait": wait})


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def report(row: str, worker: str, minibatches: int = 1, examples: int = 10, loss: float = 1.0, **more) -> dict:
    return {"row": row, "worker": worker, "minibatches": minibatches, "examples": examples, "loss": loss, **more}


def test_a_long_run_is_kept_evenly_from_its_first_report() -> None:
    """10,000 reports in at most HISTORY points: the first report's time kept, every point a bucket of
    the same number of consecutive reports, its loss their mean over examples, counts as after its last."""
    rng = np.random.default_rng(0)
    times = np.cumsum(rng.uniform(0.01, 2.0, 10_000))
    examples = rng.integers(1, 50, 10_000)
    losses = rng.uniform(0.1, 3.0, 10_000)
    history = History()
    for i in range(10_000):
        history.add(
            Point(times[i], i + 1, int(examples[: i + 1].sum()), losses[i], 0.0, None, None, 0, int(examples[i]))
        )
    points, width = history.points, history.width
    assert HISTORY // 2 <= len(points) <= HISTORY and width > 1
    assert len(points) * width + history.pending_reports == 10_000  # every report in a point or the pending bucket
    assert points[0].time == times[0]
    for k, p in enumerate(points):
        bucket = slice(k * width, (k + 1) * width)
        assert p.time == times[bucket.start] and p.minibatches == bucket.stop
        assert p.examples == examples[: bucket.stop].sum() and p.weight == examples[bucket].sum()
        assert p.loss == pytest.approx(np.average(losses[bucket], weights=examples[bucket]))


def test_a_trainer_that_fits_nothing_while_others_progress_is_marked_and_warned(caplog) -> None:
    caplog.set_level(logging.INFO, logger="dlscale")
    clock = Clock()
    panel = TrainingPanel(clock)
    panel.begin("f", "gradient sharing", 100, stall_after=30.0)
    panel.record("f", [report("a#0", "tcp://a:1", 0, 0, math.nan), report("b#0", "tcp://b:1", 0, 0, math.nan)])
    for _ in range(5):  # a fits, b not; under 30 s nothing is said
        clock.now += 5
        panel.record("f", [report("a#0", "tcp://a:1")])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    clock.now += 10  # 35 s since b appeared
    panel.record("f", [report("a#0", "tcp://a:1")])
    clock.now += 5
    panel.record("f", [report("a#0", "tcp://a:1")])  # warned once, not at every report
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["trainer b#0 on worker tcp://b:1 has fitted no minibatch for 35 s while others progress"]
    rows = panel.view()["f"]["rows"]
    assert rows["b#0"]["stalled_seconds"] == 40 and rows["a#0"]["stalled_seconds"] is None
    clock.now += 1
    panel.record("f", [report("b#0", "tcp://b:1")])
    assert panel.view()["f"]["rows"]["b#0"]["stalled_seconds"] is None
    assert caplog.records[-1].getMessage() == "trainer b#0 on worker tcp://b:1 fits again"


def test_a_lone_trainer_is_never_stalled(caplog) -> None:
    """Only others' progress shows a trainer stalled: a fit that waits as a whole warns about no one."""
    clock = Clock()
    panel = TrainingPanel(clock)
    panel.begin("f", "parameter averaging", 10, stall_after=1.0)
    panel.record("f", [report("tcp://a:1", "tcp://a:1"), report("tcp://b:1", "tcp://b:1")], rounds=[0.5])
    clock.now += 100
    rows = [report("tcp://a:1", "tcp://a:1"), report("tcp://b:1", "tcp://b:1")]
    panel.record("f", rows + rows, rounds=[60.0, 40.0])  # two rounds reported at once
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert panel.view()["f"]["rounds"] == [0.5, 60.0, 40.0]
    assert panel.view()["f"]["rows"]["tcp://a:1"]["minibatches"] == 3 * rows[0]["minibatches"]


def test_an_open_page_streams_new_points_and_redraws_a_merged_row() -> None:
    """The Bokeh document of the page, driven as the dashboard's server does: it waits for a fit, shows
    the newest, appends only new points to a row's source and replaces them after a merge; the status
    escapes names."""
    clock = Clock()
    panel = TrainingPanel(clock)
    doc = Document()
    page = TrainingDocument(panel, doc)
    assert "Waiting for a fit" in page.status.text
    panel.begin("f1", "gradient sharing", 10_000, stall_after=0.5)
    panel.record("f1", [report("<u>#1", "tcp://b:1", 0, 0, math.nan)])
    clock.now += 1
    panel.record("f1", [report("<t>#0", "tcp://a:1", threshold=1e-3, sparsity=0.01, bytes_sent=100)])
    page.update()
    assert page.fit == "f1" and [v for v, _ in page.select.options] == ["f1"]
    assert "Stalled" in page.status.text and "&lt;u&gt;#1 on tcp://b:1" in page.status.text
    assert "<u>" not in page.status.text + page.table.text and "&lt;u&gt;#1" in page.table.text
    assert '<tr class="stalled"><td>&lt;u&gt;#1</td>' in page.table.text
    source = page.sources["<t>#0"]
    shown = source.data  # streaming appends to it; a redraw replaces it
    for _ in range(3):
        clock.now += 1
        panel.record("f1", [report("<t>#0", "tcp://a:1", threshold=1e-3, sparsity=0.01, bytes_sent=100)])
        page.update()
    assert source.data is shown and source.data["t"] == [1.0, 2.0, 3.0, 4.0]
    assert source.data["rate"][1:] == [10.0, 10.0, 10.0] and source.data["bytes_rate"][1:] == [100.0] * 3
    history = panel.fits["f1"].rows["<t>#0"].history
    while history.generation == 0:
        clock.now += 1
        panel.record("f1", [report("<t>#0", "tcp://a:1")])
    page.update()
    assert source.data is not shown and len(source.data["t"]) == len(history.points) == HISTORY // 2
    panel.begin("f2", "parameter averaging", 4)  # a new fit is followed
    page.update()
    assert page.fit == "f2" and [v for v, _ in page.select.options] == ["f2", "f1"]
    page.select.value = "f1"  # chosen: kept while more fits begin
    panel.begin("f3", "parameter averaging", 4)
    page.update()
    assert page.fit == "f1"
    tally = {"planned": 4, "once": 3, "redone": 1, "lost": 0, "duplicated": 0, "workers_lost": 1}
    panel.end("f1", tally)  # the status says what the fit's exactly-once tally is
    page.update()
    assert "Exactly once</b>: 3 fitted once, 1 redone after 1 worker lost, 0 lost" in page.status.text
    assert "Chosen" not in page.status.text
    panel.end("f1", tally, "averaging every 20 minibatches <in> streaming rounds")  # a master's receipt
    page.update()
    assert "Chosen</b>: averaging every 20 minibatches &lt;in&gt; streaming rounds" in page.status.text


def test_the_page_is_in_the_dashboard_from_the_context_start() -> None:
    """A fresh context's dashboard serves the training page (in its menu and among the individual
    plots), waiting for a fit; the last fits are kept."""
    with SparkContext("local[1]") as ctx:
        base = ctx.uiWebUrl.rsplit("/", 1)[0]
        assert url(ctx.client) == base + PAGE
        assert "bokeh" in fetch(base + PAGE).lower()
        assert "bokeh" in fetch(base + PLOT).lower()
        assert f'href="{PAGE.strip("/")}"' in fetch(base + "/status")
        assert PLOT in json.loads(fetch(base + "/individual-plots.json")).values()
        assert json.loads(fetch(base + JSON)) == {}
        with dask.config.set({"dlscale.panel-fits": 2}):
            fits = [open_fit(ctx.client, "parameter averaging", 1) for _ in range(3)]
        assert list(json.loads(fetch(base + JSON))) == fits[:0:-1]


def test_the_first_fit_through_a_client_logs_where_the_panel_is(sc, caplog) -> None:
    caplog.set_level(logging.INFO, logger="dlscale")
    with distributed.Client(sc.client.scheduler.address) as client:
        with dask.config.set({"dlscale.panel": False}):
            assert open_fit(client, "parameter averaging", 4) is None
        for _ in range(2):
            close_fit(client, open_fit(client, "parameter averaging", 4))
    logged = [r.getMessage() for r in caplog.records if "panel" in r.getMessage()]
    assert logged == [f"training panel at {url(sc.client)}"]
    assert url(sc.client).endswith(PAGE)


def test_the_panel_is_live_during_a_fit(sc, tmp_path) -> None:
    """While gradient sharing trains, the page already shows the minibatches fitted so far."""
    seen: list[dict] = []

    def watch(stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                fits = json.loads(fetch(url(sc.client).rsplit("/", 1)[0] + JSON))
            except OSError:
                fits = {}
            seen.extend(f for f in fits.values() if f["ended"] is None and f["done"] > 0)
            time.sleep(0.05)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    try:
        SparkNet(sc, network(), SharedTrainingMaster(batch_size_per_worker=16)).fit(
            sc.parallelize(batches(1600), 4), epochs=3
        )
    finally:
        stop.set()
        watcher.join()
    assert seen and any(0 < f["done"] < f["minibatches"] for f in seen)
