"""A worker that joins a gradient-sharing fit while it runs takes part in it: the fit ends its current segment
(nothing dropped: the minibatches not handed out yet are taken back, the trainers' states averaged) and goes
on with trainers on every worker, the newcomer's included."""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from dlscale import SharedTrainingMaster, SparkContext, SparkNet
from dlscale.data import DataSet, load_digits
from dlscale.nn import Network
from dlscale.nn.listeners import TrainingListener

BATCH = 16
EPOCHS = 10
DELAY = 0.01  # seconds a step: the fit lasts long enough for a worker to start while it runs


class Slowed(torch.nn.Module):
    """An MLP for the 8x8 digits whose forward pass takes ``delay`` seconds more."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.layers = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return self.layers(x)


def _network() -> Network:
    torch.manual_seed(0)
    return Network(Slowed(DELAY), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))


class _ScaleAt(TrainingListener):
    """Asks the cluster for ``workers`` workers once the fit has trained ``at`` minibatches."""

    def __init__(self, cluster: Any, at: int, workers: int) -> None:
        self.cluster, self.at, self.workers = cluster, at, workers
        self.scaled_at: int | None = None

    def iteration_done(self, network: Any, iteration: int, epoch: int, score: float, examples: int) -> None:
        if self.scaled_at is None and iteration >= self.at:
            self.cluster.scale(self.workers)
            self.scaled_at = iteration


def _fit(sc: SparkContext, listener: TrainingListener | None = None) -> tuple[Network, SparkNet, float]:
    x, y = load_digits()
    train, test = DataSet(x[:1500], y[:1500]), DataSet(x[1500:], y[1500:])
    network = _network()
    spark_net = SparkNet(sc, network, SharedTrainingMaster(BATCH, rng_seed=0, collect_training_stats=True))
    if listener is not None:
        spark_net.set_listeners(listener)
    spark_net.fit(sc.parallelize(train.batch_by(BATCH), 2), epochs=EPOCHS)
    network.module.delay = 0.0
    accuracy = float((network.output(test.features).argmax(1) == test.labels).double().mean())
    return network, spark_net, accuracy


def test_a_worker_that_joins_a_sharing_fit_trains_a_share_of_the_rest() -> None:
    planned = EPOCHS * -(-1500 // BATCH)
    with SparkContext("local[2]", "elastic-reference") as sc:
        _, _, reference = _fit(sc)
    with SparkContext("local[1]", "elastic") as sc:
        (first,) = sc.client.scheduler_info(n_workers=-1)["workers"]
        scaler = _ScaleAt(sc.client.cluster, planned // 4, 2)
        network, spark_net, accuracy = _fit(sc, scaler)
    assert network.iteration == planned and scaler.scaled_at is not None
    trainers = spark_net.training_stats.trainers
    assert sum(t.minibatches for t in trainers) == planned  # every minibatch once, across the segments
    joined = sum(t.minibatches for t in trainers if t.worker != first)
    assert joined >= 0.3 * (planned - scaler.scaled_at), (joined, planned - scaler.scaled_at)
    assert accuracy >= reference - 0.02, (accuracy, reference)
