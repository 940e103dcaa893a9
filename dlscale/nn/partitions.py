"""Running a network over one partition on a worker, as evaluation and inference tasks do: the
partition's minibatches, and how many copies of the network a worker lends out at once."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from dlscale.data.dataset import DataSet, MultiDataSet
from dlscale.data.loaders import Loader, prefetch, resolve_loader
from dlscale.runtime.tasks import this_worker


def minibatches(elements: Iterable[Any], loader: Loader | str | None) -> Iterator[DataSet | MultiDataSet]:
    """The minibatches of a partition: its elements, or what ``loader`` (a loader or a registered
    loader's name; for strings, by default the ``.dlb`` loader) reads from them, a few loaded ahead."""
    elements = list(elements)
    if loader is not None or (elements and isinstance(elements[0], str)):
        loader = resolve_loader(loader)
    if loader is not None:
        yield from prefetch(elements, loader)
        return
    for element in elements:
        if not isinstance(element, (DataSet, MultiDataSet)):
            raise TypeError(
                f"the RDD holds {type(element).__name__} elements; a network reads DataSet or "
                "MultiDataSet minibatches, or paths with a loader"
            )
        yield element


def worker_copies(num_workers: int | None) -> int:
    """Network copies per worker: ``num_workers``, or one per thread of this worker."""
    if num_workers is not None:
        return num_workers
    worker = this_worker()
    return 1 if worker is None else worker.state.nthreads
