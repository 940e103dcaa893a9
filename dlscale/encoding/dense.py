"""Compressors whose messages are :class:`~dlscale.encoding.wire.ValueUpdate`: their shared wire
form and application (:class:`ValueCompressor`), and ``"dense"`` (:class:`DenseCompressor`), every
element's value at every step, uncompressed.
"""

from __future__ import annotations

import torch

from dlscale.encoding.contract import Compressor, CompressorState, Difference, check_update
from dlscale.encoding.kernels import apply_values
from dlscale.encoding.threshold import check_finite
from dlscale.encoding.wire import ValueUpdate


class ValueCompressor(Compressor):
    """The wire form and application shared by the compressors whose messages are :class:`ValueUpdate`."""

    def apply(self, message: ValueUpdate, params: torch.Tensor, scale: float = 1.0) -> None:
        apply_values(message, params, scale)

    def to_bytes(self, message: ValueUpdate) -> bytes:
        return message.to_bytes()

    def from_bytes(self, data: bytes | bytearray | memoryview) -> ValueUpdate:
        return ValueUpdate.from_bytes(data)


class DenseCompressor(ValueCompressor):
    """Every element's value at every step, as float32: no compression, the residual stays zero."""

    lossless = True

    def compress(self, state: CompressorState, update: torch.Tensor | Difference) -> ValueUpdate:
        check_update(self, state, update)
        if isinstance(update, Difference):
            values = (update.params.detach() - update.shared).to(torch.float32)
        else:
            values = update.detach().to(torch.float32, copy=True)
        check_finite(values)
        state.step += 1
        state.threshold, state.density = 0.0, 1.0
        n = state.layout.length
        return ValueUpdate(n, ((0, n),) if n else (), torch.zeros(0, dtype=torch.int64, device=values.device), values)

    def momentum_mask(self, state: CompressorState, message: ValueUpdate) -> None:
        return None

    def __repr__(self) -> str:
        return "DenseCompressor()"
