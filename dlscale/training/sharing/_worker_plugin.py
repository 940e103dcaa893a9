"""The data plane of gradient sharing on every worker: the worker's own connections for encoded
updates (``dlscale.training._sockets``, where the worker listens on ``tcp://`` and
``dlscale.training.transport`` is ``"tcp"``, the default) and the ``dlscale_update`` handler that
receives them through Dask's comms otherwise (TLS included), the session's
:class:`~dlscale.training.sharing._core.Node` they are handed to (see ``_core`` for the node,
``_comms`` for sending); and the trainers kept between fits.

A trainer that ends its fit *parks* what it trains with (its replica of the network, the shared
parameters and its compressor's state, residual included) under its session; the driver's next fit
of the same network, unchanged since, takes them back instead of sending the network again, and so
goes on as one fit of several epochs would. A worker parks the trainers of one session at most:
parking another's forgets the older ones."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import WorkerPlugin

from dlscale.runtime.retirement import retire_timeout
from dlscale.training._config import SessionConfig
from dlscale.training._errors import MalformedMessageError
from dlscale.training._sockets import Sockets, open_sockets
from dlscale.training.sharing._core import Node
from dlscale.training.sharing._messages import Update, unframed

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger("dlscale.training.sharing")

NAME = "dlscale-sharing"


class SharingWorkerPlugin(WorkerPlugin):
    """Adds the ``dlscale_update`` handler to a worker and keeps its sessions' nodes."""

    name = NAME
    idempotent = True

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.parked: dict[str, dict[int, Any]] = {}  # session: {local trainer: what it parked}
        self.sockets: Sockets | None = None

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        self._parking = threading.Lock()  # made here: the plugin is pickled to reach the worker
        worker.handlers["dlscale_update"] = self.update
        self.sockets = open_sockets(worker, "sharing", lambda session: session in self.nodes, self._delivered)

    async def teardown(self, worker: Worker) -> None:
        """A worker closing lets its trainers leave their sessions first (they see it closing: see
        ``_trainer``), at most ``dlscale.worker.retire-timeout``; then its nodes end."""
        deadline = time.monotonic() + retire_timeout()
        while any(node.busy for node in self.nodes.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for node in self.nodes.values():
            node.close()
        self.nodes.clear()
        if self.sockets is not None:
            self.sockets.close()

    def update(self, session: str, sender: str, messages: list[Any]) -> None:
        """Updates from ``sender``, in plain form; a malformed one is refused (the sender drops this
        worker) and updates for a session that has ended are dropped."""
        node = self.nodes.get(session)
        if node is not None:
            node.receive(sender, [Update.from_plain(m) for m in messages])

    def _delivered(self, session: str, sender: str, head: dict[str, Any], payload: Any) -> None:
        """Updates read off this worker's own connections; a malformed message is dropped, with a warning."""
        node = self.nodes.get(session)
        if node is None:
            return
        try:
            updates = unframed(head, payload)
        except MalformedMessageError as e:
            logger.warning("gradient sharing session %s: updates from %s refused: %s", session, sender, e)
            return
        node.receive(sender, updates)

    def open(self, session: str, trainers: int, mode: str, config: SessionConfig) -> Node:
        """Start this worker's part in ``session`` for ``trainers`` local trainers, with the
        session's ``dlscale.training`` settings (read on the driver)."""
        node = self.nodes[session] = Node(
            session, self.worker.address, self.worker.rpc, self.worker.loop, trainers, mode, config, self.sockets
        )
        return node

    def close(self, session: str) -> None:
        node = self.nodes.pop(session, None)
        if node is not None:
            node.close()

    def park(self, session: str, local: int, kept: Any) -> None:
        """Keep what local trainer ``local`` of ``session`` trains with, for the next fit; the trainers of
        any other session are forgotten."""
        with self._parking:
            for other in [s for s in self.parked if s != session]:
                del self.parked[other]
            self.parked.setdefault(session, {})[local] = kept

    def unpark(self, session: str, local: int) -> Any | None:
        """What local trainer ``local`` of ``session`` parked, taken away (``None`` if nothing is)."""
        with self._parking:
            return self.parked.get(session, {}).pop(local, None)

    def parked_trainers(self, session: str) -> list[int]:
        """The local trainers of ``session`` parked here."""
        with self._parking:
            return sorted(self.parked.get(session, {}))

    def forget(self, session: str) -> None:
        """Drop what the trainers of ``session`` parked here."""
        with self._parking:
            self.parked.pop(session, None)


def plugin(worker: Worker) -> SharingWorkerPlugin:
    found = worker.plugins.get(NAME)
    if found is None:
        raise RuntimeError(f"worker {worker.address} has no dlscale gradient-sharing plugin")
    return found
