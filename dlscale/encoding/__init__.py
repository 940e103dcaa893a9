"""The compression of updates shared between trainers (see ``docs/encoding.md``): the contract every
compressor implements (``contract``), the messages' wire forms (``wire``), DL4J's threshold encoding
(``threshold``, with its threshold algorithms in ``thresholds`` and residual post-processors in
``residual``), the kernels of value messages and top-k (``kernels``), a module per compressor
(``topk``, ``dl4j``, ``dense``) and the compressors by name (``registry``).

Names are imported on first use, so importing the package imports none of its modules."""

from __future__ import annotations

from dlscale._exports import lazy

_EXPORTS = {
    "Compressor": "dlscale.encoding.contract",
    "CompressorState": "dlscale.encoding.contract",
    "Difference": "dlscale.encoding.contract",
    "Layout": "dlscale.encoding.contract",
    "MomentumMask": "dlscale.encoding.contract",
    "BITMAP": "dlscale.encoding.wire",
    "EncodedUpdate": "dlscale.encoding.wire",
    "HEADER_BYTES": "dlscale.encoding.wire",
    "MAX_LENGTH": "dlscale.encoding.wire",
    "SPARSE": "dlscale.encoding.wire",
    "ValueUpdate": "dlscale.encoding.wire",
    "NonFiniteUpdateError": "dlscale.errors",
    "apply": "dlscale.encoding.threshold",
    "decode": "dlscale.encoding.threshold",
    "describe": "dlscale.encoding.threshold",
    "encode": "dlscale.encoding.threshold",
    "sent_indices": "dlscale.encoding.threshold",
    "DenseCompressor": "dlscale.encoding.dense",
    "TopKCompressor": "dlscale.encoding.topk",
    "Dl4jCompressor": "dlscale.encoding.dl4j",
    "COMPRESSORS": "dlscale.encoding.registry",
    "DEFAULT": "dlscale.encoding.registry",
    "compressor": "dlscale.encoding.registry",
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
