"""Sending a network to the workers: pickled once on the driver, unpickled once per worker copy.

:func:`ship` puts the pickled network on every worker, as a broadcast variable is, and returns its
future; a graph that refers to the future keeps it alive, and tasks find it already local wherever
they run (a network held by one worker only would draw every task to that worker). Evaluation and
inference tasks borrow an unpickled copy from :func:`borrow`: each worker process keeps up to
``copies`` unpickled networks per shipped network (DL4J's ``evalNumWorkers``), lends each to one
task at a time, and forgets the least recently used networks beyond
``dlscale.inference.cached-networks``.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import cloudpickle

from dlscale import config
from dlscale.errors import NetworkSerializationError
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


def ship(client: Client, network: Network, with_optimizer: bool = False) -> Future:
    """``network`` pickled (see :func:`serialise`) and held on every worker, those joining later
    included; the future's key names it in :func:`borrow`."""
    future = client.scatter([serialise(network, with_optimizer)], broadcast=True, hash=False)[0]
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
    """Up to ``limit`` unpickled copies of one network, each lent to one task at a time."""

    def __init__(self, blob: bytes, limit: int) -> None:
        self.blob, self.limit = blob, limit
        self.idle: queue.LifoQueue[Network] = queue.LifoQueue()
        self.made = 0
        self.lock = threading.Lock()

    def take(self) -> Network:
        try:
            return self.idle.get_nowait()
        except queue.Empty:
            pass
        with self.lock:
            index = self.made
            if index < self.limit:
                self.made += 1
        return pickle.loads(self.blob).to(device_for(index, self.limit)) if index < self.limit else self.idle.get()


_CACHE: OrderedDict[str, _Copies] = OrderedDict()
_CACHE_LOCK = threading.Lock()


@contextmanager
def borrow(key: str, blob: bytes, copies: int) -> Iterator[Network]:
    """One of this process's copies of the network pickled in ``blob`` (known by ``key``), for the
    duration of the block; waits while all ``copies`` are in use."""
    with _CACHE_LOCK:
        pool = _CACHE.get(key)
        if pool is None:
            pool = _CACHE[key] = _Copies(blob, copies)
        _CACHE.move_to_end(key)
        while len(_CACHE) > max(1, config.get("inference.cached-networks")):
            _CACHE.popitem(last=False)
    network = pool.take()
    try:
        yield network
    finally:
        pool.idle.put(network)


def copies_made() -> dict[str, int]:
    """How many copies of each network it holds this process has unpickled, by key."""
    with _CACHE_LOCK:
        return {key: pool.made for key, pool in _CACHE.items()}
