"""The data plane of gradient sharing, on every worker: a ``dlscale_update`` handler that receives
encoded updates from peers, and per session a :class:`Node` holding its trainers' inboxes and its
links to the peers.

Handlers run on the worker's event loop and only enqueue: trainers decode and apply what their
inbox holds between steps, in their own thread. Sending goes through one link per peer, which sends
whatever is waiting for that peer in one call (so small updates are coalesced) and one call at a
time (so a peer receives each sender's updates in order). Updates waiting to be sent are bounded by
``dlscale.sharing.send-buffer``; a trainer that would exceed it waits for the network.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import dask.config
from dask.utils import parse_bytes
from distributed.diagnostics.plugin import WorkerPlugin

from dlscale.training.sharing import _mesh

if TYPE_CHECKING:
    from distributed import Worker
    from distributed.core import ConnectionPool

logger = logging.getLogger("dlscale.training.sharing")

NAME = "dlscale-sharing"
Message = tuple[str, int, bytes]  # (origin trainer, sequence number, encoded update)


@dataclass
class _Link:
    peer: str
    queue: collections.deque[Message] = field(default_factory=collections.deque)
    running: bool = False
    dead: bool = False


class Node:
    """One worker's part in one gradient-sharing session.

    ``inboxes[i]`` receives, for local trainer ``i``, every update of every other trainer.
    """

    def __init__(
        self,
        session: str,
        address: str,
        rpc: ConnectionPool,
        loop: Any,
        trainers: int,
        mode: str,
        fanout: int | None = None,
        buffer_bytes: int | None = None,
        coalesce_bytes: int | None = None,
    ) -> None:
        self.session, self.address, self.rpc, self.loop = session, address, rpc, loop
        self.mode = mode
        self.fanout = fanout or dask.config.get("dlscale.sharing.mesh-fanout")
        self.buffer_bytes = buffer_bytes or parse_bytes(dask.config.get("dlscale.sharing.send-buffer"))
        self.coalesce_bytes = coalesce_bytes or parse_bytes(dask.config.get("dlscale.sharing.coalesce"))
        self.inboxes: list[collections.deque[Message]] = [collections.deque() for _ in range(trainers)]
        self.nodes: list[str] = [address]
        self.version = -1
        self.closed = False
        self._seen: dict[str, _mesh.Seen] = collections.defaultdict(_mesh.Seen)  # event loop only
        self._links: dict[str, _Link] = {}
        self._buffered = 0
        self._space = threading.Condition()

    # -- called from trainer threads ----------------------------------------------------------
    def set_nodes(self, version: int, nodes: list[str]) -> None:
        """Adopt the membership of ``version`` (newer versions only)."""
        if version > self.version:
            self.version = version
            self.loop.add_callback(self._set_nodes, version, list(nodes))

    def send(self, origin: str, seq: int, payload: bytes, local: int) -> float:
        """Deliver an update of local trainer ``local`` to the other local trainers and queue it for the
        peers; returns the seconds spent waiting for room in the send buffer."""
        item = (origin, seq, payload)
        for j, box in enumerate(self.inboxes):
            if j != local:
                box.append(item)
        waited = 0.0
        with self._space:
            if self._buffered > self.buffer_bytes:
                t0 = time.perf_counter()
                while self._buffered > self.buffer_bytes and not self.closed:
                    self._space.wait(0.1)
                waited = time.perf_counter() - t0
            self._buffered += len(payload)  # held until the loop has queued it
        self.loop.add_callback(self._route, item, None)
        return waited

    def close(self) -> None:
        self.closed = True
        with self._space:
            self._space.notify_all()

    # -- on the event loop --------------------------------------------------------------------
    def _set_nodes(self, version: int, nodes: list[str]) -> None:
        self.nodes = nodes
        for peer, link in list(self._links.items()):
            if peer not in nodes:
                self._drop(link)

    def _route(self, item: Message, came_from: str | None) -> None:
        origin, seq, payload = item
        if came_from is None:
            self._seen[origin].add(seq)
            self._release(len(payload))
        for peer in _mesh.targets(self.nodes, self.address, self.mode, self.fanout, came_from):
            link = self._links.get(peer)
            if link is None:
                link = self._links[peer] = _Link(peer)
            if link.dead or self.closed:
                continue
            link.queue.append(item)
            self._hold(len(payload))
            if not link.running:
                link.running = True
                asyncio.ensure_future(self._drain(link))

    async def _drain(self, link: _Link) -> None:
        try:
            while link.queue and not link.dead and not self.closed:
                batch, size = [], 0
                while link.queue and (not batch or size + len(link.queue[0][2]) <= self.coalesce_bytes):
                    batch.append(link.queue.popleft())
                    size += len(batch[-1][2])
                try:
                    await self.rpc(link.peer).dlscale_update(session=self.session, sender=self.address, messages=batch)
                except Exception as e:  # noqa: BLE001 - any failure to reach a peer drops it
                    if not self.closed:
                        logger.warning(
                            "gradient sharing session %s: %s cannot reach peer %s (%s: %s); it is dropped",
                            self.session,
                            self.address,
                            link.peer,
                            type(e).__name__,
                            e,
                        )
                    self._drop(link)
                finally:
                    self._release(size)
        finally:
            link.running = False

    def _drop(self, link: _Link) -> None:
        link.dead = True
        self._release(sum(len(m[2]) for m in link.queue))
        link.queue.clear()

    def receive(self, sender: str, messages: list[Any]) -> None:
        """Updates from ``sender``: each new one goes to every local trainer (and, in a mesh, on to
        the neighbours it did not come from)."""
        for origin, seq, payload in messages:
            if self.closed or not self._seen[origin].add(seq):
                continue
            item = (origin, seq, payload)
            for box in self.inboxes:
                box.append(item)
            if self.mode == "mesh":
                self._route(item, sender)

    def _hold(self, n: int) -> None:
        with self._space:
            self._buffered += n

    def _release(self, n: int) -> None:
        with self._space:
            self._buffered -= n
            self._space.notify_all()


class SharingWorkerPlugin(WorkerPlugin):
    """Adds the ``dlscale_update`` handler to a worker and keeps its sessions' nodes."""

    name = NAME
    idempotent = True

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        worker.handlers["dlscale_update"] = self.update

    def teardown(self, worker: Worker) -> None:
        for node in self.nodes.values():
            node.close()
        self.nodes.clear()

    def update(self, session: str, sender: str, messages: list[Any]) -> None:
        node = self.nodes.get(session)
        if node is not None:  # updates for a session that has ended are dropped
            node.receive(sender, messages)

    def open(self, session: str, trainers: int, mode: str) -> Node:
        node = self.nodes[session] = Node(
            session, self.worker.address, self.worker.rpc, self.worker.loop, trainers, mode
        )
        return node

    def close(self, session: str) -> None:
        node = self.nodes.pop(session, None)
        if node is not None:
            node.close()


def plugin(worker: Worker) -> SharingWorkerPlugin:
    found = worker.plugins.get(NAME)
    if found is None:
        raise RuntimeError(f"worker {worker.address} has no dlscale gradient-sharing plugin")
    return found
