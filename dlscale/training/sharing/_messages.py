"""The records gradient sharing's parts exchange, and their plain form on Dask's comms.

Messages travel as plain data (dicts of numbers, strings, bytes and lists, which msgpack carries);
each side turns them into these records at its edge, and :meth:`Record.from_plain` refuses one whose
fields are missing, extra or of the wrong type, naming the record and the field.

The scheduler's replies to a trainer carry a ``status``: ``"OK"`` with the record's fields, or the
reason its session has stopped for that trainer (a :class:`SessionStoppedError`'s ``reason``) with a
message; :func:`unwrap` raises the matching error. The replies to the driver (``open``, ``progress``,
``close``, ``fail``) are plain dicts read by the driver as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import msgpack
import numpy as np

from dlscale.training.sharing._exceptions import STOPPED, MalformedMessageError, SessionStoppedError

OK = "OK"


class Record:
    """A dataclass with a plain form: :meth:`to_plain` and the checking :meth:`from_plain`."""

    what: ClassVar[str]  # the record's name in errors

    def to_plain(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_plain(cls, plain: Any) -> Self:
        if not isinstance(plain, dict):
            raise MalformedMessageError(f"{cls.what}: expected a mapping of fields, got {type(plain).__name__}")
        types = _types(cls)
        if set(plain) != set(types):
            missing, extra = sorted(set(types) - set(plain)), sorted(map(str, set(plain) - set(types)))
            raise MalformedMessageError(f"{cls.what}: missing fields {missing}, unexpected fields {extra}")
        return cls(**{name: _typed(plain[name], kind, f"{cls.what}.{name}") for name, kind in types.items()})


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


def packed(plain: Any) -> bytes:
    """``plain`` as msgpack's bytes: a nested value that a hot message carries as one ``bytes`` field,
    which Dask's comms then size and frame at once (they walk a nested message in Python to decide
    whether to serialise it off the event loop, a large share of a small message's cost)."""
    return msgpack.packb(plain, use_bin_type=True)


def unpacked(data: bytes | bytearray) -> Any:
    """The value of :func:`packed`'s bytes as Dask's comms deliver a plain message (lists as tuples)."""
    return msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=False)


def ok(record: Record) -> dict[str, Any]:
    """A successful reply to a trainer, in plain form."""
    return {"status": OK, **record.to_plain()}


def refusal(error: SessionStoppedError) -> dict[str, Any]:
    """The reply telling a trainer that its session has stopped for it, in plain form."""
    return {"status": error.reason, "message": str(error)}


def unwrap(reply: Any) -> dict[str, Any]:
    """The fields of a successful reply; raises the :class:`SessionStoppedError` a refusal names."""
    if not isinstance(reply, dict) or "status" not in reply:
        raise MalformedMessageError(f"a reply from the scheduler without a status: {reply!r:.200}")
    status = reply["status"]
    if status == OK:
        return {k: v for k, v in reply.items() if k != "status"}
    if status in STOPPED:
        raise STOPPED[status](reply.get("message", status))
    raise MalformedMessageError(f"a reply from the scheduler with an unknown status {status!r}")


# -- checking plain data against a record's field types ---------------------------------------------


@functools.cache
def _types(cls: type[Record]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_plain()
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def _typed(value: Any, kind: Any, where: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if isinstance(kind, type) and issubclass(kind, Record):
        return kind.from_plain(value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _wrong(where, "a list", value)
        return tuple(_typed(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise _wrong(where, "a mapping", value)
        return {_typed(k, args[0], f"{where} key"): _typed(v, args[1], f"{where}[{k!r}]") for k, v in value.items()}
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong(where, "a number", value)
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _wrong(where, _NAMES[kind], value)
    return value


_NAMES = {int: "an integer", str: "a string", bytes: "bytes", bool: "a boolean"}


def _wrong(where: str, expected: str, value: Any) -> MalformedMessageError:
    return MalformedMessageError(f"{where}: expected {expected}, got {type(value).__name__} {value!r:.80}")
