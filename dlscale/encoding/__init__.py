"""The compression of updates shared between trainers: compressors and DL4J's threshold encoding (see
``docs/encoding.md``).

Names are imported on first use, so importing the package imports none of its modules."""

from __future__ import annotations

from dlscale._exports import lazy

_EXPORTS = {
    "BITMAP": "dlscale.encoding._codec",
    "EncodedUpdate": "dlscale.encoding._codec",
    "HEADER_BYTES": "dlscale.encoding._codec",
    "MAX_LENGTH": "dlscale.encoding._codec",
    "NonFiniteUpdateError": "dlscale.encoding._codec",
    "SPARSE": "dlscale.encoding._codec",
    "apply": "dlscale.encoding._codec",
    "decode": "dlscale.encoding._codec",
    "describe": "dlscale.encoding._codec",
    "encode": "dlscale.encoding._codec",
    "sent_indices": "dlscale.encoding._codec",
    "COMPRESSORS": "dlscale.encoding.compressors",
    "Compressor": "dlscale.encoding.compressors",
    "CompressorState": "dlscale.encoding.compressors",
    "DenseCompressor": "dlscale.encoding.compressors",
    "Difference": "dlscale.encoding.compressors",
    "Dl4jCompressor": "dlscale.encoding.compressors",
    "Layout": "dlscale.encoding.compressors",
    "TopKCompressor": "dlscale.encoding.compressors",
    "ValueUpdate": "dlscale.encoding.compressors",
    "compressor": "dlscale.encoding.compressors",
    "NoOpResidualPostProcessor": "dlscale.encoding.residual",
    "RESIDUAL_POST_PROCESSORS": "dlscale.encoding.residual",
    "ResidualClippingPostProcessor": "dlscale.encoding.residual",
    "ResidualPostProcessor": "dlscale.encoding.residual",
    "residual_post_processor": "dlscale.encoding.residual",
    "AdaptiveThresholdAlgorithm": "dlscale.encoding.thresholds",
    "FixedThresholdAlgorithm": "dlscale.encoding.thresholds",
    "THRESHOLD_ALGORITHMS": "dlscale.encoding.thresholds",
    "TargetSparsityThresholdAlgorithm": "dlscale.encoding.thresholds",
    "ThresholdAlgorithm": "dlscale.encoding.thresholds",
    "threshold_algorithm": "dlscale.encoding.thresholds",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy(__name__, _EXPORTS)
