"""The live training panel served by the scheduler: what it shows for both masters, compared with
the trainers' and workers' own statistics, read over HTTP as a user's browser would."""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
import urllib.request

import dask
import distributed
import pytest
import torch

from dlscale import ParameterAveragingTrainingMaster, SharedTrainingMaster, SparkNet
from dlscale.data import DataSet
from dlscale.monitor.panel import PATH, TrainingPanel, close_fit, open_fit, url
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
    fits = json.loads(fetch(url(sc.client) + ".json"))
    return next(f for f in fits.values() if f["approach"] == approach)


def test_gradient_sharing_rows_match_each_trainers_statistics(sc) -> None:
    data = batches()
    master = SharedTrainingMaster(batch_size_per_worker=16, workers_per_node=2, collect_training_stats=True)
    spark_net = SparkNet(sc, network(), master)
    spark_net.fit(sc.parallelize(data, 4), epochs=2)
    fit = newest(sc, "gradient sharing")
    stats = {t.trainer: t for t in spark_net.training_stats.trainers}
    assert fit["ended"] is not None and fit["done"] == fit["minibatches"] == 2 * len(data)
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

    page = fetch(url(sc.client))
    assert "gradient sharing: finished" in page and 'http-equiv="refresh"' not in page
    assert all(f'data-row="{name}"' in page for name in stats)
    assert all(f'data-chart="{chart}"' in page for chart in ("loss", "examples/s", "threshold", "sparsity"))


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


def test_the_page_refreshes_while_a_fit_runs_and_escapes_names() -> None:
    panel = TrainingPanel()
    panel.begin("f1", "gradient sharing", 10)
    t0 = time.time()
    panel.record(
        "f1",
        [
            {
                "row": "<t>#0",
                "worker": "tcp://a:1",
                "minibatches": 2,
                "examples": 20,
                "loss": 1.5,
                "threshold": 1e-3,
                "sparsity": 0.01,
                "bytes_sent": 100,
            }
        ],
    )
    panel.record(
        "f1",
        [
            {
                "row": "<t>#0",
                "worker": "tcp://a:1",
                "minibatches": 3,
                "examples": 30,
                "loss": 0.5,
                "threshold": 2e-3,
                "sparsity": 0.02,
                "bytes_sent": 50,
            }
        ],
    )
    row = panel.view()["f1"]["rows"]["<t>#0"]
    assert (row["minibatches"], row["examples"], row["bytes_sent"], row["loss"], row["threshold"]) == (
        5,
        50,
        150,
        0.5,
        2e-3,
    )
    assert row["examples_per_second"] > 30 / (time.time() - t0) * 0.5
    page = panel.page()
    assert 'http-equiv="refresh"' in page and "gradient sharing: running" in page and "5 of 10 minibatches" in page
    assert "<t>" not in page and "&lt;t&gt;#0" in page
    for i in range(6):  # only the last four fits are kept
        panel.begin(f"g{i}", "parameter averaging", 1)
    assert list(panel.view()) == ["g5", "g4", "g3", "g2"]
    for fit in panel.fits:
        panel.end(fit)
    assert 'http-equiv="refresh"' not in panel.page()


def test_the_first_fit_through_a_client_logs_where_the_panel_is(sc, caplog) -> None:
    caplog.set_level(logging.INFO, logger="dlscale")
    with distributed.Client(sc.client.scheduler.address) as client:
        with dask.config.set({"dlscale.panel": False}):
            assert open_fit(client, "parameter averaging", 4) is None
        for _ in range(2):
            close_fit(client, open_fit(client, "parameter averaging", 4))
    logged = [r.getMessage() for r in caplog.records if "panel" in r.getMessage()]
    assert logged == [f"training panel at {url(sc.client)}"]
    assert url(sc.client).endswith(PATH)


def test_the_panel_is_live_during_a_fit(sc, tmp_path) -> None:
    """While gradient sharing trains, the page already shows the minibatches fitted so far."""
    seen: list[dict] = []

    def watch(stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                fits = json.loads(fetch(url(sc.client) + ".json"))
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
