"""Pickle files that load without running arbitrary code.

:class:`SafePickler` writes torch tensors, numpy arrays and numpy scalars as raw bytes with
dtype and shape. A numpy dtype is written as plain data (:func:`dtype_spec`): its dtype string, or
for a structured dtype its field names, field dtypes (nested and shaped fields included), offsets
and item size, which the reader checks field by field before numpy sees it.
:class:`SafeUnpickler` resolves only an allow-list of globals (built-in containers and scalars, a
few standard-library value types, and the rebuild functions below), plus classes the caller names,
so a crafted file raises :class:`UnsafePickleError` instead of executing anything.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from collections.abc import Iterable
from typing import Any

import numpy as np

from dlscale.errors import UnsafePickleError

# torch is imported inside the functions that handle tensors: it takes seconds to import, and the
# facade needs it only when a pickle file is written or holds tensors.

_ALLOWED = {
    ("builtins", n)
    for n in (
        "set",
        "frozenset",
        "complex",
        "bytearray",
        "slice",
        "range",
        "list",
        "dict",
        "tuple",
        "int",
        "float",
        "str",
        "bytes",
        "bool",
        "object",
    )
} | {
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("collections", "deque"),
    ("collections", "Counter"),
    ("datetime", "date"),
    ("datetime", "datetime"),
    ("datetime", "time"),
    ("datetime", "timedelta"),
    ("datetime", "timezone"),
    ("decimal", "Decimal"),
    ("fractions", "Fraction"),
    ("uuid", "UUID"),
    ("copyreg", "_reconstructor"),
    ("dlscale.facade._safe_pickle", "_rebuild_tensor"),
    ("dlscale.facade._safe_pickle", "_rebuild_ndarray"),
    ("dlscale.facade._safe_pickle", "_rebuild_numpy_scalar"),
}


def _rebuild_tensor(dtype: str, shape: tuple, data: bytes, requires_grad: bool) -> Any:
    import torch

    torch_dtype = getattr(torch, dtype)
    if not isinstance(torch_dtype, torch.dtype):
        raise UnsafePickleError(f"{dtype!r} is not a torch dtype")
    if len(data) == 0:
        t = torch.empty(shape, dtype=torch_dtype)
    else:
        t = torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(shape)
    return t.requires_grad_(requires_grad) if requires_grad else t


_MAX_DTYPE_DEPTH = 32
_STRUCT_KEYS = {"names", "formats", "offsets", "itemsize"}


def dtype_spec(dt: np.dtype) -> str | list | dict:
    """``dt`` as strings, integers, lists and dicts that :func:`dtype_from_spec` turns back into it:
    a plain dtype is its dtype string (``"<f8"``); a shaped field is ``[spec of its base, shape]``; a
    structured dtype is ``{"names", "formats", "offsets", "itemsize", "aligned"}`` with a spec per
    field (and ``"titles"`` when a field has one). ``dtype.str`` alone would be ``"|V12"``: raw bytes."""
    if dt.subdtype is not None:
        base, shape = dt.subdtype
        return [dtype_spec(base), list(shape)]
    if dt.names is None:
        return dt.str
    fields = [dt.fields[name] for name in dt.names]
    spec: dict[str, Any] = {
        "names": list(dt.names),
        "formats": [dtype_spec(f[0]) for f in fields],
        "offsets": [f[1] for f in fields],
        "itemsize": dt.itemsize,
        "aligned": dt.isalignedstruct,
    }
    if any(len(f) > 2 for f in fields):
        spec["titles"] = [f[2] if len(f) > 2 else None for f in fields]
    return spec


def _is_int_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def dtype_from_spec(spec: Any, depth: int = 0) -> np.dtype:
    """The dtype :func:`dtype_spec` described, its structure checked before numpy builds it; a dtype
    holding Python objects raises :class:`UnsafePickleError`, a malformed description ValueError."""
    if depth > _MAX_DTYPE_DEPTH:
        raise ValueError(f"a dtype nested more than {_MAX_DTYPE_DEPTH} levels deep")
    if isinstance(spec, str):
        dt = np.dtype(spec)
    elif isinstance(spec, (list, tuple)) and len(spec) == 2 and _is_int_list(spec[1]):
        dt = np.dtype((dtype_from_spec(spec[0], depth + 1), tuple(spec[1])))
    elif isinstance(spec, dict) and _STRUCT_KEYS <= spec.keys() <= _STRUCT_KEYS | {"aligned", "titles"}:
        names, formats, offsets, itemsize = (spec[k] for k in ("names", "formats", "offsets", "itemsize"))
        titles = spec.get("titles")
        if not (
            isinstance(names, list)
            and all(isinstance(n, str) for n in names)
            and isinstance(formats, list)
            and len(formats) == len(names)
            and _is_int_list(offsets)
            and len(offsets) == len(names)
            and _is_int_list([itemsize])
            and isinstance(spec.get("aligned", False), bool)
            and (titles is None or (isinstance(titles, list) and len(titles) == len(names)))
            and all(t is None or isinstance(t, str) for t in titles or ())
        ):
            raise ValueError(f"a malformed structured dtype description: {spec!r:.200}")
        fields = {
            "names": names,
            "formats": [dtype_from_spec(f, depth + 1) for f in formats],
            "offsets": list(offsets),
            "itemsize": itemsize,
            **({"titles": titles} if titles is not None else {}),
        }
        dt = np.dtype(fields, align=spec.get("aligned", False))
    else:
        raise ValueError(f"not a dtype description: {spec!r:.200}")
    if dt.hasobject:
        raise UnsafePickleError("numpy arrays of Python objects cannot be loaded safely")
    return dt


def _rebuild_ndarray(dtype: str | list | dict, shape: tuple, data: bytes) -> Any:
    return np.frombuffer(bytearray(data), dtype=dtype_from_spec(dtype)).reshape(shape)


def _rebuild_numpy_scalar(dtype: str | list | dict, data: bytes) -> Any:
    return _rebuild_ndarray(dtype, (), data)[()]


def _reduce_tensor(t: Any) -> tuple:
    import torch

    if t.layout != torch.strided:
        t = t.to_dense()
    c = t.detach().cpu().contiguous()
    data = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return _rebuild_tensor, (str(c.dtype).removeprefix("torch."), tuple(c.shape), data, t.requires_grad)


def _safe_dtype(dt: np.dtype) -> str | list | dict:
    """:func:`dtype_spec` of ``dt``, refused when it holds Python objects or (a structured dtype numpy
    cannot rebuild from its fields, such as a union over an integer) would not come back the same."""
    if dt.hasobject:
        fields = [n for n in dt.names or () if dt.fields[n][0].hasobject]
        where = f" (field{'s' if len(fields) > 1 else ''} {', '.join(map(repr, fields))})" if fields else ""
        raise pickle.PicklingError(f"numpy arrays of Python objects{where} cannot be saved in the safe format")
    spec = dtype_spec(dt)
    if dt.names is not None and dtype_from_spec(spec) != dt:
        raise pickle.PicklingError(f"the structured dtype {dt} cannot be saved in the safe format")
    return spec


def _reduce_ndarray(a: Any) -> tuple:
    return _rebuild_ndarray, (_safe_dtype(a.dtype), a.shape, np.ascontiguousarray(a).tobytes())


def _reduce_numpy_scalar(x: Any) -> tuple:
    return _rebuild_numpy_scalar, (_safe_dtype(x.dtype), x.tobytes())


class SafePickler(pickle.Pickler):
    """A pickler that writes tensors and arrays in the form :class:`SafeUnpickler` accepts."""

    def __init__(self, file: io.BufferedIOBase) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        import torch

        table = copyreg.dispatch_table.copy()
        table[np.ndarray] = _reduce_ndarray
        for t in set(np.sctypeDict.values()):
            table[t] = _reduce_numpy_scalar
        table[torch.Tensor] = _reduce_tensor
        table[torch.nn.Parameter] = _reduce_tensor
        self.dispatch_table = table


class SafeUnpickler(pickle.Unpickler):
    """Loads only allow-listed globals; ``allowed`` adds ``"module:QualName"`` entries."""

    def __init__(self, file: io.BufferedIOBase, allowed: Iterable[str] = (), source: str = "data") -> None:
        super().__init__(file)
        self._extra = {tuple(a.split(":", 1)) for a in allowed}
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module, name) in self._extra:
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"{self._source} asks to load {module}.{name}, which is not on the allowed list; "
            f"pass allowed=['{module}:{name}'] if you trust it"
        )


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    SafePickler(buf).dump(obj)
    return buf.getvalue()


def loads(data: bytes, allowed: Iterable[str] = (), source: str = "data") -> Any:
    return SafeUnpickler(io.BytesIO(data), allowed, source).load()
