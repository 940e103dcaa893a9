"""An installed plug-in as the tests see it: this module and ``dlscale_example_plugin-1.0.dist-info``
(its METADATA and entry points) offer a threshold algorithm, a loss and an evaluation type to
dlscale's registries once this folder is on ``sys.path``."""

from __future__ import annotations

from typing import Any

import torch

from dlscale.encoding import ThresholdAlgorithm
from dlscale.evaluation import BaseEvaluation


class StepThresholdAlgorithm(ThresholdAlgorithm):
    """Halves the threshold after a message sparser than ``target``, doubles it after a denser one."""

    def __init__(self, threshold: float = 1e-3, target: float = 1e-2) -> None:
        super().__init__(threshold)
        self.target = target

    def _next(self, sparsity: float, length: int | None) -> float:
        if sparsity == self.target:
            return self._threshold
        return self._threshold / 2 if sparsity < self.target else self._threshold * 2

    def __repr__(self) -> str:
        return f"StepThresholdAlgorithm(target={self.target!r}; threshold={self._threshold!r})"


def absolute_error(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The absolute error of every element, unreduced."""
    return (output - labels.to(output.dtype)).abs()


class ExampleCount(BaseEvaluation, type_name="ExampleCount"):
    """Counts the examples evaluated."""

    def __init__(self) -> None:
        self.count = 0

    def eval(self, labels: Any, predictions: Any, mask: Any = None) -> None:
        self.count += len(self.rows(labels, predictions, mask).predictions)

    def _settings(self) -> dict[str, Any]:
        return {}

    def _accumulated(self) -> dict[str, Any]:
        return {"count": self.count}

    def _restore(self, accumulated: dict[str, Any]) -> None:
        self.count = accumulated["count"]

    def _merge(self, other: BaseEvaluation) -> None:
        self.count += other.count  # type: ignore[attr-defined]

    def reset(self) -> None:
        self.count = 0

    def stats(self) -> str:
        return f"{self.count} examples"
