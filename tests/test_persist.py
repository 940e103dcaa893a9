"""Storage levels, persistence and the correct sizing of torch tensors."""

from __future__ import annotations

import glob
import os
import time
from typing import Any

import dask
import pytest
import torch
from dask.sizeof import sizeof

from dlscale import CorruptDataError, SparkContext, StorageLevel

ALL_LEVELS = [
    "MEMORY_ONLY",
    "MEMORY_ONLY_2",
    "MEMORY_ONLY_SER",
    "MEMORY_ONLY_SER_2",
    "MEMORY_AND_DISK",
    "MEMORY_AND_DISK_2",
    "MEMORY_AND_DISK_SER",
    "MEMORY_AND_DISK_SER_2",
    "MEMORY_AND_DISK_DESER",
    "DISK_ONLY",
    "OFF_HEAP",
]


@pytest.mark.pyspark
@pytest.mark.parametrize(
    "name", ["NONE", "DISK_ONLY", "DISK_ONLY_2", "DISK_ONLY_3", "MEMORY_AND_DISK_DESER", "OFF_HEAP"]
)
def test_levels_shared_with_pyspark_print_the_same(name: str, spark: Any) -> None:
    from pyspark import StorageLevel as PySparkLevel

    ours, theirs = getattr(StorageLevel, name), getattr(PySparkLevel, name)
    assert (str(ours), repr(ours)) == (str(theirs), repr(theirs))


def test_deserialized_and_serialized_levels_follow_spark() -> None:
    # PySpark marks every level serialized (Python objects are always pickled for the JVM);
    # dlscale keeps Scala Spark's meaning, where the distinction is real.
    assert str(StorageLevel.MEMORY_ONLY) == "Memory Deserialized 1x Replicated"
    assert str(StorageLevel.MEMORY_ONLY_SER) == "Memory Serialized 1x Replicated"
    assert str(StorageLevel.MEMORY_AND_DISK_SER_2) == "Disk Memory Serialized 2x Replicated"
    assert StorageLevel.MEMORY_AND_DISK == StorageLevel.MEMORY_AND_DISK_DESER
    assert StorageLevel(True, True, False, False) == StorageLevel.MEMORY_AND_DISK_SER


@pytest.mark.parametrize("name", ALL_LEVELS)
def test_every_level_gives_the_same_results(name: str, sc: SparkContext) -> None:
    level = getattr(StorageLevel, name)
    base = sc.parallelize(range(40), 4).map(lambda x: (x % 5, torch.full((3,), float(x))))
    rdd = base.map(lambda kv: kv).persist(level)
    assert rdd.is_cached and rdd.getStorageLevel() == level
    expected = base.mapValues(lambda t: t.sum().item()).reduceByKey(lambda a, b: a + b).collectAsMap()
    for _ in range(2):
        got = rdd.mapValues(lambda t: t.sum().item()).reduceByKey(lambda a, b: a + b).collectAsMap()
        assert got == expected
    info = {i.id: i for i in sc.getRDDStorageInfo()}[rdd.id()]
    assert info.numCachedPartitions == 4 and info.storageLevel == level
    assert info.memSize + info.diskSize > 40 * 3 * 4
    if level.replication > 1:
        time.sleep(5)  # two cycles of Dask's Active Memory Manager, which drops extra replicas by default
        who_has = sc.client.who_has(rdd._stored.futures)
        assert all(len(w) == level.replication for w in who_has.values())
    rdd.unpersist(blocking=True)
    assert not rdd.is_cached and rdd.getStorageLevel() == StorageLevel.NONE
    assert rdd.count() == 40
    assert rdd.id() not in {i.id for i in sc.getRDDStorageInfo()}


def test_persist_reuses_computed_partitions(sc: SparkContext, tmp_path: Any) -> None:
    marker = str(tmp_path / "computed")

    def record(x: int) -> int:
        with open(f"{marker}-{x}", "a") as f:
            f.write("x")
        return x

    rdd = sc.parallelize(range(8), 4).map(record).persist(StorageLevel.MEMORY_AND_DISK_SER)
    assert rdd.sum() == 28 and rdd.count() == 8 and rdd.collect() == list(range(8))
    assert all(open(f"{marker}-{x}").read() == "x" for x in range(8))
    rdd.unpersist()


def test_cached_tensors_are_not_changed_by_in_place_updates(sc: SparkContext) -> None:
    rdd = sc.parallelize([torch.zeros(4) for _ in range(6)], 2).persist(StorageLevel.MEMORY_ONLY_SER)
    assert rdd.map(lambda t: t.add_(1).sum().item()).sum() == 24
    assert rdd.map(lambda t: t.sum().item()).sum() == 0
    rdd.unpersist()


def test_storage_level_cannot_change(sc: SparkContext) -> None:
    rdd = sc.parallelize([1, 2]).cache()
    assert rdd.getStorageLevel() == StorageLevel.MEMORY_ONLY
    assert rdd.persist(StorageLevel.MEMORY_ONLY) is rdd
    with pytest.raises(ValueError, match="Cannot change storage level"):
        rdd.persist(StorageLevel.DISK_ONLY)
    with pytest.raises(TypeError, match="StorageLevel"):
        sc.parallelize([1]).persist("MEMORY_ONLY")  # type: ignore[arg-type]
    rdd.unpersist()


def test_disk_only_replication_needs_shared_storage(sc: SparkContext, tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="disk-dir"):
        sc.parallelize([1]).persist(StorageLevel.DISK_ONLY_2)
    with dask.config.set({"dlscale.persist.disk-dir": str(tmp_path / "blocks")}):
        rdd = sc.parallelize(range(10), 2).persist(StorageLevel.DISK_ONLY_2)
        assert rdd.collect() == list(range(10))
        assert len(glob.glob(str(tmp_path / "blocks" / "*" / "*" / "part-*.blk"))) == 2
        rdd.unpersist(blocking=True)
        assert glob.glob(str(tmp_path / "blocks" / "*" / "*" / "part-*.blk")) == []


def _block_files(sc: SparkContext, rdd_id: int) -> dict[str, list[str]]:
    def find(dask_worker: Any) -> list[str]:
        return sorted(
            glob.glob(os.path.join(dask_worker.local_directory, "dlscale-blocks", "*", f"rdd-{rdd_id}-*", "*"))
        )

    return sc.client.run(find)


def test_disk_only_blocks_are_local_and_removed_on_unpersist(sc: SparkContext) -> None:
    rdd = sc.parallelize(range(100), 4).map(lambda x: x * 2).persist(StorageLevel.DISK_ONLY)
    assert rdd.sum() == 9900
    files = [f for fs in _block_files(sc, rdd.id()).values() for f in fs]
    assert len(files) == 4
    # a read task that runs on the other worker fetches the block from the worker that has it
    records = sc.client.gather(rdd._stored.futures)
    owners = {r[0].worker for r in records}
    sc.client.replicate(rdd._stored.futures)
    assert rdd.map(lambda x: x).repartition(3).sum() == 9900
    assert owners <= set(sc.client.run(os.getpid))
    rdd.unpersist(blocking=True)
    assert all(not fs for fs in _block_files(sc, rdd.id()).values())


def test_tampered_disk_block_is_refused(sc: SparkContext) -> None:
    rdd = sc.parallelize([torch.arange(4)] * 8, 2).persist(StorageLevel.DISK_ONLY)
    assert rdd.count() == 8
    path = next(f for fs in _block_files(sc, rdd.id()).values() for f in fs)

    def flip(path: str) -> None:
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            b = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([b[0] ^ 0xFF]))

    sc.client.run(flip, path, workers=[w for w, fs in _block_files(sc, rdd.id()).items() if path in fs])
    with pytest.raises(CorruptDataError, match="altered on disk"):
        rdd.collect()
    rdd.unpersist(blocking=True)


def test_tensor_sizeof_counts_data_in_driver_and_workers(sc: SparkContext) -> None:
    t = torch.zeros(1000, 100)
    assert sizeof(t) >= t.nelement() * t.element_size()
    assert sizeof([t, t.clone()]) >= 2 * 400_000
    on_workers = sc.client.run(lambda: sizeof(torch.zeros(1000, 100, dtype=torch.float64)))
    assert all(v >= 800_000 for v in on_workers.values())
    sparse = torch.eye(100).to_sparse()
    assert sizeof(sparse) >= 100 * (8 * 2 + 4)
    assert sizeof(torch.nn.Linear(100, 10)) >= 1010 * 4
