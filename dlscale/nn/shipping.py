"""Sending a network to the workers: pickled once on the driver, unpickled once per worker copy.

:func:`ship` puts the pickled network on every worker, as a broadcast variable is, and returns its
future; a graph that refers to the future keeps it alive, and tasks find it already local wherever
they run (a network held by one worker only would draw every task to that worker).

Each worker process keeps its unpickled networks in one :class:`NetworkCache`. Evaluation and
inference tasks borrow a copy from :func:`borrow`: up to ``copies`` per shipped network (DL4J's
``evalNumWorkers``), each lent to one task at a time, the least recently used networks forgotten
beyond ``dlscale.inference.cached-networks``. Training pins one copy per fit and trainer slot
(:func:`pin`, with the lock that keeps two tasks from training it at once) and drops it when the
fit ends (:func:`drop`); a pinned network is never forgotten to make room.
"""

from __future__ import annotations

import pickle
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

import cloudpickle

from dlscale import config
from dlscale.errors import NetworkSerializationError
from dlscale.runtime.cluster import watching_pauses
from dlscale.runtime.devices import device_for
from dlscale.runtime.replicas import EVERY_WORKER, set_replication

if TYPE_CHECKING:
    from distributed import Client, Future

    from dlscale.nn.network import Network


def serialise(network: Network, with_optimizer: bool = True) -> bytes:
    """``network`` pickled for the workers, without its listeners (they run on the driver) and, unless
    ``with_optimizer``, without its optimizer; a network that cannot be pickled is refused here,
    naming the attribute at fault."""
    saved = network.listeners, network.optimizer, network.optimizer_factory
    network.listeners = []
    if not with_optimizer:
        network.optimizer = network.optimizer_factory = None
    try:
        return cloudpickle.dumps(network, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise NetworkSerializationError(
            f"the network cannot be serialised to send it to the workers: {_culprit(network)}: {e}"
        ) from e
    finally:
        network.listeners, network.optimizer, network.optimizer_factory = saved


def ship(client: Client, network: Network, with_optimizer: bool = False, *, waiting: str) -> Future:
    """``network`` pickled (see :func:`serialise`) and held on every worker, those joining later
    included; the future's key names it in :func:`borrow`. ``waiting``: see :func:`ship_blob`. A
    network whose state is still arriving from the workers (:meth:`Network.arriving`) is pickled
    there, where it can be, and copied from worker to worker: its state never crosses to the driver."""
    arriving = network.pending()
    if arriving is not None and not with_optimizer:
        shipped = arriving.ship(client)
        if shipped is not None:
            return shipped
    return ship_blob(client, serialise(network, with_optimizer), waiting=waiting)


def ship_blob(client: Client, blob: bytes, *, waiting: str) -> Future:
    """``blob`` (a pickled network) held on every worker, those joining later included: scattered data
    cannot be recomputed, so a single copy would take every task that needs it down with its worker.
    Dask's scatter waits for a paused worker to run again: the driver warns of it meanwhile, naming
    what waits (``waiting``, as :func:`~dlscale.runtime.cluster.watching_pauses` takes it)."""
    with watching_pauses(client, waiting):
        future = client.scatter([blob], broadcast=True, hash=False)[0]
    set_replication(client, [future], EVERY_WORKER)
    return future


def _culprit(network: Network) -> str:
    """The first part of ``network`` that does not pickle, by name."""
    candidates = [("the loss", network.loss), ("the optimizer factory", network.optimizer_factory)]
    for name, module in network.module.named_modules():
        for attr, value in vars(module).items():
            if attr not in ("_parameters", "_buffers", "_modules"):
                candidates.append((f"attribute {attr!r} of module {name or type(module).__name__!r}", value))
    for what, value in candidates:
        try:
            cloudpickle.dumps(value)
        except Exception:  # noqa: BLE001 - looking for the first failure
            return what
    return "an unknown part"


class _Copies:
    """Up to ``limit`` unpickled copies of one network, each used by one task at a time; copy ``i`` is
    placed on the device of the ``first + i``-th of ``count`` (see :func:`device_for`)."""

    def __init__(self, blob: bytes, limit: int, first: int = 0, count: int | None = None) -> None:
        self.blob, self.limit, self.first, self.count = blob, limit, first, count or limit
        self.slots = threading.BoundedSemaphore(limit)  # held while a copy is in use
        self.idle: list[Network] = []
        self.made = 0
        self.lock = threading.Lock()

    def take(self) -> Network:
        """A copy for one task: the last one given back, else a new one; waits while all ``limit`` are
        in use. Every copy taken must be given back with :meth:`give_back`."""
        self.slots.acquire()
        try:
            with self.lock:
                if self.idle:
                    return self.idle.pop()
                index, self.made = self.made, self.made + 1
            try:
                return pickle.loads(self.blob).to(device_for(self.first + index, self.count))
            except BaseException:
                with self.lock:
                    self.made -= 1  # the next task tries again rather than waiting for a copy never made
                raise
        except BaseException:
            self.slots.release()
            raise

    def give_back(self, network: Network) -> None:
        with self.lock:
            self.idle.append(network)
        self.slots.release()


class NetworkCache:
    """A process's unpickled networks, each known by a key (its shipped blob's, or a fit's).

    Evaluation and inference tasks borrow one of up to ``copies`` copies of a network (:meth:`borrow`);
    beyond ``dlscale.inference.cached-networks`` such networks are forgotten, least recently used
    first. A fit keeps one copy per trainer slot with :meth:`pin`: pinned networks are outside that
    bound, so the LRU never takes the network of a running fit, and the fit forgets them with
    :meth:`drop` when it ends.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[str, _Copies] = OrderedDict()
        self._pinned: set[str] = set()
        self._lock = threading.Lock()

    def _copies(
        self, key: str, blob: bytes, limit: int, pin: bool = False, first: int = 0, count: int | None = None
    ) -> _Copies:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Copies(blob, limit, first, count)
            self._entries.move_to_end(key)
            if pin:
                self._pinned.add(key)
            lent = [k for k in self._entries if k not in self._pinned]  # least recently used first
            for k in lent[: max(0, len(lent) - max(1, config.get("inference.cached-networks")))]:
                del self._entries[k]  # copies lent now are dropped when given back
        return entry

    @contextmanager
    def borrow(self, key: str, blob: bytes, copies: int) -> Iterator[Network]:
        """One of this process's copies of the network pickled in ``blob``, for the duration of the
        block; waits while all ``copies`` are in use."""
        entry = self._copies(key, blob, copies)
        network = entry.take()
        try:
            yield network
        finally:
            entry.give_back(network)

    def pin(self, key: str, blob: bytes, local: int = 0, per_worker: int = 1) -> tuple[Network, threading.Semaphore]:
        """The one copy of the network pickled in ``blob`` that this process keeps for a fit until
        :meth:`drop`, on the device of the ``local``-th of its ``per_worker`` trainers, and the lock
        that keeps two tasks from training it at once (the copy's one slot: a key is pinned by a fit
        or borrowed from, never both)."""
        entry = self._copies(key, blob, 1, pin=True, first=local, count=per_worker)
        network = entry.take()  # made by the first call; the same copy ever after
        entry.give_back(network)
        return network, entry.slots

    def drop(self, key: str) -> None:
        """Forget the network of ``key``, pinned or not."""
        with self._lock:
            self._entries.pop(key, None)
            self._pinned.discard(key)

    def copies_made(self) -> dict[str, int]:
        """How many copies of each network it holds this cache has unpickled, by key."""
        with self._lock:
            return {key: entry.made for key, entry in self._entries.items()}


_NETWORKS = NetworkCache()


def borrow(key: str, blob: bytes, copies: int) -> AbstractContextManager[Network]:
    """:meth:`NetworkCache.borrow` on this process's cache."""
    return _NETWORKS.borrow(key, blob, copies)


def pin(key: str, blob: bytes, local: int = 0, per_worker: int = 1) -> tuple[Network, threading.Semaphore]:
    """:meth:`NetworkCache.pin` on this process's cache."""
    return _NETWORKS.pin(key, blob, local, per_worker)


def drop(key: str) -> None:
    """:meth:`NetworkCache.drop` on this process's cache (run on every worker when a fit ends)."""
    _NETWORKS.drop(key)


def copies_made() -> dict[str, int]:
    """:meth:`NetworkCache.copies_made` of this process's cache."""
    return _NETWORKS.copies_made()
