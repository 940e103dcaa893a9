"""What every evaluation type shares: input checking and flattening, merging, JSON and YAML.

An evaluation accumulates counts (or sums) over the batches given to :meth:`BaseEvaluation.eval`;
two evaluations of the same type and settings :meth:`~BaseEvaluation.merge` into the evaluation of
all their batches, which is how partitions evaluated on different workers are combined. Its state
is plain numbers and lists, so it round-trips through JSON or YAML exactly, and loading one never
unpickles anything.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np
import yaml

from dlscale.errors import EvaluationError, IncompatibleEvaluationError
from dlscale.registry import Registry, UnknownNameError

FORMAT_VERSION = 1


def as_numpy(x: Any, name: str) -> np.ndarray:
    """``x`` (a torch tensor, numpy array or nested list) as a numpy array on the CPU."""
    if hasattr(x, "detach"):  # a torch tensor, possibly on a GPU
        x = x.detach().cpu()
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        x = x.numpy()
    try:
        return np.asarray(x)
    except Exception as e:
        raise EvaluationError(f"{name} must be a tensor or array, not {type(x).__name__}") from e


@dataclass
class Rows:
    """Evaluation input flattened to one row per example (or per unmasked time step).

    ``labels`` is ``[M, C]`` float64 (one-hot, multi-label or regression targets) or ``[M]`` int64
    (class indices); ``predictions`` is ``[M, C]`` float64; ``mask`` is ``[M, C]`` bool where a
    per-output mask was given, else ``None``.
    """

    labels: np.ndarray
    predictions: np.ndarray
    mask: np.ndarray | None

    @property
    def indexed(self) -> bool:
        """Whether ``labels`` are class indices rather than one column per output."""
        return self.labels.ndim == 1


def rows(
    labels: Any, predictions: Any, mask: Any = None, *, per_output_mask: bool = False, who: str = "evaluation"
) -> Rows:
    """Check and flatten one batch.

    ``predictions`` is ``[N, C]``, ``[N]`` (one output) or ``[N, T, C]`` (sequences, batch-first).
    ``labels`` has the same shape, or the shape without the last dimension (class indices).
    ``mask`` is per example (``[N]``, or ``[N, 1]`` for one output; for sequences, it holds for every
    step), per time step (``[N, T]``), or per output (the shape of ``predictions``; only where
    ``per_output_mask``). Masked rows are left out; a NaN or infinite prediction or label is
    refused, as is any shape that does not fit.
    """
    p, y, dense = _shaped(labels, predictions, who)
    y = _checked_values(p, y, dense, who)
    keep, out_mask = (None, None) if mask is None else _masks(mask, p, per_output_mask, who)
    c = p.shape[-1]
    p = p.reshape(-1, c).astype(np.float64, copy=False)
    y = y.reshape(-1, c).astype(np.float64, copy=False) if dense else y.reshape(-1)
    if keep is not None:
        p, y = p[keep], y[keep]
    return Rows(y, p, out_mask)


def _shaped(labels: Any, predictions: Any, who: str) -> tuple[np.ndarray, np.ndarray, bool]:
    """Predictions and labels as arrays of shapes that fit, and whether the labels are dense.

    One output given as ``[N]`` becomes a column, boolean labels become 0 and 1. Dense labels have the
    shape of the predictions (one column per output); the others are class indices, one per row.
    """
    p = as_numpy(predictions, "predictions")
    y = as_numpy(labels, "labels")
    if y.dtype == np.bool_:
        y = y.astype(np.int64)
    if p.ndim == 1:
        p = p[:, None]
        if y.ndim == 1:
            y = y[:, None]
    if p.ndim not in (2, 3):
        raise EvaluationError(
            f"{who}: predictions of shape {p.shape}; expected [examples, outputs] or [examples, time, outputs]"
        )
    if y.shape == p.shape:
        return p, y, True
    if y.shape == p.shape[:-1]:
        return p, y, False
    raise EvaluationError(
        f"{who}: labels of shape {y.shape} do not fit predictions of shape {p.shape}; "
        f"labels must be {p.shape} (one column per output) or {p.shape[:-1]} (class indices)"
    )


def _checked_values(p: np.ndarray, y: np.ndarray, dense: bool, who: str) -> np.ndarray:
    """The labels, once predictions and labels are known to be finite numbers (class indices whole ones).

    Class indices come back as int64, so that they can index the classes' counts.
    """
    if not np.issubdtype(p.dtype, np.number) or not np.all(np.isfinite(p)):
        bad = int(np.size(p) - np.count_nonzero(np.isfinite(p))) if np.issubdtype(p.dtype, np.number) else "some"
        raise EvaluationError(f"{who}: predictions contain {bad} NaN or infinite values of {p.size}")
    if not np.issubdtype(y.dtype, np.number) or not np.all(np.isfinite(y.astype(np.float64, copy=False))):
        raise EvaluationError(f"{who}: labels contain NaN, infinite or non-numeric values")
    if dense:
        return y
    if not np.all(np.equal(np.mod(y, 1), 0)):
        raise EvaluationError(
            f"{who}: labels of shape {y.shape} are read as class indices, but some are not whole numbers"
        )
    return y.astype(np.int64)


def _masks(mask: Any, p: np.ndarray, per_output_mask: bool, who: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``mask`` read against predictions ``p``: the rows to keep, or the ``[rows, outputs]`` mask per output.

    A mask per example or per time step selects rows (one per sequence holds for each of its steps);
    a mask of the predictions' shape masks each output, where ``per_output_mask`` allows it.
    """
    m = as_numpy(mask, "mask")
    row_shapes = [p.shape[:-1]] + ([(p.shape[0], 1)] if p.ndim == 2 else [])
    if m.shape == p.shape and m.shape not in row_shapes:
        if not per_output_mask:
            raise EvaluationError(
                f"{who}: a per-output mask of shape {m.shape} is not supported here; give "
                "a mask per example or per time step (EvaluationBinary, ROCBinary and "
                "RegressionEvaluation take per-output masks)"
            )
        return None, m.reshape(-1, p.shape[-1]) != 0
    if m.shape in row_shapes:
        return m.reshape(-1) != 0, None
    if p.ndim == 3 and m.shape == p.shape[:1]:  # one flag per sequence, for each of its steps
        return np.repeat(m != 0, p.shape[1]), None
    raise EvaluationError(
        f"{who}: mask of shape {m.shape} fits neither the examples {p.shape[:1]}, the rows "
        f"{p.shape[:-1]} nor the outputs {p.shape} of predictions"
    )


def class_indices(r: Rows, num_classes: int, who: str = "evaluation") -> np.ndarray:
    """The true class of each row: the index given, the arg-max of one-hot labels, or for a single
    output column, ``label >= 0.5``."""
    if r.indexed:
        y = r.labels
    elif num_classes == 1:
        y = (r.labels[:, 0] >= 0.5).astype(np.int64)
    else:
        y = np.argmax(r.labels, axis=1)
    limit = max(num_classes, 2)
    if y.size and (y.min() < 0 or y.max() >= limit):
        raise EvaluationError(
            f"{who}: class index {int(y.max() if y.max() >= limit else y.min())} is outside "
            f"the {limit} classes of the predictions"
        )
    return y


def ratio(num: float, den: float) -> float:
    """``num / den``, 0 where ``den`` is 0 (scikit-learn's ``zero_division=0``)."""
    return float(num) / float(den) if den else 0.0


def to_plain(value: Any) -> Any:
    """``value`` with numpy arrays and scalars turned into lists and Python numbers (for JSON)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


class BaseEvaluation(abc.ABC):
    """An evaluation that accumulates over batches and merges with others of its kind (DL4J's
    ``IEvaluation``).

    Subclasses implement :meth:`eval`, :meth:`_merge` (add ``other``'s accumulated values),
    :meth:`_settings` (what must agree for two evaluations to merge, and the constructor's keyword
    arguments), :meth:`_accumulated` / :meth:`_restore` (the rest of the state), :meth:`reset` and
    :meth:`stats`. Everything else, JSON and YAML included, is shared.

    A concrete subclass is registered under :attr:`type_name`, the ``type`` its JSON carries: by
    default its qualified name ``<module>.<class>`` (so a class named like a built-in never takes
    the built-in's place), or a short name given in the class statement,
    ``class Top5(BaseEvaluation, type_name="Top5")``, which is refused if another type has it.
    """

    per_output_mask: ClassVar[bool] = False
    type_name: ClassVar[str]
    """The name under which this type is registered and which its JSON and YAML carry."""

    def __init_subclass__(cls, type_name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # ABCMeta sets __abstractmethods__ only after this hook: look for abstract methods left unimplemented
        names = {name for base in cls.__mro__[1:] for name in getattr(base, "__abstractmethods__", ())} | set(vars(cls))
        if any(getattr(getattr(cls, name, None), "__isabstractmethod__", False) for name in names):
            if type_name is not None:
                raise TypeError(f"{cls.__qualname__} is abstract: only a concrete evaluation type takes a type_name")
            return
        if type_name is None:
            # its own name: defining the class again (its module run again) replaces the earlier one
            cls.type_name = f"{cls.__module__}.{cls.__qualname__}"
            REGISTRY.register(cls.type_name, cls, clobber=True)
        else:
            REGISTRY.register(type_name, cls)
            cls.type_name = type_name

    # -- what subclasses provide ----------------------------------------------------------
    @abc.abstractmethod
    def eval(self, labels: Any, predictions: Any, mask: Any = None) -> None:
        """Add one batch: ``labels`` and ``predictions`` (network outputs), optionally masked."""

    @abc.abstractmethod
    def _settings(self) -> dict[str, Any]:
        """The constructor's keyword arguments; two evaluations merge only when these agree."""

    @abc.abstractmethod
    def _accumulated(self) -> dict[str, Any]:
        """Everything accumulated so far, as plain values."""

    @abc.abstractmethod
    def _restore(self, accumulated: dict[str, Any]) -> None:
        """Set the accumulated state from what :meth:`_accumulated` returned."""

    @abc.abstractmethod
    def _merge(self, other: BaseEvaluation) -> None:
        """Add ``other``'s accumulated values to this one's (settings already checked)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget every batch seen."""

    @abc.abstractmethod
    def stats(self) -> str:
        """A readable report."""

    # -- shared ---------------------------------------------------------------------------
    def rows(self, labels: Any, predictions: Any, mask: Any = None) -> Rows:
        """``labels``, ``predictions`` and ``mask`` checked and flattened for this type."""
        return rows(labels, predictions, mask, per_output_mask=self.per_output_mask, who=type(self).__name__)

    def merge(self, other: Self) -> Self:
        """Add ``other``'s batches to this evaluation (in place); returns ``self``."""
        if type(other) is not type(self):
            raise IncompatibleEvaluationError(f"cannot merge a {type(other).__name__} into a {type(self).__name__}")
        mine, theirs = to_plain(self._settings()), to_plain(other._settings())
        if mine != theirs:
            diff = {
                k: (mine.get(k), theirs.get(k)) for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)
            }
            raise IncompatibleEvaluationError(
                f"cannot merge {type(self).__name__} evaluations with different settings: "
                + ", ".join(f"{k}={a!r} vs {b!r}" for k, (a, b) in sorted(diff.items()))
            )
        self._merge(other)
        return self

    def to_dict(self) -> dict[str, Any]:
        """The whole state as plain values: ``type``, ``version``, ``settings`` and ``accumulated``."""
        return {
            "type": self.type_name,
            "version": FORMAT_VERSION,
            "settings": to_plain(self._settings()),
            "accumulated": to_plain(self._accumulated()),
        }

    def to_json(self) -> str:
        """This evaluation as JSON (DL4J's ``toJson``)."""
        return json.dumps(self.to_dict())

    def to_yaml(self) -> str:
        """This evaluation as YAML."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> Self:
        """An evaluation from :meth:`to_dict`'s output; called on a subclass it checks the type."""
        if not isinstance(state, dict) or "type" not in state:
            raise IncompatibleEvaluationError("not a dlscale evaluation: no 'type' field")
        try:
            kind = REGISTRY.lookup(state["type"])
        except UnknownNameError as e:
            raise IncompatibleEvaluationError(str(e)) from None
        if cls is not BaseEvaluation and kind is not cls:
            raise IncompatibleEvaluationError(f"this is a {state['type']}, not a {cls.type_name}")
        if state.get("version") != FORMAT_VERSION:
            raise IncompatibleEvaluationError(
                f"evaluation format version {state.get('version')!r} is not {FORMAT_VERSION}"
            )
        evaluation = kind(**state["settings"])
        evaluation._restore(state["accumulated"])
        return evaluation

    @classmethod
    def from_json(cls, text: str) -> Self:
        """An evaluation from :meth:`to_json`'s output (DL4J's ``fromJson``)."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_yaml(cls, text: str) -> Self:
        """An evaluation from :meth:`to_yaml`'s output."""
        return cls.from_dict(yaml.safe_load(text))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.to_dict() == other.to_dict()  # type: ignore[union-attr]

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self._settings().items())
        return f"{type(self).__name__}({settings})"


REGISTRY: Registry[BaseEvaluation] = Registry(
    "evaluation",
    BaseEvaluation,
    "evaluation type",
    builtins=tuple(f"dlscale.evaluation.{m}" for m in ("calibration", "classification", "regression", "roc")),
)
"""Evaluation types by :attr:`~BaseEvaluation.type_name`; an installed plug-in offers one under its
type name in the entry-point group ``dlscale.evaluation``."""
