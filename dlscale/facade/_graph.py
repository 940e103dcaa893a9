"""Building blocks for RDD graphs on :class:`dask.bag.Bag`.

Every RDD operation is one of four shapes: partition-wise (narrow), a selection of parent
partitions (union, coalesce), an all-to-all shuffle (wide), or a tree reduction (actions).
Tasks use dask's task-spec classes, so user data embedded in a graph is never mistaken for a
task, and dask's bag optimizer fuses chains of narrow operations into one task per partition.

Every task that runs user functions gathers their accumulator additions as the record of its
partition (:func:`dlscale.facade.accumulators.collecting`) and hands its result the records of its
inputs and its own (``updates`` of a :class:`Partition` or a reduction's :class:`Carried`), so that
the results an action brings back carry the records of every task behind them.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle
from dask._task_spec import Alias, DataNode, List, Task, TaskRef
from dask.bag import Bag, Item
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from dask.sizeof import sizeof
from distributed.client import futures_of
from distributed.protocol import (
    dask_deserialize,
    dask_serialize,
    deserialize,
    serialize,
)

from dlscale.facade.accumulators import Updates, collecting
from dlscale.facade.jobs import interruptible
from dlscale.facade.taskcontext import BarrierStage, running

if TYPE_CHECKING:
    from distributed import Client, Future

_counter = itertools.count()


class Partition(list):
    """The elements of one partition.

    Dask sends a plain ``list`` between processes element by element (tens of microseconds per
    element); a ``Partition`` crosses as one serialized unit, with tensors still sent as raw
    buffers. ``updates`` are the accumulator records of the tasks that made it.
    """

    updates: Updates | None = None


@dask_serialize.register(Partition)
def _serialize_partition(p: Partition) -> tuple[dict, list]:
    header, frames = serialize(list(p), serializers=("dask", "pickle"))
    if not p.updates:
        return {"elements": header}, frames
    updates_header, updates_frames = serialize(p.updates, serializers=("pickle",), on_error="raise")
    return {"elements": header, "updates": updates_header, "split": len(frames)}, frames + updates_frames


@dask_deserialize.register(Partition)
def _deserialize_partition(header: dict, frames: list) -> Partition:
    n = header.get("split", len(frames))
    p = Partition(deserialize(header["elements"], frames[:n]))
    if "updates" in header:
        p.updates = deserialize(header["updates"], frames[n:])
    return p


class Carried:
    """A reduction's partial result with the accumulator records of the tasks behind it."""

    def __init__(self, value: Any, updates: Updates) -> None:
        self.value = value
        self.updates = updates


def carried(values: Iterable[Any]) -> Updates:
    """The accumulator records that ``values`` (a task's inputs, an action's results) carry: those of
    partitions and reduction results, and of the partitions in a list (a shuffle's buckets)."""
    out: Updates = {}
    for v in values:
        if isinstance(v, (Partition, Carried)):
            if v.updates:
                out.update(v.updates)
        elif type(v) is list:
            out.update(carried(v))
    return out


def _with_records(out: Partition, inputs: Iterable[Any], own: Updates) -> Partition:
    updates = {**carried(inputs), **own}
    if updates:
        out.updates = updates
    return out


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


@contextlib.contextmanager
def _task(key: Any, stage: BarrierStage | None = None) -> Iterator[Updates]:
    """Around the user's functions of the task for partition ``key``: its ``TaskContext`` (a barrier one in
    a barrier ``stage``), its accumulator record (yielded), and the mark that lets a cancelled job
    interrupt it."""
    with interruptible(), running(key, stage), collecting(key) as own:
        yield own


def compute_partition(key: Any, func: Callable[..., Iterable[Any]], *args: Any) -> Partition:
    """``func(*args)`` as a :class:`Partition`, the partition ``key`` of its graph, carrying the accumulator
    records of the partitions in ``args`` and its own."""
    return compute_barrier_partition(None, key, func, *args)


def compute_barrier_partition(
    stage: BarrierStage | None, key: Any, func: Callable[..., Iterable[Any]], *args: Any
) -> Partition:
    """:func:`compute_partition` in a task of a barrier ``stage`` (or of none)."""
    with _task(key, stage) as own:
        out = func(*args)
        if not isinstance(out, Partition) or any(out is a for a in args):
            out = Partition(out)  # a new one: an input may be held (persisted) and must keep its records
    return _with_records(out, args, own)


def partition_of(func: Callable[..., Iterable[Any]], *args: Any) -> Partition:
    """``func(*args)`` as a :class:`Partition`, in a task that is no partition of a graph (its records
    are told apart by their run alone)."""
    return compute_partition(None, func, *args)


def _load_partition(blob: bytes) -> Partition:
    return Partition(cloudpickle.loads(blob))


def pickle_partitions(partitions: Sequence[list]) -> list[bytes]:
    """Each partition as one pickled blob, as :func:`from_pickled` embeds it: the elements as they are now."""
    return [cloudpickle.dumps(list(part), protocol=5) for part in partitions]


class PickledPartitions(Sequence):
    """Partitions held as :func:`pickle_partitions` made them, each read back (a new copy) when indexed:
    what every task of the graph computes, whatever became of the elements pickled since."""

    def __init__(self, blobs: Sequence[bytes]) -> None:
        self._blobs = blobs

    def __len__(self) -> int:
        return len(self._blobs)

    def __getitem__(self, i: int) -> Partition:
        return _load_partition(self._blobs[i])


def from_pickled(prefix: str, blobs: Sequence[bytes]) -> Bag:
    """A bag whose partitions are the given pickled lists (:func:`pickle_partitions`), embedded in the graph.

    Each partition travels as one pickled blob, which the scheduler passes on without looking
    inside (a list of a million numbers would otherwise be unpickled and pickled again there).
    """
    name = _name(prefix)
    dsk = {(name, i): Task((name, i), _load_partition, DataNode(None, blob)) for i, blob in enumerate(blobs)}
    return _bag(name, dsk, [], len(blobs))


def from_calls(prefix: str, calls: Sequence[tuple[Callable[..., Iterable[Any]], tuple]]) -> Bag:
    """A bag whose partition ``i`` is ``list(func(*args))`` for ``calls[i] = (func, args)``."""
    name = _name(prefix)
    dsk = {
        (name, i): Task(
            (name, i), compute_partition, (name, i), DataNode(None, func), *[DataNode(None, a) for a in args]
        )
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
        (name, i): Task(
            (name, i), compute_partition, (name, i), fn, i, *extra, *[TaskRef((p.name, i)) for p in parents]
        )
        for i in range(n)
    }
    return _bag(name, dsk, parents, n)


def _concat(*parts: Iterable[Any]) -> Partition:
    return _with_records(Partition(itertools.chain.from_iterable(parts)), parts, {})


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
    return _with_records(buckets[j], buckets, {})


def _split(key: Any, split: Callable[[int, Iterable[Any]], list], i: int, part: Any) -> list[Partition]:
    """A shuffle's split of partition ``i``; every bucket carries the records (they travel on, once each)."""
    with _task(key) as own:
        buckets = split(i, part)
    updates = {**carried([part]), **own}
    for bucket in buckets if updates else ():
        bucket.updates = updates
    return buckets


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
        dsk[(split_name, i)] = Task((split_name, i), _split, (split_name, i), split, i, TaskRef((bag.name, i)))
        for j in range(npartitions):
            dsk[(pick_name, i, j)] = Task((pick_name, i, j), _pick, TaskRef((split_name, i)), j)
    for j in range(npartitions):
        refs = List(*[TaskRef((pick_name, i, j)) for i in range(bag.npartitions)])
        dsk[(name, j)] = Task((name, j), compute_partition, (name, j), merge_fn, j, refs)
    return _bag(name, dsk, [bag], npartitions)


def product(prefix: str, left: Bag, right: Bag, func: Callable[[list, list], Iterable[Any]]) -> Bag:
    """Partition ``i * right.npartitions + j`` is ``list(func(left_i, right_j))``."""
    name = _name(prefix)
    fn = DataNode(None, func)
    dsk = {}
    for i in range(left.npartitions):
        for j in range(right.npartitions):
            key = (name, i * right.npartitions + j)
            dsk[key] = Task(key, compute_partition, key, fn, TaskRef((left.name, i)), TaskRef((right.name, j)))
    return _bag(name, dsk, [left, right], left.npartitions * right.npartitions)


def _reduce_partition(key: Any, per_partition: Callable[[Any], Any], part: Any) -> Carried:
    with _task(key) as own:
        value = per_partition(part)
    return Carried(value, {**carried([part]), **own})


def _reduce_results(key: Any, combine: Callable[[list], Any], parts: list[Carried]) -> Carried:
    with _task(key) as own:
        value = combine([p.value for p in parts])
    return Carried(value, {**carried(parts), **own})


def reduction(
    prefix: str, bag: Bag, per_partition: Callable[[Any], Any], combine: Callable[[list], Any], split_every: int
) -> Item:
    """``combine`` over ``per_partition`` of every partition, in a tree of ``split_every`` inputs per task;
    computes to a :class:`Carried`. Unlike Dask's ``Bag.reduction``, an empty partition is not skipped:
    the functions of its task may have added to accumulators, and ``per_partition`` gets every partition."""
    name = _name(prefix)
    dsk: dict = {}
    level = []
    for i in range(bag.npartitions):
        key = (f"{name}-partition", i)
        dsk[key] = Task(key, _reduce_partition, key, DataNode(None, per_partition), TaskRef((bag.name, i)))
        level.append(key)
    combine_fn = DataNode(None, combine)
    depth = 0
    while len(level) > 1 or depth == 0:
        groups = [level[j : j + split_every] for j in range(0, len(level), split_every)]
        level = []
        for j, group in enumerate(groups):
            key = (f"{name}-combine-{depth}", j)
            dsk[key] = Task(key, _reduce_results, key, combine_fn, List(*[TaskRef(k) for k in group]))
            level.append(key)
        depth += 1
    dsk[name] = Alias(name, level[0])
    return Item(HighLevelGraph.from_collections(name, dsk, dependencies=[bag]), name)


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
        self._outside = futures_of(bag)  # what the graph reads from futures (a persisted RDD, a barrier stage)

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
