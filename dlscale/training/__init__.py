"""Distributed training: ``SparkNet`` and its training masters (imported on first use)."""

from __future__ import annotations

from dlscale._exports import lazy

_EXPORTS = {
    "ParameterAveragingTrainingMaster": "dlscale.training.averaging",
    "SharedTrainingMaster": "dlscale.training.sharing",
    "SparkNet": "dlscale.training.sparknet",
    "TrainingMaster": "dlscale.training.master",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy(__name__, _EXPORTS)
