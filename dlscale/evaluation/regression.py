"""Regression evaluation per output column (DL4J's ``RegressionEvaluation``).

Each column keeps float64 statistics: the number of values, the means of labels and predictions,
their sums of squared deviations from the mean (M2), their co-moment, and the sums of absolute and
squared errors. A batch's statistics are computed in two passes (mean first) and combined with the
running ones by Chan et al.'s parallel formulas, which is also how two evaluations merge. Each mean
is kept as a shift (a batch mean) plus a small remainder, so that the differences between partition
means that the formulas need keep their precision: labels far from zero with a small spread (say
``1e8 ± 0.001``) lose no accuracy, however many partitions are merged.

Undefined results are ``nan``: every metric of a column without data, and the relative squared
error, R² and Pearson correlation of a column whose labels (or, for Pearson, predictions) are all
equal. scikit-learn's ``r2_score`` returns 1.0 or 0.0 there instead (``force_finite=True``). The
averages are plain means over columns, so a ``nan`` column makes its average ``nan``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dlscale.errors import EvaluationError, IncompatibleEvaluationError
from dlscale.evaluation._base import BaseEvaluation, as_numpy

__all__ = ["RegressionEvaluation"]

_FIELDS = (
    "count",
    "shift_label",
    "shift_prediction",
    "mean_label",
    "mean_prediction",
    "m2_label",
    "m2_prediction",
    "comoment",
    "sum_abs_error",
    "sum_squared_error",
)

Moments = dict[str, np.ndarray]


def _empty(columns: int) -> Moments:
    """Statistics of no data for ``columns`` columns."""
    moments = {k: np.zeros(columns) for k in _FIELDS}
    moments["count"] = np.zeros(columns, np.int64)
    return moments


def _batch(labels: np.ndarray, predictions: np.ndarray, mask: np.ndarray | None) -> Moments:
    """Statistics of one ``[M, C]`` batch, leaving out entries where ``mask`` is False. Each mean
    is kept as a shift (the batch mean as first computed) plus the mean of the values less the
    shift, so the small second part keeps its full precision however large the shift."""
    w = np.ones(labels.shape) if mask is None else mask.astype(np.float64)
    n = w.sum(axis=0)
    safe = np.maximum(n, 1)
    shift_y = (w * labels).sum(axis=0) / safe
    shift_p = (w * predictions).sum(axis=0) / safe
    dy = (labels - shift_y) * w
    dp = (predictions - shift_p) * w
    mean_y, mean_p = dy.sum(axis=0) / safe, dp.sum(axis=0) / safe
    err = (labels - predictions) * w
    return {
        "count": n.astype(np.int64),
        "shift_label": shift_y,
        "shift_prediction": shift_p,
        "mean_label": mean_y,
        "mean_prediction": mean_p,
        "m2_label": np.maximum((dy * dy).sum(axis=0) - n * mean_y * mean_y, 0.0),
        "m2_prediction": np.maximum((dp * dp).sum(axis=0) - n * mean_p * mean_p, 0.0),
        "comoment": (dy * dp).sum(axis=0) - n * mean_y * mean_p,
        "sum_abs_error": np.abs(err).sum(axis=0),
        "sum_squared_error": (err * err).sum(axis=0),
    }


def _combine(a: Moments, b: Moments) -> Moments:
    """The statistics of the union of two sets of values (Chan, Golub and LeVeque, 1979), with
    ``b``'s means moved onto ``a``'s shifts (the first non-empty side's)."""
    n = a["count"] + b["count"]
    share = np.divide(b["count"], n, out=np.zeros(n.shape), where=n > 0)  # n_b / n
    cross = a["count"] * share  # n_a * n_b / n
    first = a["count"] > 0
    shift_y = np.where(first, a["shift_label"], b["shift_label"])
    shift_p = np.where(first, a["shift_prediction"], b["shift_prediction"])
    dy = (b["shift_label"] - shift_y) + b["mean_label"] - a["mean_label"]
    dp = (b["shift_prediction"] - shift_p) + b["mean_prediction"] - a["mean_prediction"]
    return {
        "count": n,
        "shift_label": shift_y,
        "shift_prediction": shift_p,
        "mean_label": a["mean_label"] + dy * share,
        "mean_prediction": a["mean_prediction"] + dp * share,
        "m2_label": a["m2_label"] + b["m2_label"] + dy * dy * cross,
        "m2_prediction": a["m2_prediction"] + b["m2_prediction"] + dp * dp * cross,
        "comoment": a["comoment"] + b["comoment"] + dy * dp * cross,
        "sum_abs_error": a["sum_abs_error"] + b["sum_abs_error"],
        "sum_squared_error": a["sum_squared_error"] + b["sum_squared_error"],
    }


def _spread(m2: np.ndarray, n: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """``m2`` with ``nan`` where the values are all equal: M2 within what rounding the mean of
    equal values can leave (64 ulps of the mean per value)."""
    tolerance = n * (64 * np.finfo(np.float64).eps * mean) ** 2
    return np.where(m2 > tolerance, m2, np.nan)


class RegressionEvaluation(BaseEvaluation, type_name="RegressionEvaluation"):
    """Mean squared, mean absolute, root mean squared and relative squared error, Pearson
    correlation and R² per output column, and their averages over columns.

    Predictions and labels are ``[N, C]``, ``[N]`` (one column) or ``[N, T, C]`` sequences; a mask
    is per example, per time step (``[N, T]``) or per output (the shape of the predictions: each
    column counts only its unmasked entries, so columns can have different counts). One-column
    predictions ``[N, 1]`` also take labels ``[N]``. ``columns`` names the columns (and fixes their
    number); otherwise the first batch fixes it. Methods that take a ``column`` accept its index or
    its name.
    """

    per_output_mask = True

    def __init__(self, columns: list[str] | None = None) -> None:
        if columns is not None:
            columns = list(columns)
            if not columns or not all(isinstance(c, str) for c in columns) or len(set(columns)) != len(columns):
                raise ValueError(f"columns must be a non-empty list of distinct names, not {columns!r}")
        self.columns = columns
        self.reset()

    # -- accumulating -------------------------------------------------------------------------
    def eval(self, labels: Any, predictions: Any, mask: Any = None) -> None:
        """Add one batch of regression targets and network outputs."""
        p = as_numpy(predictions, "predictions")
        y = as_numpy(labels, "labels")
        if p.ndim >= 2 and p.shape[-1] == 1 and y.shape == p.shape[:-1]:
            y = y[..., None]  # one output column: [N] labels for [N, 1] predictions
        r = self.rows(y, p, mask)
        if r.indexed:
            raise EvaluationError(
                f"RegressionEvaluation: labels of shape {y.shape} for predictions of shape "
                f"{p.shape}; regression labels need one value per output, the shape of the "
                "predictions (class indices are for classification evaluations)"
            )
        c = r.predictions.shape[1]
        if self._moments["count"].size == 0:
            self._moments = _empty(c)
        elif c != self.num_columns():
            named = f" ({len(self.columns)} columns named)" if self.columns is not None else ""
            raise EvaluationError(
                f"RegressionEvaluation: predictions with {c} columns, but this evaluation "
                f"has {self.num_columns()}{named}"
            )
        self._moments = _combine(self._moments, _batch(r.labels, r.predictions, r.mask))

    def _settings(self) -> dict[str, Any]:
        return {"columns": self.columns}

    def _accumulated(self) -> dict[str, Any]:
        return {k: v.tolist() for k, v in self._moments.items()}

    def _restore(self, accumulated: dict[str, Any]) -> None:
        moments = {k: np.asarray(accumulated[k], np.int64 if k == "count" else np.float64) for k in _FIELDS}
        sizes = {v.shape for v in moments.values()}
        expected = {(len(self.columns),)} if self.columns is not None else sizes
        if len(sizes) != 1 or sizes != expected or moments["count"].ndim != 1:
            raise IncompatibleEvaluationError(
                f"RegressionEvaluation state with statistics of shapes {sorted(sizes)} for columns {self.columns!r}"
            )
        self._moments = moments

    def _merge(self, other: BaseEvaluation) -> None:
        theirs: Moments = other._moments  # type: ignore[attr-defined]
        if theirs["count"].size == 0:
            return
        if self._moments["count"].size == 0:
            self._moments = {k: v.copy() for k, v in theirs.items()}
            return
        if theirs["count"].size != self.num_columns():
            raise IncompatibleEvaluationError(
                f"cannot merge a RegressionEvaluation of {theirs['count'].size} columns "
                f"into one of {self.num_columns()}"
            )
        self._moments = _combine(self._moments, theirs)

    def reset(self) -> None:
        self._moments = _empty(len(self.columns) if self.columns is not None else 0)

    # -- per column ---------------------------------------------------------------------------
    def num_columns(self) -> int:
        """Number of output columns; 0 before the first batch unless ``columns`` was given."""
        return int(self._moments["count"].size)

    def _index(self, column: int | str) -> int:
        """The index of ``column``, given by index or name."""
        if isinstance(column, str):
            if self.columns is None or column not in self.columns:
                raise KeyError(f"no column named {column!r}; columns: {self.columns!r}")
            return self.columns.index(column)
        if not 0 <= column < self.num_columns():
            raise IndexError(f"column {column} is out of range for {self.num_columns()} columns")
        return int(column)

    def _per_column(self) -> dict[str, np.ndarray]:
        """Every metric for every column, ``nan`` where undefined."""
        m = self._moments
        n = np.where(m["count"] > 0, m["count"], np.nan)
        m2_label = _spread(m["m2_label"], m["count"], m["shift_label"] + m["mean_label"])
        m2_prediction = _spread(m["m2_prediction"], m["count"], m["shift_prediction"] + m["mean_prediction"])
        mse = m["sum_squared_error"] / n
        rse = m["sum_squared_error"] / m2_label
        return {
            "mse": mse,
            "mae": m["sum_abs_error"] / n,
            "rmse": np.sqrt(mse),
            "rse": rse,
            "pearson": m["comoment"] / np.sqrt(m2_label * m2_prediction),
            "r2": 1.0 - rse,
        }

    def _metric(self, name: str, column: int | str) -> float:
        return float(self._per_column()[name][self._index(column)])

    def _average(self, name: str) -> float:
        values = self._per_column()[name]
        return float(values.mean()) if values.size else float("nan")

    def example_count(self, column: int | str) -> int:
        """Number of values (unmasked entries) seen in ``column``."""
        return int(self._moments["count"][self._index(column)])

    def mean_squared_error(self, column: int | str) -> float:
        """Mean of (label - prediction)² in ``column``."""
        return self._metric("mse", column)

    def mean_absolute_error(self, column: int | str) -> float:
        """Mean of |label - prediction| in ``column``."""
        return self._metric("mae", column)

    def root_mean_squared_error(self, column: int | str) -> float:
        """Square root of the mean squared error of ``column``."""
        return self._metric("rmse", column)

    def relative_squared_error(self, column: int | str) -> float:
        """Sum of squared errors over the sum of (label - mean label)² in ``column``: the error
        relative to always predicting the mean."""
        return self._metric("rse", column)

    def pearson_correlation(self, column: int | str) -> float:
        """Pearson correlation of labels and predictions in ``column``."""
        return self._metric("pearson", column)

    def r_squared(self, column: int | str) -> float:
        """Coefficient of determination ``1 - relative squared error`` of ``column``, as
        ``sklearn.metrics.r2_score``; negative where the predictions are worse than the mean."""
        return self._metric("r2", column)

    # -- averages over columns ------------------------------------------------------------------
    def average_mean_squared_error(self) -> float:
        """Mean squared error averaged over columns."""
        return self._average("mse")

    def average_mean_absolute_error(self) -> float:
        """Mean absolute error averaged over columns."""
        return self._average("mae")

    def average_root_mean_squared_error(self) -> float:
        """Root mean squared error averaged over columns."""
        return self._average("rmse")

    def average_relative_squared_error(self) -> float:
        """Relative squared error averaged over columns."""
        return self._average("rse")

    def average_pearson_correlation(self) -> float:
        """Pearson correlation averaged over columns."""
        return self._average("pearson")

    def average_r_squared(self) -> float:
        """R² averaged over columns (scikit-learn's ``multioutput="uniform_average"``)."""
        return self._average("r2")

    def stats(self) -> str:
        names = self.columns if self.columns is not None else [str(j) for j in range(self.num_columns())]
        width = max([len(s) for s in names] + [7])
        metrics = self._per_column()
        keys = ("mse", "mae", "rmse", "rse", "pearson", "r2")
        header = f"{'column':<{width}} {'count':>10} " + " ".join(
            f"{h:>12}" for h in ("MSE", "MAE", "RMSE", "RSE", "Pearson", "R^2")
        )
        lines = [f"RegressionEvaluation, {self.num_columns()} columns", header]
        lines += [
            f"{name:<{width}} {self.example_count(j):>10} " + " ".join(f"{metrics[k][j]:>12.6g}" for k in keys)
            for j, name in enumerate(names)
        ]
        lines.append(f"{'average':<{width}} {'':>10} " + " ".join(f"{self._average(k):>12.6g}" for k in keys))
        return "\n".join(lines)
