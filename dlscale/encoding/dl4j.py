"""``"dl4j"``: Deeplearning4j's threshold encoding (Strom 2015) as a compressor,
:func:`~dlscale.encoding.encode` with a threshold algorithm and a residual post-processor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dlscale.encoding import residual, threshold, thresholds
from dlscale.encoding.contract import Compressor, CompressorState, Difference, Layout, MomentumMask, check_update
from dlscale.encoding.residual import ResidualPostProcessor
from dlscale.encoding.thresholds import ThresholdAlgorithm
from dlscale.encoding.wire import SPARSE, EncodedUpdate


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
        check_update(self, state, update)
        r = state.residual
        r.add_(update.detach())
        message = threshold.encode(r, state.thresholds.threshold)
        state.post.process(state.step, message.threshold, r)
        state.thresholds.update(message.sparsity, message.length)
        state.step += 1
        state.threshold, state.density = message.threshold, message.sparsity
        return message if message.count else None

    def apply(self, message: EncodedUpdate, params: torch.Tensor, scale: float = 1.0) -> None:
        threshold.apply(message, params, scale)

    def to_bytes(self, message: EncodedUpdate) -> bytes:
        return message.to_bytes()

    def from_bytes(self, data: bytes | bytearray | memoryview) -> EncodedUpdate:
        return EncodedUpdate.from_bytes(data)

    def momentum_mask(self, state: Dl4jState, message: EncodedUpdate) -> MomentumMask:
        return MomentumMask(torch.from_numpy(threshold.sent_indices(message)))

    def describe(self, state: CompressorState, message: EncodedUpdate | None) -> dict[str, float | int | str]:
        if message is None:
            message = EncodedUpdate(SPARSE, state.threshold, state.layout.length, 0, np.zeros(0, np.int32))
        return threshold.describe(message, state.residual)

    def __repr__(self) -> str:
        return (
            f"Dl4jCompressor(threshold_algorithm={self.threshold_algorithm!r}, "
            f"residual_post_processor={self.residual_post_processor!r})"
        )
