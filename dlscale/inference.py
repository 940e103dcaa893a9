"""Distributed inference: keyed forward passes and per-example scores over RDDs (DL4J's
``feedForwardWithKey`` and ``scoreExamples``), and predictions over Dask arrays and dataframes that
stay distributed.

Every task borrows a worker's copy of the network (sent to each worker once and held there while
the result is in use, see :mod:`dlscale.nn.shipping`) and computes in minibatches of
``batch_size`` examples; the batch size trades memory for speed and never changes a result.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from distributed import get_client

from dlscale import config, storage
from dlscale.data.dataset import DataSet, DataShapeError, MultiDataSet, rebatch
from dlscale.nn import shipping
from dlscale.nn.partitions import minibatches, worker_copies
from dlscale.runtime.tasks import check_count, match_threads, where

if TYPE_CHECKING:
    from dlscale.facade.rdd import RDD
    from dlscale.nn.network import Network


def _batch_size(batch_size: int | None) -> int:
    size = config.get("evaluation.batch-size") if batch_size is None else batch_size
    check_count("batch_size", size)
    return size


def _shipped(network: Network, task: Any, rdd: RDD, batch_size: int, with_optimizer: bool = False) -> RDD:
    shipped = shipping.ship(rdd.ctx.client, network, with_optimizer, waiting="the inference")
    return rdd.map_partitions_with_future(partial(task, shipped.key, batch_size), shipped)


# -- keyed forward passes ---------------------------------------------------------------------
def feed_forward_with_key(network: Network, pair_rdd: RDD, batch_size: int | None = None) -> RDD:
    """``(key, output)`` for every ``(key, features)`` of ``pair_rdd``, lazily.

    ``features`` is one example without the batch dimension (a tensor, or a list of tensors for a
    network with several inputs); ``output`` likewise (a list for several outputs). Outputs equal
    a forward pass of the example alone.
    """
    return _shipped(network, partial(_forward_partition, False), pair_rdd, _batch_size(batch_size))


def feed_forward_with_mask_and_key(network: Network, pair_rdd: RDD, batch_size: int | None = None) -> RDD:
    """As :func:`feed_forward_with_key` for ``(key, (features, mask))`` pairs: ``mask`` (``[time]``,
    or a list with one per input, ``None`` where an input has none) marks the steps that are real.
    Sequences of different lengths are padded to a common length within a batch and their masks
    passed to the module as ``mask=``; an output that runs over the padded steps is cut back to the
    example's own length, so results do not depend on which examples share a batch."""
    return _shipped(network, partial(_forward_partition, True), pair_rdd, _batch_size(batch_size))


def _chunks(elements: Iterable[Any], size: int, index: int) -> Iterator[list[tuple[Any, Any]]]:
    chunk: list[tuple[Any, Any]] = []
    for j, element in enumerate(elements):
        if not (isinstance(element, tuple) and len(element) == 2):
            raise TypeError(f"element {j} of partition {index} is a {type(element).__name__}, not a (key, value) pair")
        chunk.append(element)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _inputs(key: Any, value: Any, masked: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """One example's input tensors and masks, checked."""
    if masked:
        if not (isinstance(value, tuple) and len(value) == 2):
            raise TypeError(
                f"the value of key {key!r} is a {type(value).__name__}; feed_forward_with_mask_and_key "
                "takes (features, mask) pairs"
            )
        value, mask = value
    else:
        mask = None
    features = list(value) if isinstance(value, (list, tuple)) else [value]
    masks = list(mask) if isinstance(mask, (list, tuple)) else [mask] * len(features)
    if len(masks) != len(features):
        raise DataShapeError(f"key {key!r} has {len(masks)} masks for {len(features)} inputs")
    for t in [*features, *masks]:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"the features of key {key!r} hold a {type(t).__name__}, not a torch.Tensor")
    for f, m in zip(features, masks):
        if m is not None and (m.dim() != 1 or f.dim() < 1 or m.shape[0] != f.shape[0]):
            raise DataShapeError(
                f"key {key!r}: a mask of shape {tuple(m.shape)} for features of shape "
                f"{tuple(f.shape)}; a mask is [time] for features [time, ...]"
            )
    return features, masks


def _pad(tensors: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    return torch.stack(
        [
            t if t.shape[0] == length else torch.cat([t, t.new_zeros((length - t.shape[0], *t.shape[1:]))])
            for t in tensors
        ]
    )


def _stack(
    chunk: list[tuple[Any, Any]], masked: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor | None] | None, int | None, list[int]]:
    """The batch of a chunk's examples and their masks; with masks, the padded length of the first
    masked input and each example's own length of it (to cut sequence outputs back to)."""
    examples = [_inputs(k, v, masked) for k, v in chunk]
    first_key, (first, _) = chunk[0][0], examples[0]
    features: list[torch.Tensor] = []
    masks: list[torch.Tensor | None] = []
    lengths: list[Any] = []
    for i in range(len(first)):
        for (key, _), (fs, ms) in zip(chunk, examples):
            if len(fs) != len(first):
                raise DataShapeError(f"key {key!r} has {len(fs)} inputs, key {first_key!r} has {len(first)}")
            if fs[i].shape[1:] != first[i].shape[1:] or (ms[i] is None and fs[i].shape != first[i].shape):
                raise DataShapeError(
                    f"input {i} of key {key!r} has shape {tuple(fs[i].shape)}, of key "
                    f"{first_key!r} {tuple(first[i].shape)}; only sequences with masks may differ "
                    "in length"
                )
        column = [fs[i] for fs, _ in examples]
        column_masks = [ms[i] for _, ms in examples]
        if all(m is None for m in column_masks):
            features.append(torch.stack(column))
            masks.append(None)
            continue
        if any(m is None for m in column_masks):
            raise DataShapeError(f"input {i}: some keys have a mask and some do not (e.g. {first_key!r})")
        length = max(t.shape[0] for t in column)
        features.append(_pad(column, length))
        masks.append(_pad([m.to(torch.float32) for m in column_masks], length))
        if not lengths:
            lengths = [length, [t.shape[0] for t in column]]
    padded, own = lengths or (None, [])
    return features, (masks if masked else None), padded, own


def _row(out: torch.Tensor, i: int, padded: int | None, length: int | None) -> torch.Tensor:
    row = out[i]
    if padded is not None and row.dim() >= 1 and row.shape[0] == padded:
        row = row[:length]
    return row.clone()  # a view would pickle with the whole batch


def _forward_partition(
    masked: bool, key: str, batch_size: int, index: int, blob: bytes, elements: Iterable[Any]
) -> list[tuple[Any, Any]]:
    results: list[tuple[Any, Any]] = []
    try:
        match_threads()
        with shipping.borrow(key, blob, worker_copies(None)) as network:
            for chunk in _chunks(elements, batch_size, index):
                features, masks, padded, own = _stack(chunk, masked)
                out = network.output(*features, mask=masks)
                outputs = out if isinstance(out, list) else [out]
                for bad, o in enumerate(outputs):
                    if not torch.isfinite(o).all():
                        raise ValueError(
                            f"output {bad} of the network is NaN or infinite for some of the keys "
                            f"{[k for k, _ in chunk][:5]}..."
                        )
                for j, (k, _) in enumerate(chunk):
                    rows = [_row(o, j, padded, own[j] if own else None) for o in outputs]
                    results.append((k, rows[0] if len(rows) == 1 else rows))
    except Exception as e:
        e.add_note(f"while running inference on partition {index} on {where()}")
        raise
    return results


# -- scores -----------------------------------------------------------------------------------
def score_examples(
    network: Network, rdd: RDD, include_regularization: bool = False, batch_size: int | None = None
) -> RDD:
    """The loss of every example (see :meth:`~dlscale.nn.Network.score_examples`), lazily.

    For an RDD of DataSet or MultiDataSet: an RDD of floats, one per example, in order. For an RDD
    of ``(key, DataSet)`` pairs, each DataSet one example: an RDD of ``(key, float)``.
    """
    # the optimizer's weight decay is the regularization term
    return _shipped(
        network,
        partial(_score_partition, include_regularization),
        rdd,
        _batch_size(batch_size),
        with_optimizer=include_regularization,
    )


def _score_partition(
    include_regularization: bool, key: str, batch_size: int, index: int, blob: bytes, elements: Iterable[Any]
) -> list[Any]:
    elements = list(elements)
    keyed = bool(elements) and isinstance(elements[0], tuple)
    results: list[Any] = []
    try:
        match_threads()
        with shipping.borrow(key, blob, worker_copies(None)) as network:
            if not keyed:
                for batch in rebatch(minibatches(elements, None), batch_size):
                    results.extend(network.score_examples(batch, include_regularization).tolist())
                return results
            for chunk in _chunks(elements, batch_size, index):
                for k, example in chunk:
                    if not isinstance(example, (DataSet, MultiDataSet)) or example.num_examples() != 1:
                        raise ValueError(f"the value of key {k!r} must be a DataSet or MultiDataSet of one example")
                batch = type(chunk[0][1]).merge([example for _, example in chunk])
                scores = network.score_examples(batch, include_regularization).tolist()
                results.extend(zip([k for k, _ in chunk], scores))
    except Exception as e:
        e.add_note(f"while scoring partition {index} on {where()}")
        raise
    return results


def calculate_score(network: Network, rdd: RDD, average: bool = True, batch_size: int | None = None) -> float:
    """The loss over an RDD of DataSet or MultiDataSet: the mean over examples (``average``) or the
    sum of :func:`score_examples` (DL4J's ``calculateScore``)."""
    sums = score_examples(network, rdd, batch_size=batch_size).mapPartitions(_sum_count)
    total, count = sums.treeReduce(_add_pairs) if rdd.getNumPartitions() else (0.0, 0)
    if count == 0:
        raise ValueError("the RDD has no examples to score")
    return total / count if average else total


def _sum_count(scores: Iterable[float]) -> list[tuple[float, int]]:
    values = list(scores)
    return [(float(sum(values)), len(values))]


def _add_pairs(a: tuple[float, int], b: tuple[float, int]) -> tuple[float, int]:
    return a[0] + b[0], a[1] + b[1]


# -- predictions for minibatch files --------------------------------------------------------
def predict_files(
    network: Network,
    paths: RDD,
    output: str,
    loader: Any = None,
    batch_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> list[int]:
    """Apply ``network`` to the minibatch files named by ``paths`` (read by ``loader``, default
    ``.dlb``) and write each file's outputs to ``output/<file name>.npy``; returns the number of
    examples of each file. ``output`` must not exist yet (a relative URL is under the storage root)."""
    url, options = storage.resolve(output, storage_options)
    storage.check_empty(url, options, create=True)
    task = partial(_predict_files_partition, url, options, loader)
    return _shipped(network, task, paths, _batch_size(batch_size)).collect()


def _predict_files_partition(
    url: str,
    options: dict[str, Any] | None,
    loader: Any,
    key: str,
    batch_size: int,
    index: int,
    blob: bytes,
    elements: Iterable[Any],
) -> list[int]:
    elements = list(elements)
    counts = []
    try:
        match_threads()
        with shipping.borrow(key, blob, worker_copies(None)) as network:
            for source, batch in zip(elements, minibatches(elements, loader)):
                inputs = [batch.features] if isinstance(batch, DataSet) else batch.features
                out = torch.cat(
                    [
                        _as_tensor(network.output(*[t[i : i + batch_size] for t in inputs]), source)
                        for i in range(0, batch.num_examples(), batch_size)
                    ]
                )
                name = str(source).rstrip("/").rsplit("/", 1)[-1].rsplit(".", 1)[0] + ".npy"
                buffer = io.BytesIO()
                np.save(buffer, out.numpy(), allow_pickle=False)
                storage.write_bytes(f"{url.rstrip('/')}/{name}", buffer.getbuffer(), storage_options=options)
                counts.append(batch.num_examples())
    except Exception as e:
        e.add_note(f"while predicting partition {index} on {where()}")
        raise
    return counts


def _as_tensor(out: Any, source: Any) -> torch.Tensor:
    if isinstance(out, list):
        raise TypeError(
            f"predict_files writes one output per file; the network gives {len(out)} for {source} "
            "(use feed_forward_with_key)"
        )
    return out


# -- predictions on Dask collections --------------------------------------------------------
def predict(network: Network, data: Any, batch_size: int | None = None, columns: Sequence[str] | None = None) -> Any:
    """The network's output for every row of a Dask array (examples along axis 0) or dataframe
    (one example per row), as a lazy Dask collection of the same partitioning: an array, or a
    dataframe with the input's index and ``columns`` (default ``"0"``, ``"1"``, ...). Like dask-ml's
    ``ParallelPostFit``, predictions stay on the cluster until asked for."""
    import dask.array as da

    size = _batch_size(batch_size)
    blob = shipping.ship(get_client(), network, waiting="the prediction")
    key = blob.key
    if isinstance(data, da.Array):
        if data.ndim < 1:
            raise ValueError("predict needs examples along axis 0 of the array")
        data = data.rechunk({i: -1 for i in range(1, data.ndim)})
        meta = _sample_output(network, data.shape[1:], data.dtype)
        return da.map_blocks(
            _predict_array,
            data,
            blob,
            key,
            size,
            dtype=meta.dtype,
            chunks=(data.chunks[0], *((n,) for n in meta.shape[1:])),
            drop_axis=list(range(meta.ndim, data.ndim)) if meta.ndim < data.ndim else None,
            new_axis=list(range(data.ndim, meta.ndim)) if meta.ndim > data.ndim else None,
        )
    try:
        import dask.dataframe as dd
        import pandas as pd
    except ImportError:
        dd = None
    if dd is None or not isinstance(data, dd.DataFrame):
        raise TypeError(f"predict takes a dask Array or DataFrame, not {type(data).__name__}")
    meta = _sample_output(network, (len(data.columns),), np.dtype(np.float32))
    if meta.ndim != 2:
        raise ValueError(f"for a dataframe the network must give one row per example, got shape {meta.shape}")
    names = [str(c) for c in columns] if columns is not None else [str(i) for i in range(meta.shape[1])]
    if len(names) != meta.shape[1]:
        raise ValueError(f"columns names {len(names)} columns; the network gives {meta.shape[1]} outputs")
    empty = pd.DataFrame({n: pd.Series([], dtype=meta.dtype) for n in names})
    return data.map_partitions(_predict_frame, blob, key, size, names, meta=empty)


def _sample_output(network: Network, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """The network's output for one example of zeros: the shape and type of predictions."""
    x = torch.zeros((1, *shape), dtype=torch.from_numpy(np.zeros(0, dtype=dtype)).dtype)
    out = network.output(x)
    if isinstance(out, list):
        raise TypeError("predict takes a network with one output; use feed_forward_with_key for several")
    return out.numpy()


def _predict_array(block: np.ndarray, blob: bytes, key: str, batch_size: int) -> np.ndarray:
    match_threads()
    x = torch.from_numpy(np.ascontiguousarray(block))
    with shipping.borrow(key, blob, worker_copies(None)) as network:
        parts = [network.output(x[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)] or [network.output(x)]
    return torch.cat(parts).numpy()


def _predict_frame(part: Any, blob: bytes, key: str, batch_size: int, names: list[str]) -> Any:
    import pandas as pd

    out = _predict_array(part.to_numpy(dtype=np.float32), blob, key, batch_size)
    return pd.DataFrame(out, index=part.index, columns=names)
