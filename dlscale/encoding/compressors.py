"""Compressors: how a trainer's updates become the messages that gradient sharing exchanges.

A :class:`Compressor` is stateless and shared; each trainer holds its own
:class:`CompressorState` (made by :meth:`Compressor.state` from the parameters' :class:`Layout`),
whose *residual* is what the trainer computed and has not sent yet. At each step the trainer hands
the optimizer's update to :meth:`Compressor.compress`, which adds it to the residual, picks what to
send and takes exactly that out of the residual (error feedback: what is not sent now is sent later,
never lost unless the compressor says it discards something). Every replica, the sender's own
included, adds the message to its parameters with :meth:`Compressor.apply`.

Built in, by registered name (kind ``compressor`` of :mod:`dlscale.registry`):

- ``"topk"`` (:class:`TopKCompressor`, the default): per-tensor top-k selection with values,
  biases and norm weights dense, sparsity warm-up (Deep Gradient Compression, Lin et al. 2018);
- ``"dl4j"`` (:class:`Dl4jCompressor`): Deeplearning4j's threshold encoding (Strom 2015),
  :func:`~dlscale.encoding.encode` with a threshold algorithm and a residual post-processor;
- ``"dense"`` (:class:`DenseCompressor`): every element's value at every step, uncompressed.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
import numbers
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dlscale.encoding import _codec, residual, thresholds
from dlscale.encoding._codec import EncodedUpdate
from dlscale.encoding.residual import ResidualPostProcessor
from dlscale.encoding.thresholds import ThresholdAlgorithm
from dlscale.errors import CorruptDataError, NonFiniteUpdateError
from dlscale.registry import Registry


@dataclass(frozen=True)
class Layout:
    """The parameters a compressor works on: each tensor's shape, in the order of the flat vector
    that holds them all, and the device they live on."""

    shapes: tuple[tuple[int, ...], ...]
    device: torch.device = torch.device("cpu")

    def __post_init__(self) -> None:
        shapes = tuple(tuple(int(d) for d in s) for s in self.shapes)
        if any(d < 0 for s in shapes for d in s):
            raise ValueError(f"parameter shapes must have non-negative sizes, got {self.shapes!r}")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "device", torch.device(self.device))
        if self.length > _codec.MAX_LENGTH:
            raise ValueError(f"a layout of {self.length} elements is longer than a message holds ({_codec.MAX_LENGTH})")

    @classmethod
    def of(cls, parameters: Iterable[torch.Tensor]) -> Layout:
        """The layout of ``parameters`` (a module's ``parameters()``, in the order they are flattened)."""
        tensors = list(parameters)
        device = tensors[0].device if tensors else torch.device("cpu")
        return cls(tuple(tuple(t.shape) for t in tensors), device)

    @functools.cached_property
    def numels(self) -> tuple[int, ...]:
        """Elements of each tensor."""
        return tuple(math.prod(s) for s in self.shapes)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each tensor starts in the flat vector."""
        return tuple(int(o) for o in np.cumsum((0, *self.numels))[:-1])

    @property
    def length(self) -> int:
        """Elements of the flat vector."""
        return sum(self.numels)


@dataclass
class CompressorState:
    """One trainer's state: the ``residual`` (a flat float32 vector of what it has computed and not
    sent yet), its ``step`` s in its network's training so far (a trainer starts at its network's
    minibatches over the trainers, so that a fit that goes on with a trained network does not warm
    up again), and what the last one sent: its ``threshold``
    (the smallest magnitude it would send; 0 when it sends everything) and ``density`` (elements
    sent over elements)."""

    layout: Layout
    residual: torch.Tensor
    step: int = 0
    threshold: float = 0.0
    density: float = 0.0


@dataclass(frozen=True, eq=False)
class Difference:
    """A residual that lies in two flat vectors: ``params - shared``, a lossless trainer's replica less
    the shared parameters beside it. Given to :meth:`Compressor.compress` in place of an update, it
    lets the compressor read the residual where it lies, in its own pass over the two, where
    subtracting first would write the whole residual and read it back at every step."""

    params: torch.Tensor
    shared: torch.Tensor

    def into(self, out: torch.Tensor) -> torch.Tensor:
        """``params - shared``, written to ``out``."""
        return torch.sub(self.params.detach(), self.shared, out=out)


class Compressor(abc.ABC):
    """Turns updates into messages and back: one instance serves every trainer, each with its own
    :class:`CompressorState`. Register a subclass with
    ``dlscale.registry.register("compressor", name, cls)`` to make ``SharedTrainingMaster(...,
    compressor=name)`` use it."""

    lossless: bool = False
    """Whether what :meth:`compress` takes in and does not send stays in the residual exactly, to be
    sent later (error feedback that loses nothing). A trainer then keeps its whole update in its own
    replica, whose parameters are the shared ones plus its residual, so that its next gradient is
    taken where it would be without compression; it applies only its peers' messages (and, summing
    them, hands :meth:`compress` a :class:`Difference`, which a lossless compressor must take).
    Otherwise a trainer applies its own message to its replica, as DL4J does, and every replica
    holds the shared parameters."""

    def state(self, layout: Layout) -> CompressorState:
        """A trainer's fresh state: an all-zero residual on the parameters' device."""
        return CompressorState(layout, torch.zeros(layout.length, dtype=torch.float32, device=layout.device))

    @abc.abstractmethod
    def compress(self, state: CompressorState, update: torch.Tensor | Difference) -> Any | None:
        """Add ``update`` (the flat float32 update, on the parameters' device; not kept) to the
        residual, take out what is sent, and return the message (``None`` when nothing is sent).
        A :class:`Difference` (which only a :attr:`lossless` compressor takes) *is* the residual:
        the caller adds the message to its ``shared``, which takes out what is sent, and the state's
        own ``residual`` is neither read nor kept (``difference.into(state.residual)`` sets it when
        it is wanted). A non-finite update raises :class:`~dlscale.encoding.NonFiniteUpdateError`."""

    @abc.abstractmethod
    def apply(self, message: Any, params: torch.Tensor, scale: float = 1.0) -> None:
        """Add ``scale`` times ``message`` to the flat vector ``params`` in place, on its device."""

    @abc.abstractmethod
    def to_bytes(self, message: Any) -> bytes:
        """The message on the wire: versioned, with a magic and a CRC-32C."""

    @abc.abstractmethod
    def from_bytes(self, data: bytes | bytearray | memoryview) -> Any:
        """The message :meth:`to_bytes` wrote; damaged or inconsistent bytes raise
        :class:`~dlscale.errors.CorruptDataError`."""

    @abc.abstractmethod
    def momentum_mask(self, state: CompressorState, message: Any) -> torch.Tensor | None:
        """The increasing positions (int64) whose optimizer momentum is zeroed after ``message``, the
        message :meth:`compress` just returned for ``state``, is sent (momentum factor masking):
        elements that waited in the residual; ``None`` for none."""

    def describe(self, state: CompressorState, message: Any) -> dict[str, float | int | str]:
        """What encoding debug mode logs about one step: the message and the residual it left."""
        r = state.residual.detach()
        magnitude = r.abs()
        size = len(self.to_bytes(message)) if message is not None else 0
        return {
            "form": type(message).__name__ if message is not None else "no",
            "threshold": state.threshold,
            "length": state.layout.length,
            "sparsity": state.density,
            "message_bytes": size,
            "dense_bytes": 4 * state.layout.length,
            "residual_l2": float(torch.linalg.vector_norm(r, dtype=torch.float64)),
            "residual_max_abs": float(magnitude.max()) if r.numel() else 0.0,
            "residual_above_threshold": int(torch.count_nonzero(magnitude >= state.threshold))
            if state.threshold > 0
            else 0,
        }


# -- values: the messages of "topk" and "dense" ---------------------------------------------------
VALUE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""Element types of a :class:`ValueUpdate`'s values, by name."""
_DTYPE_CODES = tuple(VALUE_DTYPES)
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}

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
        _, index = _index_bytes(self.index)
        return VALUES_HEADER_BYTES + 16 * len(self.ranges) + len(index) + self.values.element_size() * self.count

    def positions(self) -> torch.Tensor:
        """Every position the message changes, in the order of ``values``."""
        dense = [torch.arange(a, b, device=self.index.device) for a, b in self.ranges]
        return torch.cat([*dense, self.index])

    def to_bytes(self) -> bytes:
        """The header (little-endian: magic ``DLVU``, version, value type, reserved, length, ranges,
        sparse count, CRC-32C), the ranges as uint64 pairs, the index (uint16 gaps when every gap fits,
        else int32), the values."""
        dtype = _DTYPE_CODES.index(next(k for k, v in VALUE_DTYPES.items() if v == self.values.dtype))
        ranges = np.asarray(self.ranges, dtype="<u8").reshape(-1).tobytes()
        flags, index = _index_bytes(self.index)
        values = self.values.cpu().view(_INT_VIEW[self.values.dtype]).numpy().tobytes()
        body = ranges + index + values
        head = _VALUES_HEADER.pack(
            VALUES_MAGIC, VALUES_VERSION, dtype, flags, self.length, len(self.ranges), self.index.numel(), 0
        )
        return _codec.seal(head, body)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> ValueUpdate:
        """The message :meth:`to_bytes` wrote; anything else raises :class:`CorruptDataError`."""
        data = bytes(data)
        if len(data) < VALUES_HEADER_BYTES:
            raise CorruptDataError(f"a value update is at least {VALUES_HEADER_BYTES} bytes, got {len(data)}")
        magic, version, dtype_code, flags, length, nranges, count, crc = _VALUES_HEADER.unpack_from(data)
        if magic != VALUES_MAGIC:
            raise CorruptDataError(f"not a value update: magic {magic!r}, expected {VALUES_MAGIC!r}")
        if version != VALUES_VERSION:
            raise CorruptDataError(f"value update format version {version}, this dlscale reads {VALUES_VERSION}")
        if dtype_code >= len(_DTYPE_CODES) or flags & ~_GAPS:
            raise CorruptDataError(f"value update header has value type {dtype_code} and flags {flags}")
        if length > _codec.MAX_LENGTH or count > length or nranges > length:
            raise CorruptDataError(f"value update header is inconsistent: length {length}, count {count}")
        if not _codec.intact(data, VALUES_HEADER_BYTES, crc):
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
        size = torch.empty(0, dtype=dtype).element_size()
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
        values = torch.from_numpy(raw).view(dtype)
        if not bool(torch.isfinite(values).all()):
            raise CorruptDataError("value update holds values that are not finite")
        return cls(int(length), ranges, torch.from_numpy(index), values)


def _index_bytes(index: torch.Tensor) -> tuple[int, bytes]:
    """The flags and bytes of an increasing index: uint16 gaps when every gap fits, else int32."""
    a = index.int().cpu().numpy()  # a layout's positions fit an int32: half the bytes from a GPU
    if len(a):
        gaps = np.diff(a, prepend=-1)
        if gaps.max() <= 0xFFFF:
            return _GAPS, gaps.astype("<u2").tobytes()
    return 0, a.astype("<i4").tobytes()


def _in_ranges(index: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Whether each index lies within one of the ranges whose flat ``(start, stop, ...)`` are ``bounds``."""
    return np.searchsorted(bounds, index, side="right") % 2 == 1


def _apply_values(message: ValueUpdate, params: torch.Tensor, scale: float) -> None:
    _check_target(params, message.length)
    values = message.values.to(params.device, params.dtype)
    if scale != 1:
        values = values * scale
    at = 0
    for a, b in message.ranges:
        params[a:b] += values[at : at + b - a]
        at += b - a
    if message.index.numel():
        params.index_add_(0, message.index.to(params.device), values[at:])


def _check_target(params: torch.Tensor, length: int) -> None:
    if not isinstance(params, torch.Tensor) or params.dim() != 1:
        raise ValueError(f"params must be a 1-D tensor, got {params!r:.80}")
    if params.numel() != length:
        raise ValueError(f"params has {params.numel()} elements, the message describes {length}")


def _check_update(compressor: Compressor, state: CompressorState, update: torch.Tensor | Difference) -> None:
    if isinstance(update, Difference):
        if not compressor.lossless:
            raise TypeError(f"{compressor!r} is not lossless: give it the update, not a Difference")
        tensors = (update.params, update.shared)
    else:
        tensors = (update,)
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != state.layout.length:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"update must be a flat tensor of {state.layout.length} elements, got {got}")


class _ValueCompressor(Compressor):
    """The wire form and application shared by the compressors whose messages are :class:`ValueUpdate`."""

    def apply(self, message: ValueUpdate, params: torch.Tensor, scale: float = 1.0) -> None:
        _apply_values(message, params, scale)

    def to_bytes(self, message: ValueUpdate) -> bytes:
        return message.to_bytes()

    def from_bytes(self, data: bytes | bytearray | memoryview) -> ValueUpdate:
        return ValueUpdate.from_bytes(data)


class DenseCompressor(_ValueCompressor):
    """Every element's value at every step, as float32: no compression, the residual stays zero."""

    lossless = True

    def compress(self, state: CompressorState, update: torch.Tensor | Difference) -> ValueUpdate:
        _check_update(self, state, update)
        if isinstance(update, Difference):
            values = (update.params.detach() - update.shared).to(torch.float32)
        else:
            values = update.detach().to(torch.float32, copy=True)
        _codec.check_finite(values)
        state.step += 1
        state.threshold, state.density = 0.0, 1.0
        n = state.layout.length
        return ValueUpdate(n, ((0, n),) if n else (), torch.zeros(0, dtype=torch.int64, device=values.device), values)

    def momentum_mask(self, state: CompressorState, message: ValueUpdate) -> None:
        return None

    def __repr__(self) -> str:
        return "DenseCompressor()"


@dataclass
class TopKState(CompressorState):
    """A :class:`CompressorState` that also knows what the last message sent (``last``: its ranges and
    index, no values) and which of this step's picks were not among it (``waited``), with the random
    numbers of its samples (``generator``: its own, so that compressing neither draws from nor
    depends on the program's random state)."""

    last: ValueUpdate | None = None
    waited: torch.Tensor | None = None
    generator: torch.Generator | None = None


class TopKCompressor(_ValueCompressor):
    """Per-tensor top-k with values (Deep Gradient Compression, Lin et al., ICLR 2018).

    Each tensor of two or more dimensions sends the ``density`` fraction of its residual's elements
    of largest magnitude, and at least ``min_elements`` of them (small tensors such as convolution
    kernels would otherwise wait many steps for each of their few elements), as values of type
    ``values`` (``"bf16"``, ``"fp16"`` or ``"fp32"``); what rounding to that type leaves stays in the
    residual, so nothing is lost. 1-D tensors (biases, norm weights) are sent whole at every step.
    Selection is per tensor, so a layer of small updates is sent as often as a layer of large ones.
    The density warms up: it starts at 1 (everything sent) and falls geometrically to ``density``
    over the first ``warmup_steps`` steps of the network's training (not of each fit).
    On the CPU, tensors of more than ``exact_below`` elements pick their cut from a random sample of
    about ``sample`` elements (in runs of 16 side by side: one cache line each) instead of an exact
    top-k (the sent count is then close to, not exactly, k); on a GPU every tensor's
    top-k is exact and the step stays on the device, with one round trip to the host (the finiteness
    check and the statistics) besides the message's own bytes.
    The residual loses nothing (:attr:`~Compressor.lossless`).
    """

    lossless = True

    def __init__(
        self,
        density: float = 0.004,
        values: str = "bf16",
        warmup_steps: int = 20,
        min_elements: int = 32,
        exact_below: int = 1 << 16,
        sample: int = 1 << 14,
    ) -> None:
        if isinstance(density, bool) or not isinstance(density, numbers.Real) or not 0 < density <= 1:
            raise ValueError(f"density must be a number in (0, 1], got {density!r}")
        if values not in VALUE_DTYPES:
            raise ValueError(f"values must be one of {sorted(VALUE_DTYPES)}, got {values!r}")
        for name, value, low in (
            ("warmup_steps", warmup_steps, 0),
            ("min_elements", min_elements, 1),
            ("exact_below", exact_below, 1),
            ("sample", sample, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.density, self.values = float(density), values
        self.warmup_steps, self.min_elements = warmup_steps, min_elements
        self.exact_below, self.sample = exact_below, sample

    def state(self, layout: Layout) -> TopKState:
        base = super().state(layout)
        return TopKState(layout, base.residual, generator=torch.Generator().manual_seed(0))

    def density_at(self, step: int) -> float:
        """The density of step ``step`` (from 0): 1 at first, ``density`` from ``warmup_steps`` on."""
        if step >= self.warmup_steps:
            return self.density
        return self.density ** (step / self.warmup_steps)

    def compress(self, state: TopKState, update: torch.Tensor | Difference) -> ValueUpdate:
        _check_update(self, state, update)
        r = state.residual
        on_host = r.device.type == "cpu"
        implied = isinstance(update, Difference)
        if implied and on_host:  # read where it lies: no residual written and read back
            minuend, subtrahend = update.params.detach(), update.shared.detach()
        else:
            if implied:
                update.into(r)
            else:
                r.add_(update.detach())
            minuend, subtrahend = r, None
        layout, dtype = state.layout, VALUE_DTYPES[self.values]
        density = self.density_at(state.step)
        ranges: list[tuple[int, int]] = []
        picks: list[torch.Tensor] = []
        picked: list[torch.Tensor] = []
        for offset, n, shape in zip(layout.offsets, layout.numels, layout.shapes, strict=True):
            if not n:
                continue
            k = min(n, max(self.min_elements, math.ceil(density * n)))
            if len(shape) <= 1 or 3 * k >= n:  # a third sent with indices costs what the whole does without
                ranges.append((offset, offset + n))
                continue
            a = minuend[offset : offset + n]
            b = None if subtrahend is None else subtrahend[offset : offset + n]
            if on_host:
                index, values = self._select(a, b, k, state.generator)
            else:
                index = _top(a, k)
                values = a.index_select(0, index)
            picks.append(index + offset)
            picked.append(values)
        ranges = _merge(ranges)
        dense = [minuend[a:b] if subtrahend is None else minuend[a:b] - subtrahend[a:b] for a, b in ranges]
        exact = torch.cat([*dense, *picked]).to(torch.float32) if dense or picked else r.new_zeros(0)
        index = torch.cat(picks) if picks else torch.zeros(0, dtype=torch.int64, device=r.device)
        message = ValueUpdate(layout.length, tuple(ranges), index, exact.to(dtype))
        sparse = exact[exact.numel() - index.numel() :].abs()
        smallest = sparse.min() if sparse.numel() else exact.new_zeros(())
        if on_host:  # every element not finite is among those sent: see _select
            _check_sent(message, exact)
            cut = float(smallest)
        else:  # one round trip to the host a step: the finiteness check and the smallest value sent
            total, cut = torch.stack([r.sum(), smallest]).tolist()
            if not math.isfinite(total):
                _codec.check_finite(r)
        if not implied:  # what rounding lost stays; a Difference's caller adds the message to its shared
            _apply_values(message, r, -1.0)
        state.waited = _waited(index, state.last)
        state.last = dataclasses.replace(message, values=message.values[:0])
        state.step += 1
        state.threshold = cut
        state.density = message.count / layout.length if layout.length else 0.0
        return message

    def _select(
        self, a: torch.Tensor, b: torch.Tensor | None, k: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The increasing positions of about ``k`` elements of largest magnitude in the residual
        ``a - b`` (``a`` when ``b`` is ``None``; on the CPU), and their values. Every element that is
        not finite is among them (``topk`` ranks NaN above all, the scan keeps what is not below the
        cut), so that checking the values sent checks the whole residual."""
        n = a.numel()
        if n < self.exact_below:
            r = a if b is None else a - b
            index = _top(r, k)
            return index, r.index_select(0, index)
        sample = _sample(a, b, self.sample, generator).abs()
        cut = float(torch.topk(sample, max(1, math.ceil(k * sample.numel() / n))).values[-1])
        index, values = _scan(a, b, cut)
        if index.numel() > 2 * k:  # a sample's cut that fell too low: the k largest of those found
            top = torch.sort(torch.topk(values.abs(), k, sorted=False).indices).values
            index, values = index.index_select(0, top), values.index_select(0, top)
        return index, values

    def momentum_mask(self, state: TopKState, message: ValueUpdate) -> torch.Tensor:
        """The picks that waited: elements the message before this one did not send. An element
        sent at every step waits for nothing and keeps its momentum, as in one process (masking
        it too would take momentum SGD's momentum away from every element a dense phase sends,
        such as the warm-up's)."""
        return state.waited

    def __repr__(self) -> str:
        return (
            f"TopKCompressor(density={self.density!r}, values={self.values!r}, warmup_steps={self.warmup_steps!r}, "
            f"min_elements={self.min_elements!r}, "
            f"exact_below={self.exact_below!r}, sample={self.sample!r})"
        )


def _top(part: torch.Tensor, k: int) -> torch.Tensor:
    """The increasing positions of the ``k`` elements of largest magnitude in ``part``."""
    return torch.sort(torch.topk(part.abs(), k, sorted=False).indices).values


_RUN = 16  # elements a sample reads side by side: one 64-byte cache line of float32


def _sample(a: torch.Tensor, b: torch.Tensor | None, size: int, generator: torch.Generator) -> torch.Tensor:
    """About ``size`` elements of the residual ``a - b`` (``a`` when ``b`` is ``None``), in runs of
    :data:`_RUN` at random places (with replacement): one cache line read per run, where as many
    single elements would each miss the cache; the whole residual when it is no larger."""
    n = a.numel()
    if n <= size or n < _RUN:
        return a if b is None else a - b
    starts = torch.randint(0, n - _RUN + 1, (max(1, size // _RUN),), generator=generator)
    at = (starts[:, None] + torch.arange(_RUN)).reshape(-1)
    values = a.index_select(0, at)
    return values if b is None else values - b.index_select(0, at)


_BLOCK = 1 << 16  # elements a scan works on at once: its scratch stays in the core's cache


def _scan(a: torch.Tensor, b: torch.Tensor | None, cut: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The increasing positions (int64) and values of the elements of the residual ``a - b`` (``a``
    when ``b`` is ``None``; 1-D float32 CPU tensors) whose magnitude is not below ``cut``: those at
    least ``cut``, and every one that is not finite. Block by block, by numpy's kernels (on one
    thread faster than torch's): the residual is read once from memory and never written, its
    values taken from the block in the cache."""
    x = a.numpy()
    y = None if b is None else b.numpy()
    n = len(x)
    size = min(n, _BLOCK)
    scratch, magnitude, low = np.empty(size, np.float32), np.empty(size, np.float32), np.empty(size, np.bool_)
    c = np.float32(cut)
    positions, values = [], []
    for at in range(0, n, _BLOCK):
        m = min(_BLOCK, n - at)
        if y is None:
            d = x[at : at + m]
        else:
            d = scratch[:m]
            np.subtract(x[at : at + m], y[at : at + m], out=d)
        np.abs(d, out=magnitude[:m])
        np.less(magnitude[:m], c, out=low[:m])
        np.logical_not(low[:m], out=low[:m])  # NaN is not below the cut
        found = np.flatnonzero(low[:m])
        if len(found):
            positions.append(found + at)
            values.append(d[found])
    if not positions:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32)
    return torch.from_numpy(np.concatenate(positions)), torch.from_numpy(np.concatenate(values))


def _check_sent(message: ValueUpdate, exact: torch.Tensor) -> None:
    """Raise :class:`NonFiniteUpdateError` naming the first element of ``message``, whose float32
    values are ``exact``, that is not finite."""
    bad = ~torch.isfinite(exact)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        element = int(message.positions()[i])
        raise NonFiniteUpdateError(f"residual element {element} is {float(exact[i])}: the update is not finite")


def _waited(index: torch.Tensor, last: ValueUpdate | None) -> torch.Tensor:
    """The positions of ``index`` (increasing) that the ``last`` message did not send, found by
    searching its sorted positions (numpy's search on the CPU, several times faster than torch's)
    rather than flags over every element."""
    if last is None:
        return index
    bounds = [p for r in last.ranges for p in r]
    if index.device.type == "cpu":
        i, sent = index.numpy(), last.index.numpy()
        fresh = np.ones(len(i), np.bool_)
        if len(sent):
            fresh &= sent[np.minimum(np.searchsorted(sent, i), len(sent) - 1)] != i
        if bounds:
            fresh &= np.searchsorted(np.asarray(bounds, np.int64), i, side="right") % 2 == 0
        return torch.from_numpy(i[fresh])
    fresh = torch.ones_like(index, dtype=torch.bool)
    if last.index.numel():
        at = torch.searchsorted(last.index, index).clamp_(max=last.index.numel() - 1)
        fresh &= last.index.index_select(0, at) != index
    if bounds:
        fresh &= torch.searchsorted(torch.tensor(bounds, device=index.device), index, right=True) % 2 == 0
    return index.masked_select(fresh)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent ranges joined."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


# -- Deeplearning4j's threshold encoding ------------------------------------------------------------
@dataclass
class Dl4jState(CompressorState):
    """A :class:`CompressorState` with the trainer's own threshold algorithm and post-processor."""

    thresholds: ThresholdAlgorithm | None = None
    post: ResidualPostProcessor | None = None


class Dl4jCompressor(Compressor):
    """Deeplearning4j's threshold encoding: :func:`~dlscale.encoding.encode` of the whole residual
    with one threshold from ``threshold_algorithm`` (every element at or above it sent as ``±t``),
    then ``residual_post_processor`` (clipping by default, which discards what it clips). The
    residual lives with the parameters, on the CPU or a GPU, where the codec works."""

    def __init__(
        self,
        threshold_algorithm: ThresholdAlgorithm | str = "adaptive",
        residual_post_processor: ResidualPostProcessor | str = "clipping",
    ) -> None:
        self.threshold_algorithm = thresholds.threshold_algorithm(threshold_algorithm)
        self.residual_post_processor = residual.residual_post_processor(residual_post_processor)

    def state(self, layout: Layout) -> Dl4jState:
        base = super().state(layout)
        return Dl4jState(
            layout,
            base.residual,
            threshold=self.threshold_algorithm.threshold,
            thresholds=self.threshold_algorithm.clone(),
            post=self.residual_post_processor.clone(),
        )

    def compress(self, state: Dl4jState, update: torch.Tensor | Difference) -> EncodedUpdate | None:
        _check_update(self, state, update)
        r = state.residual
        r.add_(update.detach())
        message = _codec.encode(r, state.thresholds.threshold)
        state.post.process(state.step, message.threshold, r)
        state.thresholds.update(message.sparsity, message.length)
        state.step += 1
        state.threshold, state.density = message.threshold, message.sparsity
        return message if message.count else None

    def apply(self, message: EncodedUpdate, params: torch.Tensor, scale: float = 1.0) -> None:
        _codec.apply(message, params, scale)

    def to_bytes(self, message: EncodedUpdate) -> bytes:
        return message.to_bytes()

    def from_bytes(self, data: bytes | bytearray | memoryview) -> EncodedUpdate:
        return EncodedUpdate.from_bytes(data)

    def momentum_mask(self, state: Dl4jState, message: EncodedUpdate) -> torch.Tensor:
        return torch.from_numpy(_codec.sent_indices(message))

    def describe(self, state: CompressorState, message: EncodedUpdate | None) -> dict[str, float | int | str]:
        if message is None:
            message = EncodedUpdate(_codec.SPARSE, state.threshold, state.layout.length, 0, np.zeros(0, np.int32))
        return _codec.describe(message, state.residual)

    def __repr__(self) -> str:
        return (
            f"Dl4jCompressor(threshold_algorithm={self.threshold_algorithm!r}, "
            f"residual_post_processor={self.residual_post_processor!r})"
        )


DEFAULT = "topk"
"""The compressor ``SharedTrainingMaster`` uses unless told otherwise."""

REGISTRY: Registry[Compressor] = Registry("compressor", Compressor)
REGISTRY.register("topk", TopKCompressor)
REGISTRY.register("dl4j", Dl4jCompressor)
REGISTRY.register("dense", DenseCompressor)
COMPRESSORS = REGISTRY.view
"""The registered compressors by name, read-only (add one with :func:`dlscale.registry.register`)."""


def compressor(spec: Compressor | str, **kwargs: Any) -> Compressor:
    """``spec`` itself if it is a compressor, else the one registered as ``spec`` (or offered by an
    installed plug-in), made with ``kwargs``."""
    return REGISTRY.resolve(spec, **kwargs)
