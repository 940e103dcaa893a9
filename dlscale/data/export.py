"""Export minibatches to storage once, then train and evaluate from their paths (DL4J's export approach).

An RDD is exported on the workers in two passes: the first counts the examples of every partition,
the second writes. Knowing where each partition starts, a worker writes every batch that lies inside
its partition and hands back only the pieces of the (at most two) batches that cross a partition
boundary; those are joined by one small task each. Every batch therefore has exactly
``batch_size`` examples except the last, in the RDD's order, and no worker holds more than a batch
beyond its own partition. An RDD that is expensive to compute should be persisted first, since both
passes compute it. The partitions of an RDD made by ``parallelize`` are counted and written on the
driver, which holds them: nothing is shipped to the workers.

An export says whether it finished, as Hadoop's ``_SUCCESS`` does: :data:`MANIFEST` is written
before the first batch with ``"complete": false`` and again after the last with ``true`` and the
counts, and :func:`list_paths` refuses a folder of exported batches whose manifest does not say
complete.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import dask
import fsspec

from dlscale import storage
from dlscale.data.dataset import DataSet, MultiDataSet
from dlscale.data.format import entries, save
from dlscale.errors import IncompleteExportError

if TYPE_CHECKING:
    from dlscale.facade.context import SparkContext
    from dlscale.facade.rdd import RDD

Minibatch = DataSet | MultiDataSet
PREFIXES = {DataSet: "dataset", MultiDataSet: "multidataset"}
EXTENSION = ".dlb"
MANIFEST = "_dlscale_export.json"
"""The export's manifest in its folder: ``{"format": "dlscale-export", "version": 1, "complete": ...}``,
with ``batch_size`` and, once complete, the ``batches`` and ``examples`` written."""
_EXPORTED = re.compile(rf"(?:{'|'.join(PREFIXES.values())})_\d{{8}}{re.escape(EXTENSION)}")
"""The names :class:`FileSink` gives batches: only a folder holding such files can be an export."""


@runtime_checkable
class Sink(Protocol):
    """Where an export writes its minibatches: ``write(k, batch)`` stores minibatch ``k`` (batches
    arrive in any order, each once, from any worker) and returns what a loader reads it back from (a
    path, a reference such as ``<group url>#<k>``, or the minibatch's bytes). A sink pickles, since
    it is shipped to the workers that write."""

    def write(self, k: int, batch: Minibatch) -> Any: ...


def check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")


def minibatch_kind(element: Any, where: str) -> type:
    """DataSet or MultiDataSet, or a TypeError naming where the element came from."""
    if isinstance(element, (DataSet, MultiDataSet)):
        return type(element)
    raise TypeError(f"{where} holds a {type(element).__name__}; only DataSet and MultiDataSet can be exported")


@dataclass(frozen=True)
class FileSink:
    """Writes batch ``k`` to ``<url>/<prefix>_<k:08d>.dlb``: names sort in write order."""

    url: str
    prefix: str
    storage_options: dict[str, Any] | None

    def write(self, k: int, batch: Minibatch) -> str:
        path = f"{self.url.rstrip('/')}/{self.prefix}_{k:08d}{EXTENSION}"
        save(batch, path, self.storage_options)
        return path


def rebatch(
    elements: Iterable[Any], batch_size: int, start: int, total: int | None, where: str
) -> Iterator[tuple[int, bool, Minibatch]]:
    """Cut a stream of minibatches that starts at example ``start`` at the global batch boundaries.

    Yields ``(k, whole, piece)``: ``piece`` holds examples of batch ``k``, and ``whole`` says it is
    all of batch ``k`` (the last batch ends at ``total``; ``None`` means the stream's end).
    """
    kind, pending, pos, begin = None, [], start, start
    for i, element in enumerate(elements):
        this = minibatch_kind(element, f"{where}, element {i},")
        if kind is None:
            kind = this
        elif this is not kind:
            raise TypeError(f"{where} mixes {kind.__name__} and {this.__name__} elements; export one kind at a time")
        rest = element
        while rest.num_examples():
            k = pos // batch_size
            end = (k + 1) * batch_size if total is None else min((k + 1) * batch_size, total)
            take, rest = rest.split(min(rest.num_examples(), end - pos))
            pending.append(take)
            pos += take.num_examples()
            if pos == end:
                yield k, begin == k * batch_size, _merge(kind, pending, k, where)
                pending, begin = [], pos
    if pending:  # the stream ended inside a batch: its last batch, or a partition's share of one
        k = (pos - 1) // batch_size
        yield k, total is None, _merge(kind, pending, k, where)


def _merge(kind: type, pieces: list, k: int, where: str) -> Minibatch:
    try:
        return kind.merge(pieces)
    except ValueError as e:
        e.add_note(f"while building minibatch {k} from {where}")
        raise


def schema(batch: Minibatch) -> tuple:
    """Every array's field, index, dtype and shape after the examples dimension."""
    return tuple(
        (field, index, str(t.dtype).removeprefix("torch."), tuple(t.shape[1:])) for field, index, t in entries(batch)[1]
    )


@dataclass(frozen=True)
class Description:
    """What the counting pass learns of one partition."""

    count: int = 0
    kind: str | None = None
    schemas: frozenset = frozenset()


def _describe(index: int, elements: Iterable[Any]) -> list[Description]:
    count, kind, schemas = 0, None, set()
    for i, element in enumerate(elements):
        this = minibatch_kind(element, f"partition {index}, element {i},")
        if kind is not None and this.__name__ != kind:
            raise TypeError(f"partition {index} mixes {kind} and {this.__name__} elements; export one kind at a time")
        kind = this.__name__
        count += element.num_examples()
        if len(schemas) < 2:
            schemas.add(schema(element))
    return [Description(count, kind, frozenset(schemas))]


def _write_partition(
    elements: Iterable[Any], index: int, sink: Sink, batch_size: int, start: int, count: int, total: int
) -> tuple[dict[int, str], dict[int, Minibatch]]:
    written, pieces, seen = {}, {}, 0
    for k, whole, piece in rebatch(elements, batch_size, start, total, f"partition {index}"):
        seen += piece.num_examples()
        if whole:
            written[k] = sink.write(k, piece)
        else:
            pieces[k] = piece
    if seen != count:
        raise RuntimeError(
            f"partition {index} had {count} examples when counted and {seen} when written: the RDD is not "
            "deterministic; persist it before exporting"
        )
    return written, pieces


def _join(k: int, sink: Sink, kind: type, *results: tuple[dict, dict]) -> str:
    return sink.write(k, _merge(kind, [pieces[k] for _, pieces in results if k in pieces], k, "several partitions"))


@dataclass
class ExportPlan:
    """The delayed tasks of an export: ``parts[i]`` writes partition ``i``'s whole batches and returns
    ``(written, pieces)``; ``joins[k]`` writes batch ``k`` from the pieces of several partitions;
    ``owner[k]`` is the partition that wrote batch ``k`` whole, for ``k`` not in ``joins``. ``here``:
    the tasks hold the partitions and run on the driver, which has them (see :func:`plan_export`)."""

    kind: type
    total: int
    parts: list
    joins: dict[int, Any]
    owner: dict[int, int]
    here: bool = False


def plan_export(
    rdd: RDD, batch_size: int, make_sink: Callable[[type, int, set], Sink], *, ship: bool = False
) -> ExportPlan:
    """Count ``rdd``'s examples and plan writing it in batches of ``batch_size`` through
    ``make_sink(kind, total examples, schemas)``. Partitions the driver holds (an RDD made by
    ``parallelize``) are counted there and, unless ``ship`` (what the sink returns must end on the
    workers), written there too: shipping them to a worker costs more than writing them. Any other RDD
    is counted by a job (one pass) and written by tasks on the workers."""
    local = rdd.local_partitions()
    if local is None:
        described = rdd.mapPartitionsWithIndex(_describe).collect()
    else:
        local = list(local)  # read once, for the count and the writing
        described = [d for i, part in enumerate(local) for d in _describe(i, part)]
    kinds = {d.kind for d in described if d.kind is not None}
    if len(kinds) > 1:
        raise TypeError(f"the RDD mixes {' and '.join(sorted(kinds))} partitions; export one kind at a time")
    total = sum(d.count for d in described)
    if total == 0:
        raise ValueError("nothing to export: the RDD has no examples")
    kind = DataSet if kinds == {"DataSet"} else MultiDataSet
    sink = make_sink(kind, total, set().union(*(d.schemas for d in described)))
    counted = [d.count for d in described]
    here = local is not None and not ship
    if here:
        tag = uuid.uuid4().hex
        parts = [dask.delayed(part, name=f"partition-{tag}-{i}", traverse=False) for i, part in enumerate(local)]
    else:
        parts = rdd.to_bag().to_delayed()
    write = dask.delayed(_write_partition, pure=False)
    tasks, starts, start = [], [], 0
    for i, count in enumerate(counted):
        tasks.append(write(parts[i], i, sink, batch_size, start, count, total))
        starts.append(start)
        start += count
    joins, owner = {}, {}
    for k in range(math.ceil(total / batch_size)):
        lo, hi = k * batch_size, min((k + 1) * batch_size, total)
        owners = [i for i, (s, c) in enumerate(zip(starts, counted)) if c and s < hi and s + c > lo]
        if len(owners) > 1:
            joins[k] = dask.delayed(_join, pure=False)(k, sink, kind, *(tasks[i] for i in owners))
        else:
            owner[k] = owners[0]
    return ExportPlan(kind, total, tasks, joins, owner, here)


def write_plan(sc: SparkContext, plan: ExportPlan) -> list[Any]:
    """Run ``plan``: on the workers, or by the driver's threads, a partition each at a time, where it
    holds the partitions; returns what the sink's ``write`` returned for every batch, in order."""
    tasks = [*plan.parts, *plan.joins.values()]
    done = dask.compute(*tasks, scheduler="threads") if plan.here else sc.client.compute(tasks, sync=True)
    paths = dict(zip(plan.joins, done[len(plan.parts) :]))
    for written, _ in done[: len(plan.parts)]:
        paths.update(written)
    return [paths[k] for k in sorted(paths)]


def export_rdd(rdd: RDD, batch_size: int, make_sink: Callable[[type, int, set], Sink]) -> list[Any]:
    """Write ``rdd`` in batches of ``batch_size`` through ``make_sink(kind, total examples, schemas)``."""
    return write_plan(rdd.ctx, plan_export(rdd, batch_size, make_sink))


def _write_manifest(url: str, storage_options: dict[str, Any] | None, **fields: Any) -> None:
    text = json.dumps({"format": "dlscale-export", "version": 1, **fields})
    storage.write_string_to_file(f"{url.rstrip('/')}/{MANIFEST}", text, storage_options)


def export_minibatches(
    data: RDD | Iterable[Minibatch], url: str, batch_size: int, *, storage_options: dict[str, Any] | None = None
) -> list[str]:
    """Write ``data`` to ``url`` as ``.dlb`` files of exactly ``batch_size`` examples (the last may be fewer).

    ``data`` is an RDD of DataSet or MultiDataSet (written on the workers, in parallel) or a local
    iterable of them (written here). Files are named ``dataset_00000000.dlb``, ... (``multidataset_``
    for MultiDataSets) so that listing order is write order. The folder's :data:`MANIFEST` says
    ``"complete": false`` from the first batch on and ``true`` once the last is written, which
    :func:`list_paths` checks. ``url`` must be missing or empty, once the temporary files of writers
    killed there are removed (:func:`dlscale.storage.remove_stale_temporaries`). Returns the files'
    URLs in order.
    """
    from dlscale.facade.rdd import RDD  # imported here: the facade loads distributed, importing dlscale.data does not

    check_batch_size(batch_size)
    url, storage_options = storage.resolve(url, storage_options)
    storage.remove_stale_temporaries(url, storage_options)
    storage.check_empty(url, storage_options)

    def start(kind: type) -> FileSink:
        _write_manifest(url, storage_options, complete=False, batch_size=batch_size)
        return FileSink(url, PREFIXES[kind], storage_options)

    if isinstance(data, RDD):
        plan = plan_export(data, batch_size, lambda kind, *_: start(kind))
        paths, examples = write_plan(data.ctx, plan), plan.total
    else:
        paths, examples, sink = [], 0, None
        for k, _, batch in rebatch(data, batch_size, 0, None, "the iterable"):
            sink = sink or start(type(batch))
            paths.append(sink.write(k, batch))
            examples += batch.num_examples()
        if not paths:
            raise ValueError("nothing to export: the iterable has no examples")
    _write_manifest(url, storage_options, complete=True, batch_size=batch_size, batches=len(paths), examples=examples)
    return paths


def _check_complete(fs: fsspec.AbstractFileSystem, files: list[str], display: Callable[[str], str]) -> None:
    """Refuse the folders among ``files``' that hold exported batches and a manifest that does not
    say complete. A folder without a manifest is not an export (or predates manifests) and passes."""
    folders = sorted({fs._parent(p) for p in files if _EXPORTED.fullmatch(p.rsplit("/", 1)[-1])})
    for folder in folders:
        manifest = f"{folder}/{MANIFEST}"
        with storage.as_storage_error("read", display(manifest)):
            try:
                text = fs.cat_file(manifest)
            except FileNotFoundError:
                continue
        try:
            complete = json.loads(text).get("complete") is True
        except (ValueError, AttributeError):
            complete = False
        if not complete:
            raise IncompleteExportError(
                f"{display(folder)}: the export to this folder did not finish (its {MANIFEST} does not say "
                "complete), so its minibatch files are only part of the data; export again to a new folder, "
                "or pass require_complete=False to list the files that are there"
            )


def list_paths(
    sc: SparkContext,
    url: str,
    storage_options: dict[str, Any] | None = None,
    recursive: bool = True,
    extensions: Iterable[str] | None = None,
    *,
    require_complete: bool = True,
) -> RDD:
    """An RDD of the URLs of the files under ``url``, sorted (DL4J's ``SparkUtils.listPaths``).

    Names starting with ``_`` or ``.`` are skipped (temporary and marker files); ``extensions``
    (e.g. ``["dlb"]``) keeps only files with those endings. A folder of batches written by
    :func:`export_minibatches` whose export did not finish (it was killed, or failed) raises
    :class:`IncompleteExportError` naming the folder, unless ``require_complete=False``; folders
    of other files, which have no export manifest, are listed as they are.
    """
    url, storage_options = storage.resolve(url, storage_options)
    fs, files = storage.find_files(url, storage_options, recursive, extensions)
    remote = storage.has_protocol(url)

    def display(path: str) -> str:
        return fs.unstrip_protocol(path) if remote else path

    if require_complete:
        _check_complete(fs, files, display)
    urls = [display(p) for p in files]
    return sc.parallelize(urls, min(len(urls), sc.defaultParallelism))
