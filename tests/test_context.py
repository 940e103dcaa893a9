"""SparkContext: master URLs, what it owns, configuration, and errors that name their cause."""

from __future__ import annotations

import os
import sys
import traceback

import dask
import distributed
import pytest

from dlscale import ClusterConnectionError, MasterURLError, SparkConf, SparkContext
from tests.conftest import free_port


def _workers(ctx: SparkContext) -> dict:
    return ctx.client.scheduler_info(n_workers=-1)["workers"]


@pytest.mark.parametrize(("master", "expected"), [("local", 1), ("local[2]", 2), ("local[*]", os.cpu_count())])
def test_local_masters_start_worker_processes(master: str, expected: int) -> None:
    with SparkContext(master) as ctx:
        workers = _workers(ctx)
        assert len(workers) == expected
        assert ctx.defaultParallelism == expected
        # worker processes, not threads of this process
        pids = ctx.client.run(os.getpid)
        assert os.getpid() not in pids.values() and len(set(pids.values())) == expected
        assert ctx.parallelize(range(10)).sum() == 45
        cluster = ctx._owned_cluster
    assert cluster.status.name == "closed"


def test_default_master_is_local_star() -> None:
    with SparkContext() as ctx:
        assert ctx.master == "local[*]"
        assert len(_workers(ctx)) == os.cpu_count()


def test_scheduler_address_is_used_and_left_running() -> None:
    with distributed.LocalCluster(n_workers=1, processes=True, dashboard_address=None) as cluster:
        with SparkContext(cluster.scheduler_address, "by-address") as ctx:
            assert ctx.master == cluster.scheduler_address
            assert ctx.parallelize([1, 2, 3], 2).map(lambda x: x + 1).collect() == [2, 3, 4]
        assert cluster.status.name == "running"
        with distributed.Client(cluster) as other:
            assert other.submit(sum, [1, 2]).result() == 3


def test_given_client_and_cluster_are_not_closed() -> None:
    with distributed.LocalCluster(n_workers=1, processes=True, dashboard_address=None) as cluster:
        with distributed.Client(cluster) as client:
            with SparkContext(client=client) as ctx:
                assert ctx.parallelize(range(4), 2).count() == 4
            assert client.status == "running"
        with SparkContext(cluster=cluster) as ctx:
            assert ctx.parallelize(range(4), 2).count() == 4
            own_client = ctx.client
        assert own_client.status == "closed"
        assert cluster.status.name == "running"


def test_memory_thresholds_reach_the_embedded_workers() -> None:
    settings = {
        "dlscale.local.memory-target": 0.4,
        "dlscale.local.memory-spill": 0.5,
        "dlscale.local.memory-pause": False,
    }
    with dask.config.set(settings), SparkContext("local[1]") as ctx:
        seen = ctx.client.run(
            lambda dask_worker: [
                getattr(dask_worker.memory_manager, f"memory_{n}_fraction") for n in ("target", "spill", "pause")
            ]
        )
    assert list(seen.values()) == [[0.4, 0.5, False]]


def test_conf_sets_the_embedded_cluster() -> None:
    conf = SparkConf().setMaster("local[2]").setAppName("configured").set("spark.executor.memory", "700m")
    conf.set("spark.executor.cores", "2").set("spark.default.parallelism", "5")
    with SparkContext(conf=conf) as ctx:
        workers = _workers(ctx).values()
        assert [w["memory_limit"] for w in workers] == [700 * 2**20] * 2
        assert [w["nthreads"] for w in workers] == [2, 2]
        assert ctx.appName == "configured"
        assert ctx.defaultParallelism == 5
        assert ctx.parallelize([("a", 1)] * 10, 2).reduceByKey(lambda a, b: a + b).getNumPartitions() == 5
        assert ctx.getConf().get("spark.executor.memory") == "700m"


def test_identity_and_dashboard(sc: SparkContext) -> None:
    assert sc.applicationId.startswith("app-")
    assert sc.uiWebUrl.startswith("http://")
    assert SparkContext.getOrCreate() is sc
    assert sc.defaultMinPartitions == 2
    rdd = sc.parallelize([1])
    assert rdd.id() != sc.parallelize([1]).id()
    assert rdd.context is sc


@pytest.mark.parametrize("master", ["locall", "local[x]", "local[0]", "http://host:1", "banana"])
def test_unknown_master_names_it(master: str) -> None:
    with pytest.raises(MasterURLError, match="local|workers") as e:
        SparkContext(master)
    assert master in str(e.value)


def test_spark_cluster_manager_url_explains_the_alternative() -> None:
    with pytest.raises(MasterURLError, match="Dask scheduler"):
        SparkContext("spark://host:7077")
    with pytest.raises(MasterURLError, match="dask-jobqueue"):
        SparkContext("yarn")


def test_unreachable_scheduler_names_the_address() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    with (
        dask.config.set({"dlscale.connect-timeout": "1s"}),
        pytest.raises(ClusterConnectionError, match="127.0.0.1") as e,
    ):
        SparkContext(address)
    assert address in str(e.value) and isinstance(e.value, ConnectionError)


def test_wrong_argument_types() -> None:
    with pytest.raises(TypeError, match="conf"):
        SparkContext(conf=42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="client"):
        SparkContext(client="tcp://x:1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at most one"):
        SparkContext("local", client=object())  # type: ignore[arg-type]


def test_bad_arguments_to_methods(sc: SparkContext) -> None:
    with pytest.raises(TypeError, match="numSlices"):
        sc.parallelize([1, 2], "2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="numSlices"):
        sc.parallelize([1, 2], 0)
    with pytest.raises(TypeError, match="iterable"):
        sc.parallelize(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="f must be callable"):
        sc.parallelize([1]).map(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="numPartitions"):
        sc.parallelize([(1, 2)]).reduceByKey(max, numPartitions=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"\(key, value\) pairs, but an element is [78] \(int\)"):
        sc.parallelize([7, 8], 2).reduceByKey(max).collect()


def _explode(x: int) -> int:
    if x == 3:
        raise KeyError(f"element {x} is bad")
    return x


def test_user_exception_reaches_the_driver_with_its_traceback(sc: SparkContext) -> None:
    with pytest.raises(KeyError, match="element 3 is bad") as e:
        sc.parallelize(range(5), 2).map(_explode).collect()
    frames = "".join(traceback.format_tb(e.value.__traceback__))
    assert "_explode" in frames and "test_context.py" in frames


def test_stopped_context_refuses_work() -> None:
    ctx = SparkContext("local")
    rdd = ctx.parallelize([1, 2])
    ctx.stop()
    ctx.stop()  # idempotent
    with pytest.raises(RuntimeError, match="stopped"):
        rdd.collect()


def test_first_partition_result_does_not_import_torch() -> None:
    """Sizing a partition on a worker must not run the lazy ``dask.sizeof`` registration of dlscale's
    types, which imports torch: seconds added to every new worker's first task."""
    with SparkContext("local[1]") as ctx:
        assert ctx.parallelize(range(8), 2).collect() == list(range(8))
        assert ctx.client.run(lambda: "torch" in sys.modules) == dict.fromkeys(ctx.client.run(os.getpid), False)
