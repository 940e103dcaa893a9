"""Compressors whose messages are :class:`~dlscale.encoding.wire.ValueUpdate`: their shared wire
form and application (:class:`ValueCompressor`), and ``"dense"`` (:class:`DenseCompressor`), every
element's value at every step, uncompressed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dlscale.encoding import kernels
from dlscale.encoding.contract import Compressor, CompressorState, Difference, check_update
from dlscale.encoding.threshold import check_finite
from dlscale.encoding.wire import VALUE_BITS, ValueUpdate, value_bytes


class ValueCompressor(Compressor):
    """The wire form and application shared by the compressors whose messages are :class:`ValueUpdate`.
    A message made on a device is copied off it by :meth:`stage` on a stream of its own into pinned
    memory, and its values checked to be finite on the host as its bytes are made."""

    def apply(self, message: ValueUpdate, params: torch.Tensor, scale: float = 1.0) -> None:
        kernels.add([message], [params], scale)

    def apply_all(self, messages: Sequence[ValueUpdate], targets: Sequence[torch.Tensor]) -> None:
        kernels.add(messages, targets)

    def stage(self, message: ValueUpdate) -> ValueUpdate | _Staged:
        """A message made on the host, checked as it was made, as it is; one made by a device's kernels
        packed there (index and values as one run of bytes) and copied to the host in one transfer: from
        a GPU, on a stream of its own into pinned memory, which :meth:`to_bytes` waits for."""
        if message.checked:
            return message
        packed = torch.cat([message.index.view(torch.uint8), message.values.view(torch.uint8)])
        done = None
        if packed.device.type == "cuda":
            stream = _STREAMS.get(packed.device) or _STREAMS.setdefault(packed.device, torch.cuda.Stream(packed.device))
            stream.wait_stream(torch.cuda.current_stream(packed.device))
            with torch.cuda.stream(stream):
                host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(packed, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            packed.record_stream(stream)
            packed = host
        else:
            packed = packed.cpu()
        return _Staged(message.length, message.ranges, message.index.numel(), message.values.dtype, packed, done)

    def to_bytes(self, message: ValueUpdate | _Staged) -> bytes:
        if isinstance(message, ValueUpdate):
            message = self.stage(message)
            if isinstance(message, ValueUpdate):
                return message.to_bytes()
        return message.to_bytes()

    def from_bytes(self, data: bytes | bytearray | memoryview) -> ValueUpdate:
        return ValueUpdate.from_bytes(data)


_STREAMS: dict[torch.device, Any] = {}  # a device's stream for copies off it


@dataclass(frozen=True)
class _Staged:
    """A message made by a device's kernels, its ``count`` indices (int64) then its values (of type
    ``dtype``) as one run of bytes, ``packed``, on the host or being copied there (``done``, the event
    the copy records)."""

    length: int
    ranges: tuple[tuple[int, int], ...]
    count: int
    dtype: torch.dtype
    packed: torch.Tensor
    done: Any

    def to_bytes(self) -> bytes:
        """The message's bytes, once its copy is done (one read of the device's bytes), its values
        checked to be finite: numpy's work on the host, nothing dispatched to torch."""
        if self.done is not None:
            self.done.synchronize()
        raw = self.packed.numpy()
        index = raw[: 8 * self.count].view(np.int64)
        bits = raw[8 * self.count :].view(VALUE_BITS[self.dtype])
        kernels.check_sent(self.ranges, index, bits, self.dtype)
        return value_bytes(self.length, self.ranges, index, bits, self.dtype)


class DenseCompressor(ValueCompressor):
    """Every element's value at every step, as float32: no compression, the residual stays zero."""

    lossless = True

    def compress(self, state: CompressorState, update: torch.Tensor | Difference) -> ValueUpdate:
        check_update(self, state, update)
        if isinstance(update, Difference):
            values = (update.params.detach() - update.shared).to(torch.float32)
        else:
            values = update.detach().to(torch.float32, copy=True)
        host = values.device.type == "cpu"
        if host:  # on a device, checked on the host as its bytes are made
            check_finite(values)
        state.step += 1
        state.threshold, state.density = 0.0, 1.0
        n = state.layout.length
        index = torch.zeros(0, dtype=torch.int64, device=values.device)
        return ValueUpdate(n, ((0, n),) if n else (), index, values, checked=host)

    def momentum_mask(self, state: CompressorState, message: ValueUpdate) -> None:
        return None

    def __repr__(self) -> str:
        return "DenseCompressor()"
