"""Loaders turn a path into a minibatch; ``prefetch`` reads the next ones while the current one is used.

A loader is anything that meets :class:`Loader` (DL4J's ``DataSetLoader`` / ``MultiDataSetLoader``):
the native ``.dlb`` loaders below, the image file-batch loader, the zarr loader, or a user's
function for a custom format. Loaders are registered by name (``dlb``, ``dlb-dataset``,
``dlb-multi``, ``image``, ``zarr``; plug-ins add theirs, see :mod:`dlscale.registry`), and
:func:`resolve_loader` is where every caller gets one, the default included. Training and
evaluation tasks on the workers call it through :func:`prefetch`.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

from dask.utils import format_bytes
from distributed.system import MEMORY_LIMIT

from dlscale import config
from dlscale.data.dataset import DataSet, MultiDataSet
from dlscale.data.format import load
from dlscale.errors import MinibatchTooLargeError
from dlscale.registry import Registry
from dlscale.runtime.tasks import this_worker
from dlscale.storage import open_fs


@runtime_checkable
class Loader(Protocol):
    """Reads the minibatch at ``path`` (a URL, or a reference such as zarr's ``<group url>#<k>``).

    A loader returns a DataSet or MultiDataSet, raises an error that names ``path`` when the file
    there is missing, corrupt or of another format, and pickles, since it is shipped to the workers.
    """

    def __call__(self, path: str) -> DataSet | MultiDataSet: ...


def check_minibatch_size(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """On a worker with a memory limit, refuse the minibatch file at ``url`` before it is read when
    it is larger than ``dlscale.data.max-minibatch-fraction`` (default 0.5) of that limit.

    Loading such a file would grow the worker until its nanny kills it, and the fit would fail with
    Dask's "already forgotten" instead of naming the file. The bound: a loaded ``.dlb`` minibatch
    takes its file's size in memory (its tensors are views of one buffer; measured 1.00x), and a
    training step needs at least as much again (measured 2.1x the file at its peak for float32
    features through an MLP, more where a module makes uint8 images float), so a file over half the
    limit cannot be trained on. Off a worker, or where the size cannot be read (the read that follows
    names the problem), nothing is checked.
    """
    check = size_check(url)
    if check is None:
        return
    fs, path = open_fs(url, storage_options)
    try:
        size = fs.size(path)
    except Exception:  # noqa: BLE001 - missing or unreadable: the loader's read reports it in its own words
        return
    check(size)


def size_check(url: str) -> Callable[[int | None], None] | None:
    """What :func:`check_minibatch_size` does once the size of ``url`` is known, for a reader that
    asks for the size itself (the ``.dlb`` loaders: one request, not two); ``None`` where nothing is
    checked (off a worker, or on one without a memory limit, or with the check turned off)."""
    fraction = config.get("data.max-minibatch-fraction")
    if fraction is None:
        return None
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or fraction <= 0:
        raise ValueError(f"dlscale.data.max-minibatch-fraction must be a positive number or null, got {fraction!r}")
    worker = this_worker()
    limit = None if worker is None else worker.memory_manager.memory_limit
    if not limit:  # not on a worker, or one without a memory limit
        return None

    def check(size: int | None) -> None:
        if size is not None and size > fraction * limit:
            raise MinibatchTooLargeError(
                f"minibatch {url} is {format_bytes(size)}, more than {fraction:g} of the {format_bytes(limit)} "
                f"memory limit of worker {worker.address}: loaded, it takes at least its file's size in memory "
                "and a training step as much again. Write smaller minibatches (a smaller batch size), give the "
                "workers more memory (spark.executor.memory, dlscale.local.memory-limit, dask worker "
                "--memory-limit), or raise dlscale.data.max-minibatch-fraction"
            )

    return check


class MinibatchLoader:
    """Loads a ``.dlb`` file, whichever kind of minibatch it holds: the default loader. On a worker,
    a file too large for its memory is refused unread (:func:`check_minibatch_size`)."""

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = storage_options

    def __call__(self, path: str) -> DataSet | MultiDataSet:
        return load(path, self.storage_options, size_check(path))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"  # storage_options may hold credentials


class DataSetLoader(MinibatchLoader):
    """Loads a ``.dlb`` file holding a DataSet."""

    kind: type = DataSet

    def __call__(self, path: str) -> DataSet | MultiDataSet:
        batch = super().__call__(path)
        if not isinstance(batch, self.kind):
            raise TypeError(
                f"{path} holds a {type(batch).__name__}, not a {self.kind.__name__}: use {type(batch).__name__}Loader"
            )
        return batch


class MultiDataSetLoader(DataSetLoader):
    """Loads a ``.dlb`` file holding a MultiDataSet."""

    kind = MultiDataSet


REGISTRY: Registry[Loader] = Registry("loader", Loader, builtins=("dlscale.data.images", "dlscale.data.zarr_batches"))
"""Loaders by name; an installed plug-in offers one in the entry-point group ``dlscale.loader``."""
REGISTRY.register("dlb", MinibatchLoader)
REGISTRY.register("dlb-dataset", DataSetLoader)
REGISTRY.register("dlb-multi", MultiDataSetLoader)

DEFAULT_LOADER = "dlb"
"""The loader of paths given without one: any ``.dlb`` file."""


def resolve_loader(spec: Loader | str | None = None, **kwargs: Any) -> Loader:
    """``spec`` itself if it is a loader, else the loader registered as ``spec`` made with ``kwargs``
    (e.g. ``storage_options``); ``None`` gives the default, :data:`DEFAULT_LOADER`."""
    return REGISTRY.resolve(DEFAULT_LOADER if spec is None else spec, **kwargs)


def _checked(loader: Loader, path: Any) -> DataSet | MultiDataSet:
    try:
        batch = loader(path)
    except Exception as e:
        e.add_note(f"while loading {path} with {loader!r}")
        raise
    if not isinstance(batch, (DataSet, MultiDataSet)):
        raise TypeError(
            f"loader {loader!r} returned a {type(batch).__name__} for {path}; "
            "a loader must return a DataSet or MultiDataSet"
        )
    return batch


class KeptLoader:
    """``loader``, keeping what it loads for the later epochs of a fit, within a worker-wide budget.

    A fit of several epochs reads every minibatch once an epoch; a minibatch once loaded is kept (in the
    order loaded: for a fit's cyclic reads, keeping the first ones is what hits, where an LRU would miss
    every time) while all the minibatches kept in this process stay within
    ``fraction`` of its worker's memory limit (of the machine's memory without one; the setting
    ``dlscale.data.keep-loaded``, read by the driver: :func:`keep_loaded`); the
    rest are loaded each time. Each loaded file costs a size request, an open and a parse besides the
    bytes (0.12 ms a minibatch of ``benchmarks.small_model``, where a step takes 0.3 ms). A kept minibatch
    is handed out again as it is: a network must not change its inputs in place. Use as a context
    manager: leaving it gives the budget back.
    """

    _lock = threading.Lock()
    _held = 0  # bytes kept by every KeptLoader of this process

    def __init__(self, loader: Loader, fraction: float) -> None:
        self.loader = loader
        worker = this_worker()
        limit = None if worker is None else worker.memory_manager.memory_limit
        self.budget = int(fraction * (limit or MEMORY_LIMIT))
        self.kept: dict[Any, DataSet | MultiDataSet] = {}
        self.nbytes = 0

    def __call__(self, ref: Any) -> DataSet | MultiDataSet:
        try:
            batch = self.kept.get(ref)
        except TypeError:  # a reference that cannot be a key: loaded each time
            return self.loader(ref)
        if batch is None:
            batch = self.loader(ref)
            if isinstance(batch, (DataSet, MultiDataSet)):
                self._keep(ref, batch)
        return batch

    def _keep(self, ref: Any, batch: DataSet | MultiDataSet) -> None:
        size = batch.nbytes()
        with KeptLoader._lock:  # a prefetching thread may still load as the trainer releases
            if KeptLoader._held + size > self.budget:
                return
            KeptLoader._held += size
            self.kept[ref] = batch
            self.nbytes += size

    def release(self) -> None:
        """Drop what is kept, give its bytes back to the budget and keep nothing from now on."""
        with KeptLoader._lock:
            KeptLoader._held -= self.nbytes
            self.kept.clear()
            self.nbytes = self.budget = 0

    def __enter__(self) -> KeptLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return repr(self.loader)


def keep_loaded() -> float:
    """The setting ``dlscale.data.keep-loaded``, checked: the fraction of a worker's memory that its
    trainers' :class:`KeptLoader` may keep."""
    fraction = config.get("data.keep-loaded")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ValueError(f"dlscale.data.keep-loaded must be a fraction between 0 and 1, got {fraction!r}")
    return float(fraction)


_DONE = object()
WAITED = 0.5e-3
"""Seconds the first load of :func:`prefetch` must wait on storage for a thread to read the rest ahead."""


def prefetch(paths: Iterable[Any], loader: Loader, depth: int | None = None) -> Iterator[DataSet | MultiDataSet]:
    """The minibatches at ``paths``, in order, with up to ``depth`` loaded ahead by a background thread.

    ``depth`` defaults to ``dlscale.data.prefetch``; 0 loads each one when it is asked for. The first
    minibatch is loaded at once and timed, with the getting of its path (``paths`` may be a generator
    that asks for work): only when that waited (its wall time beyond its CPU time at least
    :data:`WAITED`), on storage or on a reply, does a thread read the rest ahead, since a load that is all
    Python and parsing (a page-cached local file) overlaps nothing and a thread handing each
    minibatch over costs more than the load (0.2-0.5 ms a minibatch, measured on the small model of
    ``benchmarks.small_model``, whose load takes 0.08 ms). At most ``depth + 1`` minibatches are in
    memory besides the one in use. An error while loading is raised here, when its minibatch is
    reached; closing the iterator stops the thread. The thread runs in the caller's context, so a
    loader sees the worker of the task that iterates (``get_worker``).
    """
    depth = config.get("data.prefetch") if depth is None else depth
    if not isinstance(depth, int) or depth < 0:
        raise ValueError(f"prefetch depth must be a non-negative integer, got {depth!r}")
    if depth == 0:
        yield from (_checked(loader, p) for p in paths)
        return
    paths = iter(paths)
    wall, cpu = time.perf_counter(), time.thread_time()  # the first path, and its minibatch, timed
    path = next(paths, _DONE)
    if path is _DONE:
        return
    first = _checked(loader, path)
    if (time.perf_counter() - wall) - (time.thread_time() - cpu) < WAITED:
        yield first
        yield from (_checked(loader, p) for p in paths)
    else:
        yield from _read_ahead(first, paths, loader, depth)


def _read_ahead(
    first: DataSet | MultiDataSet, paths: Iterator[Any], loader: Loader, depth: int
) -> Iterator[DataSet | MultiDataSet]:
    """``first``, then the minibatches at ``paths`` read ahead by a thread (see :func:`prefetch`)."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for p in paths:
                if not put((True, _checked(loader, p))):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            put((False, e))
            return
        put((True, _DONE))

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(read,), name="dlscale-prefetch", daemon=True)
    thread.start()
    try:
        yield first
        while True:
            ok, item = ready.get()
            if not ok:
                raise item
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        thread.join()
