"""The plain form of every master's session protocol on Dask's comms: records, replies and packing.

Messages travel as plain data (dicts of numbers, strings, bytes and lists, which msgpack carries);
each side turns them into records at its edge, and :meth:`Record.from_plain` refuses one whose
fields are missing, extra or of the wrong type, naming the record and the field.

The scheduler's replies to a trainer carry a ``status``: ``"OK"`` with the reply's fields, or the
reason its session has stopped for that trainer (a :class:`SessionStoppedError`'s ``reason``) with a
message; :func:`unwrap` raises the matching error. The replies to the driver are plain dicts read by
the driver as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, ClassVar, Self

import msgpack

from dlscale.training._errors import STOPPED, MalformedMessageError, SessionStoppedError

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
