"""The cluster's workers as training and ``defaultParallelism`` read them: asked of the scheduler, so
that the client's periodic update of its cached copy (which holds no workers) never hides them."""

from __future__ import annotations

import dask
import distributed

from dlscale.runtime.cluster import cluster_workers
from dlscale.training._driver import workers


def test_the_workers_are_never_missing_while_the_client_updates_its_copy() -> None:
    # Client.scheduler_info(n_workers=-1) reported no workers in about 1 call of 10 with this
    # interval (21 of 200 measured): the periodic update overwrote the answer while it was read
    with (
        dask.config.set({"distributed.client.scheduler-info-interval": "1ms"}),
        distributed.LocalCluster(n_workers=2, processes=False, dashboard_address=None) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.wait_for_workers(2)
        started = {w.worker_address for w in cluster.workers.values()}
        for _ in range(50):
            assert set(cluster_workers(client)) == started
            assert workers(client) == sorted(started)
