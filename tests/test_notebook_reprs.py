"""What a notebook shows of a SparkContext and of a fit's TrainingStats."""

from __future__ import annotations

import re

import pytest

from dlscale import SparkContext, TrainingStats
from dlscale.monitor.stats import RoundStats, TrainerStats, WorkerRound
from dlscale.runtime.cluster import cluster_workers


def cells(html: str) -> dict[str, str]:
    """A stats table's rows, label to text."""
    return dict(re.findall(r"<tr><th[^>]*>(.*?)</th><td[^>]*>(.*?)</td></tr>", html))


def test_a_context_shows_its_dashboard_and_every_worker(sc: SparkContext) -> None:
    page = sc._repr_html_()
    link = sc.uiWebUrl
    assert f'<a href="{link}" target="_blank">{link}</a>' in page
    training = link.rsplit("/", 1)[0] + "/training"
    assert f'<a href="{training}" target="_blank">' in page
    assert f"<strong>Master:</strong> {sc.master}" in page and sc.applicationId in page
    workers = cluster_workers(sc.client)
    assert len(workers) == 2 and f"<strong>Workers:</strong> {len(workers)}" in page
    for address, w in workers.items():
        assert f"<tr><td>{address}</td><td>{w['name']}</td><td>{w['nthreads']}</td>" in page
    assert sc.client.id in page  # Dask's own repr of the client, inside


def test_a_stopped_context_says_so(sc: SparkContext) -> None:
    other = SparkContext(client=sc.client, appName="<mine>")
    other.stop()
    page = other._repr_html_()
    assert "<strong>Status:</strong> stopped" in page and "&lt;mine&gt;" in page and "<mine>" not in page
    assert "Workers" not in page


def sharing_stats() -> TrainingStats:
    """Two fits of gradient sharing: trainers a and b at work over 100-103.5 s, c over 200-201 s, d idle."""
    a = TrainerStats("a", "tcp://w0", minibatches=2, examples=64, messages_sent=2, bytes_sent=300, score=0.5)
    a.phases = [("fit", 100.0, 1.0), ("send", 101.0, 0.5), ("wait", 101.5, 0.5)]
    b = TrainerStats("b", "tcp://w1", minibatches=3, examples=96, messages_sent=3, bytes_sent=450, score=0.25)
    b.phases = [("fit", 101.0, 2.0), ("encode", 103.0, 0.5)]
    c = TrainerStats("c", "tcp://w0", minibatches=1, examples=32, messages_sent=1, bytes_sent=150, score=0.75)
    c.phases = [("apply", 200.0, 0.25), ("fit", 200.25, 0.75)]
    d = TrainerStats("d", "tcp://w1")
    d.phases = [("wait", 200.0, 1.0)]
    return TrainingStats("gradient sharing", 2, 0.125, trainers=[a, b, c, d], dense_bytes=1000)


def test_gradient_sharing_stats_show_throughput_bytes_against_dense_phases_and_loss() -> None:
    stats = sharing_stats()
    o = stats.overview()
    assert o["seconds"] == 4.5  # 100-103.5 and 200-201: the time between fits does not count
    assert o["examples"] == 192 and o["examples_per_second"] == pytest.approx(192 / 4.5)
    assert o["bytes_sent"] == 900 and o["dense_bytes"] == 6 * 1000  # every minibatch's update, dense
    busy = 6.5
    assert o["phases"] == pytest.approx(
        {"fit": 3.75 / busy, "encode": 0.5 / busy, "send": 0.5 / busy, "apply": 0.25 / busy, "wait": 1.5 / busy}
    )
    assert o["score"] == pytest.approx(0.5)  # the mean of the last losses of the trainers that fitted
    table = cells(stats._repr_html_())
    assert table == {
        "approach": "gradient sharing",
        "workers": "2, 4 trainers",
        "duration": "4.50 s training, 0.12 s preparing minibatches",
        "examples": "192",
        "examples/s": "42.7",
        "bytes sent": "900 B of 5.86 kiB dense (15.00%)",
        "time by phase": "fit 58%, encode 8%, send 8%, apply 4%, wait 23%",
        "final loss": "0.5",
    }
    assert repr(stats) == "<TrainingStats " + "; ".join(f"{k}: {v}" for k, v in table.items()) + ">"


def test_parameter_averaging_stats_show_rounds_and_the_share_spent_waiting_for_data() -> None:
    def share(fit: float, wait: float) -> WorkerRound:
        return WorkerRound("tcp://w0", ["b"], 50, 0.5, fit, wait, 0.0, fit)

    rounds = [
        RoundStats(0, 0, 1.5, 100, 0.5, [share(1.0, 0.25), share(1.0, 0.25)]),
        RoundStats(0, 1, 2.5, 300, 0.125, [share(2.0, 0.5)]),
    ]
    stats = TrainingStats("parameter averaging", 2, 0.5, rounds=rounds)
    o = stats.overview()
    assert (o["seconds"], o["examples"], o["examples_per_second"]) == (4.0, 400, 100.0)
    assert o["phases"] == {"fit": 0.75, "wait": 0.25} and o["score"] == 0.125
    assert o["bytes_sent"] is None and o["dense_bytes"] is None
    assert cells(stats._repr_html_()) == {
        "approach": "parameter averaging",
        "workers": "2, 2 rounds",
        "duration": "4.00 s training, 0.50 s preparing minibatches",
        "examples": "400",
        "examples/s": "100.0",
        "time by phase": "fit 75%, wait 25%",
        "final loss": "0.125",
    }


def test_an_empty_record_shows_what_it_has() -> None:
    stats = TrainingStats("gradient sharing", 3)
    o = stats.overview()
    assert o["examples_per_second"] is None and o["score"] is None and o["phases"] == {}
    assert o["seconds"] == 0 and cells(stats._repr_html_())["workers"] == "3, 0 rounds"
