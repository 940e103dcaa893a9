"""Compressors whose messages are :class:`~dlscale.encoding.wire.ValueUpdate`: their shared wire
form and application (:class:`ValueCompressor`), and ``"dense"`` (:class:`DenseCompressor`), every
element's value at every step, uncompressed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dlscale.encoding import kernels
from dlscale.encoding.contract import Compressor, CompressorState, Difference, check_update
from dlscale.encoding.threshold import check_finite
from dlscale.encoding.wire import ValueUpdate


class ValueCompressor(Compressor):
    """The wire form and application shared by the compressors whose messages are :class:`ValueUpdate`.
    A message made on a device is copied off it by :meth:`stage` on a stream of its own into pinned
    memory, and its values checked to be finite on the host as its bytes are made."""

    def apply(self, message: ValueUpdate, params: torch.Tensor, scale: float = 1.0) -> None:
        kernels.add([message], [params], scale)

    def apply_all(self, messages: Sequence[ValueUpdate], targets: Sequence[torch.Tensor]) -> None:
        kernels.add(messages, targets)

    def stage(self, message: ValueUpdate) -> ValueUpdate | _Staged:
        device = message.values.device
        if device.type != "cuda":  # on the host there is nothing to wait for; elsewhere to_bytes copies
            return message
        stream = _STREAMS.get(device) or _STREAMS.setdefault(device, torch.cuda.Stream(device))
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            index = torch.empty(message.index.shape, dtype=message.index.dtype, pin_memory=True)
            values = torch.empty(message.values.shape, dtype=message.values.dtype, pin_memory=True)
            index.copy_(message.index, non_blocking=True)
            values.copy_(message.values, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        message.index.record_stream(stream)
        message.values.record_stream(stream)
        return _Staged(ValueUpdate(message.length, message.ranges, index, values, None, message.checked), done)

    def to_bytes(self, message: ValueUpdate | _Staged) -> bytes:
        if isinstance(message, _Staged):
            message.done.synchronize()
            message = message.message
        elif message.values.device.type != "cpu":
            message = ValueUpdate(
                message.length, message.ranges, message.index.cpu(), message.values.cpu(), None, message.checked
            )
        if not message.checked:
            kernels.check_sent(message)
        return message.to_bytes()

    def from_bytes(self, data: bytes | bytearray | memoryview) -> ValueUpdate:
        return ValueUpdate.from_bytes(data)


_STREAMS: dict[torch.device, Any] = {}  # a device's stream for copies off it


@dataclass(frozen=True)
class _Staged:
    """A message whose ``message`` (index and values in pinned host memory) is being copied off its
    device; ``done`` is the event the copy records."""

    message: ValueUpdate
    done: Any


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
