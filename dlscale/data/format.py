"""The dlscale minibatch file (``.dlb``): a pickle-free, versioned, checksummed binary format.

Layout, all integers little-endian (see ``docs/minibatch-format.md``)::

    offset  size  field
    0       8     magic b"DLSBATCH"
    8       2     format version (uint16), currently 1
    10      2     reserved, 0
    12      4     header length H (uint32)
    16      4     CRC-32C of the header (uint32)
    20      4     reserved, 0
    24      8     data length D (uint64)
    32      H     header: UTF-8 JSON describing every array
    ...           zero padding to a multiple of 64
    ...     D     data: the arrays' bytes, each starting at a multiple of 64
    ...     4     CRC-32C of the data (uint32)

Loading reads the file once into one 64-byte-aligned buffer, checks it, and returns tensors that
are views of that buffer (no copy), each starting on a 64-byte boundary. Nothing in a file can
make the reader run code: the header is JSON and dtypes come from a fixed table.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import crc32c
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from dlscale.data.dataset import DataSet, MultiDataSet
from dlscale.errors import CorruptDataError, StorageError
from dlscale.storage import open_fs, write_bytes

MAGIC = b"DLSBATCH"
VERSION = 1
ALIGN = 64
_PREAMBLE = struct.Struct("<8sHHIIIQ")
_CRC = struct.Struct("<I")

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}


def _pad(n: int) -> int:
    return -n % ALIGN


def entries(batch: DataSet | MultiDataSet) -> tuple[str, list[tuple[str, int, torch.Tensor]]]:
    """The batch's kind and its arrays as (field, index, tensor)."""
    if isinstance(batch, DataSet):
        return "DataSet", [(name, 0, t) for name, t in batch._fields().items() if t is not None]
    if isinstance(batch, MultiDataSet):
        out = []
        for name in MultiDataSet.GROUPS:
            out += [(name, i, t) for i, t in enumerate(getattr(batch, name)) if t is not None]
        return "MultiDataSet", out
    raise TypeError(f"can only save a DataSet or MultiDataSet, not {type(batch).__name__}")


def raw_bytes(t: torch.Tensor, what: str) -> np.ndarray:
    """The tensor's bytes (little-endian, row-major) as a uint8 array; its dtype must be in :data:`DTYPES`."""
    if t.dtype not in _NAMES:
        raise TypeError(f"{what} has dtype {t.dtype}, which dlscale's files do not store")
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def tensor_at(buf: bytearray | np.ndarray, entry: dict, start: int = 0) -> torch.Tensor:
    """The tensor an entry (``dtype``, ``shape``, ``offset``, ``nbytes``) describes, a view of ``buf``.

    An entry that does not fit raises ValueError.
    """
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"unknown dtype {entry['dtype']!r}")
    shape = [int(s) for s in entry["shape"]]
    count = 1
    for s in shape:
        if s < 0:
            raise ValueError(f"negative dimension in shape {shape}")
        count *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    if (
        count * itemsize != entry["nbytes"]
        or entry["offset"] < 0
        or start + entry["offset"] + entry["nbytes"] > len(buf)
    ):
        raise ValueError(
            f"{entry['nbytes']} bytes at offset {entry['offset']} do not hold shape {shape} of {entry['dtype']}"
        )
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=start + entry["offset"]).reshape(shape)


def to_bytes(batch: DataSet | MultiDataSet) -> list[bytes | memoryview]:
    """The file's contents as a list of buffers (written one after another)."""
    kind, tensors = entries(batch)
    arrays, blobs, offset = [], [], 0
    for field, index, t in tensors:
        data = raw_bytes(t, f"{field}[{index}]")
        arrays.append(
            {
                "field": field,
                "index": index,
                "dtype": _NAMES[t.dtype],
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": data.nbytes,
            }
        )
        blobs.append(memoryview(data))
        offset += data.nbytes
        blobs.append(b"\0" * _pad(offset))
        offset += _pad(offset)
    counts = {"features": len(batch.features), "labels": len(batch.labels)} if kind == "MultiDataSet" else {}
    header = json.dumps(
        {"kind": kind, "num_examples": batch.num_examples(), "counts": counts, "arrays": arrays}
    ).encode()
    crc = 0
    for b in blobs:
        crc = crc32c.crc32c(b, value=crc)
    preamble = _PREAMBLE.pack(MAGIC, VERSION, 0, len(header), crc32c.crc32c(header), 0, offset)
    return [preamble, header, b"\0" * _pad(_PREAMBLE.size + len(header)), *blobs, _CRC.pack(crc)]


def save(batch: DataSet | MultiDataSet, url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Write ``batch`` to ``url`` atomically: a reader sees the whole file or none."""
    write_bytes(url, *to_bytes(batch), storage_options=storage_options)


def _aligned_buffer(size: int) -> np.ndarray:
    """A writable buffer of ``size`` bytes whose first byte is 64-byte aligned in memory."""
    raw = np.empty(size + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + size]


def _unreadable(url: str, error: Exception) -> StorageError:
    if isinstance(error, FileNotFoundError):
        return StorageError(f"minibatch file not found: {url}")
    return StorageError(f"cannot read minibatch {url}: {error}")


def _read(url: str, storage_options: dict[str, Any] | None, check_size: Callable[[int], None] | None) -> np.ndarray:
    fs, path = open_fs(url, storage_options)
    try:
        size = fs.size(path)
    except Exception as e:  # network and object-store errors do not all derive from OSError
        raise _unreadable(url, e) from e
    if check_size is not None:
        check_size(size)  # before anything is allocated or read
    try:
        buf = _aligned_buffer(size)
        # a local file is read with Python's own buffered reader: through fsspec's wrapper the
        # same read is measurably slower from disk
        with open(path, "rb") if isinstance(fs, LocalFileSystem) else fs.open(path, "rb") as f:
            n = f.readinto(buf)
    except Exception as e:
        raise _unreadable(url, e) from e
    if n != size:
        raise CorruptDataError(f"{url}: read {n} of {size} bytes")
    return buf


def from_buffer(buf: bytearray | np.ndarray, source: str = "buffer") -> DataSet | MultiDataSet:
    """Parse a minibatch from ``buf``; the tensors are views of it. Errors name ``source``."""

    def bad(what: str) -> CorruptDataError:
        return CorruptDataError(f"{source}: {what}")

    head = bytes(buf[: len(MAGIC)])
    if not MAGIC.startswith(head):  # checked first: a short foreign file is foreign, not truncated
        raise bad(f"not a dlscale minibatch file (starts with {head!r}, expected {MAGIC!r})")
    if len(buf) < _PREAMBLE.size:
        raise bad(f"truncated: {len(buf)} bytes is shorter than the {_PREAMBLE.size}-byte preamble")
    _, version, _, hlen, hcrc, _, dlen = _PREAMBLE.unpack_from(buf)
    if version > VERSION:
        raise bad(f"written in minibatch format version {version}; this dlscale reads up to version {VERSION}")
    if version < 1:
        raise bad(f"unknown minibatch format version {version}")
    start = _PREAMBLE.size + hlen + _pad(_PREAMBLE.size + hlen)
    if len(buf) != start + dlen + _CRC.size:
        raise bad(f"truncated or padded: {len(buf)} bytes, the header says {start + dlen + _CRC.size}")
    view = memoryview(buf)
    header_bytes = view[_PREAMBLE.size : _PREAMBLE.size + hlen]
    if crc32c.crc32c(header_bytes) != hcrc:
        raise bad("header checksum mismatch (the file is corrupt)")
    data = view[start : start + dlen]
    if crc32c.crc32c(data) != _CRC.unpack_from(buf, start + dlen)[0]:
        raise bad("data checksum mismatch (the file is corrupt)")
    try:
        header = json.loads(bytes(header_bytes))
        return _build(header, buf, start)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        if isinstance(e, CorruptDataError):
            raise
        raise bad(f"inconsistent header: {e}") from e


def _build(header: dict, buf: bytearray | np.ndarray, start: int) -> DataSet | MultiDataSet:
    tensors: dict[tuple[str, int], torch.Tensor] = {}
    for a in header["arrays"]:
        try:
            tensors[(a["field"], int(a["index"]))] = tensor_at(buf, a, start)
        except ValueError as e:
            raise ValueError(f"array {a['field']}[{a['index']}]: {e}") from None
    return assemble(header["kind"], tensors, header.get("counts", {}))


def assemble(kind: str, tensors: dict[tuple[str, int], torch.Tensor], counts: dict[str, int]) -> DataSet | MultiDataSet:
    """A minibatch from its arrays keyed by ``(field, index)``, as :func:`entries` lists them."""
    if kind == "DataSet":
        return DataSet(*(tensors.get((f, 0)) for f in DataSet.FIELDS))
    if kind == "MultiDataSet":
        return MultiDataSet(
            [tensors[("features", i)] for i in range(counts["features"])],
            [tensors[("labels", i)] for i in range(counts["labels"])],
            [tensors.get(("features_masks", i)) for i in range(counts["features"])],
            [tensors.get(("labels_masks", i)) for i in range(counts["labels"])],
        )
    raise ValueError(f"unknown kind {kind!r}")


def from_bytes(blob: bytes | memoryview, source: str = "buffer") -> DataSet | MultiDataSet:
    """Parse a minibatch from an immutable ``blob`` (e.g. one held in a worker's memory), copying it
    once into an aligned, writable buffer so the tensors own their memory."""
    buf = _aligned_buffer(len(blob))
    buf[:] = np.frombuffer(blob, dtype=np.uint8)
    return from_buffer(buf, source)


def load(
    url: str, storage_options: dict[str, Any] | None = None, check_size: Callable[[int], None] | None = None
) -> DataSet | MultiDataSet:
    """Read a minibatch written by :func:`save`; a damaged or foreign file raises an error naming it.
    ``check_size`` is given the file's size before it is read (to refuse one too large)."""
    return from_buffer(_read(url, storage_options, check_size), source=url)
