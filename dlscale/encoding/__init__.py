"""Threshold encoding of updates for sharing them between trainers (see ``docs/encoding.md``)."""

from __future__ import annotations

from dlscale.encoding._codec import (
    BITMAP,
    HEADER_BYTES,
    MAX_LENGTH,
    SPARSE,
    EncodedUpdate,
    NonFiniteUpdateError,
    apply,
    decode,
    describe,
    encode,
    sent_indices,
)
from dlscale.encoding.residual import (
    RESIDUAL_POST_PROCESSORS,
    NoOpResidualPostProcessor,
    ResidualClippingPostProcessor,
    ResidualPostProcessor,
    residual_post_processor,
)
from dlscale.encoding.thresholds import (
    THRESHOLD_ALGORITHMS,
    AdaptiveThresholdAlgorithm,
    FixedThresholdAlgorithm,
    TargetSparsityThresholdAlgorithm,
    ThresholdAlgorithm,
    threshold_algorithm,
)

__all__ = [
    "BITMAP",
    "HEADER_BYTES",
    "MAX_LENGTH",
    "RESIDUAL_POST_PROCESSORS",
    "SPARSE",
    "THRESHOLD_ALGORITHMS",
    "AdaptiveThresholdAlgorithm",
    "EncodedUpdate",
    "FixedThresholdAlgorithm",
    "NoOpResidualPostProcessor",
    "NonFiniteUpdateError",
    "ResidualClippingPostProcessor",
    "ResidualPostProcessor",
    "TargetSparsityThresholdAlgorithm",
    "ThresholdAlgorithm",
    "apply",
    "decode",
    "describe",
    "encode",
    "residual_post_processor",
    "sent_indices",
    "threshold_algorithm",
]
