"""The data plane of parameter averaging on every worker: the ``dlscale_averaging_part`` handler that
puts a peer's part of a round's allreduce in the trainer's mailbox, the ``dlscale_averaging_result``
handler that hands a round's average to a peer that missed part of it, the sends to peers, and the
replica a trainer parks for the next fit (``dlscale.training._parking``; one session's at most).

Parts go over the workers' own TCP connections (``dlscale.training._sockets``: written and read by threads that wait in
the kernel, not by the event loops the trainers share the interpreter's lock with) where the workers
listen on ``tcp://`` and ``dlscale.training.transport`` is ``"tcp"``, the default; otherwise, and to a
peer without such a listener, on the worker's event loop through ``worker.rpc`` (Dask's pooled
connections, TLS included), the arrays as Dask-serialised frames. Either way one way: the peer sends no
reply, which would cost a message a part and tell nothing a round's end does not. A send is done
once its bytes are handed to the connection. The trainer does not
wait for them: a part that does not arrive shows as a round that does not complete, which the
trainer resolves with the scheduler (``_trainer``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize

from dlscale.runtime.retirement import retire_timeout
from dlscale.training._sockets import NoListener, Sockets, open_sockets
from dlscale.training.averaging._exchange import Mailbox

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger("dlscale.training.averaging")

NAME = "dlscale-averaging"


class AveragingWorkerPlugin(WorkerPlugin):
    """Adds the handlers to a worker and keeps its sessions' mailboxes and last averages."""

    name = NAME
    idempotent = True

    def __init__(self) -> None:
        self.mailboxes: dict[str, Mailbox] = {}
        self.results: dict[str, tuple[int, int, dict[str, Any], Any]] = {}  # session: (round, attempt, header, array)
        self.busy: set[str] = set()  # sessions whose trainer here is at work: a closing worker waits for it to leave
        self.parked: dict[str, Any] = {}  # session: the replica its trainer here left for the next fit
        self.in_flight: dict[str, int] = {}  # session: its sends not yet done (they read the trainer's buffers)
        self.sockets: Sockets | None = None

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        self._parking = threading.Lock()  # made here: the plugin is pickled to reach the worker
        self._counting = threading.Lock()
        worker.handlers["dlscale_averaging_part"] = self.part
        worker.handlers["dlscale_averaging_result"] = self.result
        self.sockets = open_sockets(worker, "averaging", lambda session: session in self.mailboxes, self._delivered)

    async def teardown(self, worker: Worker) -> None:
        """A worker closing lets its trainer leave its session at its round's end first (it sees the
        worker closing: see ``_trainer``), at most ``dlscale.worker.retire-timeout``."""
        deadline = time.monotonic() + retire_timeout()
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self.sockets is not None:
            self.sockets.close()

    def _delivered(self, session: str, sender: str, head: dict[str, Any], payload: Any) -> None:
        """A part read from this worker's own connections."""
        self.part(session, sender, head["key"], head["header"], payload)

    def part(self, session: str, sender: str, key: Any, header: dict[str, Any], payload: Any = None) -> None:
        """A peer's part of a round's allreduce; parts for a session not open here are dropped."""
        box = self.mailboxes.get(session)
        if box is not None:
            box.put((key[0], key[1], key[2]), sender, header, payload)

    def result(self, session: str, round: int) -> dict[str, Any] | None:
        """This worker's trainer's average of ``round``, if it still holds it."""
        kept = self.results.get(session)
        if kept is None or kept[0] != round:
            return None
        _, attempt, header, array = kept
        return {"attempt": attempt, "header": header, "payload": to_serialize(array)}

    def open(self, session: str) -> Mailbox:
        box = self.mailboxes[session] = Mailbox()
        return box

    def close(self, session: str) -> None:
        self.mailboxes.pop(session, None)
        self.results.pop(session, None)

    def park(self, session: str, network: Any | None) -> None:
        """Keep the replica that the trainer of ``session`` trained for the next fit (``None``: keep
        nothing); any other session's is forgotten."""
        with self._parking:
            self.parked = {} if network is None else {session: network}

    def unpark(self, session: str) -> Any | None:
        """The replica parked by ``session``'s trainer, taken away (``None`` if none is)."""
        with self._parking:
            return self.parked.pop(session, None)

    def forget(self, session: str) -> None:
        """Drop the replica parked by ``session``'s trainer."""
        with self._parking:
            self.parked.pop(session, None)

    def keep(self, session: str, round: int, attempt: int, header: dict[str, Any], array: Any) -> None:
        """Hold round ``round``'s average for peers that missed part of it (until the next round's)."""
        self.results[session] = (round, attempt, header, array)

    def send(self, session: str, peer: str, key: tuple[int, int, int], header: dict[str, Any], payload: Any) -> None:
        """Send a part to ``peer`` from any thread, without waiting (``payload`` is read until it is
        sent: see :meth:`sending`)."""
        with self._counting:
            self.in_flight[session] = self.in_flight.get(session, 0) + 1
        done = functools.partial(self._sent, session)
        if self.sockets is None:
            self.worker.loop.add_callback(self._send, session, peer, key, header, payload, done)
            return

        def written(error: BaseException | None) -> None:  # a peer without a listener: through Dask's comms
            if isinstance(error, NoListener):
                self.worker.loop.add_callback(self._send, session, peer, key, header, payload, done)
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
            await self.worker.rpc(peer).dlscale_averaging_part(
                session=session,
                sender=self.worker.address,
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


def plugin(worker: Worker) -> AveragingWorkerPlugin:
    found = worker.plugins.get(NAME)
    if found is None:
        raise RuntimeError(f"worker {worker.address} has no dlscale parameter-averaging plugin")
    return found
