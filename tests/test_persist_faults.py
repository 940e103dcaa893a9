"""Persistence under faults: failed jobs, unpersisting, killed workers, and blocks deleted, swapped or
planted on disk. Everything runs on a real two-process LocalCluster of this module's own, which
survives ``SparkContext.stop()`` so that what a context leaves on disk can be checked."""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster

from dlscale import CorruptDataError, SparkContext, StorageError, StorageLevel

LEVELS = ["MEMORY_ONLY", "MEMORY_ONLY_2", "MEMORY_ONLY_SER", "MEMORY_AND_DISK_SER", "DISK_ONLY"]


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as c,
    ):
        yield c


@pytest.fixture
def ctx(client: Client) -> Iterator[SparkContext]:
    """A context on the module's cluster, stopped (not closed) after the test, with both workers up."""
    client.wait_for_workers(2, timeout=60)
    context = SparkContext(client=client, appName="faults")
    yield context
    context.stop()


def _fail(x: int) -> int:
    raise ValueError(f"element {x} is bad")


def _block_files(ctx: SparkContext, rdd_id: int, pattern: str = "*") -> list[str]:
    """The files, hidden ones included, in the workers' directories for the blocks of one RDD."""
    app, rdd = ctx.applicationId, f"rdd-{rdd_id}-*"

    def find(dask_worker: Any) -> list[str]:
        root = os.path.join(dask_worker.local_directory, "dlscale-blocks", app, rdd)
        return sorted(glob.glob(os.path.join(root, pattern)) + glob.glob(os.path.join(root, "." + pattern)))

    return [f for fs in ctx._client.run(find).values() for f in fs]  # after stop() too


def _wait_for(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _kill_worker_holding(ctx: SparkContext, future: Any) -> str:
    """SIGKILL the worker process that holds ``future`` and wait until the scheduler has removed it."""
    client = ctx.client
    address = sorted(client.who_has([future])[future.key])[0]
    pid = client.run(os.getpid, workers=[address])[address]
    os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: address not in client.scheduler_info()["workers"])
    return address


# -- unpersist -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["MEMORY_ONLY", "MEMORY_ONLY_SER", "DISK_ONLY"])
def test_unpersisting_a_failed_rdd_keeps_every_other_rdd(name: str, ctx: SparkContext) -> None:
    level = getattr(StorageLevel, name)
    kept = ctx.parallelize(range(8), 4).map(lambda x: x + 1).persist(level)
    assert kept.collect() == list(range(1, 9))
    failed = ctx.parallelize(range(8), 4).map(_fail).persist(level)
    with pytest.raises(ValueError, match="is bad"):
        failed.count()
    failed.unpersist(blocking=True)
    assert ctx.parallelize(range(5), 2).sum() == 10  # the client is still connected
    assert kept.collect() == list(range(1, 9))
    info = {i.id: i for i in ctx.getRDDStorageInfo()}
    assert failed.id() not in info and info[kept.id()].numCachedPartitions == 4


@pytest.mark.parametrize("name", LEVELS)
def test_child_of_an_unpersisted_rdd_recomputes_from_lineage(name: str, ctx: SparkContext) -> None:
    parent = ctx.parallelize(range(20), 4).map(lambda x: x * 2).persist(getattr(StorageLevel, name))
    assert parent.count() == 20
    child = parent.map(lambda x: x + 1)
    grandchild = child.filter(lambda x: x % 3 == 0)
    parent.unpersist()
    assert child.collect() == [x * 2 + 1 for x in range(20)]
    assert grandchild.collect() == [x * 2 + 1 for x in range(20) if (x * 2 + 1) % 3 == 0]
    assert child.persist(StorageLevel.MEMORY_ONLY).sum() == sum(x * 2 + 1 for x in range(20))
    child.unpersist(blocking=True)


@pytest.mark.slow  # 20 s of PySpark jobs on a loaded 2-core machine
@pytest.mark.pyspark
def test_child_of_an_unpersisted_rdd_matches_pyspark(spark: Any, ctx: SparkContext) -> None:
    from pyspark import StorageLevel as PySparkLevel

    def run(context: Any, level: Any) -> list:
        parent = context.parallelize(range(20), 4).map(lambda x: x * 2).persist(level)
        parent.count()
        child = parent.map(lambda x: x + 1)
        parent.unpersist()
        return child.collect()

    assert run(ctx, StorageLevel.DISK_ONLY) == run(spark, PySparkLevel.DISK_ONLY)


def test_non_blocking_unpersist_deletes_disk_only_blocks(ctx: SparkContext) -> None:
    rdd = ctx.parallelize(range(100), 4).persist(StorageLevel.DISK_ONLY)
    assert rdd.count() == 100
    assert len(_block_files(ctx, rdd.id(), "part-*.blk")) == 4
    rdd.unpersist()
    assert not rdd.is_cached
    _wait_for(lambda: not _block_files(ctx, rdd.id()))


def test_stop_deletes_blocks_left_by_unpersist(ctx: SparkContext, tmp_path: Any) -> None:
    local = ctx.parallelize(range(100), 4).persist(StorageLevel.DISK_ONLY)
    with dask.config.set({"dlscale.persist.disk-dir": str(tmp_path)}):
        shared = ctx.parallelize(range(100), 4).persist(StorageLevel.DISK_ONLY)
    assert local.count() == shared.count() == 100
    stale = Path(_shared_blocks(tmp_path, ctx, shared.id())[0]).with_name(".part-00000-0.blk.0123.tmp")
    stale.write_bytes(b"left by a killed writer")
    local.unpersist()
    shared.unpersist()
    ctx.stop()
    assert not _block_files(ctx, local.id()) and not glob.glob(str(tmp_path / "**" / "*"), recursive=True)


def test_blocking_unpersist_waits_for_block_writers(ctx: SparkContext) -> None:
    def slow(x: int) -> int:
        time.sleep(1.5)
        return x

    rdd = ctx.parallelize(range(2), 2).map(slow).persist(StorageLevel.DISK_ONLY)
    _wait_for(lambda: ctx.client.processing() and any(ctx.client.processing().values()))
    rdd.unpersist(blocking=True)
    assert not _block_files(ctx, rdd.id())
    time.sleep(2)  # a writer that outlived the unpersist would have written its block by now
    assert not _block_files(ctx, rdd.id())


def test_a_deletion_in_the_background_spares_the_blocks_of_a_new_persist(ctx: SparkContext) -> None:
    def slow(x: int) -> int:
        time.sleep(2)
        return x

    rdd = ctx.parallelize(range(100), 4).persist(StorageLevel.DISK_ONLY)
    assert rdd.count() == 100
    old = set(_block_files(ctx, rdd.id()))
    busy = ctx.parallelize(range(1), 1).map(slow).persist(StorageLevel.DISK_ONLY)
    _wait_for(lambda: any(ctx.client.processing().values()))
    busy.unpersist()  # the background deletion waits for this writer first
    rdd.unpersist()
    rdd.persist(StorageLevel.DISK_ONLY)
    assert rdd.count() == 100
    new = {r.url for part in ctx.client.gather(rdd._stored.futures) for r in part}
    _wait_for(lambda: not old & set(_block_files(ctx, rdd.id())))
    assert new <= set(_block_files(ctx, rdd.id()))


def test_unpersist_does_not_wait_for_the_persisted_rdds_it_reads(ctx: SparkContext) -> None:
    parent = ctx.parallelize(range(40), 4).persist(StorageLevel.MEMORY_ONLY)
    child = parent.map(lambda x: x + 1).persist(StorageLevel.DISK_ONLY)
    assert child.count() == 40
    with dask.config.set({"dlscale.persist.unpersist-timeout": "5s"}):
        child.unpersist(blocking=True)
    assert not _block_files(ctx, child.id())
    assert parent.count() == 40


def test_unpersist_timeout_leaves_the_blocks_to_stop(ctx: SparkContext) -> None:
    def slow(x: int) -> int:
        time.sleep(2)
        return x

    rdd = ctx.parallelize(range(2), 2).map(slow).persist(StorageLevel.DISK_ONLY)
    _wait_for(lambda: any(ctx.client.processing().values()))
    with dask.config.set({"dlscale.persist.unpersist-timeout": "100ms"}):
        with pytest.raises(StorageError, match=f"RDD {rdd.id()} are still written or read by tasks"):
            rdd.unpersist(blocking=True)
    assert not rdd.is_cached
    ctx.stop()  # waits for the writers, then deletes what they wrote
    time.sleep(0.5)
    assert not _block_files(ctx, rdd.id())


# -- blocks on disk --------------------------------------------------------------------------
def _shared_blocks(root: Any, ctx: SparkContext, rdd_id: int) -> list[str]:
    return sorted(glob.glob(str(root / ctx.applicationId / f"rdd-{rdd_id}-*" / "part-*.blk")))


def test_swapped_blocks_of_one_rdd_are_refused(ctx: SparkContext, tmp_path: Any) -> None:
    with dask.config.set({"dlscale.persist.disk-dir": str(tmp_path)}):
        rdd = ctx.parallelize(range(40), 4).map(lambda x: x * 3).persist(StorageLevel.DISK_ONLY)
    assert rdd.collect() == [x * 3 for x in range(40)]
    first, second = _shared_blocks(tmp_path, ctx, rdd.id())[:2]
    a, b = open(first, "rb").read(), open(second, "rb").read()
    open(first, "wb").write(b)
    open(second, "wb").write(a)
    either = (
        f"block ({re.escape(first)} of RDD {rdd.id()} partition 0|{re.escape(second)} of RDD {rdd.id()} partition 1)"
    )
    with pytest.raises(CorruptDataError, match=either):  # whichever partition's reader fails first
        rdd.collect()


def test_block_of_another_rdd_is_refused(ctx: SparkContext, tmp_path: Any) -> None:
    with dask.config.set({"dlscale.persist.disk-dir": str(tmp_path)}):
        one = ctx.parallelize(range(40), 4).persist(StorageLevel.DISK_ONLY)
        other = ctx.parallelize(range(100, 140), 4).persist(StorageLevel.DISK_ONLY)
    assert one.count() == other.count() == 40
    target = _shared_blocks(tmp_path, ctx, one.id())[1]
    shutil.copyfile(_shared_blocks(tmp_path, ctx, other.id())[1], target)
    with pytest.raises(CorruptDataError, match=f"block {re.escape(target)} of RDD {one.id()} partition 1"):
        one.collect()


def _capture_persist_log() -> None:
    handler = logging.Handler()
    handler.records = []  # type: ignore[attr-defined]
    handler.emit = lambda record: handler.records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dlscale.persist").addHandler(handler)


def _captured() -> list[str]:
    handlers = logging.getLogger("dlscale.persist").handlers
    return [m for h in handlers for m in getattr(h, "records", [])]


@pytest.mark.parametrize("where", ["local", "shared"])
def test_deleted_block_is_recomputed_from_lineage(where: str, ctx: SparkContext, tmp_path: Any) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()

    def mark(x: int) -> int:
        with open(marks / str(x), "a") as f:
            f.write("x")
        return x * 2

    disk_dir = str(tmp_path / "blocks") if where == "shared" else None
    with dask.config.set({"dlscale.persist.disk-dir": disk_dir}):
        rdd = ctx.parallelize(range(40), 4).map(mark).persist(StorageLevel.DISK_ONLY)
    assert rdd.collect() == [x * 2 for x in range(40)]
    ctx.client.run(_capture_persist_log)
    if where == "local":
        lost = _block_files(ctx, rdd.id(), "part-00002-*.blk")
        ctx.client.run(os.remove, lost[0], on_error="return")
    else:
        lost = glob.glob(str(tmp_path / "blocks" / "*" / "*" / "part-00002-*.blk"))
        os.remove(lost[0])
    assert len(lost) == 1
    assert rdd.collect() == [x * 2 for x in range(40)]
    assert rdd.map(lambda x: x + 1).sum() == sum(x * 2 + 1 for x in range(40))
    # partition 2 (elements 20..29) was computed twice, the others once
    assert {x: (marks / str(x)).read_text() for x in range(40)} == {x: "xx" if 20 <= x < 30 else "x" for x in range(40)}
    messages = [m for ms in ctx.client.run(_captured).values() for m in ms]
    assert any(lost[0] in m and "recomputing the partition from lineage" in m for m in messages)


def test_tampered_block_is_refused_not_recomputed(ctx: SparkContext, tmp_path: Any) -> None:
    with dask.config.set({"dlscale.persist.disk-dir": str(tmp_path)}):
        rdd = ctx.parallelize(range(40), 4).persist(StorageLevel.DISK_ONLY)
    assert rdd.count() == 40
    path = _shared_blocks(tmp_path, ctx, rdd.id())[3]
    data = bytearray(open(path, "rb").read())
    data[-2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptDataError, match=f"block {re.escape(path)} of RDD {rdd.id()} partition 3 was altered"):
        rdd.count()


# -- killed workers --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["MEMORY_ONLY", "MEMORY_ONLY_2", "DISK_ONLY"])
def test_partitions_lost_with_a_killed_worker_are_recovered(name: str, ctx: SparkContext) -> None:
    rdd = ctx.parallelize(range(40), 4).map(lambda x: x * 5).persist(getattr(StorageLevel, name))
    assert rdd.collect() == [x * 5 for x in range(40)]
    if name == "MEMORY_ONLY_2":
        _wait_for(lambda: all(len(w) == 2 for w in ctx.client.who_has(rdd._stored.futures).values()))
    _kill_worker_holding(ctx, rdd._stored.futures[0])
    assert rdd.count() == 40
    assert rdd.collect() == [x * 5 for x in range(40)]


def test_disk_block_on_a_killed_worker_is_recomputed(ctx: SparkContext) -> None:
    """The record of a block survives on a worker other than the one whose disk held the block."""
    rdd = ctx.parallelize(range(40), 4).map(lambda x: x * 7).persist(StorageLevel.DISK_ONLY)
    assert rdd.count() == 40
    owner = ctx.client.gather(rdd._stored.futures[0])[0].worker
    ctx.client.replicate(rdd._stored.futures)
    pid = ctx.client.run(os.getpid, workers=[owner])[owner]
    os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: owner not in ctx.client.scheduler_info()["workers"])
    start = time.monotonic()
    assert rdd.collect() == [x * 7 for x in range(40)]
    assert time.monotonic() - start < 20
