"""``TaskContext`` against PySpark: what a task knows about itself, and the attempt number after its worker
was killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pyspark import TaskContext as SparkTaskContext

from dlscale import BarrierError, SparkConf, SparkContext, TaskContext

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


# spark.task.cpus needs a context of its own, and a process holds one PySpark context: each system runs this
# program in a process of its own
TASK_CPUS_PROGRAM = """
import json, sys, time
system, master, cpus = sys.argv[1:]
if system == "pyspark":
    from pyspark import SparkConf, SparkContext, TaskContext
else:
    from dlscale import SparkConf, SparkContext, TaskContext
conf = SparkConf().set("spark.ui.enabled", "false")
if cpus:
    conf.set("spark.task.cpus", cpus)
with SparkContext(master, "task-cpus", conf=conf) as sc:
    def run(it):
        start = time.time()
        time.sleep(0.5)
        return [(TaskContext.get().cpus(), start, time.time())]
    spans = sc.parallelize(range(4), 4).mapPartitions(run).collect()
    at_once = max(sum(1 for s in spans if s[1] < t[2] and t[1] < s[2]) for t in spans)
    print(json.dumps([sorted({s[0] for s in spans}), at_once, sc.defaultParallelism]))
"""


def task_cpus(system: str, master: str, cpus: str) -> list:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONHASHSEED": "0"}
    out = subprocess.run(
        [sys.executable, "-c", TASK_CPUS_PROGRAM, system, master, cpus],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_task_cpus_as_pyspark() -> None:
    """``spark.task.cpus`` is what ``TaskContext.cpus()`` says, and local[2] runs 2 // 2 tasks at once (one
    worker process of two threads, each task asking for both)."""
    expected = task_cpus("pyspark", "local[2]", "2")
    assert expected == [[2], 1, 2]
    assert task_cpus("dlscale", "local[2]", "2") == expected
    assert task_cpus("dlscale", "local[2]", "")[0] == [1]  # Spark's default, 1


def test_task_cpus_limit_the_tasks_a_worker_runs_at_once() -> None:
    """On local-cluster[1, 2, 1024] (one worker of two threads, Spark's executor of two cores) with
    spark.task.cpus=2, one task at a time: an RDD's tasks, a persisted RDD's and a barrier stage's know their
    two CPUs, a barrier stage of two tasks does not fit, and the CPUs are no resource of the task's."""
    with SparkContext("local-cluster[1, 2, 1024]", "task-cpus", conf=SparkConf().set("spark.task.cpus", "2")) as c:
        cpus = c.parallelize(range(4), 4).map(lambda _: TaskContext.get().cpus()).persist()
        assert cpus.collect() == [2, 2, 2, 2]
        stage = c.parallelize(range(1), 1).barrier().mapPartitions(lambda _: [TaskContext.get().cpus()])
        assert stage.collect() == [2]
        assert c.parallelize([1], 1).map(lambda _: TaskContext.get().resources()).collect() == [{}]
        with pytest.raises(BarrierError, match=r"has 1 \(worker threads on 1 workers, 2 per task"):
            c.parallelize(range(2), 2).barrier().mapPartitions(lambda it: it).collect()
    with pytest.raises(ValueError, match=r"cores per executor \(=1\) has to be >= the number of cpus per task = 2"):
        SparkContext("local-cluster[1, 1, 1024]", "task-cpus", conf=SparkConf().set("spark.task.cpus", "2"))
    with pytest.raises(ValueError, match="spark.task.cpus must be a positive integer"):
        SparkContext("local[1]", "task-cpus", conf=SparkConf().set("spark.task.cpus", "0"))
