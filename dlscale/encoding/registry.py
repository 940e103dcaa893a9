"""The compressors by registered name (kind ``compressor`` of :mod:`dlscale.registry`). Built in:

- ``"topk"`` (:class:`~dlscale.encoding.topk.TopKCompressor`, the default): per-tensor top-k
  selection with values, biases and norm weights dense, sparsity warm-up (Deep Gradient
  Compression, Lin et al. 2018);
- ``"dl4j"`` (:class:`~dlscale.encoding.dl4j.Dl4jCompressor`): Deeplearning4j's threshold encoding
  (Strom 2015), :func:`~dlscale.encoding.encode` with a threshold algorithm and a residual
  post-processor;
- ``"dense"`` (:class:`~dlscale.encoding.dense.DenseCompressor`): every element's value at every
  step, uncompressed.
"""

from __future__ import annotations

from typing import Any

from dlscale.encoding.contract import Compressor
from dlscale.encoding.dense import DenseCompressor
from dlscale.encoding.dl4j import Dl4jCompressor
from dlscale.encoding.topk import TopKCompressor
from dlscale.registry import Registry

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
