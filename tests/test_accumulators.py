"""Accumulators against PySpark: the same programs give the same values, additions reach the driver with
the tasks' results, and each task of an action counts once even when a worker is killed during it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.accumulators import AccumulatorParam as SparkAccumulatorParam

from dlscale import AccumulatorAccessError, AccumulatorParam, SparkContext
from dlscale.facade.accumulators import Accumulator

pytestmark = pytest.mark.pyspark


class VectorParam(AccumulatorParam, SparkAccumulatorParam):
    """PySpark's example of a custom accumulator: element-wise sums of lists."""

    def zero(self, value: list[float]) -> list[float]:
        return [0.0] * len(value)

    def addInPlace(self, val1: list[float], val2: list[float]) -> list[float]:
        for i in range(len(val1)):
            val1[i] += val2[i]
        return val1


def counted_map(c: Any) -> tuple:
    acc = c.accumulator(0)

    def f(x: int) -> int:
        acc.add(1)
        return x

    n = c.parallelize(range(100), 4).map(f).count()
    return n, acc.value


def foreach_sum(c: Any) -> int:
    acc = c.accumulator(10)

    def f(x: int) -> None:
        nonlocal acc
        acc += x

    c.parallelize(range(100), 3).foreach(f)
    return acc.value


def float_and_complex(c: Any) -> tuple:
    f, z = c.accumulator(0.5), c.accumulator(1j)
    c.parallelize(range(8), 3).foreach(lambda x: (f.add(0.25), z.add(complex(x, 0))))
    return f.value, z.value


def vector(c: Any) -> list[float]:
    acc = c.accumulator([1.0, 2.0, 3.0], VectorParam())
    c.parallelize([1, 2, 3], 2).foreach(lambda x: acc.add([float(x)] * 3))
    return acc.value


def everything_filtered_out(c: Any) -> tuple:
    acc = c.accumulator(0)
    kept = c.parallelize(range(30), 5).filter(lambda x: acc.add(1) or False).count()
    return kept, acc.value


def through_a_shuffle(c: Any) -> tuple:
    before, after = c.accumulator(0), c.accumulator(0)
    rdd = c.parallelize(range(50), 5).map(lambda x: (before.add(1), (x % 7, x))[1]).reduceByKey(lambda a, b: a + b)
    result = sorted(rdd.map(lambda kv: (after.add(1), kv)[1]).collect())
    return result, before.value, after.value


def in_reduce_and_mapPartitions(c: Any) -> tuple:
    calls, parts = c.accumulator(0), c.accumulator(0)
    rdd = c.parallelize(range(20), 4).mapPartitions(lambda it: (parts.add(1), list(it))[1])
    total = rdd.reduce(lambda a, b: (calls.add(1), a + b)[1])
    return total, calls.value, parts.value


def cached_then_recomputed(c: Any) -> tuple:
    cached, plain = c.accumulator(0), c.accumulator(0)
    kept = c.parallelize(range(10), 2).map(lambda x: (cached.add(1), x)[1]).cache()
    again = c.parallelize(range(10), 2).map(lambda x: (plain.add(1), x)[1])
    values = []
    for _ in range(2):  # a cached partition is not computed again; an uncached one is
        kept.count()
        again.count()
        values.append((cached.value, plain.value))
    kept.unpersist()
    return values


def driver_side(c: Any) -> tuple:
    acc = c.accumulator(1)
    acc += 2
    acc.add(3)
    acc.value = acc.value * 10
    return acc.value, str(acc)


PROGRAMS: dict[str, Callable[[Any], Any]] = {
    f.__name__: f
    for f in (
        counted_map,
        foreach_sum,
        float_and_complex,
        vector,
        everything_filtered_out,
        through_a_shuffle,
        in_reduce_and_mapPartitions,
        cached_then_recomputed,
        driver_side,
    )
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_same_values_as_pyspark(sc: SparkContext, spark: Any, name: str) -> None:
    assert PROGRAMS[name](sc) == PROGRAMS[name](spark)


def refuse_misuse(c: Any) -> None:
    acc = c.accumulator(0)
    with pytest.raises(Exception, match=r"Value `Accumulator.value` cannot be accessed inside tasks"):  # noqa: PT011
        c.parallelize([1, 2], 2).map(lambda x: acc.value).collect()

    def set_it(x: int) -> None:
        acc.value = 7

    with pytest.raises(Exception, match=r"Value `Accumulator.value` cannot be accessed inside tasks"):  # noqa: PT011
        c.parallelize([1, 2], 2).foreach(set_it)
    with pytest.raises(TypeError, match="No default accumulator param for type <class 'list'>"):
        c.accumulator([1.0, 2.0])


def test_misuse_is_refused_as_in_pyspark(sc: SparkContext, spark: Any) -> None:
    refuse_misuse(spark)
    refuse_misuse(sc)
    acc = sc.accumulator(5)
    assert isinstance(acc, Accumulator) and repr(acc) == f"Accumulator<id={acc.aid}, value=5>"
    with pytest.raises(AccumulatorAccessError, match="no RDD operation"):
        sc.client.submit(acc.add, 1).result()


@pytest.fixture
def own_context() -> Iterator[SparkContext]:
    """Two workers of one thread each, one of which the test kills."""
    with SparkContext("local[2]", "accumulators-kill") as ctx:
        yield ctx


def logged(log: Path) -> Callable[[int], int]:
    """An identity function that takes 20 ms and appends a line to ``log`` (the workers share this machine)."""

    def f(x: int) -> int:
        time.sleep(0.02)
        with open(log, "a") as out:
            out.write(f"{x}\n")
        return x

    return f


def kill_a_worker_when(ctx: SparkContext, log: Path, lines: int) -> threading.Thread:
    """A thread that kills (SIGKILL) one of the context's worker processes once ``log`` has ``lines`` lines."""
    pid = next(iter(ctx.client.run(os.getpid).values()))

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if log.exists() and len(log.read_text().splitlines()) >= lines:
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=watch, daemon=True)
    killer.start()
    return killer


@pytest.mark.slow
def test_a_worker_killed_during_an_action_counts_each_task_once(
    own_context: SparkContext, spark: Any, tmp_path: Path
) -> None:
    """The worker dies while the partitions after the shuffle are computed: the split tasks it ran are
    computed again for the partitions still to come, while those already computed carry the first run's
    additions; each counts once, and the foreach's own additions once per element."""

    def program(c: Any, log: Path) -> tuple:
        mapped, merged, each = c.accumulator(0), c.accumulator(0), c.accumulator(0)
        rdd = (
            c.parallelize(range(400), 8)
            .map(lambda x: (mapped.add(1), time.sleep(0.02), x)[2])
            .repartition(8)
            .map(lambda x: (merged.add(1), logged(log)(x))[1])
        )
        rdd.foreach(lambda x: each.add(x))
        return mapped.value, merged.value, each.value

    expected = program(spark, tmp_path / "pyspark.log")
    assert expected == (400, 400, sum(range(400)))
    log = tmp_path / "dlscale.log"
    killer = kill_a_worker_when(own_context, log, 150)  # a few partitions after the shuffle are done
    assert program(own_context, log) == expected
    killer.join()
    assert len(log.read_text().splitlines()) > 400  # the killed worker's partitions ran again


def union_with_itself(c: Any) -> int:
    acc = c.accumulator(0)
    rdd = c.parallelize(range(10), 2).map(lambda x: (acc.add(1), x)[1])
    assert rdd.union(rdd).count() == 20
    return acc.value


def test_an_rdd_read_twice_by_one_action_adds_once(sc: SparkContext, spark: Any) -> None:
    """The difference docs/facade.md states: Dask computes a partition once per action however many tasks
    read it, where Spark computes it, and adds, once per reader."""
    assert union_with_itself(spark) == 20
    assert union_with_itself(sc) == 10
