"""Training through faults, on real multi-process clusters: a worker killed (SIGKILL) mid-fit under
both masters and both ways of holding an RDD's minibatches, non-finite values in the data, and the
error type of a failed gradient-sharing fit. The accuracy reference is single-process PyTorch for gradient
sharing and the same fit without the fault for parameter averaging (synchronous, so a fault moves it only
through the rounds that follow)."""

from __future__ import annotations

import contextlib
import os
import random
import time
import warnings
from collections import Counter
from collections.abc import Iterator

import dask
import pytest
import torch

from dlscale import (
    CorruptDataError,
    NonFiniteUpdateError,
    ParameterAveragingTrainingMaster,
    SharedTrainingMaster,
    SparkContext,
    SparkNet,
    TrainerLostWarning,
)
from dlscale.data import DataSet, export_minibatches, list_paths
from dlscale.nn import Network
from tests.conftest import WORKER_IMPORTS
from tests.test_session import exactly_once
from tests.test_sharing import BATCH, _KillAt, accuracy, digits, examples_rdd, mlp

SIZES = [64, 32, 10]
LR = 0.05
EPOCHS = 6
PER_EPOCH = 75  # minibatches of 16 in 1,200 examples
ROUNDS = 5  # rounds an epoch on three workers averaging every 5 minibatches
ROUND_ITERATIONS = 5  # parameter averaging counts iterations as minibatches per worker


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, ...]:
    return digits()


@pytest.fixture(scope="module")
def reference(data: tuple[torch.Tensor, ...]) -> float:
    """Test accuracy of single-process SGD on the same model, epochs and minibatch size."""
    x, y, tx, ty = data
    net = mlp(SIZES, lr=LR)
    g = torch.Generator().manual_seed(1)
    for _ in range(EPOCHS):
        order = torch.randperm(len(x), generator=g)
        net.fit([DataSet(x[order[i : i + BATCH]], y[order[i : i + BATCH]]) for i in range(0, len(x), BATCH)])
    return accuracy(net, tx, ty)


@pytest.fixture(scope="module")
def cluster3() -> Iterator[SparkContext]:
    """Three worker processes of one thread, for the tests that kill one: forked, as a training
    program's are, from a server that imported torch (its nanny starts a new one; Dask's 15 s before a
    lost worker's nanny is closed for good are raised for a busy machine all the same)."""
    settings = {"distributed.deploy.lost-worker-timeout": "300s", "dlscale.worker.imports": WORKER_IMPORTS}
    with dask.config.set(settings), SparkContext("local[3]", "training-faults") as ctx:
        yield ctx


def _pids(ctx: SparkContext) -> dict[str, int]:
    """The pids of three live workers, once a worker killed before is gone and its successor is up."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ctx.client.wait_for_workers(3, timeout=120)
        with contextlib.suppress(OSError):  # a killed worker not yet removed
            pids = ctx.client.run(os.getpid)
            if len(pids) == 3:
                return pids
        time.sleep(0.5)
    raise TimeoutError("the cluster did not get back to three workers")


@pytest.fixture
def sc3(cluster3: SparkContext) -> SparkContext:
    _pids(cluster3)
    return cluster3


def _victim(ctx: SparkContext, rng: random.Random) -> tuple[str, int]:
    pids = _pids(ctx)
    address = rng.choice(sorted(pids))
    return address, pids[address]


def _averaging(approach: str, seed: int, streaming: bool = False) -> ParameterAveragingTrainingMaster:
    return ParameterAveragingTrainingMaster(
        BATCH,
        averaging_frequency=5,
        rdd_training_approach=approach,
        streaming=streaming,
        rng_seed=seed,
        collect_training_stats=True,
    )


def _fit_averaging(
    ctx: SparkContext, data: tuple[torch.Tensor, ...], approach: str, seed: int, streaming: bool = False
) -> float:
    """Test accuracy of the same fit as :func:`_fit_averaging_killed` without a fault (one process with
    another shuffle differs from it by as much as seeds do, 1.5 points measured)."""
    x, y, tx, ty = data
    net = mlp(SIZES, lr=LR)
    SparkNet(ctx, net, _averaging(approach, seed, streaming)).fit(examples_rdd(ctx, x, y, 3), epochs=EPOCHS)
    return accuracy(net, tx, ty)


def _fit_averaging_killed(
    ctx: SparkContext,
    data: tuple[torch.Tensor, ...],
    approach: str,
    seed: int,
    epoch_end: bool = False,
    streaming: bool = False,
) -> Network:
    """Fit with parameter averaging, killing a random worker after a random number of rounds (or, with
    ``epoch_end``, as the first epoch's last round settles: its trainer has just averaged and begins
    the next epoch); checks that the fit finished and that every minibatch of every epoch was fitted
    exactly once."""
    x, y, _, _ = data
    rng = random.Random(seed)
    # in the fit's first third: the listener hears of a round as the driver polls (every 0.1 s, on cores it
    # shares with three trainers, in fits of 0.25-0.7 s), and a kill heard of late came after the trainers
    # had finished (no trainer lost, no warning: 3 runs in 10 with kills at round 19 or 23 of 30, 3 in 32
    # streaming fits killed at the third epoch's end, round 15, and a CI run with kills up to round 15)
    at = ROUND_ITERATIONS * (ROUNDS if epoch_end else rng.randint(1, EPOCHS * ROUNDS // 3))
    killer = _KillAt(_victim(ctx, rng)[1], at)
    net = mlp(SIZES, lr=LR)
    spark_net = SparkNet(ctx, net, _averaging(approach, seed, streaming))
    spark_net.set_listeners(killer)
    with pytest.warns(TrainerLostWarning, match=r"parameter averaging lost worker\(s\) tcp://127\.0\.0\.1:\d+;"):
        spark_net.fit(examples_rdd(ctx, x, y, 3), epochs=EPOCHS)
    assert killer.killed
    assert net.epoch == EPOCHS
    fitted = Counter((r.epoch, b) for r in spark_net.training_stats.rounds for w in r.workers for b in w.batches)
    assert len(fitted) == EPOCHS * PER_EPOCH and set(fitted.values()) == {1}
    # the tally agrees, and counts as redone at most the killed trainer's shares of the rounds not settled:
    # the one it was given, the one before if it was that round's only holder, and streaming one more
    assert exactly_once(spark_net.training_stats, PER_EPOCH, EPOCHS) <= (3 if streaming else 2) * ROUND_ITERATIONS
    return net


@pytest.mark.parametrize("streaming", [False, True], ids=["rounds", "streaming"])
def test_averaging_finishes_when_a_worker_dies_as_an_epoch_ends(
    sc3: SparkContext, data: tuple[torch.Tensor, ...], streaming: bool
) -> None:
    """A worker killed as the first epoch's last round settles: the fit finishes, each minibatch fitted
    once, within 3 points of the same fit unfaulted. Both fits move from run to run with streaming,
    whose averages are taken as late as timing makes them: by hand, twelve faulted fits of this seed
    were 0.7 below to 1.2 above their unfaulted twins (0.935-0.951; killed at the third epoch's end, a
    CI run was 2.5 below); without streaming 0.943 against 0.933 in eight."""
    unfaulted = _fit_averaging(sc3, data, "export", seed=3, streaming=streaming)
    net = _fit_averaging_killed(sc3, data, "export", seed=3, epoch_end=True, streaming=streaming)
    assert accuracy(net, data[2], data[3]) >= unfaulted - 0.03


@pytest.mark.slow
@pytest.mark.parametrize("streaming", [False, True], ids=["rounds", "streaming"])
def test_averaging_survives_kills_at_random_points(
    sc3: SparkContext, data: tuple[torch.Tensor, ...], streaming: bool
) -> None:
    """Ten fits, each killing a worker at a random round: every one finishes with each minibatch fitted
    once, and the kills cost no accuracy on average (mean within 1 point of the same fits unfaulted;
    measured 0.2 below). A kill changes the rounds that follow (two workers share what three did), which
    moves one fit's accuracy as another shuffle would: over 30 seeds, faulted less unfaulted had a mean
    of +0.1 and a standard deviation of 1.0 points, from -2.7 to +2.2, and one fit in a CI run was 3.0
    below, so a single fit is held to 4 (a lost share of minibatches fails the check that each is fitted once)."""
    unfaulted, faulted = [], []
    for seed in range(10):
        approach = "export" if seed % 2 else "direct"
        unfaulted.append(_fit_averaging(sc3, data, approach, seed=100 + seed, streaming=streaming))
        killed = _fit_averaging_killed(sc3, data, approach, seed=100 + seed, streaming=streaming)
        faulted.append(accuracy(killed, data[2], data[3]))
    assert sum(faulted) / 10 >= sum(unfaulted) / 10 - 0.01, (faulted, unfaulted)
    assert all(f >= u - 0.04 for f, u in zip(faulted, unfaulted, strict=True)), (faulted, unfaulted)


@pytest.mark.timeout(300)
def test_sharing_direct_finishes_when_a_worker_holding_minibatches_dies(
    sc3: SparkContext, data: tuple[torch.Tensor, ...], reference: float
) -> None:
    """The killed worker held a third of the minibatches: Dask recomputes them from the RDD and the
    trainers waiting for them are told, rather than waiting forever."""
    x, y, tx, ty = data
    victim, pid = _victim(sc3, random.Random(0))
    net = mlp(SIZES, lr=LR)
    master = SharedTrainingMaster(BATCH, rdd_training_approach="direct", rng_seed=0, collect_training_stats=True)
    spark_net = SparkNet(sc3, net, master)
    killer = _KillAt(pid, at=EPOCHS * PER_EPOCH // 3)
    spark_net.set_listeners(killer)
    with pytest.warns(TrainerLostWarning, match=victim):
        spark_net.fit(examples_rdd(sc3, x, y, 3), epochs=EPOCHS)
    assert killer.killed and net.epoch == EPOCHS
    assert exactly_once(spark_net.training_stats, PER_EPOCH, EPOCHS) >= 1  # it held minibatches leased ahead
    # the survivors' records, and the nanny's replacement's if it joined the fit in time: none of the victim
    workers = {t.worker for t in spark_net.training_stats.trainers}
    assert victim not in workers and len(workers) >= 2
    assert accuracy(net, tx, ty) >= reference - 0.05  # asynchronous: runs differ by a few points


# -- non-finite values --------------------------------------------------------------------------


def _poisoned(x: torch.Tensor, how: str, at: int) -> torch.Tensor:
    x = x.clone()
    if how == "all nan":
        x[:] = float("nan")
    else:
        x[at, 5] = float("nan") if how == "one nan" else float("inf")
    return x


@pytest.mark.parametrize("how", ["one nan", "one inf", "all nan"])
def test_averaging_refuses_non_finite_values_naming_the_minibatch(
    sc: SparkContext, data: tuple[torch.Tensor, ...], tmp_path: object, how: str
) -> None:
    x, y, _, _ = data
    at = 700  # in minibatch 43 (examples 688-703)
    bad = _poisoned(x[:960], how, at)
    net = mlp(SIZES, lr=LR)
    before = net.params().clone()
    master = ParameterAveragingTrainingMaster(BATCH, export_directory=str(tmp_path), rng_seed=0)
    where = r"dataset_0+43\.dlb" if how != "all nan" else r"dataset_\d{8}\.dlb"  # all nan: whichever comes first
    with pytest.raises(NonFiniteUpdateError, match=f"minibatch .*{where}"):
        SparkNet(sc, net, master).fit(examples_rdd(sc, bad, y[:960], 3), epochs=2)
    assert torch.equal(net.params(), before) and net.iteration == 0 and net.epoch == 0


def test_averaging_direct_names_the_partition_of_a_non_finite_minibatch(
    sc: SparkContext, data: tuple[torch.Tensor, ...]
) -> None:
    x, y, _, _ = data
    bad = _poisoned(x[:960], "one nan", 700)
    net = mlp(SIZES, lr=LR)
    before = net.params().clone()
    master = ParameterAveragingTrainingMaster(BATCH, rdd_training_approach="direct", rng_seed=0)
    with pytest.raises(NonFiniteUpdateError, match=r"minibatch 43 \(examples 688-703 of the RDD, in partition 2\)"):
        SparkNet(sc, net, master).fit(examples_rdd(sc, bad, y[:960], 3), epochs=2)
    assert torch.equal(net.params(), before)


def _files(sc: SparkContext, x: torch.Tensor, y: torch.Tensor, url: str) -> list[str]:
    export_minibatches([DataSet(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)], url, BATCH)
    return sorted(list_paths(sc, url).collect())


def test_fit_paths_names_the_file_of_a_non_finite_minibatch(
    sc: SparkContext, data: tuple[torch.Tensor, ...], tmp_path: object
) -> None:
    x, y, _, _ = data
    paths = _files(sc, _poisoned(x[:480], "one inf", 100), y[:480], f"{tmp_path}/train")
    net = mlp(SIZES, lr=LR)
    before = net.params().clone()
    with pytest.raises(NonFiniteUpdateError, match=os.path.basename(paths[6])):
        SparkNet(sc, net, ParameterAveragingTrainingMaster(BATCH)).fit_paths(sc.parallelize(paths, 2), epochs=2)
    assert torch.equal(net.params(), before)


def test_sharing_refuses_non_finite_values_naming_the_minibatch(
    sc: SparkContext, data: tuple[torch.Tensor, ...], tmp_path: object
) -> None:
    x, y, _, _ = data
    paths = _files(sc, _poisoned(x[:480], "one nan", 100), y[:480], f"{tmp_path}/train")
    net = mlp(SIZES, lr=LR)
    before = net.params().clone()
    with pytest.raises(NonFiniteUpdateError) as failure:
        SparkNet(sc, net, SharedTrainingMaster(BATCH)).fit_paths(sc.parallelize(paths, 2), epochs=2)
    assert any(paths[6] in note for note in failure.value.__notes__), failure.value.__notes__
    assert torch.equal(net.params(), before)


# -- the error of a failed gradient-sharing fit ------------------------------------------------------


def _sharing_fails_on_a_corrupt_file(sc: SparkContext, paths: list[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainerLostWarning)
        with pytest.raises(CorruptDataError, match=os.path.basename(paths[20])) as failure:
            SparkNet(sc, mlp(SIZES, lr=LR), SharedTrainingMaster(BATCH)).fit_paths(sc.parallelize(paths, 2), epochs=3)
    assert any("gradient-sharing trainer" in note for note in failure.value.__notes__), failure.value.__notes__


@pytest.fixture(scope="module")
def corrupt_paths(sc: SparkContext, data: tuple[torch.Tensor, ...], tmp_path_factory: pytest.TempPathFactory) -> list:
    x, y, _, _ = data
    paths = _files(sc, x[:480], y[:480], str(tmp_path_factory.mktemp("corrupt") / "train"))
    with open(paths[20], "r+b") as f:  # a minibatch of the middle of every epoch
        f.seek(40)
        f.write(b"\xff" * 16)
    return paths


@pytest.mark.parametrize("run", range(2))
def test_a_failed_sharing_fit_raises_the_trainers_error(sc: SparkContext, corrupt_paths: list, run: int) -> None:
    _sharing_fails_on_a_corrupt_file(sc, corrupt_paths)


@pytest.mark.slow
def test_a_failed_sharing_fit_always_raises_the_trainers_error(sc: SparkContext, corrupt_paths: list) -> None:
    for _ in range(10):
        _sharing_fails_on_a_corrupt_file(sc, corrupt_paths)
