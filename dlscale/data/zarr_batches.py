"""Minibatches in a zarr group: one array per tensor, one chunk per minibatch.

The alternative to one ``.dlb`` file per minibatch for dense data whose arrays have the same shape in
every minibatch (apart from the number of examples). A minibatch is named by a reference
``<group url>#<k>`` so that the same RDD-of-paths machinery trains from either store. Every chunk
carries a CRC-32C; the group's ``dlscale`` attribute is written last, so a reader never uses a group
whose export did not finish.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec

from dlscale import storage
from dlscale.data import loaders
from dlscale.data.dataset import DataSet, MultiDataSet
from dlscale.data.export import (
    Minibatch,
    check_batch_size,
    export_rdd,
    rebatch,
    schema,
)
from dlscale.data.format import assemble, entries
from dlscale.errors import CorruptDataError, StorageError

if TYPE_CHECKING:
    from dlscale.facade.context import SparkContext
    from dlscale.facade.rdd import RDD

FORMAT = "dlscale-minibatches"
VERSION = 1


def _open(url: str, storage_options: dict[str, Any] | None, mode: str) -> zarr.Group:
    kwargs = {"storage_options": storage_options} if storage_options else {}
    try:
        return zarr.open_group(store=url, mode=mode, **kwargs)
    except FileNotFoundError as e:
        raise StorageError(f"no zarr group at {url}") from e
    except Exception as e:  # zarr and object stores raise many kinds of errors
        raise StorageError(f"cannot open zarr group {url}: {e}") from e


def _name(kind: type, field: str, index: int) -> str:
    return field if kind is DataSet else f"{field}_{index}"


def _numpy_dtype(dtype: str, where: str) -> np.dtype:
    try:
        return torch.empty(0, dtype=getattr(torch, dtype)).numpy().dtype
    except TypeError as e:
        raise TypeError(f"{where} has dtype {dtype}, which zarr cannot store; use .dlb files") from e


class ZarrSink:
    """Writes minibatch ``k`` as chunk ``k`` of every array of the group at ``url``."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None, kind: type, batch_size: int) -> None:
        self.url, self.storage_options, self.kind, self.batch_size = url, storage_options, kind, batch_size
        self._arrays: dict[str, Any] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_arrays": None}

    def create(self, layout: tuple, total: int) -> None:
        """Make the group's arrays for ``total`` examples of the given schema."""
        group = _open(self.url, self.storage_options, "w")
        for field, index, dtype, shape in layout:
            group.create_array(
                _name(self.kind, field, index),
                shape=(total, *shape),
                chunks=(self.batch_size, *shape),
                dtype=_numpy_dtype(dtype, f"{field}[{index}]"),
                compressors=[Crc32cCodec()],
                fill_value=0,
            )

    def _pairs(self, batch: Minibatch) -> list[tuple[Any, np.ndarray]]:
        if self._arrays is None:
            self._arrays = dict(_open(self.url, self.storage_options, "r+").arrays())
        return [
            (self._arrays[_name(self.kind, field, index)], t.detach().cpu().numpy())
            for field, index, t in entries(batch)[1]
        ]

    def write(self, k: int, batch: Minibatch) -> str:
        start = k * self.batch_size
        for array, data in self._pairs(batch):
            array[start : start + len(data)] = data
        return f"{self.url}#{k}"

    def append(self, batch: Minibatch) -> None:
        """Add ``batch`` at the end of every array (when the total is not known in advance)."""
        for array, data in self._pairs(batch):
            array.append(data)

    def finish(self, layout: tuple, total: int) -> None:
        """Mark the group complete; readers refuse it before this."""
        counts = {group: sum(1 for entry in layout if entry[0] == group) for group in ("features", "labels")}
        _open(self.url, self.storage_options, "r+").attrs["dlscale"] = {
            "format": FORMAT,
            "version": VERSION,
            "kind": self.kind.__name__,
            "batch_size": self.batch_size,
            "num_examples": total,
            "counts": counts,
            "arrays": [[field, index, _name(self.kind, field, index)] for field, index, _, _ in layout],
        }


def _one_layout(layouts: set, url: str) -> tuple:
    if len(layouts) != 1:
        a, b = sorted(layouts)[:2]
        raise ValueError(
            f"zarr export to {url} needs every minibatch to have the same arrays, dtypes and shapes "
            f"(apart from the number of examples), but found {a} and {b}; use .dlb files"
        )
    return next(iter(layouts))


def export_zarr(
    data: RDD | Iterable[Minibatch], url: str, batch_size: int, *, storage_options: dict[str, Any] | None = None
) -> list[str]:
    """Write ``data`` to a zarr group at ``url``, one chunk per minibatch of ``batch_size`` examples.

    Returns the references ``<url>#<k>`` of the minibatches, in order; :class:`ZarrLoader` loads them.
    """
    from dlscale.facade.rdd import RDD  # imported here: the facade loads distributed, importing dlscale.data does not

    check_batch_size(batch_size)
    url, storage_options = storage.resolve(url, storage_options)
    storage.check_empty(url, storage_options)
    if isinstance(data, RDD):
        made: dict[str, Any] = {}

        def make_sink(kind: type, total: int, layouts: set) -> ZarrSink:
            made["layout"], made["total"] = _one_layout(layouts, url), total
            made["sink"] = ZarrSink(url, storage_options, kind, batch_size)
            made["sink"].create(made["layout"], total)
            return made["sink"]

        refs = export_rdd(data, batch_size, make_sink)
        made["sink"].finish(made["layout"], made["total"])
        return refs
    refs, sink, layout, total = [], None, None, 0
    for k, _, batch in rebatch(data, batch_size, 0, None, "the iterable"):
        if sink is None:
            layout = schema(batch)
            sink = ZarrSink(url, storage_options, type(batch), batch_size)
            sink.create(layout, 0)
        _one_layout({layout, schema(batch)}, url)
        sink.append(batch)
        total += batch.num_examples()
        refs.append(f"{url}#{k}")
    if sink is None:
        raise ValueError("nothing to export: the iterable has no examples")
    sink.finish(layout, total)
    return refs


def _metadata(group: zarr.Group, url: str) -> dict:
    meta = group.attrs.asdict().get("dlscale")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptDataError(f"{url} is not a complete dlscale minibatch group (its export may not have finished)")
    if meta.get("version", 0) > VERSION:
        raise CorruptDataError(f"{url} was written in version {meta['version']}; this dlscale reads up to {VERSION}")
    return meta


def list_zarr_batches(sc: SparkContext, url: str, storage_options: dict[str, Any] | None = None) -> RDD:
    """An RDD of the references ``<url>#<k>`` of every minibatch in the group at ``url``."""
    url, storage_options = storage.resolve(url, storage_options)
    meta = _metadata(_open(url, storage_options, "r"), url)
    n = -(-meta["num_examples"] // meta["batch_size"])
    return sc.parallelize([f"{url}#{k}" for k in range(n)], max(1, min(n, sc.defaultParallelism)))


class ZarrLoader:
    """Loads minibatch ``k`` from a reference ``<group url>#<k>``."""

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = storage_options
        self._groups: dict[str, tuple[dict, dict]] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_groups": {}}

    def __repr__(self) -> str:
        return "ZarrLoader()"

    def _group(self, url: str) -> tuple[dict, dict]:
        if url not in self._groups:
            group = _open(url, self.storage_options, "r")
            meta = _metadata(group, url)
            self._groups[url] = meta, {name: group[name] for _, _, name in meta["arrays"]}
        return self._groups[url]

    def __call__(self, ref: str) -> DataSet | MultiDataSet:
        url, sep, k = ref.rpartition("#")
        if not sep or not k.isdigit():
            raise ValueError(f"{ref!r} is not a zarr minibatch reference '<group url>#<k>'")
        meta, arrays = self._group(url)
        size, total = meta["batch_size"], meta["num_examples"]
        start = int(k) * size
        if start >= total:
            raise IndexError(f"{ref}: the group has {-(-total // size)} minibatches")
        tensors = {}
        try:
            for field, index, name in meta["arrays"]:
                tensors[(field, index)] = torch.from_numpy(np.asarray(arrays[name][start : min(start + size, total)]))
        except Exception as e:
            raise CorruptDataError(f"{ref}: cannot read {name}: {e}") from e
        return assemble(meta["kind"], tensors, meta["counts"])


loaders.REGISTRY.register("zarr", ZarrLoader)
