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


class ResidualPostProcessor(abc.ABC):
    """Changes the residual in place after the encoding of step ``iteration``."""

    @abc.abstractmethod
    def process(self, iteration: int, threshold: float, residual: torch.Tensor) -> None:
        """Post-process ``residual`` after step ``iteration`` encoded it with ``threshold``."""

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


RESIDUAL_POST_PROCESSORS: dict[str, type[ResidualPostProcessor]] = {
    "clipping": ResidualClippingPostProcessor,
    "none": NoOpResidualPostProcessor,
}


def residual_post_processor(spec: ResidualPostProcessor | str, **kwargs: Any) -> ResidualPostProcessor:
    """``spec`` itself if it is a post-processor, else the one of that name in
    :data:`RESIDUAL_POST_PROCESSORS`, made with ``kwargs``."""
    if isinstance(spec, ResidualPostProcessor):
        if kwargs:
            raise TypeError(f"keyword arguments {sorted(kwargs)} go with a post-processor's name, not an instance")
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a residual post-processor is a ResidualPostProcessor or a name, got {type(spec).__name__}")
    if spec not in RESIDUAL_POST_PROCESSORS:
        raise ValueError(
            f"unknown residual post-processor {spec!r}; known: {', '.join(sorted(RESIDUAL_POST_PROCESSORS))}"
        )
    return RESIDUAL_POST_PROCESSORS[spec](**kwargs)
