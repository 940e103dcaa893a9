"""The data plane of parameter averaging on every worker: the ``dlscale_averaging_part`` handler that
puts a peer's part of a round's allreduce in the trainer's mailbox, the ``dlscale_averaging_result``
handler that hands a round's average to a peer that missed part of it, the sends to peers (``_comms``),
and the replica a trainer parks for the next fit (``dlscale.training._parking``; one session's at most).

Parts come over the workers' own TCP connections (``dlscale.training._sockets``) where the workers
listen on ``tcp://`` and ``dlscale.training.transport`` is ``"tcp"``, the default; otherwise through
Dask's comms (TLS included), to the ``dlscale_averaging_part`` handler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distributed.protocol import to_serialize

from dlscale.nn import shipping
from dlscale.training._plugins import SessionWorkerPlugin
from dlscale.training.averaging._comms import Outbox
from dlscale.training.averaging._exchange import Mailbox

if TYPE_CHECKING:
    from distributed import Worker

NAME = "dlscale-averaging"
SNAPSHOTS = 4  # the averaged states a worker keeps for checkpoints, at most, a session (a round ending an epoch)


class AveragingWorkerPlugin(SessionWorkerPlugin):
    """Adds the handlers to a worker and keeps its sessions' mailboxes and last averages."""

    name = NAME
    prefix = "averaging"
    approach = "parameter-averaging"
    handlers = {"dlscale_averaging_part": "part", "dlscale_averaging_result": "result"}

    def __init__(self) -> None:
        super().__init__()
        self.mailboxes: dict[str, Mailbox] = {}
        self.results: dict[str, tuple[int, int, dict[str, Any], Any]] = {}  # session: (round, attempt, header, array)
        self.snapshots: dict[str, dict[int, dict[str, Any]]] = {}  # session: round: its averaged state
        self.comms: Outbox | None = None

    def setup(self, worker: Worker) -> None:
        super().setup(worker)
        self.comms = Outbox(worker.address, worker.rpc, worker.loop, self.sockets)

    def is_open(self, session: str) -> bool:
        return session in self.mailboxes

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
        self.snapshots.pop(session, None)

    def park(self, session: str, network: Any | None) -> None:
        """Keep the replica that the trainer of ``session`` trained for the next fit (``None``: keep
        nothing); any other session's is forgotten."""
        with self._parking:
            self.parked = {} if network is None else {session: network}

    def serialised(self, session: str) -> bytes:
        """The replica ``session``'s trainer parked here (the state its fit ended with, as every trainer
        of the fit), pickled without its optimizer; a ``LookupError`` where it is not parked (any
        more: a fit took it back)."""
        with self._parking:  # not while a fit takes it back and trains it
            network = self.parked.get(session)
            if network is None:
                raise LookupError(f"no replica of session {session} is parked on this worker")
            return shipping.serialise(network, with_optimizer=False)

    def unpark(self, session: str) -> Any | None:
        """The replica parked by ``session``'s trainer, taken away (``None`` if none is)."""
        with self._parking:
            return self.parked.pop(session, None)

    def keep(self, session: str, round: int, attempt: int, header: dict[str, Any], array: Any) -> None:
        """Hold round ``round``'s average for peers that missed part of it (until the next round's)."""
        self.results[session] = (round, attempt, header, array)

    def snapshot(self, session: str, round: int, state: dict[str, Any]) -> None:
        """Keep round ``round``'s averaged state (a CPU copy) until the driver takes it for a checkpoint;
        the :data:`SNAPSHOTS` latest at most (a driver that lags that far stops the session instead)."""
        kept = self.snapshots.setdefault(session, {})
        kept[round] = state
        for old in sorted(kept)[:-SNAPSHOTS]:
            kept.pop(old, None)

    def take_snapshot(self, session: str, round: int) -> dict[str, Any] | None:
        """Round ``round``'s averaged state, taken away (``None`` if it is not held), with any older."""
        kept = self.snapshots.get(session, {})
        for old in [r for r in list(kept) if r < round]:
            kept.pop(old, None)
        return kept.pop(round, None)

    def send(self, session: str, peer: str, key: tuple[int, int, int], header: dict[str, Any], payload: Any) -> None:
        """Send a part to ``peer`` from any thread, without waiting (see :meth:`Outbox.send`)."""
        self.comms.send(session, peer, key, header, payload)

    def sending(self, session: str) -> bool:
        """Whether a part of ``session`` is still being sent (its payload is still read)."""
        return self.comms.sending(session)


def plugin(worker: Worker) -> AveragingWorkerPlugin:
    return AveragingWorkerPlugin.on(worker)
