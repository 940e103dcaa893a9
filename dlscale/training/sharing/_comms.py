"""The send side of a node: one link per peer, after ``distributed.shuffle``'s comm buffer.

A link sends whatever is waiting for its peer in one call, up to ``coalesce`` bytes (so small
updates are coalesced), and one call at a time (so a peer receives each sender's updates in order):
over the worker's own connection to the peer where it has one (``dlscale.training._sockets``, whose
threads write and read the bytes while the trainers step, without the event loops), otherwise
through ``worker.rpc(peer).dlscale_update`` (Dask's pooled connections, TLS included). A call that
fails with a connection error is retried ``send-retries`` times, after ``send-retry-delay`` doubling
each time; a peer that still cannot be reached, or whose handler raised, is dropped. A retry can
deliver an update twice (the first call may have arrived before its connection broke): receivers
recognise it by its sequence number. Queued bytes are held in the node's limiter until sent or
dropped. Everything here runs on the worker's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dlscale.training._config import SessionConfig
from dlscale.training._sockets import NoListener
from dlscale.training.sharing._limiter import ResourceLimiter
from dlscale.training.sharing._messages import Update, framed

if TYPE_CHECKING:
    from distributed.core import ConnectionPool

    from dlscale.training._sockets import Sockets

logger = logging.getLogger("dlscale.training.sharing")


@dataclass
class Link:
    """The updates waiting for one peer; ``running`` while a drain is sending them, ``call`` the call to the
    peer under way (cancelled when the peer is dropped: a connection attempt to a lost worker would
    otherwise wait for Dask's connect timeout)."""

    peer: str
    queue: collections.deque[Update] = field(default_factory=collections.deque)
    running: bool = False
    dead: bool = False
    call: asyncio.Future | None = None


class PeerLinks:
    """The links of one node of ``session`` at ``address`` to its peers, over ``sockets`` where the
    worker has them (else Dask's comms, ``rpc``)."""

    def __init__(
        self,
        session: str,
        address: str,
        rpc: ConnectionPool,
        limiter: ResourceLimiter,
        config: SessionConfig,
        sockets: Sockets | None = None,
    ) -> None:
        self.session, self.address, self.rpc, self.sockets = session, address, rpc, sockets
        self.limiter, self.config = limiter, config
        self.links: dict[str, Link] = {}
        self.closed = False

    def put(self, peer: str, update: Update) -> None:
        """Queue ``update`` for ``peer`` (unless the peer was dropped), holding its bytes until sent."""
        link = self.links.get(peer)
        if link is None:
            link = self.links[peer] = Link(peer)
        if link.dead or self.closed:
            return
        link.queue.append(update)
        self.limiter.acquire_nowait(len(update.payload))
        if not link.running:
            link.running = True
            asyncio.ensure_future(self._drain(link))

    def drop(self, peer: str) -> None:
        """Send nothing more to ``peer``; what was waiting for it is discarded."""
        link = self.links.get(peer)
        if link is None:
            return
        link.dead = True
        self.limiter.release(sum(len(u.payload) for u in link.queue))
        link.queue.clear()
        if link.call is not None:
            link.call.cancel()

    def close(self) -> None:
        self.closed = True
        for peer in list(self.links):
            self.drop(peer)

    async def _drain(self, link: Link) -> None:
        try:
            while link.queue and not link.dead and not self.closed:
                batch, size = [], 0
                while link.queue and (not batch or size + len(link.queue[0].payload) <= self.config.coalesce):
                    batch.append(link.queue.popleft())
                    size += len(batch[-1].payload)
                try:
                    await self._send(link, batch)
                except asyncio.CancelledError:
                    if not link.dead:  # not a dropped peer's call: the loop itself is stopping
                        raise
                except Exception as e:  # noqa: BLE001 - a peer that cannot be reached is dropped
                    if not self.closed:
                        logger.warning(
                            "gradient sharing session %s: %s cannot reach peer %s (%s: %s); it is dropped",
                            self.session,
                            self.address,
                            link.peer,
                            type(e).__name__,
                            e,
                        )
                    self.drop(link.peer)
                finally:
                    self.limiter.release(size)
        finally:
            link.running = False

    async def _send(self, link: Link, batch: list[Update]) -> None:
        """One call to ``link.peer``, retried after connection errors (``CommClosedError`` is one); the
        peer's own errors are not retried."""
        for attempt in itertools.count():
            if link.dead or self.closed:  # dropped while waiting to retry: the batch goes with it
                return
            link.call = asyncio.ensure_future(self._call(link.peer, batch))
            try:
                await link.call
                return
            except OSError as e:
                if attempt >= self.config.send_retries or link.dead or self.closed:
                    raise
                delay = self.config.send_retry_delay * 2**attempt
                logger.info(
                    "gradient sharing session %s: sending to %s failed (%s: %s); retry %d of %d in %.3g s",
                    self.session,
                    link.peer,
                    type(e).__name__,
                    e,
                    attempt + 1,
                    self.config.send_retries,
                    delay,
                )
                await asyncio.sleep(delay)
            finally:
                link.call = None

    async def _call(self, peer: str, batch: list[Update]) -> None:
        """Send ``batch`` to ``peer`` once: done when its bytes are handed to the worker's own connection,
        or, through Dask's comms (a worker without the connections, a peer without a listener), when the
        peer has replied."""
        if self.sockets is not None:
            loop = asyncio.get_running_loop()
            written = loop.create_future()

            def done(error: BaseException | None) -> None:  # from the writing thread
                with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                    loop.call_soon_threadsafe(_settle, written, error)

            head, payload = framed(batch)
            self.sockets.send(self.session, peer, head, payload, done)
            try:
                await written
                return
            except NoListener:
                pass
        messages = [u.to_plain() for u in batch]
        await self.rpc(peer).dlscale_update(session=self.session, sender=self.address, messages=messages)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # cancelled: its peer was dropped
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
