"""Broadcast variables reach every worker once and are read by tasks through ``.value``."""

from __future__ import annotations

import time

import pytest
import torch

from dlscale import BroadcastDestroyedError, SparkContext


def test_broadcast_value_in_tasks(sc: SparkContext) -> None:
    table = {i: i * i for i in range(100)}
    b = sc.broadcast(table)
    assert b.value is table
    assert sc.parallelize(range(10), 3).map(lambda x: b.value[x]).collect() == [x * x for x in range(10)]
    time.sleep(5)  # two cycles of Dask's Active Memory Manager, which drops extra copies by default
    held = sc.client.has_what()
    assert all(b._key in keys for keys in held.values())  # still one copy on every worker
    b.unpersist()
    time.sleep(5)
    assert sum(b._key in keys for keys in sc.client.has_what().values()) == 1


def test_broadcast_tensor_is_not_resent_per_task(sc: SparkContext) -> None:
    weights = torch.randn(256, 256)
    b = sc.broadcast(weights)
    rdd = sc.parallelize(range(16), 8).map(lambda i: float((b.value @ torch.ones(256))[i]))
    expected = (weights @ torch.ones(256))[:16].tolist()
    assert rdd.collect() == pytest.approx(expected, rel=1e-5, abs=1e-4)  # BLAS summation order
    # the graph carries the key, not the tensor
    import pickle

    assert len(pickle.dumps(b)) < 1000


def test_unpersist_and_destroy(sc: SparkContext) -> None:
    b = sc.broadcast([1, 2, 3])
    b.unpersist()
    assert sc.parallelize([0, 1, 2], 2).map(lambda i: b.value[i]).collect() == [1, 2, 3]
    b.destroy()
    with pytest.raises(BroadcastDestroyedError, match="destroyed"):
        b.value  # noqa: B018 - reading it is the test
    with pytest.raises(BroadcastDestroyedError, match="destroyed"):
        sc.parallelize([0]).map(lambda i: b.value).collect()
