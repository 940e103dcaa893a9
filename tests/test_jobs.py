"""Job control against PySpark: local properties per thread, job groups and tags, and cancelled actions that
raise in the thread that started them, stop their tasks and leave the context usable."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dlscale import JobCancelledError, SparkContext

pytestmark = pytest.mark.pyspark


def properties(c: Any) -> tuple:
    """Local properties, job groups, descriptions and tags as a thread sees them, and another thread."""
    c.setLocalProperty("answer", "42")
    c.setJobGroup("group", "the description")
    c.setJobDescription("another description")
    c.addJobTag("b")
    c.addJobTag("a")
    c.addJobTag("a")
    c.removeJobTag("missing")
    seen = (
        c.getLocalProperty("answer"),
        c.getLocalProperty("missing"),
        c.getLocalProperty("spark.jobGroup.id"),
        c.getLocalProperty("spark.job.description"),
        c.getLocalProperty("spark.job.interruptOnCancel"),
        sorted(c.getJobTags()),
    )
    other: list = []
    thread = threading.Thread(target=lambda: other.extend([c.getLocalProperty("answer"), sorted(c.getJobTags())]))
    thread.start()
    thread.join()
    c.removeJobTag("b")
    after_remove = sorted(c.getJobTags())
    c.clearJobTags()
    c.setLocalProperty("answer", None)
    cleared = (sorted(c.getJobTags()), c.getLocalProperty("answer"))
    for key in ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel"):
        c.setLocalProperty(key, None)
    return seen, other, after_remove, cleared


def test_local_properties_and_tags_as_pyspark(sc: SparkContext, spark: Any) -> None:
    assert properties(sc) == properties(spark)


def refused_tags(c: Any) -> list[str]:
    messages = []
    for tag in ("a,b", ""):
        with pytest.raises(Exception) as info:  # noqa: PT011 - PySpark raises a Py4J error
            c.addJobTag(tag)
        messages.append(re.search(r"Spark job tag cannot [^.;\n]*", str(info.value)).group(0))
    return messages


def test_bad_tags_refused_as_pyspark(sc: SparkContext, spark: Any) -> None:
    assert refused_tags(sc) == refused_tags(spark)


def slow_partition(log: Path) -> Any:
    """A task that runs for 20 seconds unless stopped, writing a line to ``log`` every 50 ms."""

    def f(i: int, it: Any) -> Any:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with open(log, "a") as out:
                out.write(f"{i}\n")
            time.sleep(0.05)
        return it

    return f


def lines(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def cancelled_action(c: Any, log: Path, how: str) -> dict[str, Any]:
    """Start a slow action in a thread (in a group, with a tag, or neither), cancel it once its first tasks
    run, and report what the thread got, how long it took to get it, and whether the context still works."""
    outcome: dict[str, Any] = {}

    def job() -> None:
        if how == "group":
            c.setJobGroup("doomed", "a job to cancel")
        elif how == "tag":
            c.addJobTag("doomed")
        try:
            c.parallelize(range(8), 8).mapPartitionsWithIndex(slow_partition(log)).collect()
            outcome["raised"] = None
        except Exception as e:  # noqa: BLE001 - what PySpark raises is a Py4J error
            outcome["raised"] = str(e)
            outcome["raised_after"] = time.monotonic() - cancelled_at

    thread = threading.Thread(target=job)
    thread.start()
    deadline = time.monotonic() + 60
    while lines(log) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    cancelled_at = time.monotonic()
    {"group": lambda: c.cancelJobGroup("doomed"), "tag": lambda: c.cancelJobsWithTag("doomed")}.get(
        how, c.cancelAllJobs
    )()
    thread.join(30)
    assert not thread.is_alive()
    match = re.search(r"Job \d+ cancelled .*?(?= SQLSTATE|\n|$)", outcome["raised"])  # PySpark adds a SQLSTATE
    outcome["message"] = re.sub(r"\d+", "N", match.group(0)) if match else outcome["raised"]
    outcome["usable"] = c.parallelize(range(10), 2).map(lambda x: x * 2).sum()
    return outcome


@pytest.mark.slow
@pytest.mark.parametrize("how", ["group", "tag", "all"])
def test_cancelled_action_as_pyspark(sc: SparkContext, spark: Any, tmp_path: Path, how: str) -> None:
    expected = cancelled_action(spark, tmp_path / "pyspark.log", how)
    got = cancelled_action(sc, tmp_path / "dlscale.log", how)
    assert got["message"] == expected["message"]
    assert got["usable"] == expected["usable"] == 90
    assert got["raised_after"] < 2
    # the running tasks stop within two seconds and the waiting ones never start
    time.sleep(2)
    stopped = lines(tmp_path / "dlscale.log")
    time.sleep(1)
    assert lines(tmp_path / "dlscale.log") == stopped
    started = {int(x) for x in (tmp_path / "dlscale.log").read_text().split()}
    assert len(started) <= 2


def test_other_groups_run_on(sc: SparkContext, tmp_path: Path) -> None:
    """Cancelling one group while another thread's job of another group runs leaves that job to finish."""
    result: dict[str, Any] = {}
    log = tmp_path / "kept.log"

    def task(x: int) -> int:
        with open(log, "a") as out:
            out.write(f"{x}\n")
        time.sleep(1)
        return x

    def other() -> None:
        sc.setJobGroup("kept", "runs on")
        result["sum"] = sc.parallelize(range(4), 2).map(task).sum()

    thread = threading.Thread(target=other)
    thread.start()
    deadline = time.monotonic() + 120
    while lines(log) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    sc.cancelJobGroup("doomed")
    thread.join(120)  # the time is not what this test is about: the shared machine can be slow
    assert result == {"sum": 6}
    with pytest.raises(JobCancelledError, match="cancelled part of cancelled job group doomed"):
        cancelled_action_raising(sc, tmp_path / "log")


def cancelled_action_raising(c: SparkContext, log: Path) -> None:
    """Cancel this thread's own slow action from another thread, raising what the action raised."""

    def cancel_when_running() -> None:
        deadline = time.monotonic() + 60
        while lines(log) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        c.cancelJobGroup("doomed")

    c.setJobGroup("doomed", "to cancel")
    threading.Thread(target=cancel_when_running, daemon=True).start()
    try:
        c.parallelize(range(2), 2).mapPartitionsWithIndex(slow_partition(log)).collect()
    finally:
        c.setLocalProperty("spark.jobGroup.id", None)
