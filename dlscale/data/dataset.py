"""``DataSet`` and ``MultiDataSet``: a minibatch of examples as torch tensors (DL4J's types).

Examples are along dimension 0. Sequence data is batch-first, ``[examples, time, ...]``, with
masks of shape ``[examples, time]`` (1 where a step is real, 0 where it is padding), so that
minibatches of sequences of different lengths can be merged by padding the time dimension. A labels
mask may also be ``[examples]`` (one flag per example) or, for labels ``[examples, outputs]``, that
shape (DL4J's per-output masking: one flag per output of each example).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from dask.sizeof import sizeof

from dlscale.errors import DlscaleError
from dlscale.runtime.sizeof import tensor_nbytes


class DataShapeError(DlscaleError, ValueError):
    """Tensors of a minibatch whose shapes do not fit together."""


def _check_examples(tensors: dict[str, torch.Tensor | None]) -> int:
    counts = {name: t.shape[0] for name, t in tensors.items() if t is not None}
    for name, t in tensors.items():
        if t is not None and t.dim() == 0:
            raise DataShapeError(f"{name} is a scalar; examples run along dimension 0")
    if len(set(counts.values())) > 1:
        raise DataShapeError(f"tensors disagree on the number of examples: {counts}")
    return next(iter(counts.values()), 0)


def _check_mask(mask: torch.Tensor | None, data: torch.Tensor, name: str, labels: bool = False) -> None:
    """A features mask is ``[examples, time]``; a labels mask is that, ``[examples, outputs]`` (the
    same first two dimensions of its labels) or ``[examples]``."""
    if mask is None:
        return
    allowed = {tuple(data.shape[:1]): "[examples]"} if labels else {}
    if data.dim() >= 2:
        allowed[tuple(data.shape[:2])] = "[examples, time] / [examples, outputs]" if labels else "[examples, time]"
    if tuple(mask.shape) not in allowed:
        kind = "labels" if labels else "features"
        shapes = " or ".join(f"{form} = {shape}" for shape, form in allowed.items())
        if not shapes:
            shapes = f"[examples, time], which needs {kind} of two or more dimensions, not {tuple(data.shape)}"
        raise DataShapeError(f"{name} has shape {tuple(mask.shape)}; a {kind} mask is {shapes}")


def _pad_time(t: torch.Tensor, length: int) -> torch.Tensor:
    if t.shape[1] == length:
        return t
    pad = torch.zeros((t.shape[0], length - t.shape[1], *t.shape[2:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


def _merge_with_masks(
    data: Sequence[torch.Tensor], masks: Sequence[torch.Tensor | None], name: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate along examples; sequences of different lengths are padded and masked."""
    if len({tuple(d.shape[2:]) for d in data}) > 1 or len({d.dim() for d in data}) > 1:
        raise DataShapeError(f"cannot merge {name} of shapes {[tuple(d.shape) for d in data]}")
    lengths = {d.shape[1] for d in data} if data[0].dim() >= 2 else set()
    if len(lengths) <= 1 and all(m is None for m in masks):
        return torch.cat(list(data)), None
    if len(lengths) <= 1 and all(m is None or m.dim() == 1 for m in masks):  # one flag per example
        ones = [torch.ones(d.shape[0], dtype=torch.float32, device=d.device) for d in data]
        return torch.cat(list(data)), torch.cat([o if m is None else m for o, m in zip(ones, masks)])
    # an example's flag holds for each of its steps once some masks are per step or the steps are padded
    masks = [m[:, None].expand(d.shape[:2]) if m is not None and m.dim() == 1 else m for d, m in zip(data, masks)]
    if data[0].dim() < 2 or (data[0].dim() == 2 and all(m is None for m in masks)):
        # only sequences ([examples, time, features...], or [examples, time] with masks) are padded
        raise DataShapeError(f"cannot merge {name} of shapes {[tuple(d.shape) for d in data]}")
    length = max(lengths)
    full = [
        m if m is not None else torch.ones(d.shape[:2], dtype=torch.float32, device=d.device)
        for d, m in zip(data, masks)
    ]
    return torch.cat([_pad_time(d, length) for d in data]), torch.cat([_pad_time(m, length) for m in full])


def _index(t: torch.Tensor | None, idx: Any) -> torch.Tensor | None:
    return None if t is None else t[idx]


def _compact(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` alone in a storage of its own size: pickling a view would carry its whole base."""
    if t is None or (t.is_contiguous() and t.untyped_storage().nbytes() == t.nelement() * t.element_size()):
        return t
    return t.detach().clone(memory_format=torch.contiguous_format)


class _Minibatch:
    """What DataSet and MultiDataSet share: selecting, splitting, batching and shuffling examples."""

    def num_examples(self) -> int:
        raise NotImplementedError

    def _select(self, idx: Any) -> Any:
        raise NotImplementedError

    def _tensors(self) -> list[torch.Tensor | None]:
        raise NotImplementedError

    def _layout(self) -> tuple:
        return ()

    def split(self, at: float) -> tuple[Any, Any]:
        """The first ``at`` examples and the rest (a float is a fraction of the examples)."""
        n = self.num_examples()
        cut = round(at * n) if isinstance(at, float) else at
        if not 0 <= cut <= n:
            raise ValueError(f"cannot split {n} examples at {at}")
        return self._select(slice(0, cut)), self._select(slice(cut, n))

    def batch_by(self, n: int) -> list[Any]:
        """Minibatches of ``n`` examples (the last may be smaller)."""
        if n < 1:
            raise ValueError(f"batch size must be at least 1, got {n}")
        return [self._select(slice(i, i + n)) for i in range(0, self.num_examples(), n)]

    def shuffle(self, seed: int | None = None) -> Any:
        """The examples in a random order (the same order for the same seed)."""
        g = torch.Generator()
        g.manual_seed(seed if seed is not None else torch.seed())
        return self._select(torch.randperm(self.num_examples(), generator=g))

    def __reduce__(self) -> tuple:
        # split, batch_by and load give views into larger buffers; only the viewed bytes travel
        return type(self), self._pickled_args()

    def _pickled_args(self) -> tuple:
        raise NotImplementedError

    def to(self, device: torch.device | str) -> Any:
        """This minibatch with every tensor on ``device`` (itself when they are there already)."""
        device = torch.device(device)
        if all(t is None or t.device == device for t in self._tensors()):
            return self
        return self._moved(device)

    def _moved(self, device: torch.device) -> Any:
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of tensor data held."""
        return sum(t.nelement() * t.element_size() for t in self._tensors() if t is not None)

    def equals(self, other: Any) -> bool:
        """Same type, and the same tensors (values, dtypes and shapes) in every field."""
        if type(other) is not type(self) or other._layout() != self._layout():
            return False
        a, b = self._tensors(), other._tensors()
        return len(a) == len(b) and all(
            (x is None and y is None)
            or (x is not None and y is not None and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y))
            for x, y in zip(a, b)
        )


@sizeof.register(_Minibatch)
def _sizeof_minibatch(batch: _Minibatch) -> int:
    """What a worker's memory accounting counts for a minibatch: the object and its tensors' host bytes."""
    return sys.getsizeof(batch) + sum(tensor_nbytes(t) for t in batch._tensors() if t is not None)


@dataclass(eq=False)
class DataSet(_Minibatch):
    """One minibatch for a single-input, single-output model."""

    FIELDS = ("features", "labels", "features_mask", "labels_mask")

    features: torch.Tensor
    labels: torch.Tensor | None = None
    features_mask: torch.Tensor | None = None
    labels_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in self.FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"DataSet.{name} must be a torch.Tensor, not {type(value).__name__}")
        _check_examples(self._fields())
        _check_mask(self.features_mask, self.features, "features_mask")
        if self.labels is not None:
            _check_mask(self.labels_mask, self.labels, "labels_mask", labels=True)
        elif self.labels_mask is not None:
            raise DataShapeError("labels_mask given without labels")

    def _tensors(self) -> list[torch.Tensor | None]:
        return list(self._fields().values())

    def _fields(self) -> dict[str, torch.Tensor | None]:
        return {name: getattr(self, name) for name in self.FIELDS}

    def num_examples(self) -> int:
        return int(self.features.shape[0])

    def _pickled_args(self) -> tuple:
        return tuple(_compact(t) for t in self._fields().values())

    def _select(self, idx: Any) -> DataSet:
        return DataSet(*(_index(t, idx) for t in self._fields().values()))

    def _moved(self, device: torch.device) -> DataSet:
        return DataSet(*(None if t is None else t.to(device) for t in self._fields().values()))

    @staticmethod
    def merge(datasets: Sequence[DataSet]) -> DataSet:
        """One DataSet with the examples of all; sequences of unequal length are padded and masked."""
        if not datasets:
            raise ValueError("merge needs at least one DataSet")
        if any((d.labels is None) != (datasets[0].labels is None) for d in datasets):
            raise DataShapeError("cannot merge DataSets with and without labels")
        features, fmask = _merge_with_masks(
            [d.features for d in datasets], [d.features_mask for d in datasets], "features"
        )
        if datasets[0].labels is None:
            return DataSet(features, None, fmask)
        labels, lmask = _merge_with_masks([d.labels for d in datasets], [d.labels_mask for d in datasets], "labels")
        return DataSet(features, labels, fmask, lmask)


def _optional_list(values: Sequence[torch.Tensor | None] | None, n: int, name: str) -> list[torch.Tensor | None]:
    if values is None:
        return [None] * n
    values = list(values)
    if len(values) != n:
        raise DataShapeError(f"{name} has {len(values)} entries for {n} arrays")
    return values


@dataclass(eq=False)
class MultiDataSet(_Minibatch):
    """One minibatch for a model with several inputs and/or outputs."""

    GROUPS = ("features", "labels", "features_masks", "labels_masks")

    features: list[torch.Tensor]
    labels: list[torch.Tensor]
    features_masks: list[torch.Tensor | None] | None = None
    labels_masks: list[torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        self.features = list(self.features)
        self.labels = list(self.labels)
        if not self.features:
            raise DataShapeError("a MultiDataSet needs at least one features array")
        self.features_masks = _optional_list(self.features_masks, len(self.features), "features_masks")
        self.labels_masks = _optional_list(self.labels_masks, len(self.labels), "labels_masks")
        tensors = {}
        for group in self.GROUPS:
            for i, t in enumerate(getattr(self, group)):
                if t is not None and not isinstance(t, torch.Tensor):
                    raise TypeError(f"MultiDataSet.{group}[{i}] must be a torch.Tensor, not {type(t).__name__}")
                tensors[f"{group}[{i}]"] = t
        _check_examples(tensors)
        for i, (d, m) in enumerate(zip(self.features, self.features_masks)):
            _check_mask(m, d, f"features_masks[{i}]")
        for i, (d, m) in enumerate(zip(self.labels, self.labels_masks)):
            _check_mask(m, d, f"labels_masks[{i}]", labels=True)

    def _layout(self) -> tuple:
        return (len(self.features), len(self.labels))

    def _tensors(self) -> list[torch.Tensor | None]:
        return [t for group in self.GROUPS for t in getattr(self, group)]

    def num_examples(self) -> int:
        return int(self.features[0].shape[0])

    def _pickled_args(self) -> tuple:
        return tuple([_compact(t) for t in getattr(self, group)] for group in self.GROUPS)

    def _select(self, idx: Any) -> MultiDataSet:
        return MultiDataSet(
            [t[idx] for t in self.features],
            [t[idx] for t in self.labels],
            [_index(m, idx) for m in self.features_masks],
            [_index(m, idx) for m in self.labels_masks],
        )

    def _moved(self, device: torch.device) -> MultiDataSet:
        return MultiDataSet(*([None if t is None else t.to(device) for t in getattr(self, g)] for g in self.GROUPS))

    @staticmethod
    def merge(datasets: Sequence[MultiDataSet]) -> MultiDataSet:
        """One MultiDataSet with the examples of all; sequences are padded and masked as needed."""
        if not datasets:
            raise ValueError("merge needs at least one MultiDataSet")
        first = datasets[0]
        if any(len(d.features) != len(first.features) or len(d.labels) != len(first.labels) for d in datasets):
            raise DataShapeError("cannot merge MultiDataSets with different numbers of arrays")
        features, fmasks, labels, lmasks = [], [], [], []
        for i in range(len(first.features)):
            t, m = _merge_with_masks(
                [d.features[i] for d in datasets], [d.features_masks[i] for d in datasets], f"features[{i}]"
            )
            features.append(t)
            fmasks.append(m)
        for i in range(len(first.labels)):
            t, m = _merge_with_masks(
                [d.labels[i] for d in datasets], [d.labels_masks[i] for d in datasets], f"labels[{i}]"
            )
            labels.append(t)
            lmasks.append(m)
        return MultiDataSet(features, labels, fmasks, lmasks)


def rebatch(batches: Iterable[DataSet | MultiDataSet], size: int) -> Iterator[DataSet | MultiDataSet]:
    """The examples of ``batches``, in order, as minibatches of exactly ``size`` (the last may be
    smaller): evaluation and inference compute in batches of their own size, whatever the data's."""
    if size < 1:
        raise ValueError(f"batch size must be at least 1, got {size}")
    pending: list[Any] = []
    count = 0
    for batch in batches:
        while batch.num_examples():
            head, batch = batch.split(min(size - count, batch.num_examples()))
            pending.append(head)
            count += head.num_examples()
            if count == size:
                yield _joined(pending)
                pending, count = [], 0
    if pending:
        yield _joined(pending)


def _joined(batches: list[Any]) -> DataSet | MultiDataSet:
    if len(batches) == 1:
        return batches[0]
    kinds = {type(b) for b in batches}
    if len(kinds) > 1:
        raise DataShapeError(f"cannot batch {' and '.join(sorted(k.__name__ for k in kinds))} together")
    return batches[0].merge(batches)
