"""Classification evaluations: single-label :class:`Evaluation` and multi-label
:class:`EvaluationBinary` (DL4J's types of the same names).

Both accumulate integer counts only (a confusion matrix, or true/false positives/negatives per
output), so merging the evaluations of partitions is exact, and every metric is computed from the
counts when asked for. Conventions shared by both:

* an undefined ratio (zero denominator) is 0, as with scikit-learn's ``zero_division=0``;
* before any batch every metric is 0 and the per-class counts are empty (all zero where the
  number of classes is already known from ``labels``), so an evaluation of an empty partition
  reports, merges and serializes like any other;
* a class or output is named by its index or, where ``labels`` were given, by its name.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from dlscale.errors import EvaluationError, IncompatibleEvaluationError
from dlscale.evaluation._base import BaseEvaluation, class_indices, ratio

AVERAGINGS = ("macro", "micro")
MAX_PRINTED_CLASSES = 20  # a larger confusion matrix is left out of stats() (as DL4J does)
COUNT_NAMES = ("true_positives", "false_positives", "true_negatives", "false_negatives")


class Counts(NamedTuple):
    """One-vs-rest counts, one entry per class (or output)."""

    tp: np.ndarray
    fp: np.ndarray
    tn: np.ndarray
    fn: np.ndarray

    def summed(self) -> Counts:
        """The counts added over classes (one entry each): what micro averages are computed from."""
        return Counts(*(np.array([a.sum()]) for a in self))


Metric = Callable[[Counts], np.ndarray]


def _div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Element-wise ``num / den`` as float64, 0 where ``den`` is 0."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    return np.divide(num, den, out=np.zeros(np.broadcast(num, den).shape), where=den != 0)


def _accuracy(c: Counts) -> np.ndarray:
    return _div(c.tp + c.tn, c.tp + c.fp + c.tn + c.fn)


def _precision(c: Counts) -> np.ndarray:
    return _div(c.tp, c.tp + c.fp)


def _recall(c: Counts) -> np.ndarray:
    return _div(c.tp, c.tp + c.fn)


def _false_positive_rate(c: Counts) -> np.ndarray:
    return _div(c.fp, c.fp + c.tn)


def _false_negative_rate(c: Counts) -> np.ndarray:
    return _div(c.fn, c.fn + c.tp)


def _g_measure(c: Counts) -> np.ndarray:
    return np.sqrt(_precision(c) * _recall(c))


def _f_beta(beta: float) -> Metric:
    """F-beta from the counts: ``(1 + b²)·tp / ((1 + b²)·tp + b²·fn + fp)``, which is the weighted
    harmonic mean of precision and recall, and 0 where both are 0 (as scikit-learn computes it)."""
    b2 = _finite_number(beta, "beta") ** 2
    if beta < 0:
        raise ValueError(f"beta must be >= 0, not {beta!r}")
    return lambda c: _div((1 + b2) * c.tp, (1 + b2) * c.tp + b2 * c.fn + c.fp)


def _matthews(c: Counts) -> np.ndarray:
    """Binary Matthews correlation per entry (0 where undefined)."""
    tp, fp, tn, fn = (a.astype(np.float64) for a in c)
    return _div(tp * tn - fp * fn, np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))


def _multiclass_matthews(confusion: np.ndarray) -> float:
    """Gorodkin's R_K from a confusion matrix (what ``sklearn.metrics.matthews_corrcoef`` computes)."""
    cm = confusion.astype(np.float64)
    actual, predicted, total = cm.sum(axis=1), cm.sum(axis=0), cm.sum()
    den = math.sqrt((total * total - predicted @ predicted) * (total * total - actual @ actual))
    return ratio(np.trace(cm) * total - actual @ predicted, den)


def _check_averaging(averaging: str) -> None:
    if averaging not in AVERAGINGS:
        raise ValueError(f"averaging must be one of {AVERAGINGS}, not {averaging!r}")


def _names(labels: Sequence[str] | None, minimum: int, who: str) -> list[str] | None:
    """``labels`` checked (distinct strings, at least ``minimum``) as a list."""
    if labels is None:
        return None
    names = [] if isinstance(labels, str) else list(labels)
    if not names or not all(isinstance(name, str) for name in names):
        raise ValueError(f"{who}: labels must be a list of strings, not {labels!r}")
    if len(names) < minimum or len(set(names)) != len(names):
        raise ValueError(f"{who}: labels must be at least {minimum} distinct names, not {names!r}")
    return names


def _finite_number(value: Any, what: str) -> float:
    """``value`` as a float, refusing anything but a finite real number."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, not {value!r}")
    return float(value)


def _index(key: int | str, names: list[str] | None, count: int, what: str) -> int:
    """The index of a class or output given by index or by name."""
    if isinstance(key, str):
        if names is None or key not in names:
            raise ValueError(f"unknown {what} {key!r}; the names are {names}")
        return names.index(key)
    k = operator.index(key)
    if not 0 <= k < count:
        raise ValueError(f"{what} {k} is not in range({count})")
    return k


def _restored(value: Any, ndim: int, who: str) -> np.ndarray | None:
    """An accumulated list back as an int64 array of ``ndim`` dimensions (``None`` stays ``None``)."""
    if value is None:
        return None
    array = np.asarray(value, dtype=np.int64)
    if array.ndim != ndim:
        raise IncompatibleEvaluationError(f"{who}: stored counts of shape {array.shape} are not {ndim}-dimensional")
    return array


class Evaluation(BaseEvaluation, type_name="Evaluation"):
    """Single-label classification: accuracy, precision, recall, F-scores, MCC and the confusion
    matrix (DL4J's ``Evaluation``).

    ``predictions`` are ``[N, C]`` scores (probabilities or logits; the arg-max is the predicted
    class, ties going to the lower index), ``labels`` one-hot ``[N, C]`` or class indices ``[N]``;
    sequences ``[N, T, C]`` are flattened, masked time steps left out. One prediction column
    (``[N, 1]`` or ``[N]``) is a binary classifier: class 1 where the score is at least
    ``binary_decision_threshold``, with 0/1 labels; the evaluation then has 2 classes. Two-column
    predictions always use the arg-max.

    The number of classes is that of ``labels`` (the class names) where given, else that of the
    first batch; a batch with another number is refused.

    Averaging (``averaging``): ``"macro"`` is the unweighted mean over *all* classes, a class never
    predicted counting with precision 0, as scikit-learn does (DL4J leaves such classes out of its
    macro average, so its numbers can be higher); ``"micro"`` is computed from the counts summed
    over classes (micro precision, recall and F1 all equal the accuracy). With exactly two classes,
    ``cls=None`` means ``binary_positive_class`` for every per-class metric, whatever
    ``averaging`` says (DL4J's rule, and scikit-learn's ``average="binary"``); pass ``cls``
    explicitly for the other class.

    ``top_n``: :meth:`top_n_accuracy` counts an example correct when its true class is among the
    ``top_n`` highest scores (ties ranked by index, as for the arg-max).
    """

    def __init__(
        self,
        labels: Sequence[str] | None = None,
        top_n: int = 1,
        binary_positive_class: int = 1,
        binary_decision_threshold: float = 0.5,
    ) -> None:
        if isinstance(top_n, bool) or not isinstance(top_n, (int, np.integer)) or top_n < 1:
            raise ValueError(f"Evaluation: top_n must be an integer >= 1, not {top_n!r}")
        if binary_positive_class not in (0, 1) or isinstance(binary_positive_class, bool):
            raise ValueError(f"Evaluation: binary_positive_class must be 0 or 1, not {binary_positive_class!r}")
        self.labels = _names(labels, 2, "Evaluation")
        self.top_n = int(top_n)
        self.binary_positive_class = int(binary_positive_class)
        self.binary_decision_threshold = _finite_number(
            binary_decision_threshold, "Evaluation: binary_decision_threshold"
        )
        self.reset()

    # -- accumulation ---------------------------------------------------------------------
    def eval(self, labels: Any, predictions: Any, mask: Any = None) -> None:
        """Add one batch of ``labels`` and ``predictions``; ``mask`` (per example or per time step)
        leaves rows out."""
        r = self.rows(labels, predictions, mask)
        columns = r.predictions.shape[1]
        n = max(columns, 2)
        self._check_classes(n)
        actual = class_indices(r, columns, "Evaluation")
        if columns == 1:
            predicted = (r.predictions[:, 0] >= self.binary_decision_threshold).astype(np.int64)
            rank = (predicted != actual).astype(np.int64)
        else:
            predicted = np.argmax(r.predictions, axis=1)
            rank = _rank(r.predictions, actual)
        if self._confusion is None:
            self._confusion = np.zeros((n, n), dtype=np.int64)
        self._confusion += np.bincount(actual * n + predicted, minlength=n * n).reshape(n, n)
        self._top_n_correct += int(np.count_nonzero(rank < self.top_n))

    def _check_classes(self, n: int) -> None:
        if self.labels is not None and n != len(self.labels):
            raise EvaluationError(
                f"Evaluation: predictions have {n} classes but {len(self.labels)} class names were given as labels"
            )
        if self._confusion is not None and n != len(self._confusion):
            raise EvaluationError(
                f"Evaluation: predictions have {n} classes but earlier batches had {len(self._confusion)}"
            )

    def reset(self) -> None:
        """Forget every batch seen."""
        self._confusion: np.ndarray | None = (
            None if self.labels is None else np.zeros((len(self.labels),) * 2, dtype=np.int64)
        )
        self._top_n_correct = 0

    def _settings(self) -> dict[str, Any]:
        return {
            "labels": self.labels,
            "top_n": self.top_n,
            "binary_positive_class": self.binary_positive_class,
            "binary_decision_threshold": self.binary_decision_threshold,
        }

    def _accumulated(self) -> dict[str, Any]:
        return {
            "confusion": None if self._confusion is None else self._confusion.tolist(),
            "top_n_correct": self._top_n_correct,
        }

    def _restore(self, accumulated: dict[str, Any]) -> None:
        self._confusion = _restored(accumulated["confusion"], 2, "Evaluation")
        self._top_n_correct = int(accumulated["top_n_correct"])

    def _merge(self, other: BaseEvaluation) -> None:
        assert isinstance(other, Evaluation)
        if other._confusion is None:
            return
        if self._confusion is None:
            self._confusion = np.zeros_like(other._confusion)
        elif self._confusion.shape != other._confusion.shape:
            raise IncompatibleEvaluationError(
                f"cannot merge an Evaluation of {len(other._confusion)} classes into one of {len(self._confusion)}"
            )
        self._confusion += other._confusion
        self._top_n_correct += other._top_n_correct

    # -- counts ---------------------------------------------------------------------------
    def _counts(self) -> Counts:
        cm = self._confusion
        assert cm is not None
        tp = cm.diagonal().copy()
        fp, fn = cm.sum(axis=0) - tp, cm.sum(axis=1) - tp
        return Counts(tp, fp, cm.sum() - tp - fp - fn, fn)

    def _class(self, cls: int | str) -> int:
        return _index(cls, self.labels, self.num_classes(), "class")

    def _count(self, field: str, cls: int | str | None) -> np.ndarray | int:
        if self._confusion is None:
            return np.zeros(0, dtype=np.int64) if cls is None else 0
        values = getattr(self._counts(), field)
        return values if cls is None else int(values[self._class(cls)])

    def num_classes(self) -> int:
        """The number of classes (0 before the first batch unless ``labels`` were given)."""
        return 0 if self._confusion is None else len(self._confusion)

    def num_examples(self) -> int:
        """The number of examples (unmasked rows) evaluated."""
        return 0 if self._confusion is None else int(self._confusion.sum())

    def confusion_matrix(self) -> np.ndarray:
        """A copy of the ``[C, C]`` int64 confusion matrix: rows actual class, columns predicted."""
        return np.zeros((0, 0), dtype=np.int64) if self._confusion is None else self._confusion.copy()

    def class_count(self, cls: int | str) -> int:
        """How many examples actually are of class ``cls`` (DL4J's ``classCount``)."""
        return 0 if self._confusion is None else int(self._confusion[self._class(cls)].sum())

    def true_positives(self, cls: int | str | None = None) -> np.ndarray | int:
        """True positives of class ``cls``, or an int64 array with one entry per class."""
        return self._count("tp", cls)

    def false_positives(self, cls: int | str | None = None) -> np.ndarray | int:
        """False positives (predicted ``cls``, actually another class) of ``cls``, or per class."""
        return self._count("fp", cls)

    def true_negatives(self, cls: int | str | None = None) -> np.ndarray | int:
        """True negatives (neither actual nor predicted ``cls``) of ``cls``, or per class."""
        return self._count("tn", cls)

    def false_negatives(self, cls: int | str | None = None) -> np.ndarray | int:
        """False negatives (actually ``cls``, predicted another class) of ``cls``, or per class."""
        return self._count("fn", cls)

    # -- metrics --------------------------------------------------------------------------
    def _metric(self, per_class: Metric, cls: int | str | None, averaging: str) -> float:
        """``per_class`` for one class, for the positive class of a binary evaluation, or averaged."""
        _check_averaging(averaging)
        if self._confusion is None:
            return 0.0
        counts = self._counts()
        if cls is None and self.num_classes() == 2:
            cls = self.binary_positive_class
        if cls is not None:
            return float(per_class(counts)[self._class(cls)])
        return float(per_class(counts.summed() if averaging == "micro" else counts).mean())

    def accuracy(self) -> float:
        """The fraction of examples whose predicted class is the true one."""
        return 0.0 if self._confusion is None else ratio(np.trace(self._confusion), self.num_examples())

    def top_n_accuracy(self) -> float:
        """The fraction of examples whose true class is among the ``top_n`` highest scores."""
        return ratio(self._top_n_correct, self.num_examples())

    def precision(self, cls: int | str | None = None, averaging: str = "macro") -> float:
        """Precision ``tp / (tp + fp)`` of ``cls``, or averaged; two classes: the positive class."""
        return self._metric(_precision, cls, averaging)

    def recall(self, cls: int | str | None = None, averaging: str = "macro") -> float:
        """Recall ``tp / (tp + fn)`` of ``cls``, or averaged; two classes: the positive class."""
        return self._metric(_recall, cls, averaging)

    def f1(self, cls: int | str | None = None, averaging: str = "macro") -> float:
        """F1 (harmonic mean of precision and recall) of ``cls``, or averaged; two classes: the
        positive class."""
        return self._metric(_f_beta(1.0), cls, averaging)

    def f_beta(self, beta: float, cls: int | str | None = None, averaging: str = "macro") -> float:
        """F-beta (recall weighted ``beta`` times as much as precision) of ``cls``, or averaged; two
        classes: the positive class."""
        return self._metric(_f_beta(beta), cls, averaging)

    def g_measure(self, cls: int | str | None = None, averaging: str = "macro") -> float:
        """G-measure ``sqrt(precision · recall)`` of ``cls``, or averaged (macro: the mean of the
        per-class values; micro: from micro precision and recall); two classes: the positive class."""
        return self._metric(_g_measure, cls, averaging)

    def false_positive_rate(self, cls: int | str | None = None, averaging: str = "macro") -> float:
        """False positive rate ``fp / (fp + tn)`` of ``cls``, or averaged; two classes: the positive
        class."""
        return self._metric(_false_positive_rate, cls, averaging)

    def false_negative_rate(self, cls: int | str | None = None, averaging: str = "macro") -> float:
        """False negative rate ``fn / (fn + tp)`` of ``cls``, or averaged; two classes: the positive
        class."""
        return self._metric(_false_negative_rate, cls, averaging)

    def false_alarm_rate(self) -> float:
        """The mean of :meth:`false_positive_rate` and :meth:`false_negative_rate` (DL4J's
        ``falseAlarmRate``; macro-averaged, or of the positive class for two classes)."""
        return (self.false_positive_rate() + self.false_negative_rate()) / 2

    def matthews_correlation(self, cls: int | str | None = None) -> float:
        """Matthews correlation: of all classes (Gorodkin's R_K, as ``sklearn.metrics.matthews_corrcoef``;
        the binary MCC for two classes) where ``cls`` is ``None``, else of ``cls`` against the rest."""
        if self._confusion is None:
            return 0.0
        if cls is None:
            return _multiclass_matthews(self._confusion)
        return float(_matthews(self._counts())[self._class(cls)])

    # -- report ---------------------------------------------------------------------------
    def _name(self, k: int) -> str:
        return f"{k} ({self.labels[k]})" if self.labels else str(k)

    def stats(self) -> str:
        """A DL4J-style report: the main metrics, then the confusion matrix."""
        if not self.num_examples():
            return "Evaluation: no examples evaluated"
        n = self.num_classes()
        if n == 2:
            scope = f"of the positive class {self._name(self.binary_positive_class)}"
        else:
            scope = f"macro-averaged over all {n} classes (never-predicted classes count with precision 0)"
        values = [
            ("# of classes", str(n)),
            ("# of examples", str(self.num_examples())),
            ("Accuracy", f"{self.accuracy():.4f}"),
            ("Precision", f"{self.precision():.4f}"),
            ("Recall", f"{self.recall():.4f}"),
            ("F1 Score", f"{self.f1():.4f}"),
        ]
        if self.top_n > 1:
            values.append((f"Top-{self.top_n} Accuracy", f"{self.top_n_accuracy():.4f}"))
        values.append(("Matthews Correlation", f"{self.matthews_correlation():.4f}"))
        lines = [
            f"{' Evaluation Metrics ':=^66}",
            *(f" {name + ':':<22}{value}" for name, value in values),
            f"Precision, recall & F1: {scope}",
        ]
        never = [self._name(k) for k in np.flatnonzero(self._confusion.sum(axis=0) == 0)]
        if never:
            lines.append(f"Never predicted ({len(never)} of {n} classes): {', '.join(never)}")
        lines += [
            "",
            f"{' Confusion Matrix ':=^66}",
            *self._matrix_lines(),
            "Rows: actual class; columns: predicted class",
            "=" * 66,
        ]
        return "\n".join(lines)

    def _matrix_lines(self) -> list[str]:
        n = self.num_classes()
        if n > MAX_PRINTED_CLASSES:
            return [f"(not shown for more than {MAX_PRINTED_CLASSES} classes: see confusion_matrix())"]
        width = max(len(str(self._confusion.max())), len(str(n - 1)))
        header = " ".join(f"{k:>{width}}" for k in range(n))
        rows = [
            " ".join(f"{v:>{width}}" for v in self._confusion[k])
            + (f" | {k} = {self.labels[k]}" if self.labels else f" | {k}")
            for k in range(n)
        ]
        return [header, "-" * len(header), *rows]


def _rank(scores: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """The position of each row's true class when its classes are sorted by score, highest first,
    ties ranked by index (so position 0 is the arg-max)."""
    true_score = scores[np.arange(len(actual)), actual][:, None]
    lower_index = np.arange(scores.shape[1]) < actual[:, None]
    return np.count_nonzero((scores > true_score) | ((scores == true_score) & lower_index), axis=1)


class EvaluationBinary(BaseEvaluation, type_name="EvaluationBinary"):
    """Multi-label classification: each output is its own binary classifier (DL4J's
    ``EvaluationBinary``).

    ``predictions`` are ``[N, C]`` (or ``[N, T, C]``) independent probabilities, ``labels`` the same
    shape of 0s and 1s (any other value is refused). An output is predicted positive where its
    prediction is at least its ``decision_threshold`` (one for all outputs, or a list with one per
    output). Masks may be per example, per time step or per output (the shape of ``predictions``):
    masked entries are not counted, and their labels are not checked.

    The number of outputs is that of ``labels`` (output names) or of a ``decision_threshold`` list
    where given, else that of the first batch; a batch with another number is refused. Per-output
    metrics take ``output`` (index or name); ``average_*`` are unweighted means over outputs.
    """

    per_output_mask = True

    def __init__(self, decision_threshold: float | Sequence[float] = 0.5, labels: Sequence[str] | None = None) -> None:
        if isinstance(decision_threshold, (list, tuple, np.ndarray)):
            if not len(decision_threshold):
                raise ValueError("EvaluationBinary: decision_threshold is an empty list")
            self.decision_threshold: float | list[float] = [
                _finite_number(t, "EvaluationBinary: each decision_threshold") for t in decision_threshold
            ]
        else:
            self.decision_threshold = _finite_number(decision_threshold, "EvaluationBinary: decision_threshold")
        self.labels = _names(labels, 1, "EvaluationBinary")
        if (
            self.labels is not None
            and isinstance(self.decision_threshold, list)
            and len(self.labels) != len(self.decision_threshold)
        ):
            raise ValueError(
                f"EvaluationBinary: {len(self.decision_threshold)} decision thresholds for {len(self.labels)} outputs"
            )
        self.reset()

    def _configured_outputs(self) -> int | None:
        if self.labels is not None:
            return len(self.labels)
        return len(self.decision_threshold) if isinstance(self.decision_threshold, list) else None

    # -- accumulation ---------------------------------------------------------------------
    def eval(self, labels: Any, predictions: Any, mask: Any = None) -> None:
        """Add one batch of 0/1 ``labels`` and ``predictions``; ``mask`` leaves examples, time steps
        or single outputs out."""
        r = self.rows(labels, predictions, mask)
        n = r.predictions.shape[1]
        self._check_outputs(n)
        y = r.labels
        if r.indexed:
            if n != 1:
                raise EvaluationError(
                    f"EvaluationBinary: labels of shape {y.shape} for predictions of shape "
                    f"{r.predictions.shape}: give one 0/1 label per output, not class indices"
                )
            y = y[:, None]
        counted = np.ones(y.shape, dtype=bool) if r.mask is None else r.mask
        if not np.isin(y[counted], (0, 1)).all():
            raise EvaluationError("EvaluationBinary: labels must be 0 or 1")
        actual = y == 1
        predicted = r.predictions >= np.asarray(self.decision_threshold)
        batch = np.stack(
            [
                np.count_nonzero(a & p & counted, axis=0)
                for a, p in ((actual, predicted), (~actual, predicted), (~actual, ~predicted), (actual, ~predicted))
            ]
        )
        if self._counts is None:
            self._counts = np.zeros((4, n), dtype=np.int64)
        self._counts += batch

    def _check_outputs(self, n: int) -> None:
        if self.labels is not None and n != len(self.labels):
            raise EvaluationError(
                f"EvaluationBinary: predictions have {n} outputs but {len(self.labels)} output "
                "names were given as labels"
            )
        if isinstance(self.decision_threshold, list) and n != len(self.decision_threshold):
            raise EvaluationError(
                f"EvaluationBinary: predictions have {n} outputs but "
                f"{len(self.decision_threshold)} decision thresholds were given"
            )
        if self._counts is not None and n != self._counts.shape[1]:
            raise EvaluationError(
                f"EvaluationBinary: predictions have {n} outputs but earlier batches had {self._counts.shape[1]}"
            )

    def reset(self) -> None:
        """Forget every batch seen."""
        n = self._configured_outputs()
        self._counts: np.ndarray | None = None if n is None else np.zeros((4, n), dtype=np.int64)

    def _settings(self) -> dict[str, Any]:
        return {"decision_threshold": self.decision_threshold, "labels": self.labels}

    def _accumulated(self) -> dict[str, Any]:
        if self._counts is None:
            return dict.fromkeys(COUNT_NAMES)
        return dict(zip(COUNT_NAMES, self._counts.tolist(), strict=True))

    def _restore(self, accumulated: dict[str, Any]) -> None:
        rows = [_restored(accumulated[name], 1, "EvaluationBinary") for name in COUNT_NAMES]
        self._counts = None if rows[0] is None else np.stack(rows)

    def _merge(self, other: BaseEvaluation) -> None:
        assert isinstance(other, EvaluationBinary)
        if other._counts is None:
            return
        if self._counts is None:
            self._counts = np.zeros_like(other._counts)
        elif self._counts.shape != other._counts.shape:
            raise IncompatibleEvaluationError(
                f"cannot merge an EvaluationBinary of {other._counts.shape[1]} "
                f"outputs into one of {self._counts.shape[1]}"
            )
        self._counts += other._counts

    # -- counts and metrics ---------------------------------------------------------------
    def num_outputs(self) -> int:
        """The number of outputs (0 before the first batch unless known from the settings)."""
        return 0 if self._counts is None else self._counts.shape[1]

    def _output(self, output: int | str) -> int:
        return _index(output, self.labels, self.num_outputs(), "output")

    def _count(self, row: int, output: int | str | None) -> np.ndarray | int:
        if self._counts is None:
            return np.zeros(0, dtype=np.int64) if output is None else 0
        return self._counts[row].copy() if output is None else int(self._counts[row, self._output(output)])

    def true_positives(self, output: int | str | None = None) -> np.ndarray | int:
        """True positives of ``output``, or an int64 array with one entry per output."""
        return self._count(0, output)

    def false_positives(self, output: int | str | None = None) -> np.ndarray | int:
        """False positives of ``output``, or per output."""
        return self._count(1, output)

    def true_negatives(self, output: int | str | None = None) -> np.ndarray | int:
        """True negatives of ``output``, or per output."""
        return self._count(2, output)

    def false_negatives(self, output: int | str | None = None) -> np.ndarray | int:
        """False negatives of ``output``, or per output."""
        return self._count(3, output)

    def total_count(self, output: int | str) -> int:
        """How many (unmasked) entries of ``output`` were counted."""
        return 0 if self._counts is None else int(self._counts[:, self._output(output)].sum())

    def _metric(self, per_output: Metric, output: int | str) -> float:
        if self._counts is None:
            return 0.0
        return float(per_output(Counts(*self._counts))[self._output(output)])

    def _average(self, per_output: Metric) -> float:
        return 0.0 if self._counts is None else float(per_output(Counts(*self._counts)).mean())

    def accuracy(self, output: int | str) -> float:
        """The fraction of ``output``'s entries predicted right."""
        return self._metric(_accuracy, output)

    def precision(self, output: int | str) -> float:
        """Precision ``tp / (tp + fp)`` of ``output``."""
        return self._metric(_precision, output)

    def recall(self, output: int | str) -> float:
        """Recall ``tp / (tp + fn)`` of ``output``."""
        return self._metric(_recall, output)

    def f1(self, output: int | str) -> float:
        """F1 of ``output``."""
        return self._metric(_f_beta(1.0), output)

    def f_beta(self, beta: float, output: int | str) -> float:
        """F-beta (recall weighted ``beta`` times as much as precision) of ``output``."""
        return self._metric(_f_beta(beta), output)

    def g_measure(self, output: int | str) -> float:
        """G-measure ``sqrt(precision · recall)`` of ``output``."""
        return self._metric(_g_measure, output)

    def matthews_correlation(self, output: int | str) -> float:
        """Matthews correlation of ``output``."""
        return self._metric(_matthews, output)

    def false_positive_rate(self, output: int | str) -> float:
        """False positive rate ``fp / (fp + tn)`` of ``output``."""
        return self._metric(_false_positive_rate, output)

    def false_negative_rate(self, output: int | str) -> float:
        """False negative rate ``fn / (fn + tp)`` of ``output``."""
        return self._metric(_false_negative_rate, output)

    def average_accuracy(self) -> float:
        """Accuracy averaged over outputs."""
        return self._average(_accuracy)

    def average_precision(self) -> float:
        """Precision averaged over outputs."""
        return self._average(_precision)

    def average_recall(self) -> float:
        """Recall averaged over outputs."""
        return self._average(_recall)

    def average_f1(self) -> float:
        """F1 averaged over outputs."""
        return self._average(_f_beta(1.0))

    # -- report ---------------------------------------------------------------------------
    def stats(self) -> str:
        """A table with one row per output: metrics, then counts (and thresholds where they differ)."""
        if self._counts is None or not self._counts.any():
            return "EvaluationBinary: no examples evaluated"
        n = self.num_outputs()
        names = self.labels or [str(k) for k in range(n)]
        thresholds = (
            self.decision_threshold if isinstance(self.decision_threshold, list) else [self.decision_threshold] * n
        )
        counts = Counts(*self._counts)
        metrics = {
            "Accuracy": _accuracy(counts),
            "F1": _f_beta(1.0)(counts),
            "Precision": _precision(counts),
            "Recall": _recall(counts),
            "MCC": _matthews(counts),
        }
        name_width = max(len("Output"), *(len(name) for name in names))
        count_width = max(5, len(str(self._counts.sum(axis=0).max())))
        widths = {
            **{h: max(len(h), 7) for h in metrics},
            "Threshold": 9,
            **{h: count_width for h in ("Total", "TP", "TN", "FP", "FN")},
        }
        header = f"{'Output':<{name_width}}  " + "  ".join(f"{h:>{w}}" for h, w in widths.items())
        lines = [header, "-" * len(header)]
        for k in range(n):
            cells = [f"{float(m[k]):.4f}" for m in metrics.values()] + [f"{thresholds[k]:g}"]
            cells += [str(v) for v in (self._counts[:, k].sum(), *self._counts[(0, 2, 1, 3), k])]
            row = "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths.values(), strict=True))
            lines.append(f"{names[k]:<{name_width}}  {row}")
        lines.append(
            f"Average over {n} outputs: accuracy {self.average_accuracy():.4f}, precision "
            f"{self.average_precision():.4f}, recall {self.average_recall():.4f}, F1 {self.average_f1():.4f}"
        )
        return "\n".join(lines)
