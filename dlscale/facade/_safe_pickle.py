"""Pickle files that load without running arbitrary code.

:class:`SafePickler` writes torch tensors, numpy arrays and numpy scalars as raw bytes with
dtype and shape. :class:`SafeUnpickler` resolves only an allow-list of globals (built-in
containers and scalars, a few standard-library value types, and the rebuild functions below),
plus classes the caller names, so a crafted file raises :class:`UnsafePickleError` instead of
executing anything.
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


def _rebuild_ndarray(dtype: str, shape: tuple, data: bytes) -> Any:
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise UnsafePickleError("numpy arrays of Python objects cannot be loaded safely")
    return np.frombuffer(bytearray(data), dtype=dt).reshape(shape)


def _rebuild_numpy_scalar(dtype: str, data: bytes) -> Any:
    return _rebuild_ndarray(dtype, (), data)[()]


def _reduce_tensor(t: Any) -> tuple:
    import torch

    if t.layout != torch.strided:
        t = t.to_dense()
    c = t.detach().cpu().contiguous()
    data = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return _rebuild_tensor, (str(c.dtype).removeprefix("torch."), tuple(c.shape), data, t.requires_grad)


def _reduce_ndarray(a: Any) -> tuple:
    if a.dtype.hasobject:
        raise pickle.PicklingError("numpy arrays of Python objects cannot be saved in the safe format")
    return _rebuild_ndarray, (a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes())


def _reduce_numpy_scalar(x: Any) -> tuple:
    return _rebuild_numpy_scalar, (x.dtype.str, x.tobytes())


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
