"""How the encoding threshold follows training: fixed, or adapted to the sparsity of the last
message (``count / length``), as DL4J's threshold algorithms do."""

from __future__ import annotations

import abc
import copy
import math
import numbers
from typing import Any

from dlscale.registry import Registry

DEFAULT_DECAY_RATE = 0.5 ** (1 / 20)
"""Halves or doubles the threshold in 20 steps."""

# the threshold stays a positive, finite float32 however long it keeps moving one way
_LOWEST = 1.1754943508222875e-38
_HIGHEST = 3.4028234663852886e38


class ThresholdAlgorithm(abc.ABC):
    """The threshold of the next encoding: ``threshold`` now, and ``update(sparsity)`` after each
    encoding with the sparsity of the message it made. Each trainer has its own (``clone()``)."""

    def __init__(self, threshold: float) -> None:
        self._threshold = threshold

    @property
    def threshold(self) -> float:
        """The threshold to encode with now."""
        return self._threshold

    def update(self, sparsity: float, length: int | None = None) -> float:
        """Take the sparsity of the last message (in [0, 1]) and, where known, the length of the
        vector it encodes; return the next threshold."""
        if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real) or not 0 <= sparsity <= 1:
            raise ValueError(f"sparsity must be a number in [0, 1], got {sparsity!r}")
        if length is not None and (isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 1):
            raise ValueError(f"length must be a positive integer or None, got {length!r}")
        self._threshold = min(max(self._next(float(sparsity), length), _LOWEST), _HIGHEST)
        return self._threshold

    @abc.abstractmethod
    def _next(self, sparsity: float, length: int | None) -> float:
        """The next threshold, from the current one, the last sparsity and the vector's length."""

    def clone(self) -> ThresholdAlgorithm:
        """An independent copy, with the same settings and current threshold, for another trainer."""
        return copy.deepcopy(self)


class FixedThresholdAlgorithm(ThresholdAlgorithm):
    """The same threshold at every step."""

    def __init__(self, threshold: float = 1e-3) -> None:
        super().__init__(_positive("threshold", threshold))

    def _next(self, sparsity: float, length: int | None) -> float:
        return self._threshold

    def __repr__(self) -> str:
        return f"FixedThresholdAlgorithm(threshold={self._threshold!r})"


class AdaptiveThresholdAlgorithm(ThresholdAlgorithm):
    """Keeps the sparsity within ``[min_target_sparsity, max_target_sparsity]``: below it the
    threshold is multiplied by ``decay_rate`` (more is sent), above it divided by ``decay_rate``
    (less is sent), within it left as it is. DL4J's default algorithm.

    Messages of up to ``small_message_elements`` elements (when the length is known) are not made
    sparser than 1/16: a message that small costs its latency rather than its bytes, and a higher
    threshold would only coarsen the update (on a small network, a 1% bound drives the threshold up
    to the size of the weights themselves)."""

    def __init__(
        self,
        initial_threshold: float = 1e-3,
        min_target_sparsity: float = 1e-4,
        max_target_sparsity: float = 1e-2,
        decay_rate: float = DEFAULT_DECAY_RATE,
        small_message_elements: int = 512,
    ) -> None:
        super().__init__(_positive("initial_threshold", initial_threshold))
        self.initial_threshold = self._threshold
        self.min_target_sparsity = _fraction("min_target_sparsity", min_target_sparsity, 1.0)
        self.max_target_sparsity = _fraction("max_target_sparsity", max_target_sparsity, 1.0)
        if self.min_target_sparsity > self.max_target_sparsity:
            raise ValueError(
                f"min_target_sparsity ({min_target_sparsity}) must not exceed max_target_sparsity "
                f"({max_target_sparsity})"
            )
        self.decay_rate = _decay_rate(decay_rate)
        if (
            isinstance(small_message_elements, bool)
            or not isinstance(small_message_elements, numbers.Integral)
            or small_message_elements < 0
        ):
            raise ValueError(f"small_message_elements must be a non-negative integer, got {small_message_elements!r}")
        self.small_message_elements = int(small_message_elements)

    def _next(self, sparsity: float, length: int | None) -> float:
        upper = self.max_target_sparsity
        if length is not None:
            upper = max(upper, min(1 / 16, self.small_message_elements / length))
        if sparsity < self.min_target_sparsity:
            return self._threshold * self.decay_rate
        if sparsity > upper:
            return self._threshold / self.decay_rate
        return self._threshold

    def __repr__(self) -> str:
        return (
            f"AdaptiveThresholdAlgorithm(initial_threshold={self.initial_threshold!r}, "
            f"min_target_sparsity={self.min_target_sparsity!r}, max_target_sparsity={self.max_target_sparsity!r}, "
            f"decay_rate={self.decay_rate!r}, small_message_elements={self.small_message_elements!r}; "
            f"threshold={self._threshold!r})"
        )


class TargetSparsityThresholdAlgorithm(ThresholdAlgorithm):
    """Steers the sparsity towards ``sparsity_target``: the threshold is multiplied by
    ``decay_rate`` after a sparsity below the target, divided by it after one above, at every step."""

    def __init__(
        self, initial_threshold: float = 1e-3, sparsity_target: float = 1e-3, decay_rate: float = DEFAULT_DECAY_RATE
    ) -> None:
        super().__init__(_positive("initial_threshold", initial_threshold))
        self.initial_threshold = self._threshold
        # above 1/16 the bitmap form is smaller, whatever the count: a higher target buys nothing
        self.sparsity_target = _fraction("sparsity_target", sparsity_target, 1 / 16)
        self.decay_rate = _decay_rate(decay_rate)

    def _next(self, sparsity: float, length: int | None) -> float:
        if sparsity < self.sparsity_target:
            return self._threshold * self.decay_rate
        if sparsity > self.sparsity_target:
            return self._threshold / self.decay_rate
        return self._threshold

    def __repr__(self) -> str:
        return (
            f"TargetSparsityThresholdAlgorithm(initial_threshold={self.initial_threshold!r}, "
            f"sparsity_target={self.sparsity_target!r}, decay_rate={self.decay_rate!r}; "
            f"threshold={self._threshold!r})"
        )


REGISTRY: Registry[ThresholdAlgorithm] = Registry("threshold_algorithm", ThresholdAlgorithm)
REGISTRY.register("adaptive", AdaptiveThresholdAlgorithm)
REGISTRY.register("fixed", FixedThresholdAlgorithm)
REGISTRY.register("target_sparsity", TargetSparsityThresholdAlgorithm)
THRESHOLD_ALGORITHMS = REGISTRY.view
"""The registered threshold algorithms by name, read-only (add one with :func:`dlscale.registry.register`)."""


def threshold_algorithm(spec: ThresholdAlgorithm | str, **kwargs: Any) -> ThresholdAlgorithm:
    """``spec`` itself if it is an algorithm, else the algorithm registered as ``spec`` (or offered by
    an installed plug-in), made with ``kwargs``."""
    return REGISTRY.resolve(spec, **kwargs)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _positive(name: str, value: Any) -> float:
    v = _number(name, value)
    if not _LOWEST <= v <= _HIGHEST:
        raise ValueError(f"{name} must be positive (and a normal float32), got {value!r}")
    return v


def _fraction(name: str, value: Any, upper: float) -> float:
    v = _number(name, value)
    if not 0 < v <= upper:
        raise ValueError(f"{name} must be in (0, {upper:g}], got {value!r}")
    return v


def _decay_rate(value: Any) -> float:
    v = _number("decay_rate", value)
    if not 0.5 <= v < 1:
        raise ValueError(f"decay_rate must be in [0.5, 1), got {value!r}")
    return v
