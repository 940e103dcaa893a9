"""TLS end to end: a cluster that only speaks TLS, reached through a ``tls://`` master URL; gradient
sharing (updates sent worker to worker), parameter averaging (its parts kept in Dask's encrypted comms,
not the workers' own plain TCP connections), evaluation and keyed inference all run over it."""

from __future__ import annotations

import functools
import gc
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from distributed import LocalCluster, Security

from dlscale import (
    ClusterConnectionError,
    ParameterAveragingTrainingMaster,
    SharedTrainingMaster,
    SparkContext,
    SparkNet,
)
from dlscale.data import DataSet, load_digits
from dlscale.evaluation import Evaluation
from dlscale.nn import Network
from dlscale.runtime.cluster import cluster_workers


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[tuple[LocalCluster, Security]]:
    pytest.importorskip("cryptography")
    security = Security.temporary()
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, protocol="tls", security=security, dashboard_address=None
    ) as cluster:
        yield cluster, security


def digits_network() -> Network:
    torch.manual_seed(0)
    return Network(
        torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)),
        "cross_entropy",
        functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    )


def test_training_evaluation_and_inference_over_tls(tls_cluster, tmp_path) -> None:
    cluster, security = tls_cluster
    assert cluster.scheduler_address.startswith("tls://")
    x, y = load_digits()
    x, y = x.flatten(1)[:600], y[:600]
    network = digits_network()
    before = network.params().clone()
    with SparkContext(cluster.scheduler_address, "tls", security=security) as sc:
        workers = cluster_workers(sc.client)
        assert len(workers) == 2 and all(w.startswith("tls://") for w in workers)
        master = SharedTrainingMaster(
            16, rng_seed=0, export_directory=str(tmp_path / "export"), collect_training_stats=True
        )
        spark_net = SparkNet(sc, network, master)
        rdd = sc.parallelize(DataSet(x, y).batch_by(20), 4)
        spark_net.fit(rdd, epochs=10)
        assert not torch.equal(network.params(), before)
        assert {t.worker for t in spark_net.training_stats.trainers} == set(workers)
        listeners = sc.client.run(lambda dask_worker: dask_worker.handlers["dlscale_sharing_port"]())
        assert list(listeners.values()) == [None, None]  # the updates stay in the encrypted comms
        evaluation = spark_net.evaluate(rdd)
        local = Evaluation()
        local.eval(y, network.output(x))
        assert evaluation.confusion_matrix().tolist() == local.confusion_matrix().tolist()
        assert evaluation.accuracy() > 0.5  # it learned (chance is 0.1)
        keyed = dict(
            spark_net.feed_forward_with_key(sc.parallelize([(i, x[i].clone()) for i in range(50)], 2)).collect()
        )
        torch.testing.assert_close(
            torch.stack([keyed[i] for i in range(50)]), network.output(x[:50]), atol=1e-6, rtol=0
        )


def test_without_credentials_the_connection_is_refused_and_its_client_closed(tls_cluster) -> None:
    """The client that could not connect is closed then, its event loop's thread ended: left for the
    garbage collector, its ``__del__`` could deadlock a client being made at that moment (distributed's
    loop runners share one lock), as it once hung the next test's ``SparkContext``."""
    cluster, _ = tls_cluster
    loops = {t for t in threading.enumerate() if t.name == "IO loop"}
    gc.disable()  # nothing is closed by the collector meanwhile
    try:
        with pytest.raises(ClusterConnectionError, match="needs TLS credentials: pass security="):
            SparkContext(cluster.scheduler_address, "no credentials")
        deadline = time.monotonic() + 10
        while (
            left := {t for t in threading.enumerate() if t.name == "IO loop"} - loops
        ) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        gc.enable()
    assert not left


def test_parameter_averaging_keeps_its_parts_in_the_encrypted_comms(tls_cluster, tmp_path) -> None:
    cluster, security = tls_cluster
    x, y = load_digits()
    x, y = x.flatten(1)[:400], y[:400]
    network = digits_network()
    with SparkContext(cluster.scheduler_address, "tls", security=security) as sc:
        master = ParameterAveragingTrainingMaster(
            20,
            averaging_frequency=2,
            rng_seed=0,
            export_directory=str(tmp_path / "export"),
            collect_training_stats=True,
        )
        spark_net = SparkNet(sc, network, master)
        spark_net.fit(sc.parallelize(DataSet(x, y).batch_by(20), 4), epochs=3)
        rounds = spark_net.training_stats.rounds
        assert rounds and all(len(r.workers) == 2 for r in rounds)  # every round averaged between the two
        listeners = sc.client.run(lambda dask_worker: dask_worker.handlers["dlscale_averaging_port"]())
        assert list(listeners.values()) == [None, None]
        assert spark_net.evaluate(sc.parallelize(DataSet(x, y).batch_by(50), 2)).accuracy() > 0.5
