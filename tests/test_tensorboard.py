"""TensorBoardListener: real fits of both masters on local[2], their event files read back with
TensorBoard's own reader and compared with what the fit reported to its listeners."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from dlscale import ParameterAveragingTrainingMaster, SharedTrainingMaster, SparkContext, SparkNet  # noqa: E402
from dlscale.data import DataSet  # noqa: E402
from dlscale.monitor.tensorboard import (  # noqa: E402
    BYTES_SENT,
    EXAMPLES_PER_SECOND,
    LOSS,
    SPARSITY,
    THRESHOLD,
    TensorBoardListener,
)
from dlscale.nn import Network, TrainingListener  # noqa: E402
from dlscale.nn.listeners import StepReport  # noqa: E402


class Recorder(TrainingListener):
    """Keeps every step report and counts the fits it saw end."""

    def __init__(self) -> None:
        self.steps: list[StepReport] = []
        self.fits = 0

    def step_done(self, network: Any, step: StepReport) -> None:
        self.steps.append(step)

    def fit_done(self, network: Any) -> None:
        self.fits += 1


def network() -> Network:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    return Network(module, "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1))


def dataset(n: int = 256) -> DataSet:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    return DataSet(x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long())


def scalars(log_dir: Path | str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``log_dir``, by tag, as ``(step, value)``."""
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def f32(x: float) -> float:
    """``x`` as an event file keeps it."""
    return float(np.float32(x))


def points(steps: list[StepReport], frequency: int) -> list[StepReport]:
    """The steps that pass a multiple of ``frequency``."""
    return [s for s in steps if s.iteration // frequency > (s.iteration - s.iterations) // frequency]


def rates(steps: list[StepReport], frequency: int) -> list[tuple[int, float]]:
    """Examples per second at each point, over the steps since the last point with one, counted from the
    report of the fit's first step."""
    out, since, examples = [], steps[0].time, 0
    for s in steps[1:]:
        examples += s.examples
        if s in points(steps, frequency) and s.time > since:
            out.append((s.iteration, examples / (s.time - since)))
            since, examples = s.time, 0
    return out


def test_gradient_sharing_writes_loss_throughput_bytes_threshold_and_sparsity(sc: SparkContext, tmp_path) -> None:
    frequency, log_dir = 4, tmp_path / "tb"
    board, recorder = TensorBoardListener(str(log_dir), frequency), Recorder()
    master = SharedTrainingMaster(16, collect_training_stats=True, rng_seed=0)
    spark_net = SparkNet(sc, network(), master)
    spark_net.set_listeners(board, recorder)
    spark_net.fit(sc.parallelize(dataset().batch_by(16), 2), epochs=2)

    steps = recorder.steps
    assert spark_net.network.iteration == 32 and [s.iteration for s in steps] == list(range(1, 33))
    assert recorder.fits == 1 and all(s.update is not None for s in steps)
    found = scalars(log_dir)  # read without closing the writer: the fit's end flushed it
    assert set(found) == {LOSS, EXAMPLES_PER_SECOND, BYTES_SENT, THRESHOLD, SPARSITY}
    written = points(steps, frequency)
    assert [i for i, _ in found[LOSS]] == [s.iteration for s in written] == list(range(4, 33, 4))
    assert found[LOSS] == [(s.iteration, f32(s.score)) for s in written]
    assert found[THRESHOLD] == [(s.iteration, f32(s.update.threshold)) for s in written]
    assert found[SPARSITY] == [(s.iteration, f32(s.update.sparsity)) for s in written]
    windows = [
        sum(s.update.bytes for s in steps if p.iteration - frequency < s.iteration <= p.iteration) for p in written
    ]
    assert found[BYTES_SENT] == [(p.iteration, f32(b)) for p, b in zip(written, windows)]
    # the bytes the driver heard of are the bytes the trainers counted as they sent them
    assert sum(windows) == sum(t.bytes_sent for t in spark_net.training_stats.trainers) > 0
    expected = rates(steps, frequency)
    assert [i for i, _ in found[EXAMPLES_PER_SECOND]] == [i for i, _ in expected] and expected
    assert [v for _, v in found[EXAMPLES_PER_SECOND]] == pytest.approx([v for _, v in expected], rel=1e-6)


def test_parameter_averaging_writes_one_point_per_frequency_iterations(sc: SparkContext, tmp_path) -> None:
    frequency, log_dir = 3, tmp_path / "tb"
    board, recorder = TensorBoardListener(str(log_dir), frequency), Recorder()
    flushes: list[int] = []  # the iteration at each flush: object stores see nothing before one
    flush = board.writer.flush
    board.writer.flush = lambda: (flushes.append(spark_net.network.iteration), flush())
    master = ParameterAveragingTrainingMaster(16, averaging_frequency=2, export_directory=str(tmp_path / "export"))
    spark_net = SparkNet(sc, network(), master)
    spark_net.set_listeners(board, recorder)
    spark_net.fit(sc.parallelize(dataset().batch_by(16), 2), epochs=2)

    steps = recorder.steps
    iterations = spark_net.network.iteration
    assert iterations == 16 and [s.iterations for s in steps] == [2] * 8 and recorder.fits == 1
    assert flushes == [iterations]  # once, as the fit ended
    found = scalars(log_dir)
    assert set(found) == {LOSS, EXAMPLES_PER_SECOND}  # no update is shared
    assert len(found[LOSS]) == iterations // frequency
    assert found[LOSS] == [(s.iteration, f32(s.score)) for s in points(steps, frequency)]
    assert [i for i, _ in found[LOSS]] == [4, 6, 10, 12, 16]  # rounds of 2 iterations passing multiples of 3
    expected = rates(steps, frequency)
    assert [i for i, _ in found[EXAMPLES_PER_SECOND]] == [i for i, _ in expected] == [4, 6, 10, 12, 16]
    assert [v for _, v in found[EXAMPLES_PER_SECOND]] == pytest.approx([v for _, v in expected], rel=1e-6)

    # a second fit goes on at the network's iteration, into the same folder
    spark_net.fit(sc.parallelize(dataset().batch_by(16), 2))
    again = scalars(log_dir)
    assert [i for i, _ in again[LOSS]] == [4, 6, 10, 12, 16, 18, 22, 24]
    assert again[LOSS][5:] == [(s.iteration, f32(s.score)) for s in points(recorder.steps[8:], frequency)]


def test_a_network_fitted_in_this_process_writes_to_an_fsspec_url() -> None:
    board = TensorBoardListener("memory://dlscale-tb/local", frequency=2)
    net = network()
    net.listeners = [board]
    scores = [net.fit_batch(b) for b in dataset(80).batch_by(16)]
    board.close()
    found = scalars("memory://dlscale-tb/local")
    assert found[LOSS] == [(2, f32(scores[1])), (4, f32(scores[3]))]
    assert set(found) == {LOSS, EXAMPLES_PER_SECOND}


def test_a_relative_log_dir_is_under_the_storage_root(tmp_path) -> None:
    import dask

    with dask.config.set({"dlscale.storage.root": str(tmp_path)}):
        board = TensorBoardListener("runs/one")
    board.close()
    assert board.log_dir == str(tmp_path / "runs" / "one")
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "runs" / "one").iterdir())


def test_frequency_is_checked_and_missing_tensorboard_is_named(tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="frequency must be an integer >= 1, got 0"):
        TensorBoardListener(str(tmp_path), 0)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r'pip install "dlscale\[tensorboard\]"'):
        TensorBoardListener(str(tmp_path))
