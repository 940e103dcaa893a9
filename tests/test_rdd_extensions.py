"""dlscale's extensions to PySpark's RDD API: ``RDD.map_partitions_with_future``, ``RDD.to_bag`` and
``SparkContext.from_bag``, checked against plain Python on a real 2-process LocalCluster."""

from __future__ import annotations

import gc
import time

import dask.bag as db
import distributed
import pytest

from dlscale import SparkContext, StorageLevel
from dlscale.runtime.cluster import cluster_workers


def _held_by_scheduler(sc: SparkContext, key: str) -> bool:
    return sc.client.run_on_scheduler(lambda dask_scheduler: key in dask_scheduler.tasks)


def test_map_partitions_with_future_gives_each_partition_its_index_and_the_value(sc: SparkContext) -> None:
    value = {"scale": 3, "offset": 7}
    # a list of one item, as for any value: scatter would otherwise send a dict's values separately
    future = sc.client.scatter([value], broadcast=True, hash=False)[0]
    data = list(range(48))  # 4 slices of 12
    rdd = sc.parallelize(data, 4)

    def scaled(index: int, v: dict, it: object) -> list:
        return [(index, x * v["scale"] + v["offset"]) for x in it]

    got = rdd.map_partitions_with_future(scaled, future)
    expected = [[(i, x * 3 + 7) for x in data[i * 12 : (i + 1) * 12]] for i in range(4)]
    assert got.glom().collect() == expected
    assert got.partitioner is None and got.getNumPartitions() == 4
    # a lazy RDD like any other: chained, keyed, persisted
    sums = got.reduceByKey(lambda a, b: a + b).persist(StorageLevel.MEMORY_ONLY_SER)
    assert sorted(sums.collect()) == [(i, sum(y for _, y in part)) for i, part in enumerate(expected)]
    sums.unpersist(blocking=True)
    # the function runs on the workers, where the value is already held
    workers = set(cluster_workers(sc.client))
    where = rdd.map_partitions_with_future(lambda i, v, it: [distributed.get_worker().address], future).collect()
    assert len(where) == 4 and set(where) <= workers


def test_the_rdd_keeps_the_value_alive_as_long_as_it_or_a_derived_rdd_exists(sc: SparkContext) -> None:
    def make() -> tuple:
        future = sc.client.scatter([list(range(1000))], broadcast=True, hash=False)[0]
        rdd = sc.parallelize(range(8), 2).map_partitions_with_future(lambda i, v, it: [sum(v) + x for x in it], future)
        return rdd, future.key

    rdd, key = make()  # the driver no longer refers to the future: only the RDD does
    gc.collect()
    assert rdd.collect() == [499500 + x for x in range(8)]
    derived = rdd.map(lambda x: -x)
    del rdd
    gc.collect()
    assert derived.sum() == -sum(499500 + x for x in range(8))
    assert _held_by_scheduler(sc, key)
    del derived
    gc.collect()
    deadline = time.monotonic() + 30
    while _held_by_scheduler(sc, key):
        assert time.monotonic() < deadline, f"{key} is still held after every RDD using it is gone"
        time.sleep(0.05)


def test_map_partitions_with_future_refuses_what_it_cannot_use(sc: SparkContext) -> None:
    rdd = sc.parallelize(range(4), 2)
    future = sc.client.scatter([1], hash=False)[0]
    with pytest.raises(TypeError, match="f must be callable, got int"):
        rdd.map_partitions_with_future(3, future)
    broadcast = sc.broadcast(1)
    with pytest.raises(TypeError, match="future must be a distributed.Future .* not Broadcast"):
        rdd.map_partitions_with_future(lambda i, v, it: it, broadcast)
    broadcast.destroy()


def test_from_bag_keeps_the_bags_partitions(sc: SparkContext) -> None:
    data = list(range(10))
    bag = db.from_sequence(data, partition_size=4).map(lambda x: x * x)
    rdd = sc.from_bag(bag)
    assert rdd.getNumPartitions() == 3
    assert rdd.glom().collect() == [[x * x for x in data[i : i + 4]] for i in range(0, 10, 4)]
    assert rdd.reduce(lambda a, b: a + b) == sum(x * x for x in data)


def test_from_bag_reads_iterator_partitions_more_than_once(sc: SparkContext) -> None:
    # map_partitions returns the function's result as the partition: here a one-pass iterator
    bag = db.from_sequence(range(6), npartitions=2).map_partitions(lambda part: map(str, part))
    rdd = sc.from_bag(bag)
    strings = [str(x) for x in range(6)]
    assert rdd.zip(rdd).collect() == [(s, s) for s in strings]
    assert sorted(rdd.cartesian(rdd).collect()) == sorted((a, b) for a in strings for b in strings)


def test_to_bag_and_back(sc: SparkContext) -> None:
    rdd = sc.parallelize(range(10), 3)
    bag = rdd.to_bag()
    assert bag.npartitions == 3
    assert sc.client.compute(bag.sum(), sync=True) == 45
    again = sc.from_bag(bag.filter(lambda x: x % 2 == 0))
    assert again.glom().collect() == [[x for x in part if x % 2 == 0] for part in rdd.glom().collect()]
    with pytest.raises(TypeError, match="bag must be a dask.bag.Bag, not list"):
        sc.from_bag([1, 2, 3])
