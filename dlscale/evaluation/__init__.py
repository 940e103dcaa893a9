"""Evaluation types that accumulate over batches, merge across workers and round-trip through JSON,
and :func:`do_evaluation`, which computes several of them over an RDD in one pass."""

from __future__ import annotations

from dlscale.evaluation._base import BaseEvaluation
from dlscale.evaluation.calibration import EvaluationCalibration
from dlscale.evaluation.classification import Evaluation, EvaluationBinary
from dlscale.evaluation.distributed import do_evaluation
from dlscale.evaluation.regression import RegressionEvaluation
from dlscale.evaluation.roc import ROC, ROCBinary, ROCMultiClass

__all__ = [
    "ROC",
    "BaseEvaluation",
    "Evaluation",
    "EvaluationBinary",
    "EvaluationCalibration",
    "ROCBinary",
    "ROCMultiClass",
    "RegressionEvaluation",
    "do_evaluation",
]
