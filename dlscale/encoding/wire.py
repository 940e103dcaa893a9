"""The messages' wire forms, each versioned, with a magic and a CRC-32C (:func:`seal`, :func:`intact`).

- :class:`EncodedUpdate`, a threshold-encoded update (the ``"dl4j"`` compressor's), in one of two
  forms, whichever is smaller: *sparse*, one int32 per sent element (``(index + 1) * sign``), or
  *bitmap*, two bits per element of the whole vector;
- :class:`ValueUpdate`, an update that carries values (the ``"topk"`` and ``"dense"`` compressors'):
  ranges of elements sent whole, then elements by index.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import crc32c
import numpy as np
import torch

from dlscale.errors import CorruptDataError

MAX_LENGTH = 2**31 - 2
"""The longest vector a message can describe (a sparse entry is a 1-based index in an int32)."""


def seal(head: bytes, body: bytes) -> bytes:
    """A message's bytes: ``head`` (a header whose last 4 bytes are its CRC-32C field, packed as 0)
    with that field set to the CRC-32C of the rest of the header and of ``body``, then ``body``."""
    crc = crc32c.crc32c(body, value=crc32c.crc32c(head[:-4]))
    return head[:-4] + struct.pack("<I", crc) + body


def _header(data: bytes, header: struct.Struct, magic: bytes, version: int, what: str) -> list:
    """The fields of ``data``'s ``header`` after its magic and version, which are checked: ``what``
    (the message's name, with its article) is named in the error of a message that is not one."""
    if len(data) < header.size:
        raise CorruptDataError(f"{what} is at least {header.size} bytes, got {len(data)}")
    found, found_version, *fields = header.unpack_from(data)
    if found != magic:
        raise CorruptDataError(f"not {what}: magic {found!r}, expected {magic!r}")
    if found_version != version:
        name = what.split(" ", 1)[1]
        raise CorruptDataError(f"{name} format version {found_version}, this dlscale reads {version}")
    return fields


def intact(data: bytes, header_bytes: int, crc: int) -> bool:
    """Whether ``data`` (a header of ``header_bytes`` ending in its CRC-32C field, then the body) has
    the CRC-32C ``crc`` that :func:`seal` gave it."""
    return crc32c.crc32c(data[header_bytes:], value=crc32c.crc32c(data[: header_bytes - 4])) == crc


# -- threshold encoding: the messages of "dl4j" ----------------------------------------------------
SPARSE = "sparse"
BITMAP = "bitmap"
FORMS = (SPARSE, BITMAP)

MAGIC = b"DLTE"
VERSION = 1
# magic, version, form (0 sparse, 1 bitmap), reserved, threshold, length, count, CRC-32C of the rest
_HEADER = struct.Struct("<4sBBHfQQI")
HEADER_BYTES = _HEADER.size
"""Bytes of a message besides its payload (the header of :meth:`EncodedUpdate.to_bytes`)."""
SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)
"""Where each of the four 2-bit codes of a bitmap byte starts."""


@dataclass(frozen=True, eq=False)
class EncodedUpdate:
    """A threshold-encoded update: ``count`` of ``length`` elements, each ``+threshold`` or ``-threshold``.

    ``payload`` is, in the ``"sparse"`` form, an int32 array of ``(index + 1) * sign`` per sent
    element in increasing index order; in the ``"bitmap"`` form, a uint8 array of
    ``ceil(length / 4)`` bytes, element ``i`` in bits ``2 * (i % 4)`` of byte ``i // 4``: 0 nothing,
    1 ``+threshold``, 2 ``-threshold``. Pickles as its fields (a numpy array, no tensors).
    """

    form: str
    threshold: float
    length: int
    count: int
    payload: np.ndarray

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"form must be 'sparse' or 'bitmap', got {self.form!r}")
        dtype, size = (np.int32, self.count) if self.form == SPARSE else (np.uint8, bitmap_bytes(self.length))
        if not isinstance(self.payload, np.ndarray) or self.payload.dtype != dtype or self.payload.shape != (size,):
            got = f"{self.payload.shape} {self.payload.dtype}" if isinstance(self.payload, np.ndarray) else self.payload
            raise ValueError(
                f"a {self.form} payload of a {self.length}-element vector with {self.count} elements "
                f"sent is {size} {np.dtype(dtype)}, got {got!r}"
            )

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the payload and the fixed header."""
        return HEADER_BYTES + self.payload.nbytes

    @property
    def sparsity(self) -> float:
        """``count / length``, what a :class:`~dlscale.encoding.ThresholdAlgorithm` adapts to."""
        return self.count / self.length if self.length else 0.0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EncodedUpdate):
            return NotImplemented
        return (self.form, self.threshold, self.length, self.count) == (
            other.form,
            other.threshold,
            other.length,
            other.count,
        ) and np.array_equal(self.payload, other.payload)

    __hash__ = None

    def to_bytes(self) -> bytes:
        """A self-describing binary form: a 32-byte little-endian header (magic ``DLTE``, version,
        form, threshold as float32, length, count, CRC-32C), then the payload."""
        payload = self.payload.astype("<i4" if self.form == SPARSE else np.uint8, copy=False).tobytes()
        head = _HEADER.pack(MAGIC, VERSION, FORMS.index(self.form), 0, self.threshold, self.length, self.count, 0)
        return seal(head, payload)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> EncodedUpdate:
        """The message :meth:`to_bytes` wrote; anything else raises :class:`~dlscale.errors.CorruptDataError`."""
        data = bytes(data)
        form_code, reserved, threshold, length, count, crc = _header(data, _HEADER, MAGIC, VERSION, "an encoded update")
        if form_code >= len(FORMS) or reserved != 0:
            raise CorruptDataError(f"encoded update header has form code {form_code} and reserved field {reserved}")
        if not (np.isfinite(threshold) and threshold > 0) or length > MAX_LENGTH or count > length:
            raise CorruptDataError(
                f"encoded update header is inconsistent: threshold {threshold}, length {length}, count {count}"
            )
        form = FORMS[form_code]
        expected = 4 * count if form == SPARSE else bitmap_bytes(length)
        if len(data) - HEADER_BYTES != expected:
            raise CorruptDataError(
                f"a {form} encoded update of {length} elements with {count} sent has a "
                f"{expected}-byte payload, got {len(data) - HEADER_BYTES}"
            )
        if not intact(data, HEADER_BYTES, crc):
            raise CorruptDataError("encoded update checksum mismatch: the bytes were damaged")
        if form == SPARSE:
            payload = np.frombuffer(data, "<i4", count, HEADER_BYTES).astype(np.int32, copy=False)
            index = np.abs(payload.astype(np.int64)) - 1
            if count and (index.min() < 0 or index.max() >= length or np.any(np.diff(index) <= 0)):
                raise CorruptDataError(
                    "sparse encoded update entries must be non-zero, within the length and in increasing index order"
                )
        else:
            payload = np.frombuffer(data, np.uint8, expected, HEADER_BYTES)
            if np.any(payload & (payload >> 1) & 0x55):
                raise CorruptDataError("bitmap encoded update holds code 3, which no encoder writes")
            if length % 4 and payload[-1] >> (2 * (length % 4)):
                raise CorruptDataError("bitmap encoded update has codes past its length")
            sent = sum(np.count_nonzero((payload >> shift) & 3) for shift in SHIFTS)
            if sent != count:
                raise CorruptDataError(f"bitmap encoded update says {count} elements were sent, its codes say {sent}")
        return cls(form, float(threshold), length, count, payload)


def bitmap_bytes(length: int) -> int:
    """Bytes of a bitmap payload of ``length`` elements."""
    return -(-length // 4)


# -- values: the messages of "topk" and "dense" ---------------------------------------------------
VALUE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""Element types of a :class:`ValueUpdate`'s values, by name."""
_DTYPE_CODES = tuple(VALUE_DTYPES)
VALUE_BITS = {torch.bfloat16: np.int16, torch.float16: np.int16, torch.float32: np.int32}
"""The integer type (numpy's) that holds the bits of each value type."""

VALUES_MAGIC = b"DLVU"
VALUES_VERSION = 1
# magic, version, value type, flags, length, dense ranges, sparse count, CRC-32C of the rest
_VALUES_HEADER = struct.Struct("<4sBBHQIQI")
_GAPS = 1  # flag: the index is written as uint16 gaps (each index minus the one before, the first plus 1)
VALUES_HEADER_BYTES = _VALUES_HEADER.size


@dataclass(frozen=True, eq=False)
class ValueUpdate:
    """An update that carries values: every element of each of the ``ranges`` (``(start, stop)``
    pairs, increasing and disjoint), then the elements at ``index`` (increasing int64, outside the
    ranges); ``values`` holds the former in order, then the latter (bf16, fp16 or fp32)."""

    length: int
    ranges: tuple[tuple[int, int], ...]
    index: torch.Tensor
    values: torch.Tensor
    places: torch.Tensor | None = field(default=None, repr=False)
    """Every position the message changes, in the order of ``values``, where the message was made
    (not on the wire: :meth:`positions` works them out from the ranges and index otherwise)."""
    checked: bool = field(default=True, repr=False)
    """Whether the values were checked to be finite as the message was made (a device's kernels
    leave that to the host, as the bytes are made)."""

    @property
    def dense_count(self) -> int:
        """Elements sent through the ranges."""
        return sum(b - a for a, b in self.ranges)

    @property
    def count(self) -> int:
        """Elements sent."""
        return self.dense_count + self.index.numel()

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        _, index = _index_bytes(self.index.cpu().numpy())
        return VALUES_HEADER_BYTES + 16 * len(self.ranges) + len(index) + self.values.element_size() * self.count

    def positions(self) -> torch.Tensor:
        """Every position the message changes, in the order of ``values``: :attr:`places`, or worked
        out on the host from the ranges and index."""
        if self.places is not None:
            return self.places
        dense = [np.arange(a, b, dtype=np.int64) for a, b in self.ranges]
        return torch.from_numpy(np.concatenate([*dense, self.index.cpu().numpy()]))

    def to_bytes(self) -> bytes:
        """The header (little-endian: magic ``DLVU``, version, value type, reserved, length, ranges,
        sparse count, CRC-32C), the ranges as uint64 pairs, the index (uint16 gaps when every gap fits,
        else int32), the values."""
        index = self.index.cpu().numpy()
        return value_bytes(self.length, self.ranges, index, host_bits(self.values), self.values.dtype)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> ValueUpdate:
        """The message :meth:`to_bytes` wrote; anything else raises :class:`CorruptDataError`."""
        data = bytes(data)
        header = _header(data, _VALUES_HEADER, VALUES_MAGIC, VALUES_VERSION, "a value update")
        dtype_code, flags, length, nranges, count, crc = header
        if dtype_code >= len(_DTYPE_CODES) or flags & ~_GAPS:
            raise CorruptDataError(f"value update header has value type {dtype_code} and flags {flags}")
        if length > MAX_LENGTH or count > length or nranges > length:
            raise CorruptDataError(f"value update header is inconsistent: length {length}, count {count}")
        if not intact(data, VALUES_HEADER_BYTES, crc):
            raise CorruptDataError("value update checksum mismatch: the bytes were damaged")
        at = VALUES_HEADER_BYTES
        bounds = np.frombuffer(data, "<u8", 2 * nranges, at).astype(np.int64) if nranges else np.zeros(0, np.int64)
        at += 16 * nranges
        if len(bounds) and (
            bounds.max() > length or np.any(np.diff(bounds) < 0) or np.any(bounds[1::2] == bounds[::2])
        ):
            raise CorruptDataError("value update ranges must be non-empty, increasing, disjoint and within the length")
        ranges = tuple((int(a), int(b)) for a, b in bounds.reshape(-1, 2))
        dtype = VALUE_DTYPES[_DTYPE_CODES[dtype_code]]
        total = int((bounds[1::2] - bounds[::2]).sum()) + count
        size = np.dtype(VALUE_BITS[dtype]).itemsize
        width = 2 if flags & _GAPS else 4
        if len(data) - at != width * count + size * total:
            raise CorruptDataError(
                f"a value update with {len(ranges)} ranges and {count} sparse elements has a "
                f"{width * count + size * total}-byte body after its ranges, got {len(data) - at}"
            )
        if flags & _GAPS:
            index = np.cumsum(np.frombuffer(data, "<u2", count, at), dtype=np.int64) - 1
        else:
            index = np.frombuffer(data, "<i4", count, at).astype(np.int64)
        at += width * count
        if count and (index.min() < 0 or index.max() >= length or np.any(np.diff(index) <= 0)):
            raise CorruptDataError("value update indices must be increasing and within the length")
        if count and len(ranges) and np.any(_in_ranges(index, bounds)):
            raise CorruptDataError("value update indices must lie outside its ranges")
        raw = np.frombuffer(data, "<i2" if size == 2 else "<i4", total, at).copy()
        if not finite_bits(raw, dtype).all():
            raise CorruptDataError("value update holds values that are not finite")
        # every position, as apply adds them, worked out here on the host, once
        places = torch.from_numpy(np.concatenate([*(np.arange(a, b, dtype=np.int64) for a, b in ranges), index]))
        return cls(int(length), ranges, places[total - count :], torch.from_numpy(raw).view(dtype), places)


_EXPONENT = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}


def host_bits(values: torch.Tensor) -> np.ndarray:
    """The bits of ``values`` (bf16, fp16 or fp32) on the host, as numpy's integers."""
    return values.cpu().view(torch.int16 if values.element_size() == 2 else torch.int32).numpy()


def finite_bits(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Whether each value of type ``dtype`` (bf16, fp16 or fp32) whose bits are ``bits`` (int16 or
    int32, on the host) is finite, read from its exponent by numpy: not every float type has a numpy
    twin, and nothing is dispatched to torch."""
    exponent = _EXPONENT[dtype]
    return (bits & exponent) != exponent


def value_bytes(
    length: int, ranges: tuple[tuple[int, int], ...], index: np.ndarray, bits: np.ndarray, dtype: torch.dtype
) -> bytes:
    """The bytes of :meth:`ValueUpdate.to_bytes` from numpy arrays on the host: the ``index``
    (increasing int64) and the ``bits`` of the values (of type ``dtype``)."""
    code = _DTYPE_CODES.index(next(k for k, v in VALUE_DTYPES.items() if v == dtype))
    flags, index_bytes = _index_bytes(index)
    body = np.asarray(ranges, dtype="<u8").reshape(-1).tobytes() + index_bytes + bits.tobytes()
    head = _VALUES_HEADER.pack(VALUES_MAGIC, VALUES_VERSION, code, flags, length, len(ranges), len(index), 0)
    return seal(head, body)


def _index_bytes(index: np.ndarray) -> tuple[int, bytes]:
    """The flags and bytes of an increasing index: uint16 gaps when every gap fits, else int32."""
    a = index.astype(np.int32)  # a layout's positions fit an int32
    if len(a):
        gaps = np.diff(a, prepend=-1)
        if gaps.max() <= 0xFFFF:
            return _GAPS, gaps.astype("<u2").tobytes()
    return 0, a.astype("<i4").tobytes()


def _in_ranges(index: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Whether each index lies within one of the ranges whose flat ``(start, stop, ...)`` are ``bounds``."""
    return np.searchsorted(bounds, index, side="right") % 2 == 1
