"""Training progress on the driver: a tqdm bar on a terminal (driven in a real pseudo-terminal of 80
columns), a line per epoch through the ``dlscale`` logger elsewhere with each epoch's own figures
(a script's output in a file, by default), lines within a long epoch at most once per
``dlscale.progress-interval`` with the time left, the training panel's address once per context,
nothing when switched off."""

from __future__ import annotations

import fcntl
import functools
import io
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
    assert lines == [  # loss (40 + 80) / 60 examples, 60 from t=0 to t=4; loss (270 + 5 + 5) / 40, 40 from t=3 to t=5
        "training: epoch 5/6, 60 examples in 4.0 s, 15 examples/s, loss 2, elapsed 4.0 s",
        "training: epoch 6/6, 40 examples in 2.0 s, 20 examples/s, loss 7, elapsed 5.0 s",
    ]


def test_an_epoch_ended_in_the_same_instant_as_the_one_before_has_no_rate(monkeypatch, caplog) -> None:
    """A tiny fit's report can end several epochs at once: the later ones took no time of their own,
    and no rate is made up for them."""
    clock = Clock()
    monkeypatch.setattr(progress.time, "time", clock)
    caplog.set_level(logging.INFO, logger="dlscale")
    with dask.config.set({"dlscale.progress": True}):
        bar = Progress("training", per_epoch=1, epochs=2)
    clock.now += 0.5
    bar.advance(0, 1, 32, 2.0)
    bar.advance(1, 1, 32, 1.0)
    bar.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "dlscale"]
    assert lines == [
        "training: epoch 1/2, 32 examples in 0.5 s, 64 examples/s, loss 2, elapsed 0.5 s",
        "training: epoch 2/2, 32 examples in 0.0 s, - examples/s, loss 1, elapsed 0.5 s",
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
    assert lines == ["training: epoch 1/1, 100 examples in 4.0 s, 25 examples/s, loss 1, elapsed 4.0 s"]  # t=0 to 4


def _logged(
    monkeypatch, caplog, per_epoch: int, epochs: int, reports: list[tuple[float, int]], **settings
) -> list[str]:
    """The lines of a fit whose standard error is a file, under ``settings`` (``dlscale.<key>``): one
    minibatch of 10 examples done at each ``(seconds after the start, epoch)`` of ``reports``, its loss
    those seconds, all read at the end (as a burst of gradient sharing's acknowledgements)."""
    clock = Clock()
    monkeypatch.setattr(progress.time, "time", clock)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    caplog.set_level(logging.INFO, logger="dlscale")
    with dask.config.set({f"dlscale.{k.replace('_', '-')}": v for k, v in settings.items()}):
        bar = Progress("training", per_epoch=per_epoch, epochs=epochs)
    clock.now += reports[-1][0]
    for seconds, epoch in reports:
        bar.advance(epoch, 1, 10, seconds, at=100.0 + seconds)
    bar.close()
    return [r.getMessage() for r in caplog.records if r.name == "dlscale"]


def test_a_long_epoch_logs_a_line_per_interval_with_the_time_left(monkeypatch, caplog) -> None:
    """Two epochs of 10 minibatches, one every 10 s: by default (one minute), a line within each epoch
    at the first report a minute or more after the line before, none after the last epoch's."""
    reports = [(10.0 * (i + 1), i // 10) for i in range(20)]
    assert _logged(monkeypatch, caplog, 10, 2, reports) == [
        # 6 minibatches in 60 s, loss (10 + ... + 60) / 6: 14 left at 0.1 a second
        "training: epoch 1/2, fit 30% (60 examples), 1 examples/s, loss 35, elapsed 1m 00s, ETA 2m 20s",
        "training: epoch 1/2, 100 examples in 1m 40s, 1 examples/s, loss 55, elapsed 1m 40s",
        "training: epoch 2/2, fit 80% (160 examples), 1 examples/s, loss 135, elapsed 2m 40s, ETA 40.0 s",
        "training: epoch 2/2, 100 examples in 1m 40s, 1 examples/s, loss 155, elapsed 3m 20s",
    ]


def test_interval_lines_keep_to_the_setting_and_a_short_fit_has_none(monkeypatch, caplog) -> None:
    """At most one line per interval, counted from the line before (an epoch's too), only between
    epoch lines, with the rate and loss since the line before; ``null`` leaves the epoch lines alone."""
    reports = [(1.0, 0), (2.5, 0), (3.0, 0), (4.0, 0), (5.0, 1), (5.9, 1), (6.0, 1), (8.5, 1)]
    assert _logged(monkeypatch, caplog, 4, 2, reports, progress_interval="2s") == [
        # t=2.5, the first report 2 s or more after the start: 6 left at 0.8 a second
        "training: epoch 1/2, fit 25% (20 examples), 8 examples/s, loss 1.75, elapsed 2.5 s, ETA 7.5 s",
        "training: epoch 1/2, 40 examples in 4.0 s, 10 examples/s, loss 2.62, elapsed 4.0 s",
        # t=6.0 (t=5.9 is 1.9 s after the epoch line): 3 minibatches since t=4, loss (5 + 5.9 + 6) / 3
        "training: epoch 2/2, fit 87% (70 examples), 15 examples/s, loss 5.63, elapsed 6.0 s, ETA 0.7 s",
        # t=8.5, 2.5 s after the line before, but the fit's last
        "training: epoch 2/2, 40 examples in 4.5 s, 9 examples/s, loss 6.35, elapsed 8.5 s",
    ]
    caplog.clear()
    lines = _logged(monkeypatch, caplog, 4, 2, reports, progress_interval=None)
    assert [line.split(", ")[0] for line in lines] == ["training: epoch 1/2", "training: epoch 2/2"]
    caplog.clear()
    assert len(_logged(monkeypatch, caplog, 4, 2, reports)) == 2  # a fit shorter than the default minute
    assert progress.interval() == 60
    for setting, seconds in [("2s", 2), (0.5, 0.5), ("0", None), (0, None), (None, None), (False, None)]:
        with dask.config.set({"dlscale.progress-interval": setting}):
            assert progress.interval() == seconds, setting


def test_the_setting_and_the_stream_choose_how_progress_shows(monkeypatch) -> None:
    leader, follower = os.openpty()
    with open(follower, "w") as terminal, open(os.devnull, "w") as file:
        for stream, setting, expected in [
            (terminal, "auto", "bar"),
            (terminal, True, "bar"),
            (terminal, False, None),
            (file, "auto", "lines"),
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


def test_parameter_averaging_times_each_epoch_by_its_rounds_ends(sc, caplog) -> None:
    """An epoch's line is timed by when its rounds ended on the workers, not by when the driver read
    them (several rounds of a fast model settle between two of its polls): with a round an epoch, an
    epoch's rate is its examples over its round's seconds, as the training statistics have them."""
    caplog.set_level(logging.INFO, logger="dlscale")
    torch.manual_seed(0)
    net = Network(torch.nn.Linear(5, 2), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1))
    rdd = sc.parallelize(DataSet(torch.randn(64, 5), torch.randint(0, 2, (64,))).batch_by(8), 2)
    master = ParameterAveragingTrainingMaster(8, averaging_frequency=4, collect_training_stats=True)
    spark_net = SparkNet(sc, net, master)
    with dask.config.set({"dlscale.progress": True}):
        spark_net.fit(rdd, epochs=6)
    rounds = spark_net.training_stats.rounds
    assert [r.epoch for r in rounds] == list(range(6))  # a round an epoch
    rates = [re.search(r"examples in [^,]*, ([\d,]+) examples/s", r.getMessage()) for r in caplog.records]
    logged = [m.group(1) for m in rates if m]
    assert logged[1:] == [f"{r.examples / r.seconds:,.0f}" for r in rounds[1:]]  # the first: from the fit's start


FIT = """
import functools, sys, torch
from dlscale import SharedTrainingMaster, SparkContext, SparkNet
from dlscale.data import DataSet
from dlscale.nn import Network

torch.manual_seed(0)
x = torch.randn(int(sys.argv[2]), 20)
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


def _script(tmp_path: Path, fits: int, examples: int = 3072) -> tuple[list[str], dict[str, str]]:
    (tmp_path / "fit.py").write_text(FIT)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "80",
        "DASK_DLSCALE__LOCAL__DASHBOARD_ADDRESS": ":0",
        "DASK_LOGGING__DISTRIBUTED": "error",  # Dask's own warnings (a loaded machine's slow event loop) aside
    }
    env.pop("DASK_DLSCALE__PROGRESS", None)
    return [sys.executable, str(tmp_path / "fit.py"), str(fits), str(examples)], env


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
    assert len(re.findall(LOGGED + r"training on 2 workers: ", done.stderr)) == 1  # the same workers
    epoch = LOGGED + r"gradient sharing: epoch (\d/\d), 3,072 examples in [\d.]+ s, [\d,]+ examples/s, loss [\d.e-]+, "
    assert re.findall(epoch, done.stderr) == ["1/3", "2/3", "3/3", "4/6", "5/6", "6/6"], done.stderr


def _batch_job(tmp_path: Path, examples: int, **env: str) -> str:
    """The output of a 3-epoch fit run as a batch job runs it: no terminal, standard output and
    error in one file."""
    argv, environ = _script(tmp_path, fits=1, examples=examples)
    with open(tmp_path / "out.txt", "w") as out:
        done = subprocess.run(
            argv, env={**environ, **env}, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=300
        )
    output = (tmp_path / "out.txt").read_text()
    assert done.returncode == 0, output
    (fit,) = re.findall(r"fit begins\n(.*?)fit ends\n", output, re.S)
    return fit


def _seconds(duration: str) -> float:
    """``12.3 s`` or ``4m 05s`` in seconds."""
    if duration.endswith(" s"):
        return float(duration[:-2])
    minutes, seconds = re.fullmatch(r"(\d+)m (\d+)s", duration).groups()
    return 60 * int(minutes) + int(seconds)


ELAPSED = r"elapsed (\d+\.\d s|\d+m \d\ds)"


@pytest.mark.slow
def test_a_batch_job_logs_each_epoch_and_the_end_by_default(tmp_path: Path) -> None:
    """``python fit.py > out.txt 2>&1 < /dev/null`` (SLURM, nohup, CI), ``dlscale.progress`` left at
    ``auto``: a line per epoch with its examples (those of the data), rate, loss and the time, then the
    fit's closing line; nothing within the epochs of a fit that short."""
    fit = _batch_job(tmp_path, examples=3072)
    assert "\r" not in fit
    lines = [line for line in fit.splitlines() if re.match(LOGGED, line)]  # the dlscale logger's
    assert re.fullmatch(LOGGED + r"training on 2 workers: .*", lines[0])
    assert re.fullmatch(LOGGED + r"training panel at http://127\.0\.0\.1:\d+/training", lines[1])
    epochs = [
        re.fullmatch(
            LOGGED + r"gradient sharing: epoch (\d)/3, 3,072 examples in ([\d.]+) s, [\d,]+ examples/s, "
            r"loss [\d.e-]+, " + ELAPSED,
            line,
        )
        for line in lines[2:5]
    ]
    assert [m and m[1] for m in epochs] == ["1", "2", "3"], fit
    assert [_seconds(m[3]) for m in epochs] == sorted(_seconds(m[3]) for m in epochs)
    assert re.fullmatch(LOGGED + r"gradient sharing: 576 minibatches in [\d.]+ s on 2 trainers", lines[5]), fit
    assert len(lines) == 6, fit


@pytest.mark.slow
def test_a_batch_job_logs_within_long_epochs_at_most_once_per_interval(tmp_path: Path) -> None:
    """With ``dlscale.progress-interval`` set shorter than an epoch (here from the environment), lines
    with the time left come between the epoch lines, each at least the interval after the line before."""
    fit = _batch_job(tmp_path, examples=16384, DASK_DLSCALE__PROGRESS_INTERVAL="0.5s")
    lines = [line for line in fit.splitlines() if "gradient sharing: epoch" in line]
    parsed = []
    for line in lines:
        within = re.fullmatch(
            LOGGED + r"gradient sharing: epoch (\d)/3, fit (\d+)% \([\d,]+ examples\), [\d,]+ examples/s, "
            r"loss [\d.e-]+, " + ELAPSED + r", ETA (\d+\.\d s|\d+m \d\ds)",
            line,
        )
        end = re.fullmatch(
            LOGGED + r"gradient sharing: epoch (\d)/3, 16,384 examples in [\d.]+ s, [\d,]+ examples/s, "
            r"loss [\d.e-]+, " + ELAPSED,
            line,
        )
        assert within or end, line
        parsed.append((int((within or end)[1]), end is not None, _seconds((within or end)[3 if within else 2])))
    assert [epoch for epoch, end, _ in parsed if end] == [1, 2, 3], fit
    assert any(not end for _, end, _ in parsed), fit
    epoch_done = 0
    for (epoch, end, elapsed), (_, _, before) in zip(parsed, [(0, True, 0.0), *parsed[:-1]], strict=True):
        assert epoch == epoch_done + 1, fit  # the lines of an epoch come after the line of the one before
        epoch_done += end
        if not end:
            assert elapsed - before >= 0.5 - 0.1, fit  # at most one per interval (figures to 0.1 s)
