"""A fit waits for the workers its cluster was asked for: on a batch system they join as their jobs start. A
cluster whose jobs stay pending gives a clear error after ``dlscale.training.workers-timeout``, naming how
many workers are up and which jobs have not connected; a worker that joins while the fit waits is trained
on."""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import dask
import pytest
import torch
from distributed import Scheduler, SpecCluster, Worker
from distributed.deploy.spec import ProcessInterface

from dlscale import (
    ParameterAveragingTrainingMaster,
    SharedTrainingMaster,
    SparkContext,
    SparkNet,
    WorkersUnavailableError,
)
from dlscale.data import DataSet
from dlscale.nn import Network


class PendingJob(ProcessInterface):
    """A batch job still in the queue: submitted, its worker never connects (as a dask-jobqueue job whose
    allocation has not started)."""

    def __init__(self, scheduler: str | None = None, name: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.name = name


def _cluster(pending: int) -> SpecCluster:
    worker = {"cls": Worker, "options": {"nthreads": 1, "host": "127.0.0.1"}}
    workers = {"job-0": worker, **{f"job-{i + 1}": {"cls": PendingJob, "options": {}} for i in range(pending)}}
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": None, "host": "127.0.0.1"}}
    return SpecCluster(workers=workers, scheduler=scheduler, worker=worker)


def _net() -> Network:
    torch.manual_seed(0)
    return Network(
        torch.nn.Sequential(torch.nn.Linear(4, 3)), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1)
    )


def _data(sc: SparkContext) -> Any:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
    return sc.parallelize(DataSet(x, y).batch_by(8), 2)


@pytest.mark.parametrize("master", ["averaging", "sharing"])
def test_pending_jobs_are_named_after_the_timeout(master: str) -> None:
    with _cluster(pending=2) as cluster, SparkContext(cluster=cluster) as sc:
        trainer = (
            ParameterAveragingTrainingMaster(8, rng_seed=0)
            if master == "averaging"
            else SharedTrainingMaster(8, rng_seed=0)
        )
        started = time.monotonic()
        with dask.config.set({"dlscale.training.workers-timeout": "1s"}):
            with pytest.raises(WorkersUnavailableError) as raised:
                SparkNet(sc, _net(), trainer).fit(_data(sc), epochs=1)
        assert 1 <= time.monotonic() - started < 10
        message = str(raised.value)
        assert "the fit needs 3 worker(s) and 1 are up after waiting 1.00 s" in message
        assert "SpecCluster has 2 job(s) not connected yet (pending or starting): job-1, job-2" in message
        assert "dlscale.training.min-workers" in message
        # a lower minimum trains on the workers up
        with dask.config.set({"dlscale.training.min-workers": 1}):
            net = _net()
            SparkNet(sc, net, ParameterAveragingTrainingMaster(8, rng_seed=0)).fit(_data(sc), epochs=1)
            assert net.epoch == 1


def test_a_worker_the_cluster_was_asked_for_is_waited_for_and_trained_on(caplog: pytest.LogCaptureFixture) -> None:
    with _cluster(pending=0) as cluster, SparkContext(cluster=cluster) as sc:
        cluster.scale(2)  # a second job, which the fit waits for as it starts
        result: dict[str, Any] = {}

        def fit() -> None:
            net = _net()
            spark_net = SparkNet(sc, net, ParameterAveragingTrainingMaster(8, rng_seed=0, collect_training_stats=True))
            spark_net.fit(_data(sc), epochs=1)
            result["workers"] = {w.worker for r in spark_net.training_stats.rounds for w in r.workers}

        with caplog.at_level(logging.INFO, logger="dlscale"):
            thread = threading.Thread(target=fit)
            thread.start()
            thread.join(60)
        assert len(result["workers"]) == 2
        assert any(r.getMessage().startswith("training on 2 workers: tcp://127.0.0.1:") for r in caplog.records)


def test_a_loop_of_fits_names_its_workers_once_and_again_when_they_change(caplog: pytest.LogCaptureFixture) -> None:
    """One fit per epoch, as DL4J's examples train: the workers trained on are logged by the first fit and
    by a fit whose workers differ from the last one's; the fits between log them at debug level."""
    with _cluster(pending=0) as cluster, SparkContext(cluster=cluster) as sc:
        spark_net = SparkNet(sc, _net(), ParameterAveragingTrainingMaster(8, rng_seed=0))
        with caplog.at_level(logging.DEBUG, logger="dlscale"):
            for _ in range(2):
                spark_net.fit(_data(sc))
            cluster.scale(2)
            sc.client.wait_for_workers(2, timeout=30)
            spark_net.fit(_data(sc))
        told = [
            (r.levelno, r.getMessage().split(":")[0])
            for r in caplog.records
            if r.getMessage().startswith("training on")
        ]
        assert told == [
            (logging.INFO, "training on 1 worker"),
            (logging.DEBUG, "training on 1 worker"),
            (logging.INFO, "training on 2 workers"),
        ]


def test_bad_minimum_is_refused() -> None:
    with _cluster(pending=0) as cluster, SparkContext(cluster=cluster) as sc:
        with dask.config.set({"dlscale.training.min-workers": 0}):
            with pytest.raises(ValueError, match="dlscale.training.min-workers must be an integer >= 1 or null, got 0"):
                SparkNet(sc, _net(), ParameterAveragingTrainingMaster(8)).fit(_data(sc), epochs=1)
