"""Networks: a PyTorch module with its loss and optimizer, parameters in one flat buffer, archives."""

from __future__ import annotations

from dlscale.nn.archive import build, model_factory
from dlscale.nn.listeners import (
    PerformanceListener,
    ScoreIterationListener,
    TrainingListener,
)
from dlscale.nn.network import Network

__all__ = ["Network", "PerformanceListener", "ScoreIterationListener", "TrainingListener", "build", "model_factory"]
