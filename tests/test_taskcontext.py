"""``TaskContext`` against PySpark: what a task knows about itself, and the attempt number after its worker
was killed."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from pyspark import TaskContext as SparkTaskContext

from dlscale import SparkContext, TaskContext

pytestmark = pytest.mark.pyspark


def seen_by_tasks(c: Any, context: Any) -> tuple:
    def describe(it: Any) -> list:
        tc = context.get()
        return [
            (
                tc.partitionId(),
                tc.attemptNumber(),
                tc.getLocalProperty("answer"),
                tc.getLocalProperty("missing"),
                tc.cpus(),
                sorted(tc.resources()),
                type(tc.stageId()),
                type(tc.taskAttemptId()),
                sum(it),
            )
        ]

    c.setLocalProperty("answer", "42")
    try:
        narrow = c.parallelize(range(8), 4).mapPartitions(describe).collect()
        shuffled = c.parallelize(range(8), 4).map(lambda x: (x % 3, x)).partitionBy(3).values().mapPartitions(describe)
        after_shuffle = shuffled.collect()
    finally:
        c.setLocalProperty("answer", None)
    attempts = c.parallelize(range(4), 4).map(lambda _: context.get().taskAttemptId()).collect()
    return narrow, after_shuffle, len(set(attempts)), context.get()


def test_task_context_as_pyspark(sc: SparkContext, spark: Any) -> None:
    assert seen_by_tasks(sc, TaskContext) == seen_by_tasks(spark, SparkTaskContext)


def test_attempt_number_counts_a_killed_worker(sc: SparkContext, tmp_path: Path) -> None:
    """The first attempt kills its own worker (SIGKILL); the second, on a new worker process, is attempt 1."""
    marker = tmp_path / "killed"

    def f(it: Any) -> list:
        tc = TaskContext.get()
        if not marker.exists():
            marker.write_text(str(tc.attemptNumber()))
            os.kill(os.getpid(), signal.SIGKILL)
        return [(tc.partitionId(), tc.attemptNumber(), list(it))]

    assert sc.parallelize([1, 2], 1).mapPartitions(f).collect() == [(0, 1, [1, 2])]
    assert marker.read_text() == "0"
