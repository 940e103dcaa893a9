"""ROC and precision-recall evaluation: binary (:class:`ROC`), multi-label (:class:`ROCBinary`) and
one-vs-all multi-class (:class:`ROCMultiClass`), as in Deeplearning4j.

Each binary problem is accumulated in one of two modes, chosen by ``threshold_steps``:

* ``0`` (exact): every (score, label) pair is kept, so the curves, AUC and AUPRC equal
  scikit-learn's ``roc_curve(..., drop_intermediate=False)``, ``roc_auc_score``,
  ``precision_recall_curve`` and ``average_precision_score`` (ties included). Memory grows with the
  number of examples; merging concatenates.
* ``k > 0`` (histogram): scores are read as probabilities and clamped to ``[0, 1]``; only the
  number of positives and negatives whose score rounds down to each threshold ``i / k`` is kept
  (``k + 1`` counts each), so memory does not depend on the number of examples and merging adds
  counts. The result is the exact result for the scores rounded down to multiples of ``1 / k``:
  equal to the exact mode where the scores are such multiples (``i / k``), and approaching it as
  ``k`` grows otherwise.

AUPRC (:meth:`calculate_auprc`) is the non-interpolated average precision, the step-wise sum over
thresholds of ``(R_n - R_(n-1)) * P_n``, as scikit-learn's ``average_precision_score``; it is not
the trapezoid area under the precision-recall curve, which is optimistic.

Undefined quantities are ``nan`` rather than errors: AUC without both positives and negatives
(scikit-learn 1.9 also gives ``nan``, with a warning), AUPRC without data. Where scikit-learn gives
a number the result is the same: AUPRC is 1.0 with only positives and 0.0 with only negatives; a
curve's rates are ``nan`` where their denominator is 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dlscale.errors import EvaluationError, IncompatibleEvaluationError
from dlscale.evaluation._base import BaseEvaluation, class_indices

__all__ = ["ROC", "ROCBinary", "ROCMultiClass"]

Curve = tuple[np.ndarray, np.ndarray, np.ndarray]


def _check_steps(threshold_steps: int) -> int:
    if isinstance(threshold_steps, bool) or not isinstance(threshold_steps, (int, np.integer)) or threshold_steps < 0:
        raise ValueError(f"threshold_steps must be an int >= 0 (0: exact), not {threshold_steps!r}")
    return int(threshold_steps)


def _mode(threshold_steps: int) -> str:
    if threshold_steps:
        return f"histogram, {threshold_steps} threshold steps"
    return "exact"


class _BinaryCurve:
    """The scores and labels of one binary problem: every pair (exact) or counts per threshold
    (histogram), and everything computed from them."""

    def __init__(self, threshold_steps: int) -> None:
        self.threshold_steps = threshold_steps
        self.reset()

    def reset(self) -> None:
        """Forget every score."""
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []  # exact: (float64 scores, bool labels)
        size = self.threshold_steps + 1 if self.threshold_steps else 0
        self._positives = np.zeros(size, np.int64)  # histogram: per threshold i / k
        self._negatives = np.zeros(size, np.int64)
        self._cache: Curve | None = None

    def add(self, scores: np.ndarray, positive: np.ndarray) -> None:
        """Add scores (any finite floats) with whether each example is positive."""
        if not scores.size:
            return
        self._cache = None
        scores = np.array(scores, np.float64)  # a copy: the caller's array may be a reused buffer
        positive = np.array(positive, bool)
        if not self.threshold_steps:
            self._chunks.append((scores, positive))
            return
        k = self.threshold_steps
        # The largest threshold i / k at or below each score; searching the thresholds themselves
        # (not floor(score * k)) keeps a score equal to i / k in bin i despite rounding.
        grid = np.arange(k + 1) / k
        bins = np.searchsorted(grid, np.clip(scores, 0.0, 1.0), side="right") - 1
        self._positives += np.bincount(bins[positive], minlength=k + 1)
        self._negatives += np.bincount(bins[~positive], minlength=k + 1)

    def merge(self, other: _BinaryCurve) -> None:
        """Add ``other``'s scores (same mode)."""
        self._cache = None
        self._chunks.extend(other._chunks)
        self._positives += other._positives
        self._negatives += other._negatives

    def _pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Every score and label (exact mode), joined into one chunk."""
        if len(self._chunks) != 1:
            scores = np.concatenate([c[0] for c in self._chunks]) if self._chunks else np.zeros(0)
            labels = np.concatenate([c[1] for c in self._chunks]) if self._chunks else np.zeros(0, bool)
            self._chunks = [(scores, labels)] if scores.size else []
            return scores, labels
        return self._chunks[0]

    def state(self) -> dict[str, Any]:
        """The accumulated values as plain lists."""
        if self.threshold_steps:
            return {"positives": self._positives.tolist(), "negatives": self._negatives.tolist()}
        scores, labels = self._pairs()
        return {"scores": scores.tolist(), "labels": labels.astype(np.int64).tolist()}

    def restore(self, state: dict[str, Any]) -> None:
        """Set the accumulated values from :meth:`state`'s output."""
        self.reset()
        if self.threshold_steps:
            positives = np.asarray(state["positives"], np.int64)
            negatives = np.asarray(state["negatives"], np.int64)
            if positives.shape != self._positives.shape or negatives.shape != self._negatives.shape:
                raise IncompatibleEvaluationError(
                    f"histogram of {positives.size} and {negatives.size} counts; "
                    f"threshold_steps={self.threshold_steps} needs {self._positives.size}"
                )
            self._positives, self._negatives = positives, negatives
        else:
            scores = np.asarray(state["scores"], np.float64)
            labels = np.asarray(state["labels"], np.int64).astype(bool)
            if scores.shape != labels.shape or scores.ndim != 1:
                raise IncompatibleEvaluationError(f"{scores.size} scores but {labels.size} labels")
            self.add(scores, labels)

    def points(self) -> Curve:
        """``(thresholds, tps, fps)``: each distinct threshold, highest first, with the number of
        positives and negatives scoring at or above it (cached until the next change)."""
        if self._cache is None:
            if self.threshold_steps:
                occupied = np.flatnonzero(self._positives + self._negatives)[::-1]
                thresholds = occupied / self.threshold_steps
                tps = np.cumsum(self._positives[::-1])[::-1][occupied]
                fps = np.cumsum(self._negatives[::-1])[::-1][occupied]
            else:
                scores, labels = self._pairs()
                order = np.argsort(scores, kind="mergesort")[::-1]
                scores, labels = scores[order], labels[order]
                last = np.r_[np.flatnonzero(np.diff(scores)), scores.size - 1] if scores.size else order
                thresholds = scores[last]
                tps = np.cumsum(labels, dtype=np.int64)[last]
                fps = last + 1 - tps
            self._cache = (thresholds, tps, fps)
        return self._cache

    def positives(self) -> int:
        """Number of positive examples."""
        tps = self.points()[1]
        return int(tps[-1]) if tps.size else 0

    def negatives(self) -> int:
        """Number of negative examples."""
        fps = self.points()[2]
        return int(fps[-1]) if fps.size else 0

    def roc_curve(self) -> Curve:
        """``(fpr, tpr, thresholds)`` as scikit-learn's ``roc_curve(..., drop_intermediate=False)``:
        a first point (0, 0) at threshold ``inf``, then one point per threshold, highest first."""
        thresholds, tps, fps = self.points()
        with np.errstate(divide="ignore", invalid="ignore"):
            fpr = np.r_[0, fps] / (fps[-1] if fps.size else 0)
            tpr = np.r_[0, tps] / (tps[-1] if tps.size else 0)
        return fpr, tpr, np.r_[np.inf, thresholds]

    def precision_recall_curve(self) -> Curve:
        """``(precision, recall, thresholds)`` as scikit-learn's ``precision_recall_curve``:
        thresholds lowest first, then a last point (precision 1, recall 0); recall is 1 throughout
        when there are no positives."""
        thresholds, tps, fps = self.points()
        precision = tps / (tps + fps)
        recall = tps / tps[-1] if tps.size and tps[-1] else np.ones(tps.size)
        return np.r_[precision[::-1], 1.0], np.r_[recall[::-1], 0.0], thresholds[::-1]

    def auc(self) -> float:
        """Area under the ROC curve (trapezoids); ``nan`` without both positives and negatives."""
        _, tps, fps = self.points()
        if not tps.size or not tps[-1] or not fps[-1]:
            return float("nan")
        return float(np.trapezoid(np.r_[0, tps] / tps[-1], np.r_[0, fps] / fps[-1]))

    def auprc(self) -> float:
        """Average precision (non-interpolated); ``nan`` without data, 0 without positives."""
        _, tps, fps = self.points()
        if not tps.size:
            return float("nan")
        if not tps[-1]:
            return 0.0
        return float(np.sum(np.diff(np.r_[0, tps]) / tps[-1] * (tps / (tps + fps))))


class ROC(BaseEvaluation, type_name="ROC"):
    """Binary ROC and precision-recall evaluation (DL4J's ``ROC``).

    Predictions are ``[N, 1]`` or ``[N]`` (the positive class's probability) or ``[N, 2]`` (column 1
    is the positive class); sequences ``[N, T, C]`` with ``[N, T]`` masks are flattened. Labels are
    0/1 (``[N, 1]`` or ``[N]``; positive where ``>= 0.5``), one-hot ``[N, 2]`` or class indices.
    ``threshold_steps`` picks exact (0) or histogram (k > 0) mode; see the module documentation.
    """

    def __init__(self, threshold_steps: int = 0) -> None:
        self.threshold_steps = _check_steps(threshold_steps)
        self._curve = _BinaryCurve(self.threshold_steps)

    def eval(self, labels: Any, predictions: Any, mask: Any = None) -> None:
        """Add one batch of labels and predicted probabilities."""
        r = self.rows(labels, predictions, mask)
        c = r.predictions.shape[1]
        if c > 2:
            raise EvaluationError(
                f"ROC: predictions with {c} columns; ROC is binary ([N], [N, 1] or [N, 2]): "
                "use ROCMultiClass for several classes or ROCBinary for several outputs"
            )
        self._curve.add(r.predictions[:, c - 1], class_indices(r, c, "ROC") == 1)

    def calculate_auc(self) -> float:
        """Area under the ROC curve; ``nan`` unless both classes were seen."""
        return self._curve.auc()

    def calculate_auprc(self) -> float:
        """Area under the precision-recall curve as non-interpolated average precision."""
        return self._curve.auprc()

    def get_roc_curve(self) -> Curve:
        """``(fpr, tpr, thresholds)``, highest threshold first, starting at (0, 0) and ``inf``."""
        return self._curve.roc_curve()

    def get_precision_recall_curve(self) -> Curve:
        """``(precision, recall, thresholds)``, lowest threshold first, ending at (1, 0)."""
        return self._curve.precision_recall_curve()

    def count_actual_positive(self) -> int:
        """Number of positive examples seen."""
        return self._curve.positives()

    def count_actual_negative(self) -> int:
        """Number of negative examples seen."""
        return self._curve.negatives()

    def _settings(self) -> dict[str, Any]:
        return {"threshold_steps": self.threshold_steps}

    def _accumulated(self) -> dict[str, Any]:
        return self._curve.state()

    def _restore(self, accumulated: dict[str, Any]) -> None:
        self._curve.restore(accumulated)

    def _merge(self, other: BaseEvaluation) -> None:
        self._curve.merge(other._curve)  # type: ignore[attr-defined]

    def reset(self) -> None:
        self._curve.reset()

    def stats(self) -> str:
        positives, negatives = self.count_actual_positive(), self.count_actual_negative()
        return "\n".join(
            [
                f"ROC ({_mode(self.threshold_steps)})",
                f"Examples:  {positives + negatives} ({positives} positive, {negatives} negative)",
                f"AUC:       {self.calculate_auc():.4f}",
                f"AUPRC:     {self.calculate_auprc():.4f}  (average precision)",
            ]
        )


class _PerOutputROC(BaseEvaluation):
    """One binary curve per output column; the number of outputs is fixed by the first batch."""

    _noun = "output"

    def __init__(self, threshold_steps: int = 0) -> None:
        self.threshold_steps = _check_steps(threshold_steps)
        self._curves: list[_BinaryCurve] = []

    def _add(self, scores: np.ndarray, positive: np.ndarray, mask: np.ndarray | None) -> None:
        """Add ``[M, C]`` scores and positives, leaving out entries where ``mask`` is False."""
        c = scores.shape[1]
        if not self._curves:
            self._curves = [_BinaryCurve(self.threshold_steps) for _ in range(c)]
        elif c != len(self._curves):
            raise EvaluationError(
                f"{type(self).__name__}: predictions with {c} {self._noun}s; earlier batches had {len(self._curves)}"
            )
        for j, curve in enumerate(self._curves):
            keep = slice(None) if mask is None else mask[:, j]
            curve.add(scores[keep, j], positive[keep, j])

    def _curve(self, output: int) -> _BinaryCurve:
        if not -len(self._curves) <= output < len(self._curves):
            raise IndexError(f"{type(self).__name__}: no {self._noun} {output}; there are {len(self._curves)}")
        return self._curves[output]

    def num_outputs(self) -> int:
        """Number of outputs (columns of the predictions); 0 before the first batch."""
        return len(self._curves)

    def calculate_auc(self, output: int) -> float:
        """Area under the ROC curve of one output; ``nan`` unless it saw both classes."""
        return self._curve(output).auc()

    def calculate_auprc(self, output: int) -> float:
        """Average precision (non-interpolated) of one output."""
        return self._curve(output).auprc()

    def calculate_average_auc(self) -> float:
        """Mean AUC over the outputs; ``nan`` if any output's AUC is undefined (or none seen)."""
        return float(np.mean([c.auc() for c in self._curves])) if self._curves else float("nan")

    def calculate_average_auprc(self) -> float:
        """Mean average precision over the outputs; ``nan`` if none seen."""
        return float(np.mean([c.auprc() for c in self._curves])) if self._curves else float("nan")

    def get_roc_curve(self, output: int) -> Curve:
        """``(fpr, tpr, thresholds)`` of one output, highest threshold first."""
        return self._curve(output).roc_curve()

    def get_precision_recall_curve(self, output: int) -> Curve:
        """``(precision, recall, thresholds)`` of one output, lowest threshold first."""
        return self._curve(output).precision_recall_curve()

    def count_actual_positive(self, output: int) -> int:
        """Number of (unmasked) positives of one output."""
        return self._curve(output).positives()

    def count_actual_negative(self, output: int) -> int:
        """Number of (unmasked) negatives of one output."""
        return self._curve(output).negatives()

    def _settings(self) -> dict[str, Any]:
        return {"threshold_steps": self.threshold_steps}

    def _accumulated(self) -> dict[str, Any]:
        return {"curves": [c.state() for c in self._curves]}

    def _restore(self, accumulated: dict[str, Any]) -> None:
        self._curves = [_BinaryCurve(self.threshold_steps) for _ in accumulated["curves"]]
        for curve, state in zip(self._curves, accumulated["curves"]):
            curve.restore(state)

    def _merge(self, other: BaseEvaluation) -> None:
        theirs: list[_BinaryCurve] = other._curves  # type: ignore[attr-defined]
        if not theirs:
            return
        if not self._curves:
            self._curves = [_BinaryCurve(self.threshold_steps) for _ in theirs]
        elif len(theirs) != len(self._curves):
            raise IncompatibleEvaluationError(
                f"cannot merge a {type(self).__name__} of {len(theirs)} {self._noun}s into one of {len(self._curves)}"
            )
        for mine, their in zip(self._curves, theirs):
            mine.merge(their)

    def reset(self) -> None:
        self._curves = []

    def stats(self) -> str:
        lines = [
            f"{type(self).__name__} ({_mode(self.threshold_steps)}), {len(self._curves)} {self._noun}s",
            f"{self._noun:>8} {'AUC':>8} {'AUPRC':>8} {'positive':>10} {'negative':>10}",
        ]
        lines += [
            f"{j:>8} {c.auc():>8.4f} {c.auprc():>8.4f} {c.positives():>10} {c.negatives():>10}"
            for j, c in enumerate(self._curves)
        ]
        lines.append(f"{'average':>8} {self.calculate_average_auc():>8.4f} {self.calculate_average_auprc():>8.4f}")
        return "\n".join(lines)


class ROCBinary(_PerOutputROC, type_name="ROCBinary"):
    """ROC per output of a multi-label network (DL4J's ``ROCBinary``): each column of ``[N, C]``
    predictions is an independent probability, scored against the same column of 0/1 labels
    (positive where ``>= 0.5``). A mask the shape of the predictions leaves out single entries.
    """

    per_output_mask = True

    def eval(self, labels: Any, predictions: Any, mask: Any = None) -> None:
        """Add one batch of 0/1 labels and predicted probabilities, one column per output."""
        r = self.rows(labels, predictions, mask)
        if r.indexed:
            if r.predictions.shape[1] != 1:
                raise EvaluationError(
                    f"ROCBinary: labels of shape {r.labels.shape} for "
                    f"{r.predictions.shape[1]} outputs; give one 0/1 column per output"
                )
            positive = class_indices(r, 1, "ROCBinary")[:, None] == 1
        else:
            positive = r.labels >= 0.5
        self._add(r.predictions, positive, r.mask)


class ROCMultiClass(_PerOutputROC, type_name="ROCMultiClass"):
    """One-vs-all ROC per class (DL4J's ``ROCMultiClass``): class ``k``'s curve scores column ``k``
    of ``[N, C]`` class probabilities, positive where the true class is ``k``. Labels are one-hot
    ``[N, C]`` (arg-max taken) or class indices ``[N]``. The per-output methods take the class index.
    """

    _noun = "class"

    def eval(self, labels: Any, predictions: Any, mask: Any = None) -> None:
        """Add one batch of labels and predicted class probabilities."""
        r = self.rows(labels, predictions, mask)
        c = r.predictions.shape[1]
        if c < 2:
            raise EvaluationError("ROCMultiClass: predictions with 1 column; use ROC for a binary problem")
        truth = class_indices(r, c, "ROCMultiClass")
        self._add(r.predictions, truth[:, None] == np.arange(c), None)

    def num_classes(self) -> int:
        """Number of classes; 0 before the first batch."""
        return self.num_outputs()
