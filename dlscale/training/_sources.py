"""The minibatches a fit trains on, prepared once before the first round.

Three sources: files listed by a paths RDD (``fit_paths``), an RDD exported to minibatch files
("export", DL4J's memory-safe default), or an RDD cut into minibatches held in the workers' memory
("direct"). Either way every minibatch but the last has exactly ``batch_size`` examples.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed import Future, wait

from dlscale import storage
from dlscale.data.export import PREFIXES, ExportPlan, FileSink, plan_export, write_plan
from dlscale.data.format import to_bytes
from dlscale.data.loaders import resolve_loader
from dlscale.training._worker import decode

logger = logging.getLogger("dlscale.training")

if TYPE_CHECKING:
    from dlscale.facade.persist import StorageLevel
    from dlscale.facade.rdd import RDD


@dataclass
class Minibatches:
    """``refs[i]`` is what the loader turns into minibatch ``i`` (a URL, or the future of one held in
    memory), ``names[i]`` how statistics name it, and ``holders[i]`` the worker holding it in memory."""

    refs: list[Any]
    names: list[str]
    loader: Callable[[Any], Any]
    holders: list[str] | None
    seconds: float


def from_paths(paths: RDD, loader: Callable[[Any], Any] | None) -> Minibatches:
    """The files named by ``paths``, read by ``loader`` (default: any ``.dlb`` file). Paths the driver
    holds (``list_paths`` and ``parallelize`` make such RDDs) are read there, without a job."""
    t0 = time.perf_counter()
    local = paths.local_partitions()
    urls = paths.collect() if local is None else [url for part in local for url in part]
    if not urls:
        raise ValueError("the paths RDD is empty: there is nothing to train on")
    for i, url in enumerate(urls):
        if not isinstance(url, str):
            raise TypeError(
                f"fit_paths trains on an RDD of paths (strings naming minibatch files), but element {i} is of "
                f"type {type(url).__name__}: {url!r:.80}; an RDD of DataSets trains with fit(rdd)"
            )
    return Minibatches(urls, [str(u) for u in urls], resolve_loader(loader), None, time.perf_counter() - t0)


def _checked_plan(
    rdd: RDD, batch_size: int, make_sink: Callable[[type, int, set], Any], ship: bool = False
) -> ExportPlan:
    try:
        plan = plan_export(rdd, batch_size, make_sink, ship=ship)
    except ValueError as e:
        if "no examples" not in str(e):
            raise
        raise ValueError("the RDD has no examples: there is nothing to train on") from None
    if plan.total < batch_size:
        raise ValueError(
            f"batch_size_per_worker={batch_size} is larger than the whole data set "
            f"({plan.total} examples); use at most {plan.total}"
        )
    return plan


def export(rdd: RDD, url: str, batch_size: int, storage_options: dict[str, Any] | None) -> Minibatches:
    """Write ``rdd`` under ``url`` as minibatch files and train from those."""
    t0 = time.perf_counter()
    storage.check_empty(url, storage_options)
    plan = _checked_plan(rdd, batch_size, lambda kind, *_: FileSink(url, PREFIXES[kind], storage_options))
    urls = write_plan(rdd.ctx, plan)
    return Minibatches(urls, urls, resolve_loader(storage_options=storage_options), None, time.perf_counter() - t0)


@dataclass(frozen=True)
class _MemorySink:
    """Keeps each minibatch as ``.dlb`` bytes (a serialized storage level: exact size, cheap to spill)
    or as the object itself (a deserialized level)."""

    serialized: bool

    def write(self, k: int, batch: Any) -> Any:
        return b"".join(to_bytes(batch)) if self.serialized else batch


def _pick(result: tuple[dict, dict], k: int) -> Any:
    return result[0][k]


def in_memory(rdd: RDD, batch_size: int, level: StorageLevel) -> Minibatches:
    """Cut ``rdd`` into minibatches kept in the workers' memory, each where its partition was computed."""
    t0 = time.perf_counter()
    client = rdd.ctx.client
    plan = _checked_plan(rdd, batch_size, lambda *_: _MemorySink(not level.deserialized), ship=True)
    tag = uuid.uuid4().hex[:8]
    done = client.compute([*plan.parts, *plan.joins.values()])
    parts, joins = done[: len(plan.parts)], dict(zip(plan.joins, done[len(plan.parts) :]))
    refs = []
    for k in range(len(plan.owner) + len(plan.joins)):
        refs.append(
            joins[k]
            if k in joins
            else client.submit(_pick, parts[plan.owner[k]], k, key=f"dlscale-minibatch-{tag}-{k}")
        )
    wait(refs)
    for f in refs:
        if f.status == "error":
            f.result()  # raises the error
    del parts, joins, done  # the picked minibatches keep their bytes; the partition results can go
    who = client.who_has(refs)
    holders = [min(who[f.key]) if who.get(f.key) else None for f in refs]
    return Minibatches(refs, _names(plan, batch_size, len(refs)), decode, holders, time.perf_counter() - t0)


def _names(plan: ExportPlan, batch_size: int, count: int) -> list[str]:
    """How errors and statistics name minibatches held in memory: by the RDD's examples and partitions."""
    names = []
    for k in range(count):
        lo, hi = k * batch_size, min((k + 1) * batch_size, plan.total) - 1
        where = f"partition {plan.owner[k]}" if k in plan.owner else "several partitions"
        names.append(f"{k} (examples {lo}-{hi} of the RDD, in {where})")
    return names


class ExportCache:
    """The minibatch files a training master exported, per RDD and batch size: written on an RDD's
    first fit, reused by later fits of the same RDD, deleted by :meth:`delete`."""

    def __init__(self) -> None:
        self._exports: dict[tuple, tuple[Minibatches, str, Any]] = {}

    @staticmethod
    def _key(rdd: RDD, batch_size: int) -> tuple:
        return (id(rdd.ctx), rdd.id(), batch_size)

    def holds(self, rdd: RDD, batch_size: int) -> bool:
        """Whether ``rdd`` was exported in minibatches of ``batch_size`` already."""
        return self._key(rdd, batch_size) in self._exports

    def get(
        self, rdd: RDD, batch_size: int, directory: str | None, storage_options: dict[str, Any] | None
    ) -> Minibatches:
        """``rdd``'s minibatch files under ``directory`` (default ``_training/`` under the storage root)."""
        key = self._key(rdd, batch_size)
        if key in self._exports:
            return dataclasses.replace(self._exports[key][0], seconds=0.0)
        base, options = storage.resolve(directory or "_training", storage_options)
        url = f"{base.rstrip('/')}/rdd{rdd.id()}-{uuid.uuid4().hex[:12]}"
        self._exports[key] = (export(rdd, url, batch_size, options), url, options)
        return self._exports[key][0]

    def delete(self) -> None:
        """Delete every exported file."""
        for _, url, options in self._exports.values():
            fs, path = storage.open_fs(url, options)
            if fs.exists(path):
                fs.rm(path, recursive=True)
        self._exports.clear()


_PATIENCE = 2.0  # seconds a fetch of a held minibatch may take before it is asked again (doubling)


@dataclass(frozen=True)
class HeldMinibatch:
    """The loader of minibatches held in workers' memory ("direct" training), by name. The driver
    publishes their futures as the Dask dataset ``dataset``; a trainer takes them from there once
    (:meth:`bind`), which makes its client want them as the driver's does: a minibatch lost with its
    worker is recomputed from its RDD's lineage, and the trainer waiting for it is told when it is
    back. ``timeout`` (seconds) bounds that wait.

    A fetch can be connecting to a worker that died after the scheduler named it as the holder, and
    Dask retries a refused connection until its connect timeout (``distributed.comm.timeouts.connect``,
    30 s). So a fetch that takes longer than :data:`_PATIENCE` seconds is cancelled and asked again,
    which asks the scheduler again and finds the copy recomputed elsewhere, with the patience doubled
    each time so that a long transfer still ends."""

    dataset: str
    timeout: float
    futures: dict[str, Future] | None = None

    def bind(self, client: Any) -> HeldMinibatch:
        return HeldMinibatch(self.dataset, self.timeout, client.get_dataset(self.dataset))

    def __call__(self, name: str) -> Any:
        future, patience = self.futures[name], _PATIENCE
        deadline = time.monotonic() + self.timeout
        while True:
            wait = min(patience, deadline - time.monotonic())
            try:
                return decode(future.result(timeout=max(wait, 0.0)))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"minibatch {name}, held in worker memory, was not available within {self.timeout:g} s "
                        "(dlscale.training.end-timeout): it was lost with its worker and not recomputed"
                    ) from None
                logger.info("minibatch %s, held in worker memory, not here after %.3g s: asking again", name, wait)
                patience *= 2
