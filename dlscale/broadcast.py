"""Broadcast variables: a value sent to every worker once and read by tasks through ``.value``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distributed import Future, get_client, get_worker

if TYPE_CHECKING:
    from dlscale.context import SparkContext


def _scatter(sc: SparkContext, value: Any, everywhere: bool = True) -> Future:
    # a list of one item: scatter would otherwise send a list's or dict's elements separately
    return sc.client.scatter([value], broadcast=everywhere, hash=False)[0]


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
        self._future: Future | None = _scatter(sc, value)
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
        # no copy here (a worker that joined later, or after unpersist): fetch one from a peer
        return Future(self._key, client=get_client()).result()

    def unpersist(self, blocking: bool = False) -> None:
        """Drop the workers' copies but one; a task elsewhere that uses the value fetches it again."""
        if self._future is not None:
            old, self._future = self._future, _scatter(self._sc, self._value, everywhere=False)
            self._key = self._future.key
            old.release()

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
        return (_restore, (self._key,))
