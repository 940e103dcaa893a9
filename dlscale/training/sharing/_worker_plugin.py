"""The data plane of gradient sharing on every worker: the worker's own connections for encoded
updates (``dlscale.training._sockets``, where the worker listens on ``tcp://`` and
``dlscale.training.transport`` is ``"tcp"``, the default) and the ``dlscale_update`` handler that
receives them through Dask's comms otherwise (TLS included), the session's
:class:`~dlscale.training.sharing._node.Node` they are handed to (see ``_node`` for the node,
``_comms`` for sending); and the trainers kept between fits.

A trainer that ends its fit *parks* what it trains with (its replica of the network, the shared
parameters and its compressor's state, residual included) under its session; the driver's next fit
of the same network, unchanged since, takes them back instead of sending the network again, and so
goes on as one fit of several epochs would. A worker parks the trainers of one session at most:
parking another's forgets the older ones."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dlscale.training._config import SessionConfig
from dlscale.training._errors import MalformedMessageError
from dlscale.training._plugins import SessionWorkerPlugin
from dlscale.training.sharing._messages import Update, unframed
from dlscale.training.sharing._node import Node

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger("dlscale.training.sharing")

NAME = "dlscale-sharing"


class SharingWorkerPlugin(SessionWorkerPlugin):
    """Adds the ``dlscale_update`` handler to a worker and keeps its sessions' nodes."""

    name = NAME
    prefix = "sharing"
    approach = "gradient-sharing"
    handlers = {"dlscale_update": "update"}

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, Node] = {}
        self.parked: dict[str, dict[int, Any]] = {}  # session: {local trainer: what it parked}

    def is_open(self, session: str) -> bool:
        return session in self.nodes

    def at_work(self) -> bool:
        return any(node.busy for node in self.nodes.values())

    def end(self) -> None:
        for node in self.nodes.values():
            node.close()
        self.nodes.clear()

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
            self._park_alone(session)
            self.parked.setdefault(session, {})[local] = kept

    def unpark(self, session: str, local: int) -> Any | None:
        """What local trainer ``local`` of ``session`` parked, taken away (``None`` if nothing is)."""
        with self._parking:
            return self.parked.get(session, {}).pop(local, None)

    def _trainers(self, parked: dict[int, Any]) -> list[int]:
        return sorted(parked)


def plugin(worker: Worker) -> SharingWorkerPlugin:
    return SharingWorkerPlugin.on(worker)
