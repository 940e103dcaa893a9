"""Broadcast variables: a value sent to every worker once and read by tasks through ``.value``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distributed import Future, get_client, get_worker

if TYPE_CHECKING:
    from dlscale.context import SparkContext


def _restore(key: Any) -> Broadcast:
    b = Broadcast.__new__(Broadcast)
    b._key, b._future, b._sc, b._destroyed = key, None, None, False
    return b


class Broadcast:
    """A read-only value held once per worker (PySpark's ``Broadcast``).

    Tasks that use it carry only its key; ``.value`` on a worker reads the worker's copy.
    """

    def __init__(self, sc: SparkContext, value: Any) -> None:
        self._sc = sc
        self._value = value
        self._future: Future | None = sc.client.scatter(value, broadcast=True, hash=False)
        self._key = self._future.key
        self._destroyed = False

    @property
    def value(self) -> Any:
        if self._destroyed:
            raise RuntimeError(f"broadcast {self._key} was destroyed")
        if self._sc is not None:
            return self._value
        worker = get_worker()
        if self._key in worker.data:
            return worker.data[self._key]
        # a worker that joined after the broadcast: fetch a copy from a peer
        return Future(self._key, client=get_client()).result()

    def unpersist(self, blocking: bool = False) -> None:
        """Drop the workers' copies; the next task that uses the value sends it again."""
        if self._future is not None:
            self._future.release()
            self._future = None

    def destroy(self, blocking: bool = False) -> None:
        """Drop every copy, on the driver too; the value cannot be used afterwards."""
        if self._future is not None:
            self._future.release()
            self._future = None
        self._value = None
        self._destroyed = True

    def __reduce__(self) -> tuple:
        if self._destroyed:
            raise RuntimeError(f"broadcast {self._key} was destroyed and cannot be used in a task")
        if self._future is None and self._sc is not None:
            self._future = self._sc.client.scatter(self._value, broadcast=True, hash=False)
            self._key = self._future.key
        return (_restore, (self._key,))
