"""The records gradient sharing's parts exchange (``dlscale.training._messages`` gives them their plain
form): a trainer's encoded updates, its acknowledgements, the session's view and a hand-out of work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dlscale.training._errors import MalformedMessageError
from dlscale.training._messages import Record


@dataclass(frozen=True)
class Update(Record):
    """One encoded update of trainer ``origin``, its ``seq``-th (the data plane's message); with
    ``residual``, the whole residual of a trainer leaving its session, in the "dense" compressor's form."""

    what: ClassVar[str] = "update"
    origin: str
    seq: int
    payload: bytes
    residual: bool = False


@dataclass(frozen=True)
class Ack(Record):
    """A trainer's acknowledgement of a fitted work item, with what the panel shows of its step."""

    what: ClassVar[str] = "acknowledgement"
    item: int
    examples: int
    score: float
    threshold: float
    sparsity: float
    bytes_sent: int


@dataclass(frozen=True)
class View(Record):
    """The session as a trainer sees it in every reply: whether every work item is acknowledged, the
    membership (its ``version`` grows with every loss or departure; ``nodes`` are the workers of the
    ``alive`` trainers) and how many updates each trainer sent that has finished, alive or gone on
    purpose (retired: its peers wait for its last updates as for a finished trainer's)."""

    what: ClassVar[str] = "session view"
    done: bool
    version: int
    nodes: tuple[str, ...]
    alive: tuple[str, ...]
    finished: dict[str, int]


@dataclass(frozen=True)
class Handout(Record):
    """The reply to a trainer's request for work: up to the items it wanted, and the session's view."""

    what: ClassVar[str] = "handout"
    items: tuple[int, ...]
    view: View


def framed(updates: list[Update]) -> tuple[dict[str, Any], np.ndarray]:
    """``updates`` as one message on the workers' own connections: a head of their fields and sizes,
    and their payloads one after the other (``dlscale.training._sockets``)."""
    head = {"updates": [[u.origin, u.seq, u.residual, len(u.payload)] for u in updates]}
    data = updates[0].payload if len(updates) == 1 else b"".join(u.payload for u in updates)
    return head, np.frombuffer(data, np.uint8)


def unframed(head: Any, payload: np.ndarray | None) -> list[Update]:
    """The updates of a message :func:`framed` made, checked as :meth:`Record.from_plain` checks them
    (and their sizes against the payload's)."""
    fields = head.get("updates") if isinstance(head, dict) else None
    if not isinstance(fields, list | tuple) or not all(isinstance(f, list | tuple) and len(f) == 4 for f in fields):
        raise MalformedMessageError(f"updates: expected a list of [origin, seq, residual, size], got {head!r:.200}")
    data = b"" if payload is None else payload.tobytes()
    sizes = [size for *_, size in fields]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes) or sum(sizes) != len(data):
        raise MalformedMessageError(f"updates: sizes {sizes!r:.200} do not add up to the {len(data)} bytes sent")
    updates, at = [], 0
    for origin, seq, residual, size in fields:
        plain = {"origin": origin, "seq": seq, "payload": data[at : at + size], "residual": residual}
        updates.append(Update.from_plain(plain))
        at += size
    return updates
