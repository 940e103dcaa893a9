"""The driver loop every training master runs in (``training/_driver.py``): a master written on the
``TrainingMaster`` base gets the workers, the seed, the probe, progress, listeners, counters and
statistics from ``FitRun``, and masters are driven through a ``FitContext`` without ``SparkNet``."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import ClassVar

import dask.config
import numpy as np
import pytest
import torch

from dlscale import ParameterAveragingTrainingMaster, SharedTrainingMaster, SparkNet, TrainingMaster
from dlscale.data import DataSet, export_minibatches, list_paths, load
from dlscale.monitor.stats import TrainingStats
from dlscale.nn import Network, ScoreIterationListener
from dlscale.training._driver import FitContext, FitRun
from dlscale.training._errors import TrainingConfigError

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def mlp_network(seed: int = 0) -> Network:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    return Network(module, "cross_entropy", SGD)


def files(tmp_path, n: int = 64, batch: int = 8) -> str:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    export_minibatches([DataSet(x, y)], str(tmp_path / "files"), batch)
    return str(tmp_path / "files")


@dataclasses.dataclass
class OnTheDriver(TrainingMaster):
    """A master of its own on the base: fits every minibatch on the driver, in the run's seeded order,
    and fails at step ``fail_at`` when asked."""

    approach: ClassVar[str] = "on the driver"
    fail_at: int | None = None

    def _train(self, run: FitRun, batches, *, partitions=None, probe=False) -> None:
        if probe:
            run.probe()
        run.show_progress()
        for epoch in range(run.epochs):
            for i in np.random.default_rng([run.seed, run.first_epoch + epoch]).permutation(len(batches.refs)):
                if run.network.iteration == self.fail_at:
                    raise RuntimeError("stopped on purpose")
                batch = batches.loader(batches.refs[i])
                score = run.network.fit_batch(batch)
                run.step(epoch, 1, batch.num_examples(), score, iterations=0)  # fit_batch counted it


def test_a_master_on_the_base_gets_the_driver_loop(sc, tmp_path) -> None:
    paths = list_paths(sc, files(tmp_path))
    network = mlp_network()
    master = OnTheDriver(8, rng_seed=3, collect_training_stats=True)
    spark_net = SparkNet(sc, network, master)
    listener = ScoreIterationListener(1)
    spark_net.set_listeners(listener)
    spark_net.fit_paths(paths, loader=load, epochs=2)

    reference = mlp_network()
    urls = paths.collect()  # the order the master's minibatches have
    scores = []
    for epoch in range(2):
        for i in np.random.default_rng([3, epoch]).permutation(len(urls)):
            scores.append(reference.fit_batch(load(urls[i])))
    torch.testing.assert_close(network.params(), reference.params(), rtol=0, atol=0)
    assert [i for i, _ in listener.history] == list(range(1, 17))
    assert [s for _, s in listener.history] == pytest.approx(scores)
    assert network.iteration == 16 and network.epoch == 2
    assert isinstance(spark_net.training_stats, TrainingStats)
    assert spark_net.training_stats.approach == "on the driver" and spark_net.training_stats.workers == 2


def test_a_failed_fit_restores_the_counters_and_releases_the_network(sc, tmp_path) -> None:
    paths = list_paths(sc, files(tmp_path))
    network = mlp_network()
    network.iteration, network.epoch = 5, 1
    before = set(sc.client.futures)
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        SparkNet(sc, network, OnTheDriver(8, fail_at=9)).fit_paths(paths, loader=load, epochs=2)
    assert (network.iteration, network.epoch) == (5, 1)
    deadline = time.monotonic() + 5  # a released future leaves the client on its next loop turn
    while not set(sc.client.futures) <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(sc.client.futures) <= before  # the scattered network was released


def test_masters_are_driven_through_a_fit_context(sc, tmp_path) -> None:
    """No SparkNet: a client, a network, listeners and a statistics sink are all a master uses."""
    paths = list_paths(sc, files(tmp_path))
    network, recorded = mlp_network(), []
    master = ParameterAveragingTrainingMaster(8, averaging_frequency=1, rng_seed=0, collect_training_stats=True)
    master.fit_paths(FitContext(sc.client, network, (), recorded.append), paths, None, 1)
    assert network.iteration == 4 and network.epoch == 1  # 8 minibatches, 2 workers, one each per round
    assert not torch.equal(network.params(), mlp_network().params())
    assert [len(s.rounds) for s in recorded] == [4]


def test_shared_settings_are_keywords() -> None:
    with pytest.raises(TypeError):
        ParameterAveragingTrainingMaster(8, 5, 2, True, "always", None, "float32", "direct")
    master = SharedTrainingMaster(8, rdd_training_approach="direct", rng_seed=1)
    assert master.rdd_training_approach == "direct" and master.rng_seed == 1


def test_sharing_settings_are_read_on_the_driver(sc, tmp_path) -> None:
    """A bad ``dlscale.training`` value set around ``fit`` on the driver fails it, naming the setting."""
    paths = list_paths(sc, files(tmp_path))
    network = mlp_network()
    before = network.params().clone()
    with dask.config.set({"dlscale.training.sharing.send-retries": -1}):
        with pytest.raises(TrainingConfigError, match="dlscale.training.sharing.send-retries"):
            SparkNet(sc, network, SharedTrainingMaster(8)).fit_paths(paths)
    assert torch.equal(network.params(), before) and network.iteration == 0
