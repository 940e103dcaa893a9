"""Broadcast variables: a value sent to every worker once, held once per worker and read by tasks
through ``.value`` without a copy.

The value travels as one :class:`_Payload`. Dask's ``scatter`` would serialize a list, set, tuple or
dict element by element (a set of two million ints took twelve minutes); a payload is serialized once
on the driver as a single unit, with numpy arrays, tensors and ``bytes`` as raw frames, and those frames
go from the driver to every worker directly, where they are deserialized once into the copy that the
worker's tasks share. A task carries only the broadcast's key.
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any

from dask.sizeof import sizeof
from dask.utils import parse_timedelta
from distributed import Future, get_client, get_worker
from distributed.protocol import dask_deserialize, dask_serialize, deserialize, serialize

from dlscale import config
from dlscale.errors import BroadcastDestroyedError, BroadcastOperationError
from dlscale.runtime.cluster import cluster_workers
from dlscale.runtime.replicas import EVERY_WORKER, KEEP, set_replication

if TYPE_CHECKING:
    from dlscale.facade.context import SparkContext


class _Payload:
    """A broadcast value as the one unit Dask stores and sends. On the driver it holds its serialized
    frames, made once before the first send, for the sends to every worker; ``nbytes`` is the value's
    size in memory (``dask.sizeof`` of the value, measured once on the driver)."""

    def __init__(self, value: Any, nbytes: int) -> None:
        self.value = value
        self.nbytes = nbytes
        self.serialized: tuple[dict, list] | None = None


def _serialize_value(value: Any) -> tuple[dict, list]:
    return serialize(value, serializers=("dask", "pickle"), on_error="raise", iterate_collection=False)


@dask_serialize.register(_Payload)
def _serialize_payload(p: _Payload) -> tuple[dict, list]:
    if p.serialized is not None:
        return p.serialized
    header, frames = _serialize_value(p.value)
    return {"value": header, "nbytes": p.nbytes}, frames


def _not_serializable(value: Any, error: Exception) -> pickle.PicklingError:
    """PySpark's error for a broadcast value that cannot be pickled, naming the value's type and why (the
    pickler's own error, which Dask's ``TypeError`` wraps)."""
    cause = error.__cause__ if isinstance(error, TypeError) and error.__cause__ is not None else error
    kind = type(value)
    return pickle.PicklingError(
        f"Could not serialize broadcast: {type(cause).__name__}: {cause} "
        f"(the value is a {kind.__module__}.{kind.__qualname__})"
    )


@dask_deserialize.register(_Payload)
def _deserialize_payload(header: dict, frames: list) -> _Payload:
    return _Payload(deserialize(header["value"], frames), header["nbytes"])


@sizeof.register(_Payload)
def _sizeof_payload(p: _Payload) -> int:
    return p.nbytes


def _dataset_name(key: str) -> str:
    return f"dlscale-{key}"


# values a worker fetched for its tasks after unpersist() dropped its copy, by key
_fetched: dict[str, Any] = {}
_fetch_lock = threading.Lock()


def _forget(key: str) -> None:
    """Drop this worker's fetched copy of ``key`` (run on every worker by unpersist and destroy)."""
    with _fetch_lock:
        _fetched.pop(key, None)


def _worker_value(key: str) -> Any:
    """The value of broadcast ``key`` on this worker: its held copy, else one fetched once and kept."""
    worker = get_worker()
    try:
        return worker.data[key].value
    except KeyError:
        pass
    with _fetch_lock:
        if key in _fetched:
            return _fetched[key]
        try:
            future = get_client().get_dataset(_dataset_name(key))
        except KeyError:
            raise BroadcastDestroyedError(f"broadcast {key} was destroyed and cannot be used in a task") from None
        value = _fetched[key] = future.result().value
        return value


def _restore(key: str) -> Broadcast:
    b = Broadcast.__new__(Broadcast)
    b._key, b._future, b._sc, b._destroyed, b._value = key, None, None, False, None
    b._read = False
    return b


class Broadcast:
    """A read-only value held once per worker (PySpark's ``Broadcast``).

    Tasks that use it carry only its key; ``.value`` on a worker is the worker's copy itself (no copy is
    made: treat it as read-only), or, where the worker has none (it joined later, or the broadcast was
    unpersisted), a copy fetched once from a worker that has one and kept for the worker's later tasks.
    """

    def __init__(self, sc: SparkContext, value: Any) -> None:
        self._sc = sc
        self._value = value
        self._destroyed = False
        self._read = True
        self._key = f"broadcast-{uuid.uuid4().hex}"
        client = sc.client
        try:  # once, for every worker it is sent to; a value that cannot be pickled fails here, as in PySpark
            header, frames = _serialize_value(value)
        except Exception as e:
            raise _not_serializable(value, e) from e
        payload = _Payload(value, sizeof(value))
        payload.serialized = {"value": header, "nbytes": payload.nbytes}, frames
        # straight from the driver to each worker, unless the client was told it cannot reach them
        direct = client.direct_to_workers is not False
        workers = list(cluster_workers(client)) or [None]

        def send(worker: str | None) -> Future:
            return client.scatter({self._key: payload}, workers=worker, direct=direct, hash=False)[self._key]

        set_replication(client, [self._key], KEEP)  # the memory manager leaves the copies to these sends
        with ThreadPoolExecutor(len(workers)) as pool:  # to every worker at once
            self._future: Future | None = list(pool.map(send, workers))[0]
        set_replication(client, [self._future], EVERY_WORKER)  # and on workers that join later
        payload.serialized = None  # the driver keeps the value, not a second, serialized copy
        client.publish_dataset(self._future, name=_dataset_name(self._key))
        sc._broadcasts.add(self)

    @property
    def value(self) -> Any:
        """The value: on the driver the object given, in a task the worker's copy."""
        if self._destroyed:
            raise BroadcastDestroyedError(f"broadcast {self._key} was destroyed")
        if not self._read:
            self._value, self._read = _worker_value(self._key), True
        return self._value

    def _on_driver(self, operation: str) -> None:
        """Raise PySpark's error for ``operation`` on a task's copy of the broadcast."""
        if self._sc is None:
            raise BroadcastOperationError(f"[INVALID_BROADCAST_OPERATION] Broadcast can only be {operation} in driver.")

    def unpersist(self, blocking: bool = False) -> None:
        """Drop the workers' copies but one; a worker whose task uses the value again fetches it once more
        and keeps it. With ``blocking``, wait until the copies are gone (at most
        ``dlscale.persist.unpersist-timeout``). In a task it raises ``BroadcastOperationError``, as PySpark's
        error."""
        self._on_driver("unpersisted")
        if self._future is None:
            return
        client = self._sc.client
        set_replication(client, [self._future], 1)
        client.run(_forget, self._key)
        if blocking:
            deadline = time.monotonic() + parse_timedelta(config.get("persist.unpersist-timeout"))
            while len(client.who_has([self._future]).get(self._key, ())) > 1 and time.monotonic() < deadline:
                time.sleep(0.1)

    def destroy(self, blocking: bool = False) -> None:
        """Drop every copy, on the driver too; the value cannot be used afterwards, and a task that uses
        it fails with :class:`~dlscale.errors.BroadcastDestroyedError`. In a task it raises
        ``BroadcastOperationError``, as PySpark's error."""
        self._on_driver("destroyed")
        if self._future is not None:
            client = self._sc._client
            set_replication(client, [self._future], 1)
            client.unpublish_dataset(_dataset_name(self._key))
            self._future.release()
            self._future = None
            client.run(_forget, self._key)
        self._value = None
        self._destroyed = True
        self._sc._broadcasts.discard(self)

    def dump(self, value: Any, f: IO[bytes]) -> None:
        """Pickle ``value`` into ``f`` and close it (PySpark's format: one pickle)."""
        try:
            pickle.dump(value, f, pickle.HIGHEST_PROTOCOL)
        except pickle.PickleError:
            raise
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            raise pickle.PicklingError(f"Could not serialize broadcast: {type(e).__name__}: {e}") from e
        f.close()

    def load_from_path(self, path: str) -> Any:
        """The value pickled in the file ``path`` (by :meth:`dump`)."""
        with open(path, "rb", 1 << 20) as f:
            return self.load(f)

    def load(self, file: IO[bytes]) -> Any:
        """The value pickled in ``file``."""
        return pickle.load(file)

    def __reduce__(self) -> tuple:
        if self._destroyed:
            raise BroadcastDestroyedError(f"broadcast {self._key} was destroyed and cannot be used in a task")
        return (_restore, (self._key,))

    def __repr__(self) -> str:
        return f"Broadcast({self._key})"
