"""Workers that come and go while a fit runs.

A worker that joins a fit takes part in it: the fit ends its current segment (nothing dropped: with
gradient sharing the minibatches not handed out yet are taken back and the trainers' states averaged,
with parameter averaging at the next round's end) and goes on with trainers on every worker, the
newcomer's included. A worker retired while a fit runs (its process
closed by ``cluster.scale``, or Dask's ``retire_workers``) ends its part in order: its trainer hands back
what it holds and sends its residual to its peers, a parameter-averaging trainer leaves between rounds;
no ``TrainerLostWarning``, every minibatch fitted once."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dlscale import ParameterAveragingTrainingMaster, SharedTrainingMaster, SparkContext, SparkNet
from dlscale.data import DataSet, load, load_digits
from dlscale.errors import TrainerLostWarning
from dlscale.nn import Network
from dlscale.nn.listeners import TrainingListener
from dlscale.training import _worker
from tests.test_session import exactly_once

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


class _RetireAt(TrainingListener):
    """Retires a worker (``retire``, run in a thread of its own, as a cluster manager would) once the fit
    has trained ``at`` minibatches."""

    def __init__(self, retire: Callable[[], Any], at: int) -> None:
        self.retire, self.at = retire, at
        self.retired_at: int | None = None
        self.thread = threading.Thread(target=retire)

    def iteration_done(self, network: Any, iteration: int, epoch: int, score: float, examples: int) -> None:
        if self.retired_at is None and iteration >= self.at:
            self.retired_at = iteration
            self.thread.start()


def _sharing() -> SharedTrainingMaster:
    return SharedTrainingMaster(BATCH, rng_seed=0, collect_training_stats=True)


def _averaging() -> ParameterAveragingTrainingMaster:
    return ParameterAveragingTrainingMaster(BATCH, averaging_frequency=5, rng_seed=0, collect_training_stats=True)


def _streaming() -> ParameterAveragingTrainingMaster:
    return dataclasses.replace(_averaging(), streaming=True)


def _fit(
    sc: SparkContext, listener: TrainingListener | None = None, master: Callable[[], Any] = _sharing
) -> tuple[Network, SparkNet, float]:
    x, y = load_digits()
    train, test = DataSet(x[:1500], y[:1500]), DataSet(x[1500:], y[1500:])
    network = _network()
    spark_net = SparkNet(sc, network, master())
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
    assert exactly_once(spark_net.training_stats, planned // EPOCHS, EPOCHS) == 0  # a worker joined: none redone
    trainers = spark_net.training_stats.trainers
    assert sum(t.minibatches for t in trainers) == planned  # every minibatch once, across the segments
    assert all(len(t.steps) == t.minibatches for t in trainers)
    # from its first step on (when its process had started and the fit's segment ended), the newcomer
    # trains a share of what is left: about half, as the two workers step at the same pace
    joined = [step for t in trainers if t.worker != first for step, *_ in t.steps]
    rest = [step for t in trainers for step, *_ in t.steps if step >= min(joined)]
    assert len(joined) >= 0.3 * len(rest), (len(joined), len(rest), planned - scaler.scaled_at)
    # both fits are asynchronous and move with timing (297 test digits, 0.0034 each): 26 pairs measured
    # quiet and beside the test suite differ by -0.013 to +0.007 (references 0.919-0.933, joined
    # 0.916-0.933); one run in CI by -0.020 (0.909 against 0.929)
    assert accuracy >= reference - 0.025, (accuracy, reference)


def _replay(rounds: list[Any]) -> Network:
    """The network that parameter averaging's recorded ``rounds`` make, replayed in this process: each
    round's shares fitted from the round's starting state by replicas of their own, then averaged by
    examples (the same arithmetic, to float32 rounding), with one thread as each worker computes (a
    matrix product's sums go in another order on two threads, and 600 steps grow that past 1e-3)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _replayed(rounds)
    finally:
        torch.set_num_threads(before)


def _replayed(rounds: list[Any]) -> Network:
    network = _network()
    network.module.delay = 0.0
    state = _worker.state_of(network, True)
    for r in rounds:
        states = []
        for share in r.workers:
            replica = _network()
            replica.module.delay = 0.0
            _worker.apply_state(replica, state)
            for path in share.batches:
                replica.fit_batch(load(path))
            states.append(
                {
                    **_worker.state_of(replica, True),
                    "examples": share.examples,
                    "batches": 1,
                    "score": 0.0,
                    "shares": [],
                }
            )
        state = _worker.average(*states)
    _worker.apply_state(network, state)
    return network


def test_a_worker_that_joins_a_parameter_averaging_fit_takes_part_from_the_next_round() -> None:
    planned = EPOCHS * -(-1500 // BATCH)
    with SparkContext("local[1]", "elastic") as sc:
        (first,) = sc.client.scheduler_info(n_workers=-1)["workers"]
        scaler = _ScaleAt(sc.client.cluster, planned // 4, 2)  # a lone worker's iterations are its minibatches
        network, spark_net, _ = _fit(sc, scaler, _averaging)
    rounds = spark_net.training_stats.rounds
    fitted = [(r.epoch, name) for r in rounds for w in r.workers for name in w.batches]
    assert len(fitted) == len(set(fitted)) == planned  # every minibatch of every epoch once
    assert exactly_once(spark_net.training_stats, planned // EPOCHS, EPOCHS) == 0
    joined = sum(len(w.batches) for r in rounds for w in r.workers if w.worker != first)
    assert scaler.scaled_at is not None and joined >= 0.3 * (planned - scaler.scaled_at), (joined, scaler.scaled_at)
    # the newcomer trains from a round's end, not an epoch's: the first round of two comes mid-epoch
    both = next(i for i, r in enumerate(rounds) if len(r.workers) == 2)
    assert rounds[both].round > 0 or rounds[both].epoch == rounds[both - 1].epoch + 1
    # and the fit is its rounds, one worker's then two's, exactly
    torch.testing.assert_close(network.params(), _replay(rounds).params(), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def two_workers() -> dict[str, float]:
    """The accuracy of a gradient-sharing fit on two workers from the start to the end."""
    with SparkContext("local[2]", "elastic-reference") as sc:
        return {"_sharing": _fit(sc)[2]}


def _close(dask_worker: Any) -> None:
    """Close this worker as a batch system ending its job would have it close (its nanny told not to restart it)."""
    dask_worker.loop.add_callback(dask_worker.close, reason="its job ended")


@pytest.mark.parametrize(
    "master, how",
    [
        (_sharing, "scale"),
        pytest.param(_sharing, "retire_workers", marks=pytest.mark.slow),
        pytest.param(_sharing, "close", marks=pytest.mark.slow),
        pytest.param(_averaging, "scale", marks=pytest.mark.slow),
        (_averaging, "retire_workers"),
        (_streaming, "retire_workers"),
        pytest.param(_averaging, "close", marks=pytest.mark.slow),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__.strip("_"),
)
def test_a_worker_retired_mid_fit_ends_its_part_in_order(
    how: str, master: Callable[[], Any], two_workers: dict[str, float]
) -> None:
    planned = EPOCHS * -(-1500 // BATCH)
    with SparkContext("local[2]", "elastic-retire") as sc:
        client, cluster = sc.client, sc.client.cluster
        first, second = sorted(client.scheduler_info(n_workers=-1)["workers"])
        if how == "scale":
            retire = functools.partial(cluster.scale, 1)  # closes the newest worker's process
            second = next(w for w, i in client.scheduler_info(n_workers=-1)["workers"].items() if i["name"] == 1)
        elif how == "retire_workers":
            retire = functools.partial(client.retire_workers, [second], close_workers=True)
        else:
            retire = functools.partial(client.run, _close, workers=[second])
        retirer = _RetireAt(retire, planned // 4)
        with warnings.catch_warnings():
            warnings.simplefilter("error", TrainerLostWarning)
            network, spark_net, accuracy = _fit(sc, retirer, master)
        retirer.thread.join()
        assert second not in client.scheduler_info(n_workers=-1)["workers"]
    assert retirer.retired_at is not None
    stats = spark_net.training_stats
    redone = exactly_once(stats, planned // EPOCHS, EPOCHS)
    # a retiring trainer leaves between rounds or hands back what it has not fitted; streaming, it may
    # have fitted its share of the round after, which the others fit again
    assert redone == 0 or (master is _streaming and redone <= 5), redone  # a round's share
    if master is _sharing:
        assert network.iteration == planned
        trainers = stats.trainers
        assert sum(t.minibatches for t in trainers) == planned  # every minibatch once, none lost with the worker
        assert 0 < sum(t.minibatches for t in trainers if t.worker == second) < planned / 2
        assert accuracy >= two_workers["_sharing"] - 0.02, (accuracy, two_workers)
    else:
        fitted = [(r.epoch, name) for r in stats.rounds for w in r.workers for name in w.batches]
        assert len(fitted) == len(set(fitted)) == planned  # every minibatch of every epoch once
        assert any(w.worker == second for r in stats.rounds for w in r.workers)
        # the retiring trainer leaves between two rounds: the fit is its rounds, two workers' then one's
        assert len(stats.rounds[-1].workers) == 1
        if master is _averaging:
            torch.testing.assert_close(network.params(), _replay(stats.rounds).params(), rtol=0, atol=1e-5)
