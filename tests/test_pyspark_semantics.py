"""Behaviour that programs ported from PySpark rely on, compared with PySpark on the same data: RDD ids,
histograms and aggregations of empty partitions, ``StatCounter``, ``repartitionAndSortWithinPartitions``
and ``countApproxDistinct``."""

from __future__ import annotations

import math
from operator import add
from typing import Any

import pytest
from pyspark.statcounter import StatCounter as SparkStatCounter

from dlscale import SparkContext, StatCounter
from dlscale.runtime.cluster import cluster_workers

pytestmark = pytest.mark.pyspark


def both(sc: Any, spark: Any, program: Any) -> Any:
    """``program`` run on PySpark and on dlscale; asserts they agree and returns the result."""
    expected, got = program(spark), program(sc)
    assert got == expected
    return got


def test_a_new_rdds_id_is_the_previous_ones_plus_one(sc: Any, spark: Any) -> None:
    def ids(c: Any) -> tuple[int, int, int]:
        rdd = c.parallelize(range(10))
        first = rdd.id()
        chained = rdd.map(str).filter(bool)
        return first, chained.id() - first, rdd.id() - first

    both(sc, spark, lambda c: ids(c)[1:])  # (1, 0): consecutive, and stable once given
    rdd = sc.parallelize([1])
    assert repr(rdd) == f"RDD[{rdd.id()}] with 2 partitions"


def test_aggregations_of_empty_partitions(sc: Any, spark: Any) -> None:
    assert both(sc, spark, lambda c: c.parallelize([]).histogram([0, 10])[1]) == [0]
    assert both(sc, spark, lambda c: c.parallelize([], 3).histogram([0, 4, 10])) == ([0, 4, 10], [0, 0])
    # every partition, an empty one too, starts from the zero value
    assert both(sc, spark, lambda c: c.parallelize([], 3).treeAggregate(5, add, add)) == 15
    assert both(sc, spark, lambda c: c.parallelize([1, 2], 4).treeAggregate(5, add, add)) == 23
    assert both(sc, spark, lambda c: c.parallelize(range(20), 9).treeAggregate(1, add, add, depth=3)) == 199


def test_stat_counter_as_pyspark(sc: Any, spark: Any) -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    for sample in (False, True):
        got, expected = StatCounter(values).asDict(sample), SparkStatCounter(values).asDict(sample)
        assert got == expected
    assert StatCounter(values).asDict()["stdev"] == pytest.approx(1.2909944487358056, rel=1e-15)  # sample
    assert both(sc, spark, lambda c: c.parallelize(values, 2).stats().asDict())["variance"] == pytest.approx(
        5 / 3, rel=1e-15
    )
    empty = StatCounter(None)
    assert empty.count() == SparkStatCounter(None).count() == 0
    assert math.isnan(empty.variance())
    with pytest.raises(TypeError, match="Can only merge StatCounter but got <class 'int'>"):
        empty.mergeStats(3)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((2, lambda x: x % 2, True), {}),
        ((3,), {"ascending": False}),
        ((), {"keyfunc": lambda k: -k}),
        ((2,), {"partitionFunc": lambda k: 0}),
    ],
)
def test_repartition_and_sort_within_partitions(sc: Any, spark: Any, args: tuple, kwargs: dict) -> None:
    data = [(0, 5), (3, 8), (2, 6), (0, 8), (3, 8), (1, 3), (7, 1), (4, 4)]
    both(
        sc, spark, lambda c: c.parallelize(data, 3).repartitionAndSortWithinPartitions(*args, **kwargs).glom().collect()
    )


DATA_SETS = {
    "ints": lambda c: c.range(0, 100_000, numSlices=4),
    "strings": lambda c: c.parallelize([str(i) for i in range(1000)], 3),
    "repeated": lambda c: c.parallelize([i % 20 for i in range(1000)], 3),
    "tuples": lambda c: c.parallelize([(i % 997, str(i // 997)) for i in range(30_000)], 4),
    "floats": lambda c: c.parallelize([i / 7 for i in range(20_000)], 2),
    "few": lambda c: c.parallelize([1, 2, 3, 3, 2], 2),
    "empty partitions": lambda c: c.parallelize([], 3),
}


def test_count_approx_distinct_within_its_bound(sc: Any, spark: Any) -> None:
    """The relative error of the estimate is a standard error of at most relativeSD: every data set's
    estimate, PySpark's and dlscale's, lies within three of them of the true count."""
    for relative_sd in (0.05, 0.01):
        squares = []
        for name, make in DATA_SETS.items():
            true = len(set(make(sc).collect()))
            for c in (spark, sc):
                estimate = make(c).countApproxDistinct(relative_sd)
                assert abs(estimate - true) <= 3 * relative_sd * true, (name, relative_sd, c, estimate, true)
                if c is sc and true:
                    squares.append(((estimate - true) / true) ** 2)
        assert math.sqrt(sum(squares) / len(squares)) <= relative_sd
    for c in (spark, sc):
        assert 900 < c.parallelize(range(1000)).map(str).countApproxDistinct() < 1100  # PySpark's own examples
        assert 16 < c.parallelize([i % 20 for i in range(1000)]).countApproxDistinct() < 24
        with pytest.raises(ValueError, match="relativeSD should be greater than 0.000017"):
            c.parallelize([1]).countApproxDistinct(0.00001)
    assert sc.emptyRDD().countApproxDistinct() == 0


def test_names_spark_programs_and_tests_use(sc: Any, spark: Any) -> None:
    """``TaskContext()`` in a task, the deprecated ``mapPartitionsWithSplit`` and ``collectWithJobGroup``,
    a union of RDDs partitioned alike, and a context refused in a task, as PySpark."""
    from pyspark import TaskContext as SparkTaskContext

    from dlscale import TaskContext

    def program(c: Any, task_context: Any) -> tuple:
        rdd = c.parallelize(range(8), 4)
        parted = c.parallelize([(i, i) for i in range(10)], 3).partitionBy(2)
        both = parted.union(parted)
        with pytest.warns(FutureWarning):
            split = rdd.mapPartitionsWithSplit(lambda i, it: [i * 10 + sum(it)]).collect()
        with pytest.warns(FutureWarning):
            grouped = rdd.collectWithJobGroup("group", "a job group")
        return (
            rdd.map(lambda x: task_context().partitionId()).collect(),
            split,
            grouped,
            both.getNumPartitions(),
            both.partitioner == parted.partitioner,
            both.glom().map(sorted).collect(),
            c.parallelize(range(6), 3).union(c.parallelize(range(2), 1)).getNumPartitions(),
        )

    assert both(sc, spark, lambda c: program(c, TaskContext if c is sc else SparkTaskContext))[3] == 2

    def refused(c: Any) -> str:
        context_class = type(c)

        def make(_: Any) -> str:
            try:
                context_class("local[1]", "in a task")
            except Exception as e:
                return str(e).split(". ")[0]
            return "created"

        return c.parallelize([1], 1).map(make).collect()[0]

    assert both(sc, spark, refused).startswith("[CONTEXT_ONLY_VALID_ON_DRIVER] It appears that you are attempting")
    with SparkContext("local[1]", "stopped") as other:
        assert SparkContext._active_spark_context is other  # the newest
    assert SparkContext._active_spark_context is None  # as PySpark's, once it stops


def test_spark_local_cluster_master() -> None:
    with SparkContext("local-cluster[2, 1, 1024]", "local-cluster") as c:
        workers = cluster_workers(c.client).values()
        assert c.master == "local-cluster[2, 1, 1024]"
        assert sorted((w["nthreads"], w["memory_limit"]) for w in workers) == [(1, 1024 * 2**20)] * 2
