"""Training progress on the driver: one line per epoch with the example-weighted loss, a live bar on
terminals, nothing when switched off; and both training masters report through it."""

from __future__ import annotations

import functools
import io

import dask
import pytest
import torch

from dlscale import ParameterAveragingTrainingMaster, SparkNet
from dlscale.data import DataSet
from dlscale.monitor.progress import Progress
from dlscale.nn import Network


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_per_epoch_with_the_example_weighted_loss() -> None:
    stream = io.StringIO()
    with dask.config.set({"dlscale.progress": True}):
        bar = Progress("training", per_epoch=3, epochs=2, first_epoch=4, stream=stream)
    for loss, examples in [(1.0, 10), (4.0, 30), (2.0, 20), (0.5, 10), (0.5, 10), (0.5, 10)]:
        bar.advance(1, examples, loss)
    lines = stream.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["training: epoch 5/6 done", "training: epoch 6/6 done"]
    assert "loss 2.8333" in lines[0]  # (10 + 120 + 40) / 60
    assert "loss 0.5000" in lines[1]
    assert "\r" not in stream.getvalue()


def test_a_live_bar_on_a_terminal_and_nothing_when_off(monkeypatch) -> None:
    monkeypatch.setattr("dlscale.monitor.progress.REDRAW_SECONDS", 0.0)
    terminal = Terminal()
    with dask.config.set({"dlscale.progress": "auto"}):
        bar = Progress("training", per_epoch=4, epochs=1, stream=terminal)
    bar.advance(1, 8, 1.0)
    assert "\rtraining: epoch 1/1 [######..................] 1/4 minibatches" in terminal.getvalue()
    quiet = io.StringIO()
    with dask.config.set({"dlscale.progress": "auto"}):  # not a terminal
        Progress("training", 4, 1, stream=quiet).advance(4, 32, 1.0)
    with dask.config.set({"dlscale.progress": False}):
        Progress("training", 4, 1, stream=quiet).advance(4, 32, 1.0)
    assert quiet.getvalue() == ""
    with dask.config.set({"dlscale.progress": "yes"}), pytest.raises(TypeError, match="dlscale.progress"):
        Progress("training", 4, 1, stream=quiet)


def test_parameter_averaging_reports_each_epoch(sc, tmp_path, capsys) -> None:
    torch.manual_seed(0)
    net = Network(torch.nn.Linear(5, 2), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1))
    rdd = sc.parallelize(DataSet(torch.randn(64, 5), torch.randint(0, 2, (64,))).batch_by(8), 2)
    master = ParameterAveragingTrainingMaster(8, averaging_frequency=2, export_directory=str(tmp_path))
    with dask.config.set({"dlscale.progress": True}):
        SparkNet(sc, net, master).fit(rdd, epochs=2)
    err = capsys.readouterr().err
    assert "parameter averaging: epoch 1/2 done" in err and "parameter averaging: epoch 2/2 done" in err
