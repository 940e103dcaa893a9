"""Functions given to RDD operations: a ``StopIteration`` they raise fails the action, as in PySpark,
instead of ending the loop over a partition early and dropping its remaining elements silently."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dlscale import UserStopIterationError

pytestmark = pytest.mark.pyspark

MESSAGE = "Caught StopIteration thrown from user's code; failing the task: boom"


def stopit(*_: Any) -> Any:
    raise StopIteration("boom")


def nums(c: Any) -> Any:
    return c.parallelize(range(10), 2)


def keyed(c: Any) -> Any:
    return c.parallelize([(x % 2, x) for x in range(10)], 2)


def first(*args: Any) -> Any:
    return args[0]


OPERATIONS: dict[str, Callable[[Any], Any]] = {
    "map": lambda c: nums(c).map(stopit).collect(),
    "flatMap": lambda c: nums(c).flatMap(stopit).collect(),
    "filter": lambda c: nums(c).filter(stopit).collect(),
    "mapPartitions": lambda c: nums(c).mapPartitions(stopit).collect(),
    "mapPartitionsWithIndex": lambda c: nums(c).mapPartitionsWithIndex(stopit).collect(),
    "foreach": lambda c: nums(c).foreach(stopit),
    "foreachPartition": lambda c: nums(c).foreachPartition(stopit),
    "reduce": lambda c: nums(c).reduce(stopit),
    "fold": lambda c: nums(c).fold(0, stopit),
    "aggregate.seqOp": lambda c: nums(c).aggregate(0, stopit, first),
    "aggregate.combOp": lambda c: nums(c).aggregate(0, first, stopit),
    "treeAggregate": lambda c: nums(c).treeAggregate(0, stopit, first),
    "treeReduce": lambda c: nums(c).treeReduce(stopit),
    "keyBy": lambda c: nums(c).keyBy(stopit).collect(),
    "groupBy": lambda c: nums(c).groupBy(stopit).collect(),
    "sortBy": lambda c: nums(c).sortBy(stopit).collect(),
    "sortByKey": lambda c: keyed(c).sortByKey(keyfunc=stopit).collect(),
    "mapValues": lambda c: keyed(c).mapValues(stopit).collect(),
    "flatMapValues": lambda c: keyed(c).flatMapValues(stopit).collect(),
    "reduceByKey": lambda c: keyed(c).reduceByKey(stopit).collect(),
    "reduceByKeyLocally": lambda c: keyed(c).reduceByKeyLocally(stopit),
    "combineByKey": lambda c: keyed(c).combineByKey(stopit, first, first).collect(),
    "aggregateByKey": lambda c: keyed(c).aggregateByKey(0, stopit, first).collect(),
    "foldByKey": lambda c: keyed(c).foldByKey(0, stopit).collect(),
    "partitionBy": lambda c: keyed(c).partitionBy(2, stopit).collect(),
    "max.key": lambda c: nums(c).max(key=stopit),
    "top.key": lambda c: nums(c).top(2, key=stopit),
    "takeOrdered.key": lambda c: nums(c).takeOrdered(2, key=stopit),
    "cartesian.flatMap": lambda c: nums(c).cartesian(nums(c)).flatMap(stopit).collect(),
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_stopiteration_fails_the_action(sc: Any, spark: Any, operation: str) -> None:
    program = OPERATIONS[operation]
    with pytest.raises(Exception) as reference:  # noqa: PT011 - PySpark's types vary with where it is raised
        program(spark)
    described = f"{type(reference.value).__name__}: {reference.value}"
    assert "StopIteration" in described and "boom" in described
    with pytest.raises(UserStopIterationError, match=MESSAGE) as raised:
        program(sc)
    assert isinstance(raised.value, RuntimeError)
    named = "flatMap" if operation == "cartesian.flatMap" else operation.split(".")[0]
    assert str(raised.value).endswith(f" of {named})")  # the operation whose function raised it


def test_message_is_pysparks_where_pyspark_names_it(sc: Any, spark: Any) -> None:
    with pytest.raises(Exception, match=MESSAGE):  # noqa: PT011 - a Py4JJavaError from PySpark
        nums(spark).map(stopit).collect()
    with pytest.raises(UserStopIterationError, match=MESSAGE + r" \(StopIteration raised by f of map\)"):
        nums(sc).map(stopit).collect()


def test_stopiteration_of_a_returned_iterator_still_ends_it(sc: Any) -> None:
    """Only what the function itself raises is wrapped: an iterator it returns ends as iterators do."""
    assert nums(sc).mapPartitions(lambda it: iter(list(it)[:2])).collect() == [0, 1, 5, 6]
