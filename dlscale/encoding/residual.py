"""What happens to a trainer's residual between encodings: DL4J's residual post-processors.

A residual element far above the threshold takes many steps to send (one threshold a step) and
goes on being sent long after the update that made it; clipping bounds that backlog.
"""

from __future__ import annotations

import abc
import copy
import math
import numbers
from typing import Any

import torch

from dlscale.registry import Registry


class ResidualPostProcessor(abc.ABC):
    """Changes the residual in place after the encoding of step ``iteration``: it may move elements
    towards zero (as far as zero), never away from it, so nothing is added to what is left to send."""

    @abc.abstractmethod
    def process(self, iteration: int, threshold: float, residual: torch.Tensor) -> None:
        """Post-process ``residual`` (in place) after step ``iteration`` encoded it with ``threshold``."""

    def clone(self) -> ResidualPostProcessor:
        """An independent copy for another trainer."""
        return copy.deepcopy(self)


class NoOpResidualPostProcessor(ResidualPostProcessor):
    """Leaves the residual as it is."""

    def process(self, iteration: int, threshold: float, residual: torch.Tensor) -> None:
        pass

    def __repr__(self) -> str:
        return "NoOpResidualPostProcessor()"


class ResidualClippingPostProcessor(ResidualPostProcessor):
    """Every ``frequency`` iterations (not at iteration 0), clamps the residual to
    ``[-clip_multiple * threshold, clip_multiple * threshold]``: with no new updates, what is left
    would be sent within ``clip_multiple`` steps. DL4J's default post-processor."""

    def __init__(self, clip_multiple: float = 5.0, frequency: int = 5) -> None:
        if (
            isinstance(clip_multiple, bool)
            or not isinstance(clip_multiple, numbers.Real)
            or not math.isfinite(clip_multiple)
            or clip_multiple < 1
        ):
            raise ValueError(
                f"clip_multiple must be a finite number >= 1 (1 clips at the threshold), got {clip_multiple!r}"
            )
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(f"frequency must be a positive integer, got {frequency!r}")
        self.clip_multiple = float(clip_multiple)
        self.frequency = frequency

    def process(self, iteration: int, threshold: float, residual: torch.Tensor) -> None:
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"iteration must be a non-negative integer, got {iteration!r}")
        if not (isinstance(threshold, numbers.Real) and math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"threshold must be positive and finite, got {threshold!r}")
        if iteration > 0 and iteration % self.frequency == 0:
            bound = self.clip_multiple * threshold
            residual.detach().clamp_(-bound, bound)

    def __repr__(self) -> str:
        return f"ResidualClippingPostProcessor(clip_multiple={self.clip_multiple!r}, frequency={self.frequency!r})"


REGISTRY: Registry[ResidualPostProcessor] = Registry(
    "residual_post_processor", ResidualPostProcessor, "residual post-processor"
)
REGISTRY.register("clipping", ResidualClippingPostProcessor)
REGISTRY.register("none", NoOpResidualPostProcessor)
RESIDUAL_POST_PROCESSORS = REGISTRY.view
"""The registered residual post-processors by name, read-only (add one with :func:`dlscale.registry.register`)."""


def residual_post_processor(spec: ResidualPostProcessor | str, **kwargs: Any) -> ResidualPostProcessor:
    """``spec`` itself if it is a post-processor, else the one registered as ``spec`` (or offered by an
    installed plug-in), made with ``kwargs``."""
    return REGISTRY.resolve(spec, **kwargs)
