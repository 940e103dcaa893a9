"""Per-partition and combining functions of RDD operations.

Module-level functions, so that a task's pickled form names them instead of carrying their code.
"""

from __future__ import annotations

import bisect
import copy
import heapq
import itertools
import math
import shlex
import subprocess
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from functools import reduce
from typing import TYPE_CHECKING, Any

from dlscale.errors import PipeFunctionExitedError, UserStopIterationError
from dlscale.facade._graph import Partition
from dlscale.facade.statcounter import StatCounter

if TYPE_CHECKING:
    from dlscale.facade.rdd import Partitioner


class ResultIterable(Iterable):
    """The grouped values of one key (``groupByKey``, ``cogroup``): iterable and sized."""

    def __init__(self, data: list) -> None:
        self.data = data
        self.maxindex = len(data)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return f"ResultIterable({self.data!r})"


class UserFunction:
    """A function given to an RDD operation, called so that a ``StopIteration`` it raises fails the task.

    Operations loop over a partition calling the function (``map``, ``filter``, ``reduce``, ``sorted``
    with a key): a ``StopIteration`` escaping from it would end that loop early and drop the rest of the
    partition without a word. PySpark wraps user functions with ``fail_on_stopiteration`` for the same
    reason, and raises the same message. Equal when the wrapped functions are (partitioners compare them).
    """

    def __init__(self, f: Callable, operation: str, name: str) -> None:
        self.f = f
        self.operation = operation
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.f(*args, **kwargs)
        except StopIteration as e:
            raise UserStopIterationError(
                f"Caught StopIteration thrown from user's code; failing the task: {e} "
                f"(StopIteration raised by {self.name} of {self.operation})"
            ) from e

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UserFunction) and self.f == other.f

    def __hash__(self) -> int:
        return hash(self.f)

    def __repr__(self) -> str:
        return f"UserFunction({self.f!r})"


def user_function(f: Any, operation: str, name: str) -> UserFunction:
    """``f`` checked to be callable (a ``TypeError`` naming the parameter if not) and wrapped in a
    :class:`UserFunction`; the one place where functions given to RDD operations are wrapped."""
    if isinstance(f, UserFunction):
        return f
    if not callable(f):
        raise TypeError(f"{name} must be callable, got {type(f).__name__} (in {operation})")
    return UserFunction(f, operation, name)


def user_key(key: Any, operation: str) -> UserFunction | None:
    """An optional ``key`` function, wrapped as :func:`user_function` wraps it."""
    return None if key is None else user_function(key, operation, "key")


# -- per-partition functions (module level so that they pickle small) -----------------------


def map_elements(f: Callable, _i: int, it: Iterable) -> Iterator:
    return map(f, it)


def flat_map(f: Callable, _i: int, it: Iterable) -> Iterator:
    return itertools.chain.from_iterable(map(f, it))


def filter_elements(f: Callable, _i: int, it: Iterable) -> Iterator:
    return filter(f, it)


def map_partitions(f: Callable, _i: int, it: Iterable) -> Iterable:
    return f(iter(it))


def map_partitions_with_index(f: Callable, i: int, it: Iterable) -> Iterable:
    return f(i, iter(it))


def concatenated(_i: int, *parts: Iterable) -> Iterator:
    return itertools.chain.from_iterable(parts)


def elements(_i: int, it: Iterable) -> Iterable:
    return it


def map_partitions_with_value(f: Callable, i: int, value: Any, it: Iterable) -> Iterable:
    return f(i, value, iter(it))


def glom(_i: int, it: Iterable) -> list:
    return [list(it)]


def zip_partitions(i: int, left: list, right: list) -> Iterable:
    if len(left) != len(right):
        raise ValueError(
            "Can only zip RDDs with same number of elements in each partition "
            f"(partition {i} has {len(left)} and {len(right)})"
        )
    return zip(left, right)


def pipe(command: str, env: dict[str, str], check_code: bool, _i: int, it: Iterable) -> Iterator[str]:
    """The lines ``command`` writes when fed the partition's elements, one ``str()`` a line (PySpark's
    ``pipe``: the command's environment is ``env`` alone). A thread writes while this one reads, so
    neither side waits on a full pipe and the input is never held as one block; a command that stops
    reading early (``head``) just gets no more. The process is killed if the task ends first."""
    proc = subprocess.Popen(shlex.split(command), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    failed: list[BaseException] = []

    def feed() -> None:
        try:
            with proc.stdin:
                for x in it:
                    proc.stdin.write((str(x).rstrip("\n") + "\n").encode("utf-8"))
        except BrokenPipeError:
            pass  # the command exited or closed its input: the rest is not wanted
        except BaseException as e:  # an element's __str__ failed: the task fails with it
            failed.append(e)

    writer = threading.Thread(target=feed, name=f"dlscale-pipe-{proc.pid}", daemon=True)
    writer.start()
    try:
        for line in proc.stdout:
            yield line.rstrip(b"\n").decode("utf-8")
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        writer.join()
    if failed:
        raise failed[0]
    if check_code and proc.returncode:
        raise PipeFunctionExitedError(f"Pipe function `{command}` exited with error code {proc.returncode}.")


def float_sum(it: Iterable) -> list[float]:
    """A partition's sum as PySpark's ``sumApprox`` takes it."""
    return [float(sum(it))]


def float_count(it: Iterable) -> list[float]:
    """A partition's size as PySpark's ``countApprox`` takes it."""
    return [float(count(it))]


def float_stats(it: Iterable) -> list[StatCounter]:
    """A partition's statistics of its elements as floats (PySpark's ``meanApprox``)."""
    return [StatCounter(map(float, it))]


def pair(kv: Any) -> tuple[Any, Any]:
    try:
        k, v = kv
    except (TypeError, ValueError):
        raise TypeError(
            f"this operation needs (key, value) pairs, but an element is {kv!r} ({type(kv).__name__})"
        ) from None
    return k, v


def split_by_key(partitioner: Partitioner, _i: int, items: Iterable) -> list[Partition]:
    buckets = [Partition() for _ in range(partitioner.numPartitions)]
    for kv in items:
        buckets[partitioner(pair(kv)[0])].append(kv)
    return buckets


def split_round_robin(n: int, i: int, items: Iterable) -> list[Partition]:
    buckets = [Partition() for _ in range(n)]
    for pos, x in enumerate(items, start=i):
        buckets[pos % n].append(x)
    return buckets


def merge_buckets(_j: int, lists: list[list]) -> Iterator:
    return itertools.chain.from_iterable(lists)


def combine_values(create: Callable, merge_value: Callable, _i: int, it: Iterable) -> Iterable:
    combined: dict = {}
    for kv in it:
        k, v = pair(kv)
        combined[k] = merge_value(combined[k], v) if k in combined else create(v)
    return combined.items()


def reduce_by_key_partition(func: Callable, it: Iterable) -> list[dict]:
    combined: dict = {}
    for kv in it:
        k, v = pair(kv)
        combined[k] = func(combined[k], v) if k in combined else v
    return [combined]


def merge_maps(func: Callable, a: dict, b: dict) -> dict:
    for k, v in b.items():
        a[k] = func(a[k], v) if k in a else v
    return a


def combine_combiners(merge: Callable, _i: int, it: Iterable) -> Iterable:
    combined: dict = {}
    for k, c in it:
        combined[k] = merge(combined[k], c) if k in combined else c
    return combined.items()


def sort_partition(keyfunc: Callable, ascending: bool, _i: int, it: Iterable) -> list:
    return sorted(it, key=lambda kv: keyfunc(kv[0]), reverse=not ascending)


def fold_partition(zero: Any, op: Callable, it: Iterable) -> list:
    return [reduce(op, it, copy.deepcopy(zero))]


def aggregate_partition(zero: Any, seq_op: Callable, it: Iterable) -> Any:
    return reduce(seq_op, it, copy.deepcopy(zero))


def aggregate_partition_list(zero: Any, seq_op: Callable, _i: int, it: Iterable) -> list:
    return [aggregate_partition(zero, seq_op, it)]


def only(it: Iterable) -> Any:
    (x,) = it
    return x


def reduce_all(f: Callable, parts: Iterable) -> Any:
    return reduce(f, parts)


def reduce_partition(f: Callable, it: Iterable) -> list:
    it = iter(it)
    try:
        first = next(it)
    except StopIteration:
        return []
    return [reduce(f, it, first)]


def reduce_results(f: Callable, parts: list[list]) -> list:
    return reduce_partition(f, itertools.chain.from_iterable(parts))


def count(it: Iterable) -> int:
    return sum(1 for _ in it)


def take(n: int, it: Iterable) -> list:
    return list(itertools.islice(it, n))


def stat_counter(it: Iterable) -> StatCounter:
    return StatCounter(it)


def merge_stats(counters: list[StatCounter]) -> StatCounter:
    out = StatCounter()
    for c in counters:
        out.mergeStats(c)
    return out


def count_values(it: Iterable) -> dict:
    counts: dict = defaultdict(int)
    for x in it:
        counts[x] += 1
    return counts


def merge_counts(dicts: list[dict]) -> dict:
    out: dict = defaultdict(int)
    for d in dicts:
        for k, v in d.items():
            out[k] += v
    return out


def nlargest(num: int, key: Callable | None, it: Iterable) -> list:
    return heapq.nlargest(num, it, key=key)


def nsmallest(num: int, key: Callable | None, it: Iterable) -> list:
    return heapq.nsmallest(num, it, key=key)


def nlargest_merge(num: int, key: Callable | None, parts: list[list]) -> list:
    return heapq.nlargest(num, itertools.chain.from_iterable(parts), key=key)


def nsmallest_merge(num: int, key: Callable | None, parts: list[list]) -> list:
    return heapq.nsmallest(num, itertools.chain.from_iterable(parts), key=key)


def foreach(f: Callable, it: Iterable) -> int:
    for x in it:
        f(x)
    return 0


def foreach_partition(f: Callable, it: Iterable) -> int:
    f(iter(it))
    return 0


def sum_ints(parts: list[int]) -> int:
    return sum(parts)


def histogram_partition(buckets: list, even: bool, inc: Any, it: Iterable) -> list[int]:
    minv, maxv = buckets[0], buckets[-1]
    counters = [0] * len(buckets)
    for x in it:
        if x is None or (isinstance(x, float) and math.isnan(x)) or x > maxv or x < minv:
            continue
        t = int((x - minv) / inc) if even else bisect.bisect_right(buckets, x) - 1
        counters[t] += 1
    last = counters.pop()
    counters[-1] += last
    return counters


def add_counters(buckets: int, parts: Iterable[list[int]]) -> list[int]:
    """Per-bucket sums of the partitions' counts; zeros when every partition was empty (Dask's reduction
    then hands the combining step no partition at all)."""
    totals = [0] * buckets
    for counts in parts:
        totals = [a + b for a, b in zip(totals, counts, strict=True)]
    return totals


def comparable(x: Any) -> bool:
    return x is not None and not (type(x) is float and math.isnan(x))


def plain(x: Any) -> Any:
    """Turn numpy and torch scalars into Python numbers."""
    if callable(getattr(x, "item", None)) and getattr(x, "shape", None) == ():
        return x.item()
    return x


def cogroup_values(n: int, values: Iterable) -> tuple[ResultIterable, ...]:
    bufs: list[list] = [[] for _ in range(n)]
    for i, v in values:
        bufs[i].append(v)
    return tuple(ResultIterable(b) for b in bufs)


def join_values(left_outer: bool, right_outer: bool, values: Iterable) -> Iterator:
    vbuf, wbuf = [], []
    for i, v in values:
        (vbuf if i == 0 else wbuf).append(v)
    if left_outer and not wbuf:
        wbuf.append(None)
    if right_outer and not vbuf:
        vbuf.append(None)
    return ((v, w) for v in vbuf for w in wbuf)


def cartesian(left: list, right: list) -> Iterator:
    return itertools.product(left, right)


def append(xs: list, x: Any) -> list:
    xs.append(x)
    return xs


def extend(a: list, b: list) -> list:
    a.extend(b)
    return a


def tag(i: int, v: Any) -> tuple[int, Any]:
    return (i, v)
