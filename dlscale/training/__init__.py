"""Distributed training: ``SparkNet`` and its training masters."""

from __future__ import annotations

from dlscale.training.averaging import ParameterAveragingTrainingMaster
from dlscale.training.master import TrainingMaster
from dlscale.training.sharing import SharedTrainingMaster
from dlscale.training.sparknet import SparkNet

__all__ = ["ParameterAveragingTrainingMaster", "SharedTrainingMaster", "SparkNet", "TrainingMaster"]
