"""The compression of updates shared between trainers: compressors and DL4J's threshold encoding (see
``docs/encoding.md``)."""

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
from dlscale.encoding.compressors import (
    COMPRESSORS,
    Compressor,
    CompressorState,
    DenseCompressor,
    Dl4jCompressor,
    Layout,
    TopKCompressor,
    ValueUpdate,
    compressor,
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
    "COMPRESSORS",
    "HEADER_BYTES",
    "MAX_LENGTH",
    "RESIDUAL_POST_PROCESSORS",
    "SPARSE",
    "THRESHOLD_ALGORITHMS",
    "AdaptiveThresholdAlgorithm",
    "Compressor",
    "CompressorState",
    "DenseCompressor",
    "Dl4jCompressor",
    "EncodedUpdate",
    "FixedThresholdAlgorithm",
    "Layout",
    "NoOpResidualPostProcessor",
    "NonFiniteUpdateError",
    "ResidualClippingPostProcessor",
    "ResidualPostProcessor",
    "TargetSparsityThresholdAlgorithm",
    "ThresholdAlgorithm",
    "TopKCompressor",
    "ValueUpdate",
    "apply",
    "compressor",
    "decode",
    "describe",
    "encode",
    "residual_post_processor",
    "sent_indices",
    "threshold_algorithm",
]
