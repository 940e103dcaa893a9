"""Calibration of predicted class probabilities (DL4J's ``EvaluationCalibration``): reliability
diagrams, expected calibration error, residual plots and probability histograms.

Everything is kept as counts (and, per reliability bin, a sum of probabilities), so memory does not
depend on the number of examples and merging adds. Two binning conventions are used, each matching
the library its results are compared with:

* reliability diagrams use ``reliability_diagram_bins`` uniform bins on ``[0, 1]`` closed on the
  right, ``[0, e1], (e1, e2], ..., (e(B-1), 1]``, as ``sklearn.calibration.calibration_curve(...,
  strategy="uniform")``: a probability exactly on an inner edge falls in the lower bin;
* histograms use ``histogram_bins`` uniform bins closed on the left, ``[0, e1), ..., [e(H-1), 1]``,
  as ``numpy.histogram``: a value on an inner edge falls in the upper bin, 1.0 in the last.

Labels are read per class as 0/1, positive where ``>= 0.5`` (one-hot and multi-hot labels alike),
or given as class indices. Predictions with one column are binary: the column is class 1's
probability and class 0's is ``1 - p``, so such an evaluation has two classes.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from dlscale import storage
from dlscale.errors import EvaluationError, IncompatibleEvaluationError
from dlscale.evaluation._base import BaseEvaluation, class_indices

__all__ = ["EvaluationCalibration"]

Histogram = tuple[np.ndarray, np.ndarray]

# Accumulated arrays: per class, per reliability bin ("reliability") or histogram bin ("histogram").
_RELIABILITY = ("bin_counts", "bin_probability_sums", "bin_positives")
_HISTOGRAM = ("residuals", "residuals_actual", "probabilities", "probabilities_actual")


def _check_bins(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, not {value!r}")
    return int(value)


def _counts(
    bins: np.ndarray, size: int, where: np.ndarray | None = None, weights: np.ndarray | None = None
) -> np.ndarray:
    """Per class (column) counts of ``[M, C]`` bin indices in ``[0, size)``, as ``[C, size]``:
    of the ``where`` entries only, or sums of ``weights``."""
    c = bins.shape[1]
    flat = bins + np.arange(c) * size
    if where is not None:
        flat = flat[where]
    return np.bincount(flat.ravel(), weights=None if weights is None else weights.ravel(), minlength=c * size).reshape(
        c, size
    )


class EvaluationCalibration(BaseEvaluation, type_name="EvaluationCalibration"):
    """Reliability diagrams, residual plots and probability histograms per class.

    Predictions are ``[N, C]`` class probabilities in ``[0, 1]`` (softmax or sigmoid outputs),
    ``[N]`` or ``[N, 1]`` for a binary problem, or ``[N, T, C]`` sequences with ``[N, T]`` masks.
    Per class ``k`` it counts, over all examples: the reliability diagram of ``p_k``; the
    histograms of ``p_k`` and of the residual ``|y_k - p_k|``, both over all examples and over the
    examples whose label is ``k`` ("actual class only"); how many examples have label ``k``; and
    how many have ``k`` as the arg-max prediction (ties to the lower class).
    """

    def __init__(self, reliability_diagram_bins: int = 10, histogram_bins: int = 50) -> None:
        self.reliability_diagram_bins = _check_bins("reliability_diagram_bins", reliability_diagram_bins)
        self.histogram_bins = _check_bins("histogram_bins", histogram_bins)
        self._reliability_edges = np.linspace(0.0, 1.0, self.reliability_diagram_bins + 1)
        self._histogram_edges = np.linspace(0.0, 1.0, self.histogram_bins + 1)
        self.reset()

    # -- accumulating -------------------------------------------------------------------------
    def _allocate(self, classes: int) -> None:
        b, h = self.reliability_diagram_bins, self.histogram_bins
        self._state: dict[str, np.ndarray] = {k: np.zeros((classes, b), np.int64) for k in _RELIABILITY}
        self._state["bin_probability_sums"] = np.zeros((classes, b))
        self._state.update({k: np.zeros((classes, h), np.int64) for k in _HISTOGRAM})
        self._state["label_counts"] = np.zeros(classes, np.int64)
        self._state["prediction_counts"] = np.zeros(classes, np.int64)

    def _histogram_bins(self, values: np.ndarray) -> np.ndarray:
        """``numpy.histogram``'s bin of each value in ``[0, 1]``."""
        return np.minimum(np.searchsorted(self._histogram_edges, values, side="right") - 1, self.histogram_bins - 1)

    def eval(self, labels: Any, predictions: Any, mask: Any = None) -> None:
        """Add one batch of labels (0/1 per class, or class indices) and class probabilities."""
        r = self.rows(labels, predictions, mask)
        p = r.predictions
        if p.size and (p.min() < 0 or p.max() > 1):
            raise EvaluationError(
                f"EvaluationCalibration: predictions must be probabilities in [0, 1]; found "
                f"values in [{p.min():g}, {p.max():g}]"
            )
        if p.shape[1] == 1:
            p = np.hstack([1.0 - p, p])
            positive = class_indices(r, 1, "EvaluationCalibration")[:, None] == np.arange(2)
        elif r.indexed:
            positive = class_indices(r, p.shape[1], "EvaluationCalibration")[:, None] == np.arange(p.shape[1])
        else:
            positive = r.labels >= 0.5
        c = p.shape[1]
        if not self.num_classes():
            self._allocate(c)
        elif c != self.num_classes():
            raise EvaluationError(
                f"EvaluationCalibration: predictions for {c} classes, but this evaluation has {self.num_classes()}"
            )
        b, h, s = self.reliability_diagram_bins, self.histogram_bins, self._state
        reliability = np.searchsorted(self._reliability_edges[1:-1], p)  # calibration_curve's binning
        s["bin_counts"] += _counts(reliability, b)
        s["bin_probability_sums"] += _counts(reliability, b, weights=p)
        s["bin_positives"] += _counts(reliability, b, where=positive)
        residuals = self._histogram_bins(np.abs(positive - p))
        probabilities = self._histogram_bins(p)
        s["residuals"] += _counts(residuals, h)
        s["residuals_actual"] += _counts(residuals, h, where=positive)
        s["probabilities"] += _counts(probabilities, h)
        s["probabilities_actual"] += _counts(probabilities, h, where=positive)
        s["label_counts"] += positive.sum(axis=0)
        s["prediction_counts"] += np.bincount(np.argmax(p, axis=1), minlength=c)

    def _settings(self) -> dict[str, Any]:
        return {"reliability_diagram_bins": self.reliability_diagram_bins, "histogram_bins": self.histogram_bins}

    def _accumulated(self) -> dict[str, Any]:
        return {k: v.tolist() for k, v in self._state.items()}

    def _restore(self, accumulated: dict[str, Any]) -> None:
        classes = len(accumulated["label_counts"])
        self._allocate(classes)
        for k, v in self._state.items():
            value = np.asarray(accumulated[k], v.dtype)
            if value.size != v.size:
                raise IncompatibleEvaluationError(
                    f"EvaluationCalibration state {k!r} has {value.size} values; "
                    f"{classes} classes and these settings need {v.size}"
                )
            self._state[k] = value.reshape(v.shape)

    def _merge(self, other: BaseEvaluation) -> None:
        theirs: dict[str, np.ndarray] = other._state  # type: ignore[attr-defined]
        classes = theirs["label_counts"].size
        if not classes:
            return
        if not self.num_classes():
            self._allocate(classes)
        elif classes != self.num_classes():
            raise IncompatibleEvaluationError(
                f"cannot merge an EvaluationCalibration of {classes} classes into one of {self.num_classes()}"
            )
        for k, v in self._state.items():
            v += theirs[k]

    def reset(self) -> None:
        self._allocate(0)

    # -- results ------------------------------------------------------------------------------
    def num_classes(self) -> int:
        """Number of classes (2 for one-column predictions); 0 before the first batch."""
        return int(self._state["label_counts"].size)

    def example_count(self) -> int:
        """Number of examples (unmasked rows) seen."""
        return int(self._state["bin_counts"][0].sum()) if self.num_classes() else 0

    def _class(self, cls: int) -> int:
        if not 0 <= cls < self.num_classes():
            raise IndexError(f"class {cls} is out of range for {self.num_classes()} classes")
        return int(cls)

    def reliability_diagram(self, cls: int) -> tuple[np.ndarray, np.ndarray]:
        """``(mean_predicted, fraction_positives)`` of class ``cls`` over the non-empty bins, lowest
        first: ``calibration_curve(y == cls, prob[:, cls], n_bins=reliability_diagram_bins)``'s
        ``(prob_pred, prob_true)``."""
        k = self._class(cls)
        counts = self._state["bin_counts"][k]
        full = counts > 0
        return (
            self._state["bin_probability_sums"][k][full] / counts[full],
            self._state["bin_positives"][k][full] / counts[full],
        )

    def expected_calibration_error(self, cls: int | None = None) -> float:
        """Expected calibration error of class ``cls``: the mean over examples of
        ``|fraction positive - mean predicted|`` of their reliability bin, i.e. the bins' gaps
        weighted by their counts. With ``cls=None``, the mean over classes (every class's diagram
        holds every example, so this is the count-weighted mean: the "classwise" ECE). ``nan``
        before any example."""
        n = self.example_count()
        if not n:
            return float("nan")
        gaps = np.abs(self._state["bin_positives"] - self._state["bin_probability_sums"]).sum(axis=1) / n
        return float(gaps.mean() if cls is None else gaps[self._class(cls)])

    def _histogram(self, name: str, cls: int | None, actual_class_only: bool) -> Histogram:
        counts = self._state[f"{name}_actual" if actual_class_only else name]
        total = counts.sum(axis=0) if cls is None else counts[self._class(cls)].copy()
        return total, self._histogram_edges.copy()

    def residual_plot(self, cls: int | None = None, actual_class_only: bool = False) -> Histogram:
        """``(counts, bin_edges)`` of the residuals ``|y_k - p_k|`` of class ``cls`` (``None``: every
        class), over all examples or, with ``actual_class_only``, over those whose label is the
        class (DL4J's per-class residual plot)."""
        return self._histogram("residuals", cls, actual_class_only)

    def probability_histogram(self, cls: int | None = None, actual_class_only: bool = False) -> Histogram:
        """``(counts, bin_edges)`` of the predicted probability of class ``cls`` (``None``: every
        class), over all examples or, with ``actual_class_only``, over those whose label is the
        class (DL4J's per-class probability histogram)."""
        return self._histogram("probabilities", cls, actual_class_only)

    def label_counts(self) -> np.ndarray:
        """Number of examples labelled with each class."""
        return self._state["label_counts"].copy()

    def prediction_counts(self) -> np.ndarray:
        """Number of examples whose arg-max prediction is each class."""
        return self._state["prediction_counts"].copy()

    def stats(self) -> str:
        labels, predicted = self._state["label_counts"], self._state["prediction_counts"]
        lines = [
            (
                f"EvaluationCalibration, {self.num_classes()} classes, {self.example_count()} examples, "
                f"{self.reliability_diagram_bins} reliability bins, {self.histogram_bins} histogram bins"
            ),
            f"{'class':>8} {'labels':>10} {'predicted':>10} {'ECE':>8}",
        ]
        lines += [
            f"{k:>8} {labels[k]:>10} {predicted[k]:>10} {self.expected_calibration_error(k):>8.4f}"
            for k in range(self.num_classes())
        ]
        lines.append(f"{'all':>8} {'':>10} {'':>10} {self.expected_calibration_error():>8.4f}")
        return "\n".join(lines)

    def save_png(self, url_or_path: str, storage_options: dict[str, Any] | None = None) -> None:
        """Draw the reliability diagrams (with the diagonal of perfect calibration), the residual
        plot and the probability histogram, all classes together, to a PNG at ``url_or_path`` (a
        local path or any fsspec URL, atomically; a relative one is under the storage root)."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as e:
            raise ImportError("EvaluationCalibration.save_png needs matplotlib: pip install matplotlib") from e
        figure = Figure(figsize=(15, 4.5), layout="constrained")
        FigureCanvasAgg(figure)
        reliability, residuals, probabilities = figure.subplots(1, 3)
        reliability.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfectly calibrated")
        for k in range(self.num_classes()):
            reliability.plot(*self.reliability_diagram(k), "o-", markersize=3, label=f"class {k}")
        reliability.set(
            title="Reliability diagram",
            xlabel="mean predicted probability",
            ylabel="fraction of positives",
            xlim=(-0.02, 1.02),
            ylim=(-0.02, 1.02),
        )
        if self.num_classes() <= 10:
            reliability.legend(fontsize="small")
        for axes, (counts, edges), title, xlabel in (
            (residuals, self.residual_plot(), "Residuals, all classes", "|label - probability|"),
            (probabilities, self.probability_histogram(), "Probabilities, all classes", "predicted probability"),
        ):
            axes.stairs(counts, edges, fill=True)
            axes.set(title=title, xlabel=xlabel, ylabel="count", xlim=(0, 1))
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        storage.write_bytes(url_or_path, buffer.getbuffer(), storage_options=storage_options)
