"""Broadcast variables: a value sent to every worker once and read by tasks through ``.value``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distributed import Future, get_client, get_worker

from dlscale.errors import BroadcastDestroyedError
from dlscale.runtime.replicas import EVERY_WORKER, set_replication

if TYPE_CHECKING:
    from dlscale.facade.context import SparkContext


def _dataset_name(key: Any) -> str:
    return f"dlscale-broadcast-{key}"


def _restore(key: Any) -> Broadcast:
    b = Broadcast.__new__(Broadcast)
    b._key, b._future, b._sc, b._destroyed = key, None, None, False
    return b


class Broadcast:
    """A read-only value held once per worker (PySpark's ``Broadcast``).

    Tasks that use it carry only its key; ``.value`` on a worker reads the worker's copy, or
    fetches one through the scheduler's published datasets where the worker has none (it joined
    later, or the broadcast was unpersisted).
    """

    def __init__(self, sc: SparkContext, value: Any) -> None:
        self._sc = sc
        self._value = value
        self._destroyed = False
        client = sc.client
        # a list of one item: scatter would otherwise send a list's or dict's elements separately
        self._future: Future | None = client.scatter([value], broadcast=True, hash=False)[0]
        self._key = self._future.key
        client.publish_dataset(self._future, name=_dataset_name(self._key))
        set_replication(client, [self._future], EVERY_WORKER)
        sc._broadcasts.add(self)

    @property
    def value(self) -> Any:
        if self._destroyed:
            raise BroadcastDestroyedError(f"broadcast {self._key} was destroyed")
        if self._sc is not None:
            return self._value
        worker = get_worker()
        if self._key in worker.data:
            return worker.data[self._key]
        return get_client().get_dataset(_dataset_name(self._key)).result()

    def unpersist(self, blocking: bool = False) -> None:
        """Drop the workers' copies but one; a task elsewhere that uses the value fetches it again."""
        if self._future is not None:
            set_replication(self._sc.client, [self._future], 1)

    def destroy(self, blocking: bool = False) -> None:
        """Drop every copy, on the driver too; the value cannot be used afterwards."""
        if self._future is not None:
            set_replication(self._sc._client, [self._future], 1)
            self._sc._client.unpublish_dataset(_dataset_name(self._key))
            self._future.release()
            self._future = None
        self._value = None
        self._destroyed = True
        self._sc._broadcasts.discard(self)

    def __reduce__(self) -> tuple:
        if self._destroyed:
            raise BroadcastDestroyedError(f"broadcast {self._key} was destroyed and cannot be used in a task")
        return (_restore, (self._key,))
