"""Checkpoints against PySpark: written after the next action, read from then on (the lineage's functions do
not run again), local checkpoints, and the error before a checkpoint directory is set."""

from __future__ import annotations

import gc
import os
import signal
import uuid
import weakref
from pathlib import Path
from typing import Any

import pytest

from dlscale import CheckpointError, SparkContext, StorageLevel

pytestmark = pytest.mark.pyspark


def checkpointed(c: Any, directory: Path) -> tuple:
    calls = c.accumulator(0)
    c.setCheckpointDir(str(directory))
    rdd = c.parallelize(range(20), 4).map(lambda x: (calls.add(1), x * 2)[1])
    rdd.checkpoint()
    before = (rdd.isCheckpointed(), rdd.getCheckpointFile(), rdd.isLocallyCheckpointed())
    total = rdd.sum()  # the action, then the checkpoint's own job: the map runs twice per element
    after = (rdd.isCheckpointed(), rdd.getCheckpointFile() is not None, calls.value)
    again = (rdd.collect(), rdd.getNumPartitions(), rdd.map(lambda x: x + 1).sum(), calls.value)

    parent = c.parallelize(range(4), 2)
    parent.checkpoint()
    parent.map(lambda x: x).count()  # an action on a child checkpoints its parent
    other = c.parallelize(range(4), 2)
    other.checkpoint()
    c.parallelize(range(3), 1).count()  # an action elsewhere does not
    return before, total, after, again, parent.isCheckpointed(), other.isCheckpointed()


def test_checkpoint_as_pyspark(sc: SparkContext, spark: Any, tmp_path: Path) -> None:
    expected = checkpointed(spark, tmp_path / "pyspark")
    assert checkpointed(sc, tmp_path / "dlscale") == expected
    assert expected[2] == (True, True, 40)


def test_checkpoint_files_are_in_the_directory(sc: SparkContext, tmp_path: Path) -> None:
    sc.setCheckpointDir(str(tmp_path))
    rdd = sc.parallelize(range(10), 3)
    rdd.checkpoint()
    rdd.count()
    path = rdd.getCheckpointFile()
    assert path is not None and path.startswith(sc.getCheckpointDir())
    assert sc.getCheckpointDir().startswith(f"file:{tmp_path}/")  # Spark's (Hadoop's) form of a local URL
    written = sorted(p.name for p in Path(path.removeprefix("file:")).iterdir())
    assert written == ["_SUCCESS", "part-00000", "part-00001", "part-00002"]
    assert rdd.glom().collect() == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    assert sc.pickleFile(path).glom().collect() == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]  # the URL reads back


def checkpoint_urls(c: Any, directory: Path) -> tuple:
    """Spark's ``test_basic_checkpointing``: where the checkpoint directory and an RDD's checkpoint are."""
    c.setCheckpointDir(str(directory))
    rdd = c.parallelize([1, 2, 3, 4]).flatMap(lambda x: range(1, x + 1))
    before = (rdd.getCheckpointFile(), c.getCheckpointDir() is None)
    rdd.checkpoint()
    result = rdd.collect()
    file = rdd.getCheckpointFile()
    return (
        before,
        os.path.dirname(os.path.dirname(file)),
        os.path.dirname(file) == c.getCheckpointDir(),
        os.path.basename(file) == f"rdd-{rdd.id()}",
        rdd.isCheckpointed(),
        rdd.collect() == result,
    )


def test_checkpoint_urls_as_pyspark(sc: SparkContext, spark: Any, tmp_path: Path) -> None:
    expected = checkpoint_urls(spark, tmp_path / "pyspark")
    got = checkpoint_urls(sc, tmp_path / "dlscale")
    assert expected[1] == f"file:{tmp_path / 'pyspark'}"
    assert got[1] == f"file:{tmp_path / 'dlscale'}"
    assert got[:1] + got[2:] == expected[:1] + expected[2:] == ((None, False), True, True, True, True)


def locally_checkpointed(c: Any) -> tuple:
    calls = c.accumulator(0)
    rdd = c.parallelize(range(10), 2).map(lambda x: (calls.add(1), x)[1])
    rdd.localCheckpoint()
    level = rdd.getStorageLevel()
    marked = (rdd.isLocallyCheckpointed(), rdd.isCheckpointed(), level.useMemory, level.useDisk)
    # collect, not sum: PySpark's sum would fold the map into a new Python RDD that bypasses the marked one
    first = rdd.collect()
    second = rdd.collect()
    result = (marked, first, second, rdd.isCheckpointed(), rdd.getCheckpointFile(), calls.value)
    rdd.unpersist()
    return result


def test_local_checkpoint_as_pyspark(sc: SparkContext, spark: Any) -> None:
    assert locally_checkpointed(sc) == locally_checkpointed(spark)


def test_checkpoint_needs_a_directory(sc: SparkContext) -> None:
    fresh = SparkContext(client=sc.client)
    try:
        with pytest.raises(CheckpointError, match="Checkpoint directory has not been set in the SparkContext"):
            fresh.parallelize([1]).checkpoint()
        assert fresh.getCheckpointDir() is None
    finally:
        fresh.stop()


def test_an_iterative_program_that_checkpoints_keeps_its_graph_bounded(sc: SparkContext, tmp_path: Path) -> None:
    """200 steps, a checkpoint every 10: each checkpointed RDD's graph is its files' reader alone, and the
    driver holds no RDD of the steps before (their graphs and functions go with them)."""
    sc.setCheckpointDir(str(tmp_path))
    rdd = sc.parallelize(range(100), 4)
    alive: weakref.WeakSet = weakref.WeakSet()
    graph_sizes = set()
    for step in range(200):
        rdd = rdd.map(lambda x: x + 1)
        alive.add(rdd)
        if step % 10 == 9:
            rdd.checkpoint()
            rdd.count()
            graph_sizes.add(len(rdd.to_bag().__dask_graph__()))
    assert rdd.collect() == list(range(200, 300))
    assert graph_sizes == {4}  # one task per partition, reading its file
    gc.collect()
    assert len(alive) == 1


def test_a_persisted_checkpointed_rdd_reads_its_files_after_losing_a_block(tmp_path: Path) -> None:
    """Its lineage is cut: a block lost with its worker (SIGKILL) is read again from the checkpoint's files,
    and the functions of the lineage never run again."""
    calls = tmp_path / "calls"
    calls.mkdir()

    def traced(x: int) -> int:
        (calls / f"{x}-{uuid.uuid4().hex}").touch()
        return x * 3

    with SparkContext("local[2]", "checkpoint-kill") as ctx:
        ctx.setCheckpointDir(str(tmp_path / "checkpoints"))
        rdd = ctx.parallelize(range(40), 4).map(traced).cache()
        rdd.checkpoint()
        assert rdd.count() == 40
        ran = len(list(calls.iterdir()))
        assert rdd.isCheckpointed() and rdd.getStorageLevel() == StorageLevel.MEMORY_ONLY
        victim = next(iter(ctx.client.scheduler_info(n_workers=-1)["workers"]))
        os.kill(ctx.client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        assert rdd.collect() == [x * 3 for x in range(40)]
        assert len(list(calls.iterdir())) == ran
