"""Networks: a PyTorch module with its loss and optimizer, parameters in one flat buffer, archives.

Names are imported on first use, so importing the package imports none of its modules."""

from __future__ import annotations

from dlscale._exports import lazy

_EXPORTS = {
    "build": "dlscale.nn.archive",
    "model_factory": "dlscale.nn.archive",
    "PerformanceListener": "dlscale.nn.listeners",
    "ScoreIterationListener": "dlscale.nn.listeners",
    "TrainingListener": "dlscale.nn.listeners",
    "Network": "dlscale.nn.network",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy(__name__, _EXPORTS)
