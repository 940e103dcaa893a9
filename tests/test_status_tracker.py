"""``SparkContext.statusTracker()`` on real worker processes: jobs of a group and a tag while they run and
after, a running stage's task counts, failed jobs, the bound on finished jobs, and PySpark's shapes."""

from __future__ import annotations

import operator
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dask
import pytest

from dlscale import SparkContext, SparkJobInfo, SparkStageInfo
from dlscale.facade.jobs import Jobs


def wait_for(condition: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


def blocked_until(gate: Path) -> Callable[[int], int]:
    """A map function whose tasks wait for ``gate`` to exist."""

    def f(x: int) -> int:
        deadline = time.monotonic() + 60
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return x

    return f


def clear_group(c: Any) -> None:
    for key in ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel"):
        c.setLocalProperty(key, None)


def in_a_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(target()))
    thread.start()
    return thread, out


def test_jobs_of_a_group_and_a_tag_while_running_and_after(sc: SparkContext, tmp_path: Path) -> None:
    tracker = sc.statusTracker()
    group, tag, gate = f"group-{uuid.uuid4()}", f"tag-{uuid.uuid4()}", tmp_path / "gate"

    def job() -> list[int]:
        sc.setJobGroup(group, "a job to watch")
        sc.addJobTag(tag)
        return sc.parallelize(range(4), 4).map(blocked_until(gate)).collect()

    thread, out = in_a_thread(job)
    try:
        (job_id,) = wait_for(lambda: tracker.getJobIdsForGroup(group))
        assert tracker.getJobIdsForTag(tag) == [job_id]
        (stage,) = tracker.getJobInfo(job_id).stageIds  # no shuffle: one stage
        assert job_id in tracker.getActiveJobsIds() and stage in tracker.getActiveStageIds()
        assert job_id not in tracker.getJobIdsForGroup()  # the jobs of no group
        assert tracker.getJobInfo(job_id) == SparkJobInfo(job_id, [stage], "RUNNING")
    finally:
        gate.touch()
        thread.join()
    assert out == [[0, 1, 2, 3]]
    assert tracker.getJobIdsForGroup(group) == [job_id] and tracker.getJobIdsForTag(tag) == [job_id]
    assert job_id not in tracker.getActiveJobsIds() and stage not in tracker.getActiveStageIds()
    assert tracker.getJobInfo(job_id) == SparkJobInfo(job_id, [stage], "SUCCEEDED")
    later = sc.parallelize([1]).count()  # this thread's job: no group, no tag
    assert later == 1 and max(tracker.getJobIdsForGroup()) > job_id and tracker.getJobIdsForTag(tag) == [job_id]
    assert tracker.getJobInfo(10**9) is None and tracker.getStageInfo(10**9) is None


def test_a_running_stage_counts_its_tasks(sc: SparkContext, tmp_path: Path) -> None:
    """Four tasks on two one-thread workers, held until released: two or more are active and none is done;
    then all are done. The stage is named after the action and the line that called it, as Spark names it."""
    tracker, gate = sc.statusTracker(), tmp_path / "gate"
    line = 0

    def job() -> list[int]:
        nonlocal line
        line = job.__code__.co_firstlineno + 3
        return sc.parallelize(range(4), 4).map(blocked_until(gate)).collect()

    thread, _ = in_a_thread(job)
    try:
        job_id = wait_for(lambda: tracker.getActiveJobsIds())[-1]
        (stage,) = tracker.getJobInfo(job_id).stageIds
        running = wait_for(lambda: (s := tracker.getStageInfo(stage)) and s.numActiveTasks >= 2 and s)
        assert running.stageId == stage and running.currentAttemptId == 0
        assert running.name == f"collect at {__file__}:{line}"
        assert running.numTasks >= 4 and running.numActiveTasks <= running.numTasks
        assert (running.numCompletedTasks, running.numFailedTasks) == (0, 0)
    finally:
        gate.touch()
        thread.join()
    done = tracker.getStageInfo(stage)
    assert done == running._replace(numActiveTasks=0, numCompletedTasks=running.numTasks)


def test_a_failed_job(sc: SparkContext) -> None:
    tracker = sc.statusTracker()
    group = f"failing-{uuid.uuid4()}"

    def fail_one(x: int) -> int:
        if x == 0:
            raise ValueError("no")
        return x

    sc.setJobGroup(group, "fails")
    try:
        with pytest.raises(ValueError, match="no"):
            sc.parallelize(range(2), 2).map(fail_one).collect()
    finally:
        clear_group(sc)
    (job_id,) = tracker.getJobIdsForGroup(group)
    assert tracker.getJobInfo(job_id).status == "FAILED"
    (stage_id,) = tracker.getJobInfo(job_id).stageIds
    stage = wait_for(lambda: (s := tracker.getStageInfo(stage_id)) and s.numActiveTasks == 0 and s)
    assert stage.numFailedTasks == 1 and stage.numCompletedTasks < stage.numTasks


def test_a_shuffle_keeps_its_finished_tasks_counted(sc: SparkContext) -> None:
    """The map side of a shuffle is forgotten by Dask while the job runs on: its tasks stay counted, in the
    shuffle map stage, named after the call that made the shuffle; the result stage counts the rest."""
    tracker = sc.statusTracker()
    line = test_a_shuffle_keeps_its_finished_tasks_counted.__code__.co_firstlineno + 5
    assert sc.parallelize(range(40), 4).map(lambda x: (x % 3, 1)).reduceByKey(lambda a, b: a + b, 2).count() == 3
    job_id = max(tracker.getJobIdsForGroup())
    map_stage, result_stage = (tracker.getStageInfo(s) for s in tracker.getJobInfo(job_id).stageIds)
    assert map_stage.stageId < result_stage.stageId
    assert map_stage.name == f"reduceByKey at {__file__}:{line}"
    assert result_stage.name == f"count at {__file__}:{line}"
    assert map_stage.numTasks >= 4 and result_stage.numTasks >= 2
    for stage in (map_stage, result_stage):
        assert stage.numCompletedTasks == stage.numTasks and stage.numActiveTasks == 0


def stages(c: Any, context: Any) -> tuple:
    """The stages of each job of programs with and without shuffles, as the tracker lists them, and the stages
    that tasks before and after a shuffle say they belong to."""
    tracker = c.statusTracker()
    prefix = f"stages-{uuid.uuid4()}-"
    rdd = c.parallelize(range(10), 3).map(lambda x: (x % 4, x))
    parted = rdd.partitionBy(2)
    cached = rdd.reduceByKey(operator.add).cache()
    checkpointed = rdd.reduceByKey(operator.add)
    checkpointed.checkpoint()
    programs: dict[str, Callable[[], Any]] = {
        "map": lambda: rdd.map(lambda kv: kv).collect(),
        "count": lambda: rdd.count(),
        "reduceByKey": lambda: rdd.reduceByKey(operator.add).collect(),
        "two shuffles": lambda: rdd.reduceByKey(operator.add).map(lambda kv: (kv[1], kv[0])).groupByKey().collect(),
        "partitionBy": lambda: parted.collect(),
        "co-partitioned join": lambda: parted.join(parted).collect(),
        "join": lambda: parted.join(rdd).collect(),
        "co-partitioned cogroup": lambda: parted.cogroup(parted).collect(),
        "cogroup": lambda: parted.cogroup(rdd).collect(),
        "co-partitioned reduceByKey": lambda: parted.reduceByKey(operator.add, 2).collect(),
        "union": lambda: parted.union(rdd).collect(),
        "repartition": lambda: rdd.repartition(4).collect(),
        "coalesce": lambda: rdd.coalesce(1).collect(),
        "distinct": lambda: rdd.keys().distinct().collect(),
        "cartesian": lambda: rdd.cartesian(rdd).count(),
        "persisted": lambda: (cached.count(), cached.map(lambda kv: kv).collect()),
        "checkpointed": lambda: (checkpointed.count(), checkpointed.map(lambda kv: kv).collect()),
    }
    counts = {}
    try:
        for name, program in programs.items():
            c.setJobGroup(prefix + name, name)
            program()
            jobs = sorted(tracker.getJobIdsForGroup(prefix + name))
            counts[name] = [len(tracker.getJobInfo(j).stageIds) for j in jobs]
        c.setJobGroup(prefix + "seen", "seen")
        seen = (
            rdd.map(lambda kv: (kv[0], context.get().stageId()))
            .partitionBy(2)
            .map(lambda kv: (kv[1], context.get().stageId()))
            .collect()
        )
        (job,) = tracker.getJobIdsForGroup(prefix + "seen")
    finally:
        clear_group(c)
        cached.unpersist()
    ids = list(tracker.getJobInfo(job).stageIds)
    before, after = {b for b, _ in seen}, {a for _, a in seen}
    infos = [tracker.getStageInfo(s) for s in ids]
    done = [i.numTasks > 0 and i.numCompletedTasks == i.numTasks and i.numActiveTasks == 0 for i in infos]
    return counts, (len(before), len(after), before | after == set(ids), before == after), done


@pytest.mark.pyspark
def test_stages_as_pyspark(sc: SparkContext, spark: Any, tmp_path: Path) -> None:
    """Spark's DAG scheduler cuts a job at each shuffle (a join of RDDs partitioned alike has none of its
    own: Spark's test_narrow_dependency_in_join); dlscale's jobs list the same stages."""
    from pyspark import TaskContext as SparkTaskContext

    from dlscale import TaskContext

    spark.setCheckpointDir(str(tmp_path / "pyspark"))
    sc.setCheckpointDir(str(tmp_path / "dlscale"))
    expected = stages(spark, SparkTaskContext)
    assert stages(sc, TaskContext) == expected
    counts = expected[0]
    assert counts["co-partitioned join"] == [2] and counts["join"] == [3]
    assert counts["map"] == [1] and counts["reduceByKey"] == [2] and counts["two shuffles"] == [3]


def test_finished_jobs_beyond_the_bound_are_forgotten(sc: SparkContext) -> None:
    jobs = Jobs("bounded", retained=2)
    for i in range(4):
        assert jobs.run(sc.client, dask.delayed(lambda x: x + 1)(i)) == i + 1
    assert [r.id for r in jobs.records()] == [2, 3]
    assert all(r.status == "SUCCEEDED" and r.group is None and r.tags == set() for r in jobs.records())


def test_stage_info_shape_as_pyspark() -> None:
    """PySpark's field names (its namedtuples are the reference)."""
    pytest.importorskip("pyspark")
    from pyspark.core.status import SparkJobInfo as PySparkJobInfo
    from pyspark.core.status import SparkStageInfo as PySparkStageInfo

    assert SparkJobInfo._fields == PySparkJobInfo._fields
    assert SparkStageInfo._fields == PySparkStageInfo._fields


def watched(c: Any, group: str) -> tuple:
    """A succeeding and a failing job in ``group``, as the tracker describes them once both have ended."""
    tracker = c.statusTracker()

    def fail_first(it: Any) -> Any:
        items = list(it)
        if 0 in items:
            raise ValueError("no")
        return items

    c.setJobGroup(group, "watched")
    try:
        assert c.parallelize(range(4), 2).map(lambda x: x * 2).collect() == [0, 2, 4, 6]
        with pytest.raises(Exception, match="no"):
            c.parallelize(range(4), 2).mapPartitions(fail_first).collect()
    finally:
        clear_group(c)
    ids = sorted(wait_for(lambda: (found := tracker.getJobIdsForGroup(group)) and len(found) == 2 and found))
    infos = [wait_for(lambda i=i: (j := tracker.getJobInfo(i)) and j.status != "RUNNING" and j) for i in ids]
    # a failed job's other tasks may still run a moment (dlscale does not stop them): wait for them
    stages = [
        wait_for(lambda s=s: (stage := tracker.getStageInfo(s)) and stage.numActiveTasks == 0 and stage)
        for info in infos
        for s in info.stageIds
    ]
    return (
        len(ids),
        [(info.jobId == i, len(list(info.stageIds)), info.status) for i, info in zip(ids, infos)],
        [(s.currentAttemptId, s.name.split(" at ")[0], s.numFailedTasks > 0) for s in stages],
        stages[0].numCompletedTasks == stages[0].numTasks,
        [type(v) for v in stages[0]],
        tracker.getJobInfo(10**6),
        tracker.getStageInfo(10**6),
        [i for i in tracker.getActiveJobsIds() if i in ids],
    )


@pytest.mark.pyspark
def test_as_pyspark(sc: SparkContext, spark: Any) -> None:
    assert watched(sc, f"watched-{uuid.uuid4()}") == watched(spark, f"watched-{uuid.uuid4()}")
