"""Spark's ``local[N, F]`` master: a task that raises runs again, F attempts in all, and
``TaskContext.attemptNumber()`` counts them (PySpark's ``test_attempt_number`` pattern)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from dlscale import MasterURLError, SparkContext, TaskContext
from dlscale.facade.context import _parse_local


@pytest.mark.parametrize(
    ("master", "parsed"),
    [
        ("local", (1, 1)),
        ("local[3]", (3, 1)),
        ("local[2, 3]", (2, 3)),
        ("local[2,4]", (2, 4)),
        ("local[*, 2]", (os.cpu_count() or 1, 2)),
    ],
)
def test_masters_give_workers_and_attempts(master: str, parsed: tuple[int, int]) -> None:
    assert _parse_local(master) == parsed


@pytest.mark.parametrize("master", ["local[2, 0]", "local[2, x]", "local[2,]", "local[, 2]"])
def test_bad_attempts_are_refused(master: str) -> None:
    with pytest.raises(MasterURLError, match="attempts per task|unknown master") as e:
        SparkContext(master)
    assert master in str(e.value)


def log_attempt(log: Path) -> int:
    attempt = TaskContext.get().attemptNumber()
    with log.open("a") as f:
        f.write(f"{TaskContext.get().partitionId()}:{attempt}\n")
    return attempt


def test_a_failed_task_runs_again_and_counts_its_attempts(tmp_path: Path) -> None:
    log = tmp_path / "attempts"

    def first_attempt_fails(it: Any) -> list:
        attempt = log_attempt(log)
        if TaskContext.get().partitionId() == 0 and attempt == 0:
            raise ValueError("the first attempt fails")
        return [(TaskContext.get().partitionId(), attempt, sum(it))]

    def always_fails(_: Any) -> None:
        log_attempt(log)
        raise ValueError("every attempt fails")

    with SparkContext("local[2, 3]") as c:
        assert c.parallelize(range(4), 2).mapPartitions(first_attempt_fails).collect() == [(0, 1, 1), (1, 0, 5)]
        assert sorted(log.read_text().split()) == ["0:0", "0:1", "1:0"]
        log.unlink()
        with pytest.raises(ValueError, match="every attempt fails"):
            c.parallelize([0], 1).map(always_fails).collect()
        assert log.read_text().split() == ["0:0", "0:1", "0:2"]
        tracker = c.statusTracker()
        (failed,) = [j for j in tracker.getJobIdsForGroup() if tracker.getJobInfo(j).status == "FAILED"]
        assert tracker.getStageInfo(failed).numFailedTasks == 3


def test_local_n_runs_a_task_once(sc: SparkContext, tmp_path: Path) -> None:
    log = tmp_path / "attempts"

    def fails(_: Any) -> None:
        log_attempt(log)
        raise ValueError("fails")

    with pytest.raises(ValueError, match="fails"):
        sc.parallelize([0], 1).map(fails).collect()
    assert log.read_text().split() == ["0:0"]
