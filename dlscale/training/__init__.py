"""Distributed training: ``SparkNet`` and its training masters (imported on first use)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ParameterAveragingTrainingMaster": "dlscale.training.averaging",
    "SharedTrainingMaster": "dlscale.training.sharing",
    "SparkNet": "dlscale.training.sparknet",
    "TrainingMaster": "dlscale.training.master",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dlscale.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
