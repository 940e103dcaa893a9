"""Building blocks for RDD graphs on :class:`dask.bag.Bag`.

Every RDD operation is one of four shapes: partition-wise (narrow), a selection of parent
partitions (union, coalesce), an all-to-all shuffle (wide), or a tree reduction (actions).
Tasks use dask's task-spec classes, so user data embedded in a graph is never mistaken for a
task, and dask's bag optimizer fuses chains of narrow operations into one task per partition.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle
from dask._task_spec import Alias, DataNode, List, Task, TaskRef
from dask.bag import Bag
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from dask.sizeof import sizeof
from distributed.protocol import (
    dask_deserialize,
    dask_serialize,
    deserialize,
    serialize,
)

if TYPE_CHECKING:
    from distributed import Client, Future

_counter = itertools.count()


class Partition(list):
    """The elements of one partition.

    Dask sends a plain ``list`` between processes element by element (tens of microseconds per
    element); a ``Partition`` crosses as one serialized unit, with tensors still sent as raw
    buffers.
    """


@dask_serialize.register(Partition)
def _serialize_partition(p: Partition) -> tuple[dict, list]:
    header, frames = serialize(list(p), serializers=("dask", "pickle"))
    return {"elements": header}, frames


@dask_deserialize.register(Partition)
def _deserialize_partition(header: dict, frames: list) -> Partition:
    return Partition(deserialize(header["elements"], frames))


@sizeof.register(Partition)
def _sizeof_partition(p: Partition) -> int:
    """Dask's estimate for a list. Registered for the class itself: Dask would otherwise run the lazy
    registration for every ``dlscale`` type on sizing the first partition, which imports torch (seconds
    of a worker's first task)."""
    return sizeof.dispatch(list)(p)


def _name(prefix: str, *token_args: Any) -> str:
    # tokenize alone would merge identical graphs; the counter keeps each RDD's keys its own
    return f"{prefix}-{tokenize(*token_args, next(_counter))}"


def _bag(name: str, dsk: dict, parents: Sequence[Bag], npartitions: int) -> Bag:
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=list(parents))
    return Bag(graph, name, npartitions)


def partition_of(func: Callable[..., Iterable[Any]], *args: Any) -> Partition:
    """``func(*args)`` as a :class:`Partition`."""
    out = func(*args)
    return out if isinstance(out, Partition) else Partition(out)


def _load_partition(blob: bytes) -> Partition:
    return Partition(cloudpickle.loads(blob))


def from_partitions(prefix: str, partitions: Sequence[list]) -> Bag:
    """A bag whose partitions are the given lists, embedded in the graph.

    Each partition travels as one pickled blob, which the scheduler passes on without looking
    inside (a list of a million numbers would otherwise be unpickled and pickled again there).
    """
    name = _name(prefix)
    dsk = {
        (name, i): Task((name, i), _load_partition, DataNode(None, cloudpickle.dumps(list(part), protocol=5)))
        for i, part in enumerate(partitions)
    }
    return _bag(name, dsk, [], len(partitions))


def from_calls(prefix: str, calls: Sequence[tuple[Callable[..., Iterable[Any]], tuple]]) -> Bag:
    """A bag whose partition ``i`` is ``list(func(*args))`` for ``calls[i] = (func, args)``."""
    name = _name(prefix)
    dsk = {
        (name, i): Task((name, i), partition_of, DataNode(None, func), *[DataNode(None, a) for a in args])
        for i, (func, args) in enumerate(calls)
    }
    return _bag(name, dsk, [], len(calls))


def partitionwise(prefix: str, func: Callable[..., Iterable[Any]], *parents: Bag, shared: TaskRef | None = None) -> Bag:
    """Partition ``i`` of the result is ``list(func(i, part_i_of_each_parent...))``; with ``shared``, a
    future (e.g. of a network held on every worker), ``list(func(i, shared_value, part_i...))``."""
    n = parents[0].npartitions
    if any(p.npartitions != n for p in parents):
        raise ValueError(
            "partition-wise operations need the same number of partitions, got "
            + ", ".join(str(p.npartitions) for p in parents)
        )
    name = _name(prefix)
    fn = DataNode(None, func)
    extra = [shared] if shared is not None else []
    dsk = {
        (name, i): Task((name, i), partition_of, fn, i, *extra, *[TaskRef((p.name, i)) for p in parents])
        for i in range(n)
    }
    return _bag(name, dsk, parents, n)


def _concat(*parts: Iterable[Any]) -> Partition:
    return Partition(itertools.chain.from_iterable(parts))


def select(prefix: str, sources: Sequence[Sequence[tuple[Bag, int]]], parents: Sequence[Bag]) -> Bag:
    """Partition ``j`` of the result concatenates the parent partitions listed in ``sources[j]``."""
    name = _name(prefix)
    dsk: dict = {}
    for j, refs in enumerate(sources):
        key = (name, j)
        if len(refs) == 1:
            bag, i = refs[0]
            dsk[key] = Alias(key, (bag.name, i))
        else:
            dsk[key] = Task(key, _concat, *[TaskRef((bag.name, i)) for bag, i in refs])
    return _bag(name, dsk, parents, len(sources))


def _pick(buckets: list, j: int) -> Partition:
    return partition_of(operator.getitem, buckets, j)


def shuffle(
    prefix: str,
    bag: Bag,
    npartitions: int,
    split: Callable[[int, Iterable[Any]], list],
    merge: Callable[[int, list[list]], Iterable[Any]],
) -> Bag:
    """All-to-all exchange.

    ``split(i, partition)`` returns ``npartitions`` lists (one per output partition; build them as
    :class:`Partition` objects so that they need no copy before they travel);
    ``merge(j, lists)`` turns the lists bound for output ``j`` into its elements. Only the
    bucket bound for ``j`` travels to the task that builds output ``j``.
    """
    name = _name(prefix)
    split_name = f"{name}-split"
    pick_name = f"{name}-pick"
    merge_fn = DataNode(None, merge)
    dsk: dict = {}
    for i in range(bag.npartitions):
        dsk[(split_name, i)] = Task((split_name, i), split, i, TaskRef((bag.name, i)))
        for j in range(npartitions):
            dsk[(pick_name, i, j)] = Task((pick_name, i, j), _pick, TaskRef((split_name, i)), j)
    for j in range(npartitions):
        refs = List(*[TaskRef((pick_name, i, j)) for i in range(bag.npartitions)])
        dsk[(name, j)] = Task((name, j), partition_of, merge_fn, j, refs)
    return _bag(name, dsk, [bag], npartitions)


def product(prefix: str, left: Bag, right: Bag, func: Callable[[list, list], Iterable[Any]]) -> Bag:
    """Partition ``i * right.npartitions + j`` is ``list(func(left_i, right_j))``."""
    name = _name(prefix)
    fn = DataNode(None, func)
    dsk = {}
    for i in range(left.npartitions):
        for j in range(right.npartitions):
            key = (name, i * right.npartitions + j)
            dsk[key] = Task(key, partition_of, fn, TaskRef((left.name, i)), TaskRef((right.name, j)))
    return _bag(name, dsk, [left, right], left.npartitions * right.npartitions)


class PartitionJobs:
    """Computes a bag's partitions one job at a time (``toLocalIterator``), each when asked for.

    What more than one partition depends on (a shuffle's split tasks, a cartesian product's inputs) is
    computed with the first partition that needs it and held until this object is dropped, as Spark
    keeps a shuffle's output for the jobs after the first: otherwise every partition of a shuffled RDD
    would compute the whole map side again. Each job sends only the tasks its partition still needs.
    """

    def __init__(self, client: Client, bag: Bag) -> None:
        self._client = client
        self._keys = bag.__dask_keys__()
        self._dsk = dict(bag.__dask_optimize__(bag.__dask_graph__(), self._keys))
        dependents = Counter(dep for node in self._dsk.values() for dep in node.dependencies)
        self._shared = {key for key, n in dependents.items() if n > 1 and key in self._dsk}
        self._held: dict[Any, Future] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def submit(self, i: int) -> Future:
        """Start computing partition ``i``; its future."""
        tasks: dict = {}
        stack = [self._keys[i]]
        while stack:
            key = stack.pop()
            if key in tasks or key in self._held or key not in self._dsk:
                continue  # already sent, held from an earlier job, or held outside (a persisted RDD)
            tasks[key] = node = self._dsk[key]
            stack.extend(node.dependencies)
        shared = [key for key in tasks if key in self._shared]
        futures = self._client.get(tasks, [self._keys[i], *shared], sync=False)
        self._held.update(zip(shared, futures[1:], strict=True))
        return futures[0]
