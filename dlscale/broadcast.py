"""Broadcast variables: a value sent to every worker once and read by tasks through ``.value``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distributed import Future, get_client, get_worker

from dlscale.errors import BroadcastDestroyedError

if TYPE_CHECKING:
    from dlscale.context import SparkContext


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
        self._future: Future | None = None
        self._publish(everywhere=True)
        sc._broadcasts.add(self)

    def _publish(self, everywhere: bool) -> None:
        client = self._sc.client
        # a list of one item: scatter would otherwise send a list's or dict's elements separately
        future = client.scatter([self._value], broadcast=everywhere, hash=False)[0]
        client.publish_dataset(future, name=_dataset_name(future.key))
        self._withdraw()
        self._future, self._key = future, future.key

    def _withdraw(self) -> None:
        if self._future is not None:
            self._sc._client.unpublish_dataset(_dataset_name(self._key))
            self._future.release()
            self._future = None

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
        if not self._destroyed:
            self._publish(everywhere=False)

    def destroy(self, blocking: bool = False) -> None:
        """Drop every copy, on the driver too; the value cannot be used afterwards."""
        self._withdraw()
        self._value = None
        self._destroyed = True
        self._sc._broadcasts.discard(self)

    def __reduce__(self) -> tuple:
        if self._destroyed:
            raise BroadcastDestroyedError(f"broadcast {self._key} was destroyed and cannot be used in a task")
        return (_restore, (self._key,))
