"""The send side of parameter averaging on a worker: its trainers' parts of a round's allreduce to their
peers, from any thread, without waiting.

Parts go over the workers' own TCP connections (``dlscale.training._sockets``: written and read by
threads that wait in the kernel, not by the event loops the trainers share the interpreter's lock with)
where the workers listen on ``tcp://`` and ``dlscale.training.transport`` is ``"tcp"``, the default;
otherwise, and to a peer without such a listener, on the worker's event loop through ``worker.rpc``
(Dask's pooled connections, TLS included), the arrays as Dask-serialised frames. Either way one way: the
peer sends no reply, which would cost a message a part and tell nothing a round's end does not. A send
is done once its bytes are handed to the connection. The trainer does not wait for them: a part that
does not arrive shows as a round that does not complete, which the trainer resolves with the scheduler
(``_trainer``). A part's array is read until it is sent, so the sends in flight are counted by session
(:meth:`Outbox.sending`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distributed.protocol import to_serialize

from dlscale.training._sockets import NoListener, Sockets

if TYPE_CHECKING:
    from distributed.core import ConnectionPool

logger = logging.getLogger("dlscale.training.averaging")


class Outbox:
    """The parts the worker at ``address`` sends its peers: over its own connections (``sockets``) where
    it has them, else through Dask's comms (``rpc``) on its event loop ``loop``; the counterpart of the
    trainers' :class:`~dlscale.training.averaging._exchange.Mailbox`."""

    def __init__(self, address: str, rpc: ConnectionPool, loop: Any, sockets: Sockets | None = None) -> None:
        self.address, self.rpc, self.loop, self.sockets = address, rpc, loop, sockets
        self.in_flight: dict[str, int] = {}  # session: its sends not yet done (they read the trainer's buffers)
        self._counting = threading.Lock()

    def send(self, session: str, peer: str, key: tuple[int, int, int], header: dict[str, Any], payload: Any) -> None:
        """Send a part to ``peer`` from any thread, without waiting (``payload`` is read until it is
        sent: see :meth:`sending`)."""
        with self._counting:
            self.in_flight[session] = self.in_flight.get(session, 0) + 1
        done = functools.partial(self._sent, session)
        if self.sockets is None:
            self.loop.add_callback(self._send, session, peer, key, header, payload, done)
            return

        def written(error: BaseException | None) -> None:  # a peer without a listener: through Dask's comms
            if isinstance(error, NoListener):
                self.loop.add_callback(self._send, session, peer, key, header, payload, done)
            else:
                done(error)

        self.sockets.send(session, peer, {"key": list(key), "header": header}, payload, written)

    def _sent(self, session: str, error: BaseException | None = None) -> None:
        """A send of ``session`` done; one that failed is a part lost in flight (``_trainer``)."""
        with self._counting:
            left = self.in_flight.pop(session) - 1
            if left:
                self.in_flight[session] = left

    def sending(self, session: str) -> bool:
        """Whether a part of ``session`` is still being sent."""
        with self._counting:
            return self.in_flight.get(session, 0) > 0

    async def _send(
        self,
        session: str,
        peer: str,
        key: tuple[int, int, int],
        header: dict[str, Any],
        payload: Any,
        done: Callable[[BaseException | None], None],
    ) -> None:
        """Send a part through Dask's comms, on the worker's event loop; ``done`` once it is sent."""
        error = None
        try:
            await self.rpc(peer).dlscale_averaging_part(
                session=session,
                sender=self.address,
                key=list(key),
                header=header,
                payload=None if payload is None else to_serialize(payload),
                reply=False,
            )
        except Exception as e:  # noqa: BLE001 - a peer lost: the round goes on without it
            error = e
            logger.debug(
                "parameter averaging session %s: a part for %s was not delivered (%s: %s)",
                session,
                peer,
                type(e).__name__,
                e,
            )
        finally:
            done(error)
