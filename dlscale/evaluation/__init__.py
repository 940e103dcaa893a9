"""Evaluation types that accumulate over batches, merge across workers and round-trip through JSON,
and :func:`do_evaluation`, which computes several of them over an RDD in one pass.

Names are imported on first use, so importing the package imports none of its modules."""

from __future__ import annotations

from dlscale._exports import lazy

_EXPORTS = {
    "BaseEvaluation": "dlscale.evaluation._base",
    "EvaluationCalibration": "dlscale.evaluation.calibration",
    "Evaluation": "dlscale.evaluation.classification",
    "EvaluationBinary": "dlscale.evaluation.classification",
    "do_evaluation": "dlscale.evaluation.distributed",
    "RegressionEvaluation": "dlscale.evaluation.regression",
    "ROC": "dlscale.evaluation.roc",
    "ROCBinary": "dlscale.evaluation.roc",
    "ROCMultiClass": "dlscale.evaluation.roc",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy(__name__, _EXPORTS)
