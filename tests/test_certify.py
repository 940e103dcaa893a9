"""``dlscale certify`` and the records it reads: the record file written through
``dlscale.monitor.record``, the verdict on records of runs, the printed certificate, the errors
that stop it before a cluster starts, and the command end to end on real clusters with worker
processes killed."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import dlscale
from dlscale import certify, cli
from dlscale.monitor import record

ROOT = Path(__file__).resolve().parent.parent


# -- records ---------------------------------------------------------------------------------
def test_append_writes_one_json_line_per_call_only_when_asked(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "record.jsonl"
    monkeypatch.delenv(record.RECORD_ENV, raising=False)
    record.append("fit", seconds=1.0)
    assert not path.exists()
    monkeypatch.setenv(record.RECORD_ENV, str(path))
    record.append("fit", seconds=1.5, workers_lost=["tcp://127.0.0.1:1"])
    record.append("metrics", metrics={"accuracy": 0.9})
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["kind"] == "fit" and first["seconds"] == 1.5 and isinstance(first["time"], float)
    with path.open("a") as f:
        f.write('{"kind": "fit", "secon')  # a line cut short by a killed process
    assert [r["kind"] for r in record.read(path)] == ["fit", "metrics"]
    assert record.read(tmp_path / "missing.jsonl") == []


def test_report_logs_and_records_real_numbers_only(tmp_path: Path, monkeypatch, caplog) -> None:
    path = tmp_path / "record.jsonl"
    monkeypatch.setenv(record.RECORD_ENV, str(path))
    with caplog.at_level(logging.INFO, logger="dlscale.monitor.record"):
        dlscale.report(accuracy=0.97, loss=1)
    assert "accuracy=0.97" in caplog.text and "loss=1" in caplog.text
    (metrics,) = record.read(path)
    assert metrics["kind"] == "metrics" and metrics["metrics"] == {"accuracy": 0.97, "loss": 1.0}
    for bad in ("0.9", None, True, float("nan")):
        with pytest.raises(ValueError, match="metric 'accuracy'"):
            dlscale.report(accuracy=bad)
    assert len(record.read(path)) == 1


# -- the verdict -----------------------------------------------------------------------------
def _records(path: Path, monkeypatch, fits: list[dict[str, Any]], metrics: dict[str, float] | None) -> list[dict]:
    """Records of a run, written as a script's driver writes them."""
    path.unlink(missing_ok=True)
    monkeypatch.setenv(record.RECORD_ENV, str(path))
    for fit in fits:
        record.append("fit", **fit)
    if metrics is not None:
        dlscale.report(**metrics)
    return record.read(path)


def _fit(lost: int = 0, redone: int = 0, seconds: float = 2.0, score: float | None = 0.3) -> dict[str, Any]:
    epochs = [
        {"epoch": 0, "planned": 50, "once": 50, "redone": 0, "lost": 0},
        {"epoch": 1, "planned": 50, "once": 50 - lost, "redone": redone, "lost": lost},
    ]
    return {"approach": "export", "seconds": seconds, "workers_lost": [], "score": score, "epochs": epochs}


def _certificate(
    tmp_path: Path, monkeypatch, unfaulted: tuple, faulted: tuple | None, kills: int = 1, **bounds: float
) -> dict[str, Any]:
    """The certificate of two runs, each ``(exit status, seconds, fits, metrics)``, with ``kills`` faults."""
    plan = certify.Plan(argv=["train.py"], label="train.py", workers=2, kill_every=5.0, **bounds)
    runs = []
    for name, run in (("unfaulted", unfaulted), ("faulted", faulted)):
        if run is None:
            runs.append(None)
            continue
        status, seconds, fits, metrics = run
        records = _records(tmp_path / f"{name}.jsonl", monkeypatch, fits, metrics)
        runs.append(certify.run_summary(status, seconds, records))
    faults = [certify.Fault(2.0 * i, "kill", f"tcp://127.0.0.1:{i}", 100 + i) for i in range(1, kills + 1)]
    return certify.certificate(plan, runs[0], runs[1], faults)


def _failed(cert: dict[str, Any]) -> list[str]:
    return [c["message"] for c in cert["verdict"]["checks"] if not c["passed"]]


def test_a_job_within_its_bounds_passes(tmp_path: Path, monkeypatch) -> None:
    cert = _certificate(
        tmp_path,
        monkeypatch,
        (0, 10.0, [_fit()], {"accuracy": 0.95, "loss": 0.20}),
        (0, 12.0, [_fit(redone=3, seconds=2.5)], {"accuracy": 0.94, "loss": 0.21}),
        max_time_ratio=1.3,
        max_metric_drop=0.02,
    )
    assert cert["verdict"]["passed"], _failed(cert)
    assert [c["bound"] for c in cert["verdict"]["checks"]] == [
        "exit status",
        "faults injected",
        "lost minibatches",
        "fits",
        "--max-time-ratio",
        "--max-metric-drop",
        "--max-metric-drop",
    ]
    assert cert["time_ratio"] == 1.2 and cert["fit_time_ratio"] == 1.25
    faulted = cert["runs"]["faulted"]
    assert faulted["fits"][0]["tally"] == {"planned": 100, "once": 100, "redone": 3, "lost": 0}
    assert faulted["fits"][0]["epochs"][1]["redone"] == 3
    assert faulted["metrics"] == {"accuracy": 0.94, "loss": 0.21} and faulted["metrics_from"] == "dlscale.report"
    assert cert["faults"]["counts"] == {"kill": 1, "stop": 0}
    assert json.loads(json.dumps(cert)) == cert  # what --output writes


def test_each_failing_bound_is_named_with_its_value_and_limit(tmp_path: Path, monkeypatch) -> None:
    cert = _certificate(
        tmp_path,
        monkeypatch,
        (0, 10.0, [_fit(), _fit()], {"accuracy": 0.95, "val_loss": 0.20}),
        (0, 15.2, [_fit(lost=4)], {"accuracy": 0.90, "val_loss": 0.30}),
        max_time_ratio=1.3,
        max_metric_drop=0.02,
    )
    assert not cert["verdict"]["passed"]
    assert _failed(cert) == [
        "minibatches lost under faults: 4 of 100 in fit 1 (limit 0)",
        "1 fit in the faulted run, 2 unfaulted",
        "time ratio 1.52 > --max-time-ratio 1.3",
        "accuracy drop 0.05 > --max-metric-drop 0.02 (0.95 unfaulted, 0.9 faulted)",
        "val_loss drop 0.1 > --max-metric-drop 0.02 (0.2 unfaulted, 0.3 faulted)",
    ]
    text = certify.render(cert)
    assert "verdict: FAILED, 5 of 7 bounds do not hold" in text
    assert "  FAILED: time ratio 1.52 > --max-time-ratio 1.3" in text.splitlines()


def test_metric_drops_by_name_and_fallbacks(tmp_path: Path, monkeypatch) -> None:
    assert certify.metric_drop("accuracy", 0.9, 0.8) == pytest.approx(0.1)
    assert certify.metric_drop("test_error", 0.1, 0.3) == pytest.approx(0.2)
    assert certify.metric_drop("Loss", 0.5, 0.4) == pytest.approx(-0.1)  # better under faults
    # no metrics reported: the last fit's score stands for them, as "loss"
    cert = _certificate(
        tmp_path,
        monkeypatch,
        (0, 10.0, [_fit(score=0.5), _fit(score=0.25)], None),
        (0, 11.0, [_fit(score=0.9), _fit(score=0.26)], None),
        max_metric_drop=0.02,
    )
    assert cert["runs"]["faulted"]["metrics"] == {"loss": 0.26}
    assert cert["runs"]["faulted"]["metrics_from"] == "score of the last fit"
    assert cert["verdict"]["passed"], _failed(cert)
    # a metric the faulted run did not report fails; no metrics at all fail a metric bound
    cert = _certificate(tmp_path, monkeypatch, (0, 1.0, [], {"f1": 0.8}), (0, 1.0, [], {}), max_metric_drop=0.1)
    assert _failed(cert) == ["f1 not reported by the faulted run"]
    cert = _certificate(tmp_path, monkeypatch, (0, 1.0, [], None), (0, 1.0, [], None), max_metric_drop=0.1)
    assert _failed(cert) == ["no metrics to compare (a script reports them with dlscale.report)"]


def test_a_failed_script_fails_the_certificate(tmp_path: Path, monkeypatch) -> None:
    cert = _certificate(tmp_path, monkeypatch, (0, 5.0, [_fit()], None), (1, 3.0, [], None))
    assert _failed(cert) == ["the faulted run exited with status 1", "0 fits in the faulted run, 1 unfaulted"]
    # a baseline that fails is not run again under faults
    cert = _certificate(tmp_path, monkeypatch, (2, 5.0, [], None), None, max_time_ratio=2.0)
    assert cert["runs"]["faulted"] is None and cert["time_ratio"] is None
    assert _failed(cert) == ["the unfaulted run exited with status 2 (no faulted run)"]
    assert any(line.split() == ["faulted", "not", "run"] for line in certify.render(cert).splitlines())


def test_a_run_that_no_fault_reached_certifies_nothing(tmp_path: Path, monkeypatch) -> None:
    cert = _certificate(tmp_path, monkeypatch, (0, 1.0, [], None), (0, 1.5, [], None), kills=0)
    assert _failed(cert) == [
        "no fault injected: the script ended after 1.5 s, before the first (give a shorter period)"
    ]


def test_the_printed_certificate_fits_in_80_columns(tmp_path: Path, monkeypatch) -> None:
    cert = _certificate(
        tmp_path,
        monkeypatch,
        (0, 10.0, [_fit(), _fit()], {"a_rather_long_metric_name_for_accuracy": 0.95}),
        (0, 99999.0, [_fit(), _fit(lost=2)], {"a_rather_long_metric_name_for_accuracy": 0.5}),
        max_time_ratio=1.3,
        max_metric_drop=0.02,
    )
    cert["script"] = "/a/very/long/path/to/a/training/script/in/a/deep/folder/of/the/project/train_model.py"
    cert["faults"]["injected"] *= 15
    text = certify.render(cert)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "... 5 more" in text and "  fit 2" in text


# -- the command (its bad input: tests/test_cli.py) ----------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["certify", "job.py"], "the following arguments are required: --kill-every"),
        (["certify", "job.py", "--kill-every", "0"], "argument --kill-every: expected a positive duration"),
        (["certify", "job.py", "--kill-every", "soon"], "argument --kill-every: expected a duration such as 5s"),
        (["certify", "job.py", "--kill-every", "5s", "--max-time-ratio", "-1"], "argument --max-time-ratio"),
        (["certify", "job.py", "--kill-every", "5s", "--stop-for", "-2s"], "argument --stop-for"),
    ],
)
def test_usage_errors_name_the_flag(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _certify(
    tmp_path: Path, script: str, *flags: str, output: str = "certificate.json", trains: bool = True
) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """``dlscale certify`` on ``script`` in a subprocess, run from ``tmp_path``: the process and the
    certificate it wrote to ``output``. A script that does not ``trains`` gets workers that start
    without importing torch (sooner)."""
    (tmp_path / "job.py").write_text(textwrap.dedent(script))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not trains:
        env["DASK_DLSCALE__WORKER__IMPORTS"] = "[]"
    argv = [sys.executable, "-m", "dlscale.cli", "certify", "job.py", "--workers", "2", *flags]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    path = tmp_path / output
    assert path.exists(), done.stdout + done.stderr
    return done, json.loads(path.read_text())


SMALL_JOB = """
    import time
    import dlscale
    from dlscale import SparkContext

    with SparkContext() as sc:
        assert sc.parallelize(range(100), 4).sum() == 4950
        time.sleep(2)
    dlscale.report(accuracy=1.0)
"""


def test_a_bound_that_fails_exits_1_and_is_named(tmp_path: Path) -> None:
    """End to end, quickly: a job without a fit, one of its worker processes killed (its nanny
    starts a new one), within every bound but an impossible time ratio."""
    done, cert = _certify(tmp_path, SMALL_JOB, "--kill-every", "1s", "--max-time-ratio", "0.01", trains=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED: time ratio" in done.stdout and "> --max-time-ratio 0.01" in done.stdout
    assert max(len(line) for line in done.stdout.splitlines()) <= 80
    assert cert["faults"]["counts"]["kill"] >= 1
    assert all(f["kind"] == "kill" and f["pid"] > 0 for f in cert["faults"]["injected"])
    for run in cert["runs"].values():
        assert run["exit_status"] == 0 and run["metrics"] == {"accuracy": 1.0}
    assert [c["bound"] for c in cert["verdict"]["checks"] if not c["passed"]] == ["--max-time-ratio"]
    assert cert["command"][:3] == ["dlscale", "certify", "job.py"]


EPOCHS = 200  # a fit of about 4 s here, so that a kill every 2 s from the connection lands in it
TRAINING_JOB = f"""
    import functools
    import torch
    import dlscale
    from dlscale import ParameterAveragingTrainingMaster, SparkContext, SparkNet
    from dlscale.data import DataSet, load_digits
    from dlscale.nn import Network

    images, labels = load_digits()
    x, y = images.flatten(1), labels
    x, y, tx, ty = x[:1200], y[:1200], x[1200:], y[1200:]
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    net = Network(module, "cross_entropy", functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))
    with SparkContext() as sc:
        rdd = sc.parallelize([DataSet(x[i : i + 16], y[i : i + 16]) for i in range(0, len(x), 16)], 4)
        master = ParameterAveragingTrainingMaster(16, averaging_frequency=5, rng_seed=1)
        SparkNet(sc, net, master).fit(rdd, epochs={EPOCHS})
    dlscale.report(accuracy=float((net.output(tx).argmax(1) == ty).float().mean()))
"""


@pytest.mark.slow
def test_a_training_job_is_certified_under_kills(tmp_path: Path) -> None:
    """End to end: a digits MLP fit by parameter averaging, a worker process killed every 2 s,
    loose bounds: it passes, and nothing its fits planned was lost."""
    flags = ("--kill-every", "2s", "--max-time-ratio", "20", "--max-metric-drop", "0.2", "--output", "out/cert.json")
    (tmp_path / "out").mkdir()
    done, cert = _certify(tmp_path, TRAINING_JOB, *flags, output="out/cert.json")
    assert not (tmp_path / "certificate.json").exists()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verdict: PASSED" in done.stdout
    assert cert["faults"]["counts"]["kill"] >= 1
    runs = cert["runs"]
    for run in runs.values():
        assert run["exit_status"] == 0 and run["seconds"] > 0
        assert set(run["metrics"]) == {"accuracy"} and run["metrics_from"] == "dlscale.report"
        assert len(run["fits"]) == 1
    assert runs["unfaulted"]["metrics"]["accuracy"] > 0.8
    assert any(fit["workers_lost"] for fit in runs["faulted"]["fits"]), "no kill landed in the fit"
    for fit in runs["faulted"]["fits"]:
        assert fit["tally"]["lost"] == 0 and all(e["lost"] == 0 for e in fit["epochs"])
        assert fit["tally"]["planned"] == EPOCHS * 75 == sum(e["planned"] for e in fit["epochs"])
    assert cert["time_ratio"] > 0 and cert["fit_time_ratio"] > 0
