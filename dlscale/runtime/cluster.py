"""What the scheduler knows of the cluster now."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Client


def cluster_workers(client: Client) -> dict[str, dict[str, Any]]:
    """The cluster's workers now, by address, with what the scheduler knows of each (``nthreads``…).

    Asked of the scheduler itself: ``Client.scheduler_info(n_workers=-1)`` returns the client's cached
    copy, which the client's periodic update (which asks for no workers) can overwrite while the call
    waits, so that it sometimes reports a cluster without workers."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]
