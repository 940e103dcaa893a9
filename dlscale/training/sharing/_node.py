"""One worker's part in one gradient-sharing session: a :class:`Node` holding its trainers' inboxes,
the membership it routes by, and its links to the peers.

Received updates only enqueue (from the thread that read them off the worker's own connection to
their sender, or from the event loop through Dask's comms): trainers decode and apply what their
inbox holds between steps, in their own threads. A trainer's own update goes straight to the
worker's other trainers and, through the event loop, to the peers the mode routes it to (``_mesh``);
in a mesh, received updates are passed on too, and duplicates (after a change of tree, or a retried
send) are recognised by their origin's sequence number. Encoded bytes waiting to be sent are bounded by the session's
``send_buffer``: a trainer whose update would exceed it waits for the network.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any

from dlscale.training._config import SessionConfig
from dlscale.training.sharing import _mesh
from dlscale.training.sharing._comms import PeerLinks
from dlscale.training.sharing._limiter import ResourceLimiter
from dlscale.training.sharing._messages import Update

if TYPE_CHECKING:
    from distributed.core import ConnectionPool

    from dlscale.training._sockets import Sockets


class Node:
    """One worker's part in ``session``: ``inboxes[i]`` receives, for local trainer ``i``, every update
    of every other trainer of the session.

    :meth:`set_nodes` and :meth:`send` are called from trainer threads; :meth:`receive` from a thread
    reading the worker's own connections (``sockets``, where the worker has them) or on the worker's
    event loop ``loop``, as is :meth:`close`.
    """

    def __init__(
        self,
        session: str,
        address: str,
        rpc: ConnectionPool,
        loop: Any,
        trainers: int,
        mode: str,
        config: SessionConfig,
        sockets: Sockets | None = None,
    ) -> None:
        self.session, self.address, self.loop, self.mode, self.config = session, address, loop, mode, config
        self.limiter = ResourceLimiter(config.send_buffer)
        self.comms = PeerLinks(session, address, rpc, self.limiter, config, sockets)
        self.inboxes: list[collections.deque[Update]] = [collections.deque() for _ in range(trainers)]
        self.nodes: list[str] = [address]
        self.version = -1
        self.closed = False
        self.busy: set[int] = set()  # local trainers at work: a worker that closes waits for them to leave
        self._seen: dict[str, _mesh.Seen] = collections.defaultdict(_mesh.Seen)
        self._seeing = threading.Lock()  # _seen: updates are received on reading threads and the loop

    # -- called from trainer threads ----------------------------------------------------------
    def set_nodes(self, version: int, nodes: list[str] | tuple[str, ...]) -> None:
        """Adopt the membership of ``version`` (newer versions only)."""
        if version > self.version:
            self.version = version
            self.loop.add_callback(self._set_nodes, list(nodes))

    def send(self, update: Update, local: int) -> float:
        """Deliver an update of local trainer ``local`` to the other local trainers and queue it for the
        peers; returns the seconds spent waiting for room in the send buffer."""
        for j, box in enumerate(self.inboxes):
            if j != local:
                box.append(update)
        waited = self.limiter.acquire(len(update.payload))  # held until the loop has queued it
        self.loop.add_callback(self._route, update, None)
        return waited

    def drained(self, timeout: float) -> bool:
        """Wait until every update queued here has been sent (or dropped with its peer), at most
        ``timeout`` seconds; whether it was."""
        deadline = time.monotonic() + timeout
        while not self.limiter.empty and not self.closed:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def receive(self, sender: str, updates: list[Update]) -> None:
        """Updates from ``sender``: each new one goes to every local trainer (and, in a mesh, on to
        the neighbours it did not come from, from the event loop)."""
        fresh = []
        with self._seeing:
            for update in updates:
                if self.closed or not self._seen[update.origin].add(update.seq):
                    continue
                for box in self.inboxes:
                    box.append(update)
                fresh.append(update)
        if self.mode == "mesh" and fresh:
            self.loop.add_callback(self._relay, fresh, sender)

    # -- on the event loop --------------------------------------------------------------------
    def close(self) -> None:
        """End the session here: waiting trainers go on, nothing more is sent or received."""
        self.closed = True
        self.limiter.close()
        self.comms.close()

    def _set_nodes(self, nodes: list[str]) -> None:
        self.nodes = nodes
        for peer in list(self.comms.links):
            if peer not in nodes:
                self.comms.drop(peer)

    def _relay(self, updates: list[Update], came_from: str) -> None:
        for update in updates:
            self._route(update, came_from)

    def _route(self, update: Update, came_from: str | None) -> None:
        for peer in _mesh.targets(self.nodes, self.address, self.mode, self.config.mesh_fanout, came_from):
            self.comms.put(peer, update)
        if came_from is None:  # a local trainer's update: the links hold its bytes now
            with self._seeing:
                self._seen[update.origin].add(update.seq)
            self.limiter.release(len(update.payload))
