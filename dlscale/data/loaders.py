"""Loaders turn a path into a minibatch; ``prefetch`` reads the next ones while the current one is used.

A loader is anything that meets :class:`Loader` (DL4J's ``DataSetLoader`` / ``MultiDataSetLoader``):
the native ``.dlb`` loaders below, the image file-batch loader, the zarr loader, or a user's
function for a custom format. Loaders are registered by name (``dlb``, ``dlb-dataset``,
``dlb-multi``, ``image``, ``zarr``; plug-ins add theirs, see :mod:`dlscale.registry`), and
:func:`resolve_loader` is where every caller gets one, the default included. Training and
evaluation tasks on the workers call it through :func:`prefetch`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

from dlscale import config
from dlscale.data.dataset import DataSet, MultiDataSet
from dlscale.data.format import load
from dlscale.registry import Registry


@runtime_checkable
class Loader(Protocol):
    """Reads the minibatch at ``path`` (a URL, or a reference such as zarr's ``<group url>#<k>``).

    A loader returns a DataSet or MultiDataSet, raises an error that names ``path`` when the file
    there is missing, corrupt or of another format, and pickles, since it is shipped to the workers.
    """

    def __call__(self, path: str) -> DataSet | MultiDataSet: ...


class MinibatchLoader:
    """Loads a ``.dlb`` file, whichever kind of minibatch it holds: the default loader."""

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = storage_options

    def __call__(self, path: str) -> DataSet | MultiDataSet:
        return load(path, self.storage_options)

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


REGISTRY: Registry[Loader] = Registry("loader", Loader)
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


_DONE = object()


def prefetch(paths: Iterable[Any], loader: Loader, depth: int | None = None) -> Iterator[DataSet | MultiDataSet]:
    """The minibatches at ``paths``, in order, with up to ``depth`` loaded ahead by a background thread.

    ``depth`` defaults to ``dlscale.data.prefetch``; 0 loads each one when it is asked for. At most
    ``depth + 1`` minibatches are in memory besides the one in use. An error while loading is raised
    here, when its minibatch is reached; closing the iterator stops the thread.
    """
    depth = config.get("data.prefetch") if depth is None else depth
    if not isinstance(depth, int) or depth < 0:
        raise ValueError(f"prefetch depth must be a non-negative integer, got {depth!r}")
    if depth == 0:
        yield from (_checked(loader, p) for p in paths)
        return
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

    thread = threading.Thread(target=read, name="dlscale-prefetch", daemon=True)
    thread.start()
    try:
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
