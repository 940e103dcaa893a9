"""Persisting three times the workers' memory never pauses or kills a worker, and the storage
report counts the bytes exactly."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from dlscale import SparkConf, SparkContext, StorageLevel

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
    words = ("Pausing worker", "exceeded", "Restarting worker", "Worker process died")
    return [msg for entries in logs.values() for _, msg in entries if any(w in msg for w in words)]


@pytest.mark.parametrize("level", [StorageLevel.MEMORY_AND_DISK_SER, StorageLevel.DISK_ONLY], ids=str)
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
