"""``toLocalIterator`` against PySpark: one partition per job, computed when the iteration reaches it,
and what several partitions share (a shuffle's map side) computed once for the whole iteration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.pyspark


def recorded(log: Path) -> Any:
    """An identity function that appends a line to ``log`` per call (the workers share this machine)."""

    def f(x: Any) -> Any:
        with open(log, "a") as out:
            out.write(f"{x}\n")
        return x

    return f


def calls(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.parametrize("prefetch", [False, True])
def test_shuffle_map_side_runs_once_per_iteration(sc: Any, spark: Any, tmp_path: Path, prefetch: bool) -> None:
    counts = {}
    for name, c in (("pyspark", spark), ("dlscale", sc)):
        log = tmp_path / f"{name}.log"
        rdd = c.parallelize(range(6), 2).map(recorded(log)).repartition(40)
        assert sorted(rdd.toLocalIterator(prefetchPartitions=prefetch)) == list(range(6))
        counts[name] = calls(log)
    assert counts["dlscale"] == counts["pyspark"] == 6


def test_two_iterators_over_one_rdd(sc: Any, spark: Any) -> None:
    def interleave(c: Any) -> tuple[list, list]:
        rdd = c.parallelize(range(12), 4).repartition(3)
        first = rdd.toLocalIterator()
        head = [next(first), next(first)]
        second = list(rdd.toLocalIterator())
        return sorted(head + list(first)), sorted(second)

    assert interleave(sc) == interleave(spark) == (list(range(12)), list(range(12)))


def test_partitions_are_computed_when_reached(sc: Any, spark: Any) -> None:
    def fail_last(x: int) -> int:
        if x == 9:
            raise RuntimeError("This should not be hit")
        return x

    for c in (spark, sc):
        it = c.range(12, numSlices=4).map(fail_last).toLocalIterator()
        assert [next(it) for _ in range(4)] == [0, 1, 2, 3]
        with pytest.raises(Exception, match="This should not be hit"):  # noqa: PT011 - PySpark's Py4JJavaError
            list(it)
