"""Persisting three times the workers' memory, or training over twice of it, never pauses or kills
a worker, nor leaves it holding memory Dask cannot spill, and the storage report counts the bytes
exactly; a fit or an RDD action that waits on a worker Dask paused says so, and goes on once its
memory falls."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import psutil
import pytest
import torch
from distributed import Client

from dlscale import (
    ParameterAveragingTrainingMaster,
    SharedTrainingMaster,
    SparkConf,
    SparkContext,
    SparkNet,
    StorageLevel,
)
from dlscale.data import DataSet, export_minibatches, list_paths
from dlscale.nn import Network
from dlscale.runtime.cluster import PAUSE_CHECK, cluster_workers

WORKERS = 2
MEMORY_LIMIT = 768 * 2**20
PARTITION_BYTES = 16 * 2**20
TENSORS_PER_PARTITION = 2
NUM_PARTITIONS = 3 * WORKERS * MEMORY_LIMIT // PARTITION_BYTES  # 3x the workers' memory in all


def make_partition(i: int, _items: Iterator[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    n = PARTITION_BYTES // TENSORS_PER_PARTITION // 4
    return [torch.rand(n, generator=g) for _ in range(TENSORS_PER_PARTITION)]


@pytest.fixture(scope="module")
def small_sc() -> Iterator[SparkContext]:
    conf = SparkConf().setMaster(f"local[{WORKERS}]").set("spark.executor.memory", str(MEMORY_LIMIT))
    with SparkContext(conf=conf) as ctx:
        yield ctx


def _memory_events(ctx: SparkContext) -> list[str]:
    logs = ctx.client.get_worker_logs() | ctx.client.get_worker_logs(nanny=True)
    words = ("Pausing worker", "exceeded", "Restarting worker", "Worker process died", "Unmanaged memory use is high")
    return [msg for entries in logs.values() for _, msg in entries if any(w in msg for w in words)]


@pytest.mark.parametrize(
    "level",
    # DISK_ONLY (about 30 s) with the slow tests: the default run keeps under 15 minutes on 2 cores
    [StorageLevel.MEMORY_AND_DISK_SER, pytest.param(StorageLevel.DISK_ONLY, marks=pytest.mark.slow)],
    ids=str,
)
def test_three_times_memory_persisted_and_counted_twice(level: StorageLevel, small_sc: SparkContext) -> None:
    ctx = small_sc
    pids = ctx.client.run(os.getpid)
    rdd = ctx.parallelize(range(NUM_PARTITIONS), NUM_PARTITIONS).mapPartitionsWithIndex(make_partition)
    rdd.persist(level)
    true_bytes = NUM_PARTITIONS * PARTITION_BYTES
    assert true_bytes >= 3 * WORKERS * MEMORY_LIMIT

    for _ in range(2):
        assert rdd.count() == NUM_PARTITIONS * TENSORS_PER_PARTITION

    info = next(i for i in ctx.getRDDStorageInfo() if i.id == rdd.id())
    assert info.numCachedPartitions == NUM_PARTITIONS
    assert abs(info.memSize + info.diskSize - true_bytes) <= 0.05 * true_bytes
    assert info.diskSize > 2 * WORKERS * MEMORY_LIMIT  # most of it had to leave memory
    # the persisted copy is what was computed: spot-check two partitions against a recomputation
    first, last = rdd.glom().take(1)[0], make_partition(0, iter(()))
    assert all(torch.equal(a, b) for a, b in zip(first, last))

    assert ctx.client.run(os.getpid) == pids, "a worker was restarted"
    assert _memory_events(ctx) == []
    rdd.unpersist(blocking=True)


TRAIN_FEATURES = 4096
TRAIN_BATCH = 512  # 8 MiB of features per minibatch


def _minibatches(count: int) -> Iterator[DataSet]:
    g = torch.Generator().manual_seed(7)
    for _ in range(count):
        x = torch.rand(TRAIN_BATCH, TRAIN_FEATURES, generator=g)
        yield DataSet(x, (x[:, :10].sum(1) > 5).long())


def test_training_over_more_data_than_the_workers_memory(small_sc: SparkContext, tmp_path) -> None:
    """Gradient sharing over minibatch files holding more than each worker's memory limit, twice
    over: the files stream through the workers, and no worker is paused, killed or restarted."""
    ctx = small_sc
    pids = ctx.client.run(os.getpid)
    count = 2 * WORKERS * MEMORY_LIMIT // (TRAIN_BATCH * TRAIN_FEATURES * 4)  # 2x the workers' memory in all
    export_minibatches(_minibatches(count), str(tmp_path / "train"), TRAIN_BATCH)
    network = Network(torch.nn.Linear(TRAIN_FEATURES, 2), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.01))
    before = network.params().clone()
    spark_net = SparkNet(ctx, network, SharedTrainingMaster(TRAIN_BATCH, collect_training_stats=True, rng_seed=0))
    spark_net.fit_paths(list_paths(ctx, str(tmp_path / "train")), epochs=2)
    trainers = spark_net.training_stats.trainers
    assert sum(t.minibatches for t in trainers) == 2 * count
    assert all(t.minibatches * TRAIN_BATCH * TRAIN_FEATURES * 4 > MEMORY_LIMIT for t in trainers)
    assert not torch.equal(network.params(), before)
    assert ctx.client.run(os.getpid) == pids, "a worker was restarted"
    assert _memory_events(ctx) == []


def _hold(fraction: float, dask_worker) -> None:
    """Take the worker's process to ``fraction`` of its memory limit, in memory Dask cannot spill."""
    nbytes = int(fraction * dask_worker.memory_manager.memory_limit) - psutil.Process().memory_info().rss
    dask_worker.dlscale_test_ballast = np.ones(nbytes, np.uint8)  # written: resident, not just reserved


def _release(dask_worker) -> None:
    del dask_worker.dlscale_test_ballast


def _pause(client: Client) -> None:
    """Take every worker past Dask's pause threshold (0.8 of its limit, short of its restart at 0.95);
    returns once the scheduler knows they paused."""
    client.run(_hold, 0.86)
    deadline = time.monotonic() + 10
    while any(w["status"] != "paused" for w in cluster_workers(client).values()):
        assert time.monotonic() < deadline, "Dask did not pause the worker"
        time.sleep(0.05)


def test_a_fit_waiting_on_a_worker_dask_paused_says_so_and_goes_on_once_its_memory_falls(caplog) -> None:
    """A worker past Dask's pause threshold takes no network sent to it and starts no task, so a fit
    whose trainers can only run there waits; the driver warns, naming the worker and its memory, within
    a look or two, and once the memory is freed the fit ends as it would have."""
    conf = SparkConf().setMaster("local[1]").set("spark.executor.memory", str(MEMORY_LIMIT))
    with SparkContext(conf=conf) as ctx:
        (address,) = cluster_workers(ctx.client)
        x = torch.rand(64, 4, generator=torch.Generator().manual_seed(0))
        batches = ctx.parallelize(DataSet(x, (x.sum(1) > 2).long()).batch_by(8), 2)
        sgd = functools.partial(torch.optim.SGD, lr=0.1)
        nets = [Network(torch.nn.Linear(4, 2), "cross_entropy", sgd) for _ in "ab"]
        nets[1].set_params(nets[0].params())
        SparkNet(ctx, nets[0], ParameterAveragingTrainingMaster(8, rng_seed=0)).fit(batches)  # the reference
        spark_net = SparkNet(ctx, nets[1], ParameterAveragingTrainingMaster(8, rng_seed=0))
        _pause(ctx.client)
        _waits_warns_and_goes_on(ctx.client, caplog, threading.Thread(target=spark_net.fit, args=(batches,)), address)
        assert torch.equal(nets[1].params(), nets[0].params())


@pytest.mark.parametrize("computation", ["action", "toLocalIterator"])
def test_an_rdd_computation_waiting_on_a_worker_dask_paused_says_so_and_ends_once_its_memory_falls(
    caplog, computation
) -> None:
    """An action (or a ``toLocalIterator``, whose partitions are computed outside an action's job) whose
    tasks can only run on a paused worker waits; the driver warns, naming the worker, its memory and
    the job (the RDD), and once the memory is freed it gives what Python computes."""
    conf = SparkConf().setMaster("local[1]").set("spark.executor.memory", str(MEMORY_LIMIT))
    with SparkContext(conf=conf) as ctx:
        (address,) = cluster_workers(ctx.client)
        rdd = ctx.parallelize(range(100), 4).map(lambda x: x * x)
        _pause(ctx.client)
        result: list[int] = []
        run, expected, waiting = {
            "action": (lambda: result.append(rdd.sum()), [sum(x * x for x in range(100))], "job "),
            "toLocalIterator": (
                lambda: result.extend(rdd.toLocalIterator()),
                [x * x for x in range(100)],
                f"toLocalIterator of RDD {rdd.id()}",
            ),
        }[computation]
        warning = _waits_warns_and_goes_on(ctx.client, caplog, threading.Thread(target=run), address)
        assert result == expected
        assert f"and {waiting}" in warning and " waits for any of its tasks to run there" in warning


def _waits_warns_and_goes_on(client: Client, caplog, waiting: threading.Thread, address: str) -> str:
    """Start ``waiting`` (a fit or an action with work only the paused worker at ``address`` can run);
    check that it waits, that the driver warns within a few looks, naming the worker and its memory,
    and that once the worker's memory is freed it ends and the driver says the worker runs again.
    Returns the warning."""
    with caplog.at_level(logging.INFO, logger="dlscale"):
        waiting.start()
        deadline = time.monotonic() + 3 * PAUSE_CHECK
        while not (warned := [r for r in caplog.records if r.levelno == logging.WARNING and "paused" in r.message]):
            assert time.monotonic() < deadline and waiting.is_alive(), "no warning of the paused worker"
            time.sleep(0.1)
        assert waiting.is_alive(), "it did not wait for the paused worker"
        client.run(_release)
        waiting.join(timeout=60)
    assert not waiting.is_alive(), "it did not go on once the worker's memory fell"
    assert warned[0].message.startswith(f"worker {address} is paused: its process holds ")
    assert "of its 768.00 MiB memory limit" in warned[0].message
    assert f"worker {address} runs tasks again" in [r.message for r in caplog.records]
    return warned[0].message
