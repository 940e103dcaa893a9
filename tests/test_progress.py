"""Training progress on the driver: a tqdm bar on a terminal (driven in a real pseudo-terminal of 80
columns), a line per epoch through the ``dlscale`` logger elsewhere with each epoch's own figures,
the training panel's address once per context, nothing when switched off."""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import dask
import pytest
import torch

from dlscale import ParameterAveragingTrainingMaster, SparkNet
from dlscale.data import DataSet
from dlscale.monitor import progress
from dlscale.monitor.progress import Progress
from dlscale.nn import Network

ROOT = Path(__file__).resolve().parent.parent


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_epoch_line_has_the_epochs_own_loss_rate_and_time(monkeypatch, caplog) -> None:
    """Gradient sharing acknowledges minibatches in bursts, the next epoch's first ones sometimes
    before this epoch's last: an epoch's figures count its own minibatches, from its start to its end."""
    clock = Clock()
    monkeypatch.setattr(progress.time, "time", clock)
    caplog.set_level(logging.INFO, logger="dlscale")
    with dask.config.set({"dlscale.progress": True}):  # standard error is no terminal here
        bar = Progress("training", per_epoch=3, epochs=2, first_epoch=4)
    clock.now += 2.0
    bar.advance(0, 2, 40, 1.0)  # a burst: two minibatches of the first epoch
    clock.now += 1.0
    bar.advance(1, 1, 30, 9.0)  # the second epoch's first minibatch, before the first epoch's last
    clock.now += 1.0
    bar.advance(1, 1, 5, 1.0)  # a burst of both epochs
    bar.advance(0, 1, 20, 4.0)
    clock.now += 1.0
    bar.advance(1, 1, 5, 1.0)
    bar.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "dlscale"]
    assert lines == [
        "training: epoch 5/6, loss 2, 15 examples/s, 4.0 s",  # (40 + 80) / 60 examples, 60 from t=0 to t=4
        "training: epoch 6/6, loss 7, 20 examples/s, 2.0 s",  # (270 + 5 + 5) / 40 examples, 40 from t=3 to t=5
    ]


def test_rates_come_from_when_the_work_was_reported_not_when_it_was_read(monkeypatch, caplog) -> None:
    """A checkpoint or a slow poll delivers a whole epoch's reports at once: the epoch's rate is
    counted from the reports' own times, not from the moment the driver read them."""
    clock = Clock()
    monkeypatch.setattr(progress.time, "time", clock)
    caplog.set_level(logging.INFO, logger="dlscale")
    with dask.config.set({"dlscale.progress": True}):
        bar = Progress("training", per_epoch=4, epochs=1)
    clock.now += 10.0  # all four read at t=10, done at t=1..4
    for i in range(4):
        bar.advance(0, 1, 25, 1.0, at=101.0 + i)
    bar.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "dlscale"]
    assert lines == ["training: epoch 1/1, loss 1, 25 examples/s, 4.0 s"]  # 100 examples from t=0 to t=4


def test_the_setting_and_the_stream_choose_how_progress_shows(monkeypatch) -> None:
    leader, follower = os.openpty()
    with open(follower, "w") as terminal, open(os.devnull, "w") as file:
        for stream, setting, expected in [
            (terminal, "auto", "bar"),
            (terminal, True, "bar"),
            (terminal, False, None),
            (file, "auto", None),
            (file, True, "lines"),
            (file, False, None),
        ]:
            monkeypatch.setattr(sys, "stderr", stream)
            with dask.config.set({"dlscale.progress": setting}):
                assert progress.mode() == expected, (stream, setting)
        with dask.config.set({"dlscale.progress": "yes"}), pytest.raises(TypeError, match="dlscale.progress"):
            progress.mode()
    os.close(leader)


def test_parameter_averaging_reports_each_epoch(sc, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="dlscale")
    torch.manual_seed(0)
    net = Network(torch.nn.Linear(5, 2), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1))
    rdd = sc.parallelize(DataSet(torch.randn(64, 5), torch.randint(0, 2, (64,))).batch_by(8), 2)
    master = ParameterAveragingTrainingMaster(8, averaging_frequency=2, export_directory=str(tmp_path))
    with dask.config.set({"dlscale.progress": True}):
        SparkNet(sc, net, master).fit(rdd, epochs=2)
    lines = [r.getMessage() for r in caplog.records if "epoch" in r.getMessage()]
    assert [line.split(",")[0] for line in lines] == [
        "parameter averaging: epoch 1/2",
        "parameter averaging: epoch 2/2",
    ]


FIT = """
import functools, sys, torch
from dlscale import SharedTrainingMaster, SparkContext, SparkNet
from dlscale.data import DataSet
from dlscale.nn import Network

torch.manual_seed(0)
x = torch.randn(3072, 20)
y = (x[:, 0] > 0).long()
net = Network(torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)),
              "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1))
with SparkContext("local[2]") as sc:
    rdd = sc.parallelize(DataSet(x, y).batch_by(16), 4)
    for _ in range(int(sys.argv[1])):
        print("fit begins", flush=True)
        SparkNet(sc, net, SharedTrainingMaster(16)).fit(rdd, epochs=3)
        print("fit ends", flush=True)
"""
LOGGED = r"\d\d:\d\d:\d\d "  # how the dlscale logger's lines begin while the application configures no logging


def _script(tmp_path: Path, fits: int) -> tuple[list[str], dict[str, str]]:
    (tmp_path / "fit.py").write_text(FIT)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "80",
        "DASK_DLSCALE__LOCAL__DASHBOARD_ADDRESS": ":0",
        "DASK_LOGGING__DISTRIBUTED": "error",  # Dask's own warnings (a loaded machine's slow event loop) aside
    }
    return [sys.executable, str(tmp_path / "fit.py"), str(fits)], env


def _screen(output: str) -> list[str]:
    """The lines a terminal shows for ``output``: a carriage return goes back to the line's start,
    and what follows overwrites what was there."""
    lines = []
    for raw in output.replace("\r\n", "\n").split("\n"):
        line: list[str] = []
        for segment in raw.split("\r"):
            line[: len(segment)] = segment
        lines.append("".join(line).rstrip())
    return lines


@pytest.mark.slow
def test_a_bar_in_a_terminal_of_80_columns(tmp_path: Path) -> None:
    argv, env = _script(tmp_path, fits=1)
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal's other end closed: the script has ended
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    (fit,) = re.findall(r"fit begins\r?\n(.*?)fit ends", b"".join(chunks).decode(), re.S)
    drawn = [s for s in re.split(r"[\r\n]+", fit) if s.strip()]
    assert all(len(s) <= 80 for s in drawn), max(drawn, key=len)
    bars = [s for s in drawn if s.startswith("gradient sharing: epoch")]
    assert len(bars) >= 3
    assert any(re.search(r"\| \d\d:\d\d<\d\d:\d\d, loss [\d.e-]+, [\d.]+k? ex/s", s) for s in bars)  # an ETA
    # left on the screen: whole lines of the logger (the workers trained on, the panel's address), and the
    # finished bar
    screen = [line for line in _screen(fit) if line]
    assert re.match(LOGGED + r"training on 2 workers: tcp://127\.0\.0\.1:\d+, tcp://127\.0\.0\.1:\d+$", screen[0])
    assert re.match(LOGGED + r"training panel at http://127\.0\.0\.1:\d+/training$", screen[1])
    assert [line for line in screen if not re.match(LOGGED, line)] == [bars[-1].rstrip()]
    assert re.match(r"gradient sharing: epoch 3/3 100%\|█+\| \d\d:\d\d<00:00, loss", bars[-1])


@pytest.mark.slow
def test_outside_a_terminal_a_line_per_epoch_and_the_panel_once(tmp_path: Path) -> None:
    argv, env = _script(tmp_path, fits=2)
    done = subprocess.run(
        argv, env={**env, "DASK_DLSCALE__PROGRESS": "true"}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    panel = re.findall(LOGGED + r"training panel at http://127\.0\.0\.1:\d+/training\n", done.stderr)
    assert len(panel) == 1  # two fits, one context
    epoch = LOGGED + r"gradient sharing: epoch (\d/\d), loss [\d.e-]+, [\d,]+ examples/s, [\d.]+ s\n"
    assert re.findall(epoch, done.stderr) == ["1/3", "2/3", "3/3", "4/6", "5/6", "6/6"], done.stderr
