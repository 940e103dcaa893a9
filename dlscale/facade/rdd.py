"""``RDD``: PySpark's resilient distributed dataset API over a :class:`dask.bag.Bag`.

Transformations are lazy and build a Dask graph; actions compute it on the context's cluster.
Results follow PySpark (the reference for names, arguments, partitioning and return values);
where they differ, ``docs/facade.md`` says how.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import math
import operator
import random
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial, reduce
from typing import TYPE_CHECKING, Any

import dask
from dask.utils import funcname
from distributed import Future

from dlscale.errors import CheckpointError, UnsupportedOperationError
from dlscale.facade import _graph, _hll, _io, _lineage, _ops, barrier, persist
from dlscale.facade._approx import BoundedFloat, check_confidence, mean_bound, sum_bound
from dlscale.facade._hash import portable_hash
from dlscale.facade._sampling import RangeSampler, Sampler, StratifiedSampler, fraction_for_sample_size
from dlscale.facade.jobs import call_site
from dlscale.facade.persist import StorageLevel
from dlscale.facade.statcounter import StatCounter
from dlscale.runtime.cluster import PauseWatch

if TYPE_CHECKING:
    from dask.bag import Bag

    from dlscale.facade.context import SparkContext

__all__ = ["RDD", "BoundedFloat", "Partitioner", "ResultIterable", "portable_hash"]

ResultIterable = _ops.ResultIterable


class Partitioner:
    """Assigns a key to one of ``numPartitions`` partitions with ``partitionFunc(key) % n``."""

    def __init__(self, numPartitions: int, partitionFunc: Callable[[Any], int]) -> None:
        self.numPartitions = numPartitions
        self.partitionFunc = partitionFunc
        self._func = _ops.user_function(partitionFunc, "partitionBy", "partitionFunc")

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Partitioner)
            and self.numPartitions == other.numPartitions
            and self.partitionFunc == other.partitionFunc
        )

    def __call__(self, k: Any) -> int:
        return self._func(k) % self.numPartitions


class RDD:
    """A partitioned collection, computed lazily on the cluster (PySpark's ``RDD``)."""

    def __init__(
        self, bag: Bag, ctx: SparkContext, partitioner: Partitioner | None = None, parents: tuple[RDD, ...] = ()
    ) -> None:
        self._plan = bag
        self.ctx = ctx
        self.partitioner = partitioner
        # the lineage toDebugString prints: the operation that made this RDD (its graph layer's prefix,
        # see _graph._name) and the RDDs it was made from
        self._operation = bag.name.rsplit("-", 1)[0]
        self._parents = parents
        self._id: int | None = None  # given on first use, see id()
        self._name: str | None = None
        self._stored: Any = None  # dlscale.persist.Stored when persisted
        self._checkpoint_mark: str | None = None  # "reliable" or "local", once checkpoint() is called
        self._checkpointed = False  # written (reliable) or persisted (local) by an action since marked
        self._checkpoint_file: str | None = None
        self._barrier = False  # computed in a barrier stage: rdd.barrier().mapPartitions(f) and narrow children
        # made by a shuffle: the operation and line that called it (``partitionBy at job.py:12``), which names
        # the shuffle map stage that computes its input (see _stages)
        self._shuffle_site: str | None = None
        self._local: Sequence[list] | None = None  # the partitions, where the driver holds them (parallelize)

    @property
    def _bag(self) -> Bag:
        """The graph that computes this RDD, in which RDDs unpersisted since it was built are computed
        from their lineage again."""
        return persist.resolve(self._plan)

    @_bag.setter
    def _bag(self, bag: Bag) -> None:
        self._plan = bag

    # -- identity ------------------------------------------------------------------------
    @property
    def context(self) -> SparkContext:
        return self.ctx

    def id(self) -> int:
        """A number unique to this RDD within its context, given when first asked for: the context's next
        number, so that a new RDD's id is the previous one's plus one (as in Spark, where the RDDs a
        chain of narrow operations builds in between are one pipelined RDD and take no number)."""
        if self._id is None:
            self._id = self.ctx._new_rdd_id()
        return self._id

    def name(self) -> str | None:
        return self._name

    def setName(self, name: str) -> RDD:
        self._name = name
        return self

    def getNumPartitions(self) -> int:
        return self._bag.npartitions

    def to_bag(self) -> Bag:
        """The :class:`dask.bag.Bag` that computes this RDD's partitions, one list each (dlscale's
        extension; it reads the persisted copy when persisted). :meth:`SparkContext.from_bag` goes back."""
        return self._bag

    def local_partitions(self) -> Sequence[list] | None:
        """This RDD's partitions as the driver holds them, for an RDD made by
        :meth:`SparkContext.parallelize` and not transformed (dlscale's extension): what they hold can
        be known, and written, without a job, which would ship them to the workers. Each partition is
        read back when indexed, a copy of the elements as ``parallelize`` took them (as every job
        computes them). ``None`` for any other RDD."""
        return self._local

    def __repr__(self) -> str:
        label = f"{self._name} " if self._name else ""
        return f"{label}RDD[{self.id()}] with {self.getNumPartitions()} partitions"

    # -- building blocks -----------------------------------------------------------------
    def _derive(self, bag: Bag, partitioner: Partitioner | None = None, parents: tuple[RDD, ...] | None = None) -> RDD:
        return RDD(bag, self.ctx, partitioner, (self,) if parents is None else parents)

    def _partitionwise(self, prefix: str, func: Callable, preserves: bool = False) -> RDD:
        bag = self._bag
        if not self._barrier:
            return self._derive(_graph.partitionwise(prefix, func, bag), self.partitioner if preserves else None)
        # as in Spark, a narrow operation on a barrier RDD runs in a barrier stage: in the same tasks, or
        # reading the persisted partitions of one
        stage = barrier.pipelined(bag, func) if barrier.stage_of(bag) is not None else barrier.stage_bag(bag, func)
        out = self._derive(stage, self.partitioner if preserves else None)
        out._barrier = True
        return out

    def _is_barrier(self) -> bool:
        """Whether a barrier stage computes this RDD's partitions (PySpark's private method, which Spark's
        own tests and some programs call)."""
        return self._barrier

    def _reduce(self, per_partition: Callable, combine: Callable, split_every: int = 8) -> Any:
        bag = self._bag
        result = self.ctx._compute(_graph.reduction("reduce", bag, per_partition, combine, split_every), rdd=self)
        self._checkpoint_lineage(bag)
        return result

    def _run_partitions(self, func: Callable, partitions: Iterable[int], action: set | None = None) -> list:
        """``func(partition)`` for the given partitions only (``SparkContext.runJob``); ``action`` as in
        :meth:`SparkContext._compute`."""
        bag = self._bag
        parts = bag.to_delayed(optimize_graph=not barrier.has_stages(bag))  # fused, a stage's layer would go
        tasks = [dask.delayed(_graph.partition_of)(func, parts[i]) for i in partitions]
        result = list(self.ctx._compute(tasks, action, rdd=self)) if tasks else []
        self._checkpoint_lineage(bag)
        return result

    def _run_within(self, func: Callable, timeout: float) -> dict[int, Any]:
        """``func(partition)`` for every partition, for at most ``timeout`` milliseconds: the results of the
        partitions done by then, by index; the rest are cancelled (approximate actions, which, as in
        Spark, checkpoint nothing)."""
        if not self.getNumPartitions():
            return {}
        bag = _graph.partitionwise("approx", partial(_ops.map_partitions, func), self._bag)
        return self.ctx._compute_within(bag.to_delayed(), timeout / 1000, rdd=self)

    def _sum_within(self, per_partition: Callable, timeout: float, confidence: float) -> BoundedFloat:
        check_confidence(confidence)
        done = self._run_within(per_partition, timeout)
        counter = StatCounter()
        for i in sorted(done):
            counter.mergeStats(StatCounter(done[i]))
        return sum_bound(counter, len(done), self.getNumPartitions(), confidence)

    # -- narrow transformations ----------------------------------------------------------
    def map(self, f: Callable[[Any], Any], preservesPartitioning: bool = False) -> RDD:
        f = _ops.user_function(f, "map", "f")
        return self._partitionwise("map", partial(_ops.map_elements, f), preservesPartitioning)

    def flatMap(self, f: Callable[[Any], Iterable[Any]], preservesPartitioning: bool = False) -> RDD:
        f = _ops.user_function(f, "flatMap", "f")
        return self._partitionwise("flatMap", partial(_ops.flat_map, f), preservesPartitioning)

    def filter(self, f: Callable[[Any], bool]) -> RDD:
        f = _ops.user_function(f, "filter", "f")
        return self._partitionwise("filter", partial(_ops.filter_elements, f), True)

    def mapPartitions(self, f: Callable[[Iterator[Any]], Iterable[Any]], preservesPartitioning: bool = False) -> RDD:
        f = _ops.user_function(f, "mapPartitions", "f")
        return self._partitionwise("mapPartitions", partial(_ops.map_partitions, f), preservesPartitioning)

    def mapPartitionsWithIndex(
        self, f: Callable[[int, Iterator[Any]], Iterable[Any]], preservesPartitioning: bool = False
    ) -> RDD:
        f = _ops.user_function(f, "mapPartitionsWithIndex", "f")
        return self._partitionwise(
            "mapPartitionsWithIndex", partial(_ops.map_partitions_with_index, f), preservesPartitioning
        )

    def mapPartitionsWithSplit(
        self, f: Callable[[int, Iterator[Any]], Iterable[Any]], preservesPartitioning: bool = False
    ) -> RDD:
        """PySpark's deprecated name of :meth:`mapPartitionsWithIndex` (it warns, as PySpark does)."""
        warnings.warn("mapPartitionsWithSplit is deprecated; use mapPartitionsWithIndex instead", FutureWarning, 2)
        return self.mapPartitionsWithIndex(f, preservesPartitioning)

    def barrier(self) -> barrier.RDDBarrier:
        """This RDD, for an operation whose tasks run all at once as a barrier stage (see
        :mod:`dlscale.facade.barrier`): ``rdd.barrier().mapPartitions(f)``."""
        return barrier.RDDBarrier(self)

    def map_partitions_with_future(self, f: Callable[[int, Any, Iterator[Any]], Iterable[Any]], future: Future) -> RDD:
        """``f(index, value, iterator)`` for every partition, where ``value`` is the result of
        ``future`` (dlscale's extension, for a large value held on every worker).

        ``mapPartitionsWithIndex`` with a value that the tasks refer to by key instead of carrying it:
        scattered to every worker, it is read where it is held and fetched where it is not. The RDD holds
        the future, so the value lives as long as this RDD or one derived from it, and a lost partition
        is recomputed like any other. Tasks are named after ``f``.
        """
        wrapped = _ops.user_function(f, "map_partitions_with_future", "f")
        if not isinstance(future, Future):
            raise TypeError(f"future must be a distributed.Future (from Client.scatter), not {type(future).__name__}")
        name = funcname(f).lstrip("_") or "map_partitions_with_future"
        return self._derive(
            _graph.partitionwise(name, partial(_ops.map_partitions_with_value, wrapped), self._bag, shared=future)
        )

    def glom(self) -> RDD:
        """Each partition as one list."""
        return self._partitionwise("glom", _ops.glom)

    def keyBy(self, f: Callable[[Any], Any]) -> RDD:
        f = _ops.user_function(f, "keyBy", "f")
        return self.map(lambda x: (f(x), x))

    def keys(self) -> RDD:
        return self.map(lambda kv: _ops.pair(kv)[0])

    def values(self) -> RDD:
        return self.map(lambda kv: _ops.pair(kv)[1])

    def mapValues(self, f: Callable[[Any], Any]) -> RDD:
        f = _ops.user_function(f, "mapValues", "f")
        return self.map(lambda kv: (_ops.pair(kv)[0], f(kv[1])), preservesPartitioning=True)

    def flatMapValues(self, f: Callable[[Any], Iterable[Any]]) -> RDD:
        f = _ops.user_function(f, "flatMapValues", "f")
        return self.flatMap(lambda kv: ((_ops.pair(kv)[0], x) for x in f(kv[1])), preservesPartitioning=True)

    def zip(self, other: RDD) -> RDD:
        """Pairs of the i-th elements; both RDDs need equal partition counts and sizes."""
        if self.getNumPartitions() != other.getNumPartitions():
            raise ValueError(
                "Can only zip with RDD which has the same number of partitions "
                f"({self.getNumPartitions()} and {other.getNumPartitions()})"
            )
        bag = _graph.partitionwise("zip", _ops.zip_partitions, self._bag, other._bag)
        return self._derive(bag, None, (self, other))

    def zipWithIndex(self) -> RDD:
        """``(element, index)`` in partition order; runs one job to count the partitions."""
        starts = [0]
        if self.getNumPartitions() > 1:
            counts = self.mapPartitions(lambda it: [_ops.count(it)]).collect()
            starts = list(itertools.accumulate(counts[:-1], initial=0))
        return self.mapPartitionsWithIndex(lambda i, it: ((v, n) for n, v in enumerate(it, starts[i])))

    def zipWithUniqueId(self) -> RDD:
        """``(element, id)`` with ids ``k, n+k, 2n+k, ...`` in partition ``k`` of ``n``; no job runs."""
        n = self.getNumPartitions()
        return self.mapPartitionsWithIndex(lambda k, it: ((v, i * n + k) for i, v in enumerate(it)))

    def union(self, other: RDD) -> RDD:
        return self.ctx.union([self, other])

    def __add__(self, other: RDD) -> RDD:
        if not isinstance(other, RDD):
            return NotImplemented
        return self.union(other)

    def coalesce(self, numPartitions: int, shuffle: bool = False) -> RDD:
        """Fewer partitions by merging neighbours (or any number with ``shuffle=True``)."""
        n = self._check_num_partitions(numPartitions, "numPartitions")
        if shuffle:
            bag = _graph.shuffle("repartition", self._bag, n, partial(_ops.split_round_robin, n), _ops.merge_buckets)
            return self._shuffled(bag, None)
        m = self.getNumPartitions()
        if n >= m:
            return self._derive(_graph.select("coalesce", [[(self._bag, i)] for i in range(m)], [self._bag]))
        sources = [[(self._bag, i) for i in range(j * m // n, (j + 1) * m // n)] for j in range(n)]
        return self._derive(_graph.select("coalesce", sources, [self._bag]))

    def repartition(self, numPartitions: int) -> RDD:
        """Exactly ``numPartitions`` partitions of balanced size (a shuffle)."""
        return self.coalesce(numPartitions, shuffle=True)

    def sample(self, withReplacement: bool, fraction: float, seed: int | None = None) -> RDD:
        """A random subset: each element kept with probability ``fraction`` (or Poisson counts)."""
        if fraction < 0:
            raise ValueError(f"fraction must be nonnegative, got {fraction}")
        seed = random.randint(0, sys.maxsize) if seed is None else seed
        return self.mapPartitionsWithIndex(Sampler(withReplacement, fraction, seed), True)

    def randomSplit(self, weights: list[float], seed: int | None = None) -> list[RDD]:
        """Disjoint random splits with sizes proportional to ``weights``."""
        if any(w < 0 for w in weights):
            raise ValueError(f"weights must be nonnegative, got {weights}")
        total = float(sum(weights))
        if total <= 0:
            raise ValueError(f"the sum of weights must be positive, got {weights}")
        bounds = list(itertools.accumulate((w / total for w in weights), initial=0.0))
        seed = random.randint(0, 2**32 - 1) if seed is None else seed
        return [self.mapPartitionsWithIndex(RangeSampler(lo, hi, seed), True) for lo, hi in itertools.pairwise(bounds)]

    def sampleByKey(self, withReplacement: bool, fractions: dict[Any, float], seed: int | None = None) -> RDD:
        """A random subset of the pairs, each key's kept at its own rate ``fractions[key]`` (stratified
        sampling: a pair whose key has no fraction fails the task, as in PySpark)."""
        for fraction in fractions.values():
            if not fraction >= 0.0:
                raise ValueError(f"Negative fraction value: {fraction}")
        seed = random.randint(0, sys.maxsize) if seed is None else seed
        return self.mapPartitionsWithIndex(StratifiedSampler(withReplacement, fractions, seed), True)

    def pipe(self, command: str, env: dict[str, str] | None = None, checkCode: bool = False) -> RDD:
        """The lines that ``command`` (split as a shell would, run without a shell) prints when fed a
        partition's elements, one ``str()`` per line. As in PySpark, the command's environment is ``env``
        alone (empty by default, so ``PATH`` is the system's default); with ``checkCode``, a non-zero exit
        fails the task with ``PipeFunctionExitedError``."""
        if not isinstance(command, str):
            raise TypeError(f"command must be a str, not {type(command).__name__}")
        return self._partitionwise("pipe", partial(_ops.pipe, command, dict(env or {}), checkCode))

    # -- wide transformations ------------------------------------------------------------
    def _check_num_partitions(self, n: Any, name: str) -> int:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{name} must be an int, not {type(n).__name__}")
        if n < 1:
            raise ValueError(f"{name} must be positive, got {n}")
        return n

    def _reduce_partitions(self, numPartitions: int | None) -> int:
        if numPartitions is None:
            return self.ctx._default_reduce_partitions(self)
        return self._check_num_partitions(numPartitions, "numPartitions")

    def partitionBy(self, numPartitions: int | None, partitionFunc: Callable[[Any], int] = portable_hash) -> RDD:
        """Pairs moved to partition ``partitionFunc(key) % numPartitions``."""
        n = self._reduce_partitions(numPartitions)
        partitioner = Partitioner(n, partitionFunc)
        if self.partitioner == partitioner:
            return self
        bag = _graph.shuffle("partitionBy", self._bag, n, partial(_ops.split_by_key, partitioner), _ops.merge_buckets)
        return self._shuffled(bag, partitioner)

    def _shuffled(self, bag: Bag, partitioner: Partitioner | None) -> RDD:
        """The RDD of a shuffle of this one (``bag``): a stage boundary, named after the call that made it."""
        out = self._derive(bag, partitioner)
        out._shuffle_site = call_site()
        return out

    def combineByKey(
        self,
        createCombiner: Callable[[Any], Any],
        mergeValue: Callable[[Any, Any], Any],
        mergeCombiners: Callable[[Any, Any], Any],
        numPartitions: int | None = None,
        partitionFunc: Callable[[Any], int] = portable_hash,
    ) -> RDD:
        """Per-key combination: combined within each partition first, then across partitions."""
        createCombiner = _ops.user_function(createCombiner, "combineByKey", "createCombiner")
        mergeValue = _ops.user_function(mergeValue, "combineByKey", "mergeValue")
        mergeCombiners = _ops.user_function(mergeCombiners, "combineByKey", "mergeCombiners")
        n = self._reduce_partitions(numPartitions)
        local = self._partitionwise("combineLocally", partial(_ops.combine_values, createCombiner, mergeValue), True)
        shuffled = local.partitionBy(n, partitionFunc)
        return shuffled._partitionwise("mergeCombiners", partial(_ops.combine_combiners, mergeCombiners), True)

    def reduceByKey(
        self,
        func: Callable[[Any, Any], Any],
        numPartitions: int | None = None,
        partitionFunc: Callable[[Any], int] = portable_hash,
    ) -> RDD:
        func = _ops.user_function(func, "reduceByKey", "func")
        return self.combineByKey(lambda x: x, func, func, numPartitions, partitionFunc)

    def reduceByKeyLocally(self, func: Callable[[Any, Any], Any]) -> dict:
        """The values of each key combined with ``func``, as a dict on the driver (no shuffle: each
        partition's dict is merged into the next)."""
        func = _ops.user_function(func, "reduceByKeyLocally", "func")
        maps = self.mapPartitions(partial(_ops.reduce_by_key_partition, func))
        return maps.reduce(partial(_ops.merge_maps, func))

    def aggregateByKey(
        self,
        zeroValue: Any,
        seqFunc: Callable[[Any, Any], Any],
        combFunc: Callable[[Any, Any], Any],
        numPartitions: int | None = None,
        partitionFunc: Callable[[Any], int] = portable_hash,
    ) -> RDD:
        seqFunc = _ops.user_function(seqFunc, "aggregateByKey", "seqFunc")
        combFunc = _ops.user_function(combFunc, "aggregateByKey", "combFunc")
        return self.combineByKey(
            lambda v: seqFunc(copy.deepcopy(zeroValue), v), seqFunc, combFunc, numPartitions, partitionFunc
        )

    def foldByKey(
        self,
        zeroValue: Any,
        func: Callable[[Any, Any], Any],
        numPartitions: int | None = None,
        partitionFunc: Callable[[Any], int] = portable_hash,
    ) -> RDD:
        func = _ops.user_function(func, "foldByKey", "func")
        return self.combineByKey(lambda v: func(copy.deepcopy(zeroValue), v), func, func, numPartitions, partitionFunc)

    def groupByKey(self, numPartitions: int | None = None, partitionFunc: Callable[[Any], int] = portable_hash) -> RDD:
        """``(key, ResultIterable of values)``."""
        grouped = self.combineByKey(lambda v: [v], _ops.append, _ops.extend, numPartitions, partitionFunc)
        return grouped.mapValues(ResultIterable)

    def groupBy(
        self,
        f: Callable[[Any], Any],
        numPartitions: int | None = None,
        partitionFunc: Callable[[Any], int] = portable_hash,
    ) -> RDD:
        f = _ops.user_function(f, "groupBy", "f")
        return self.map(lambda x: (f(x), x)).groupByKey(numPartitions, partitionFunc)

    def distinct(self, numPartitions: int | None = None) -> RDD:
        return self.map(lambda x: (x, None)).reduceByKey(lambda x, _: x, numPartitions).map(operator.itemgetter(0))

    def _tagged_groups(self, others: list[RDD], numPartitions: int | None) -> RDD:
        tagged = [rdd.mapValues(partial(_ops.tag, i)) for i, rdd in enumerate([self, *others])]
        return reduce(RDD.union, tagged).groupByKey(numPartitions)

    def cogroup(self, other: RDD, numPartitions: int | None = None) -> RDD:
        """``(key, (values in self, values in other))`` for every key in either."""
        return self._tagged_groups([other], numPartitions).mapValues(partial(_ops.cogroup_values, 2))

    def groupWith(self, other: RDD, *others: RDD) -> RDD:
        rdds = [other, *others]
        return self._tagged_groups(rdds, None).mapValues(partial(_ops.cogroup_values, len(rdds) + 1))

    def _join(self, other: RDD, numPartitions: int | None, left: bool, right: bool) -> RDD:
        return self._tagged_groups([other], numPartitions).flatMapValues(partial(_ops.join_values, left, right))

    def join(self, other: RDD, numPartitions: int | None = None) -> RDD:
        return self._join(other, numPartitions, False, False)

    def leftOuterJoin(self, other: RDD, numPartitions: int | None = None) -> RDD:
        return self._join(other, numPartitions, True, False)

    def rightOuterJoin(self, other: RDD, numPartitions: int | None = None) -> RDD:
        return self._join(other, numPartitions, False, True)

    def fullOuterJoin(self, other: RDD, numPartitions: int | None = None) -> RDD:
        return self._join(other, numPartitions, True, True)

    def subtractByKey(self, other: RDD, numPartitions: int | None = None) -> RDD:
        """Pairs of ``self`` whose key is not in ``other``."""
        return (
            self.cogroup(other, numPartitions)
            .filter(lambda kv: len(kv[1][0]) > 0 and len(kv[1][1]) == 0)
            .flatMapValues(lambda groups: groups[0])
        )

    def subtract(self, other: RDD, numPartitions: int | None = None) -> RDD:
        """Elements of ``self`` not in ``other`` (duplicates in ``self`` are kept)."""
        return self.map(lambda x: (x, True)).subtractByKey(other.map(lambda x: (x, True)), numPartitions).keys()

    def intersection(self, other: RDD) -> RDD:
        """Distinct elements present in both."""
        return (
            self.map(lambda v: (v, None))
            .cogroup(other.map(lambda v: (v, None)))
            .filter(lambda kv: len(kv[1][0]) > 0 and len(kv[1][1]) > 0)
            .keys()
        )

    def cartesian(self, other: RDD) -> RDD:
        """Every pair ``(a, b)``; partition ``i * m + j`` pairs partition i of self with j of other."""
        return self._derive(_graph.product("cartesian", self._bag, other._bag, _ops.cartesian), None, (self, other))

    def sortByKey(
        self,
        ascending: bool = True,
        numPartitions: int | None = None,
        keyfunc: Callable[[Any], Any] = lambda x: x,
    ) -> RDD:
        """Sorted by key, range-partitioned with bounds from a sample (as PySpark)."""
        keyfunc = _ops.user_function(keyfunc, "sortByKey", "keyfunc")
        n = self._reduce_partitions(numPartitions)
        sort = partial(_ops.sort_partition, keyfunc, ascending)
        if n == 1:
            src = self.coalesce(1) if self.getNumPartitions() > 1 else self
            return src._partitionwise("sortPartition", sort, True)
        size = self.count()
        if not size:
            return self
        fraction = min(n * 20.0 / size, 1.0)
        samples = sorted(self.sample(False, fraction, 1).map(lambda kv: _ops.pair(kv)[0]).collect(), key=keyfunc)
        bounds = [keyfunc(samples[int(len(samples) * (i + 1) / n)]) for i in range(n - 1)] if samples else []

        def range_partitioner(k: Any) -> int:
            p = bisect.bisect_left(bounds, keyfunc(k))
            return p if ascending else n - 1 - p

        return self.partitionBy(n, range_partitioner)._partitionwise("sortPartition", sort, True)

    def repartitionAndSortWithinPartitions(
        self,
        numPartitions: int | None = None,
        partitionFunc: Callable[[Any], int] = portable_hash,
        ascending: bool = True,
        keyfunc: Callable[[Any], Any] = lambda x: x,
    ) -> RDD:
        """Pairs moved to partition ``partitionFunc(key) % numPartitions`` (``partitionBy``), each partition
        then sorted by ``keyfunc(key)``, descending unless ``ascending``."""
        keyfunc = _ops.user_function(keyfunc, "repartitionAndSortWithinPartitions", "keyfunc")
        n = self._reduce_partitions(numPartitions)
        sort = partial(_ops.sort_partition, keyfunc, ascending)
        return self.partitionBy(n, partitionFunc)._partitionwise("sortPartition", sort, True)

    def sortBy(self, keyfunc: Callable[[Any], Any], ascending: bool = True, numPartitions: int | None = None) -> RDD:
        keyfunc = _ops.user_function(keyfunc, "sortBy", "keyfunc")
        return self.keyBy(keyfunc).sortByKey(ascending, numPartitions).values()

    # -- actions -------------------------------------------------------------------------
    def collect(self) -> list:
        """Every element, in partition order, on the driver."""
        # gathered partition by partition: each crosses the network as one unit
        return list(itertools.chain.from_iterable(self._run_partitions(iter, range(self.getNumPartitions()))))

    def collectWithJobGroup(self, groupId: str, description: str, interruptOnCancel: bool = False) -> list:
        """:meth:`collect` as a job of group ``groupId`` (PySpark's deprecated method; the thread's own
        group is restored after)."""
        warnings.warn(
            "Deprecated in 3.1, Use pyspark.InheritableThread with the pinned thread mode enabled.", FutureWarning, 2
        )
        jobs = self.ctx._jobs
        before = dict(jobs.properties())
        self.ctx.setJobGroup(groupId, description, interruptOnCancel)
        try:
            return self.collect()
        finally:
            jobs.properties().clear()
            jobs.properties().update(before)

    def count(self) -> int:
        if self.getNumPartitions() == 0:
            return 0
        return int(self._reduce(_ops.count, _ops.sum_ints))

    def take(self, num: int) -> list:
        """The first ``num`` elements, computing as few partitions as possible (as PySpark)."""
        items: list = []
        total = self.getNumPartitions()
        scanned = 0
        action: set = set()  # the rounds are one action for accumulators
        while len(items) < num and scanned < total:
            to_try = 1
            if scanned > 0:
                if not items:
                    to_try = scanned * 4
                else:
                    to_try = min(max(int(1.5 * num * scanned / len(items)) - scanned, 1), scanned * 4)
            left = num - len(items)
            for part in self._run_partitions(
                partial(_ops.take, left), range(scanned, min(scanned + to_try, total)), action
            ):
                items.extend(part)
            scanned += to_try
        return items[:num]

    def first(self) -> Any:
        rs = self.take(1)
        if rs:
            return rs[0]
        raise ValueError("RDD is empty")

    def isEmpty(self) -> bool:
        return self.getNumPartitions() == 0 or len(self.take(1)) == 0

    def reduce(self, f: Callable[[Any, Any], Any]) -> Any:
        """Combine all elements with the associative, commutative ``f``."""
        f = _ops.user_function(f, "reduce", "f")
        vals = (
            self._reduce(partial(_ops.reduce_partition, f), partial(_ops.reduce_results, f))
            if self.getNumPartitions()
            else []
        )
        if vals:
            return vals[0]
        raise ValueError("Can not reduce() empty RDD")

    def fold(self, zeroValue: Any, op: Callable[[Any, Any], Any]) -> Any:
        """Fold each partition from ``zeroValue``, then the partition results from ``zeroValue``."""
        op = _ops.user_function(op, "fold", "op")
        vals = self.mapPartitions(partial(_ops.fold_partition, zeroValue, op)).collect()
        return reduce(op, vals, zeroValue)

    def aggregate(self, zeroValue: Any, seqOp: Callable[[Any, Any], Any], combOp: Callable[[Any, Any], Any]) -> Any:
        seqOp = _ops.user_function(seqOp, "aggregate", "seqOp")
        combOp = _ops.user_function(combOp, "aggregate", "combOp")
        vals = self.mapPartitions(lambda it: [_ops.aggregate_partition(zeroValue, seqOp, it)]).collect()
        return reduce(combOp, vals, zeroValue)

    def treeAggregate(
        self, zeroValue: Any, seqOp: Callable[[Any, Any], Any], combOp: Callable[[Any, Any], Any], depth: int = 2
    ) -> Any:
        """``aggregate`` with partial results combined in a tree of the given depth on the workers. Every
        partition, an empty one too, starts from ``zeroValue`` (as in PySpark)."""
        seqOp = _ops.user_function(seqOp, "treeAggregate", "seqOp")
        combOp = _ops.user_function(combOp, "treeAggregate", "combOp")
        if depth < 1:
            raise ValueError(f"Depth cannot be smaller than 1 but got {depth}.")
        n = self.getNumPartitions()
        if n == 0:
            return zeroValue
        scale = max(math.ceil(n ** (1.0 / depth)), 2)
        # one partial result per partition: Dask's reduction would skip the empty partitions, whose zero
        # values PySpark combines too
        partials = self._partitionwise("aggregatePartition", partial(_ops.aggregate_partition_list, zeroValue, seqOp))
        return partials._reduce(_ops.only, partial(_ops.reduce_all, combOp), split_every=scale)

    def treeReduce(self, f: Callable[[Any, Any], Any], depth: int = 2) -> Any:
        f = _ops.user_function(f, "treeReduce", "f")
        if depth < 1:
            raise ValueError(f"Depth cannot be smaller than 1 but got {depth}.")
        n = self.getNumPartitions()
        scale = max(math.ceil(max(n, 1) ** (1.0 / depth)), 2)
        vals = self._reduce(partial(_ops.reduce_partition, f), partial(_ops.reduce_results, f), scale) if n else []
        if vals:
            return vals[0]
        raise ValueError("Cannot reduce empty RDD.")

    def max(self, key: Callable[[Any], Any] | None = None) -> Any:
        key = _ops.user_key(key, "max")
        return _ops.plain(self.reduce(max if key is None else lambda a, b: max(a, b, key=key)))

    def min(self, key: Callable[[Any], Any] | None = None) -> Any:
        key = _ops.user_key(key, "min")
        return _ops.plain(self.reduce(min if key is None else lambda a, b: min(a, b, key=key)))

    def sum(self) -> Any:
        if self.getNumPartitions() == 0:
            return 0
        return _ops.plain(self._reduce(sum, sum))

    def stats(self) -> StatCounter:
        """Count, mean, variance, min and max in one pass."""
        if self.getNumPartitions() == 0:
            return StatCounter()
        return self._reduce(_ops.stat_counter, _ops.merge_stats)

    def mean(self) -> float:
        return self.stats().mean()

    def variance(self) -> float:
        return self.stats().variance()

    def stdev(self) -> float:
        return self.stats().stdev()

    def sampleVariance(self) -> float:
        return self.stats().sampleVariance()

    def sampleStdev(self) -> float:
        return self.stats().sampleStdev()

    def histogram(self, buckets: int | list | tuple) -> tuple[list, list[int]]:
        """Counts per bucket: ``buckets`` evenly spaced between min and max, or the given edges."""
        if isinstance(buckets, bool):
            raise TypeError("buckets should be a list or tuple or number(int or long)")
        if isinstance(buckets, int):
            if buckets < 1:
                raise ValueError("number of buckets must be >= 1")
            filtered = self.filter(_ops.comparable)
            try:
                minv = filtered.min()
                maxv = filtered.max()
            except ValueError:
                raise ValueError("can not generate buckets from empty RDD") from None
            if minv == maxv or buckets == 1:
                return [minv, maxv], [filtered.count()]
            try:
                inc = (maxv - minv) / buckets
            except TypeError:
                raise TypeError("Can not generate buckets with non-number in RDD") from None
            if math.isinf(inc):
                raise ValueError("Can not generate buckets with infinite value")
            inc = int(inc)
            if inc * buckets != maxv - minv:
                inc = (maxv - minv) * 1.0 / buckets
            edges = [i * inc + minv for i in range(buckets)]
            edges.append(maxv)
            even = True
        elif isinstance(buckets, (list, tuple)):
            if len(buckets) < 2:
                raise ValueError("buckets should have more than one value")
            if any(b is None or (isinstance(b, float) and math.isnan(b)) for b in buckets):
                raise ValueError("can not have None or NaN in buckets")
            if sorted(buckets) != list(buckets):
                raise ValueError("buckets should be sorted")
            if len(set(buckets)) != len(buckets):
                raise ValueError("buckets should not contain duplicated values")
            edges = list(buckets)
            even, inc = False, None
            try:
                steps = [edges[i + 1] - edges[i] for i in range(len(edges) - 1)]
            except TypeError:
                pass
            else:
                if max(steps) - min(steps) < 1e-10:
                    even = True
                    inc = (edges[-1] - edges[0]) / (len(edges) - 1)
        else:
            raise TypeError("buckets should be a list or tuple or number(int or long)")
        if self.getNumPartitions() == 0:
            return edges, [0] * (len(edges) - 1)
        counts = self._reduce(
            partial(_ops.histogram_partition, edges, even, inc), partial(_ops.add_counters, len(edges) - 1)
        )
        return (buckets if isinstance(buckets, (list, tuple)) else edges), counts

    def countApproxDistinct(self, relativeSD: float = 0.05) -> int:
        """The approximate number of distinct elements: a HyperLogLog sketch of 2^p registers per
        partition, p chosen from ``relativeSD`` as Spark chooses it (standard error at most ``relativeSD``,
        which must be greater than 0.000017; each register is one byte). Elements are hashed with
        :func:`portable_hash`, so equal elements count once whatever worker sees them."""
        p = _hll.precision(relativeSD)
        if self.getNumPartitions() == 0:
            return 0
        return _hll.estimate(self._reduce(partial(_hll.registers, p), partial(_hll.merge, p)))

    def countApprox(self, timeout: int, confidence: float = 0.95) -> int:
        """The number of elements, estimated from the partitions counted within ``timeout`` milliseconds
        (exact if all were): PySpark's ``sumApprox`` of the partitions' sizes, as an int."""
        return int(self._sum_within(_ops.float_count, timeout, confidence))

    def sumApprox(self, timeout: int, confidence: float = 0.95) -> BoundedFloat:
        """The sum, from the partitions summed within ``timeout`` milliseconds, with a ``confidence``
        interval (``low``, ``high``; Spark's ``SumEvaluator`` over the partitions' sums, as PySpark). Once
        every partition is in, the sum is exact (confidence 1.0, low == high); at the timeout the rest
        of the job is cancelled."""
        return self._sum_within(_ops.float_sum, timeout, confidence)

    def meanApprox(self, timeout: int, confidence: float = 0.95) -> BoundedFloat:
        """The mean, from the partitions done within ``timeout`` milliseconds, with a ``confidence``
        interval (Spark's ``MeanEvaluator``); exact when every partition is done, as ``sumApprox``."""
        check_confidence(confidence)
        done = self._run_within(_ops.float_stats, timeout)
        counter = StatCounter()
        for i in sorted(done):
            counter.mergeStats(done[i][0])
        return mean_bound(counter, len(done), self.getNumPartitions(), confidence)

    def countByValue(self) -> dict:
        if self.getNumPartitions() == 0:
            return defaultdict(int)
        return self._reduce(_ops.count_values, _ops.merge_counts)

    def countByKey(self) -> dict:
        return self.map(lambda kv: _ops.pair(kv)[0]).countByValue()

    def collectAsMap(self) -> dict:
        return dict(map(_ops.pair, self.collect()))

    def lookup(self, key: Any) -> list:
        """Values of ``key``; only its partition is computed when the partitioner is known."""
        values = self.filter(lambda kv: _ops.pair(kv)[0] == key).values()
        if self.partitioner is not None:
            return list(values._run_partitions(iter, [self.partitioner(key)])[0])
        return values.collect()

    def top(self, num: int, key: Callable[[Any], Any] | None = None) -> list:
        """The ``num`` largest elements, largest first."""
        key = _ops.user_key(key, "top")
        if self.getNumPartitions() == 0 or num <= 0:
            return []
        return self._reduce(partial(_ops.nlargest, num, key), partial(_ops.nlargest_merge, num, key))

    def takeOrdered(self, num: int, key: Callable[[Any], Any] | None = None) -> list:
        """The ``num`` smallest elements, smallest first."""
        if num < 0:
            raise ValueError("top N cannot be negative.")
        key = _ops.user_key(key, "takeOrdered")
        if num == 0 or self.getNumPartitions() == 0:
            return []
        return self._reduce(partial(_ops.nsmallest, num, key), partial(_ops.nsmallest_merge, num, key))

    def takeSample(self, withReplacement: bool, num: int, seed: int | None = None) -> list:
        """Exactly ``num`` elements sampled at random (fewer if the RDD is smaller, without replacement)."""
        num_stdev = 10.0
        max_size = sys.maxsize - int(num_stdev * math.sqrt(sys.maxsize))
        if num < 0:
            raise ValueError("Sample size cannot be negative.")
        if num > max_size:
            raise ValueError(f"Sample size cannot be greater than {max_size}.")
        if num == 0 or self.getNumPartitions() == 0:
            return []
        total = self.count()
        if total == 0:
            return []
        rng = random.Random(seed)
        if not withReplacement and num >= total:
            samples = self.collect()
            rng.shuffle(samples)
            return samples
        fraction = fraction_for_sample_size(num, total, withReplacement)
        samples = self.sample(withReplacement, fraction, seed).collect()
        while len(samples) < num:
            samples = self.sample(withReplacement, fraction, rng.randint(0, sys.maxsize)).collect()
        rng.shuffle(samples)
        return samples[:num]

    def foreach(self, f: Callable[[Any], None]) -> None:
        """Run ``f`` on every element, on the workers."""
        f = _ops.user_function(f, "foreach", "f")
        if self.getNumPartitions():
            self._reduce(partial(_ops.foreach, f), _ops.sum_ints)

    def foreachPartition(self, f: Callable[[Iterator[Any]], None]) -> None:
        f = _ops.user_function(f, "foreachPartition", "f")
        if self.getNumPartitions():
            self._reduce(partial(_ops.foreach_partition, f), _ops.sum_ints)

    def toLocalIterator(self, prefetchPartitions: bool = False) -> Iterator[Any]:
        """Every element, one partition at a time: a partition is computed when the iteration reaches it
        (with ``prefetchPartitions``, the next one too), so the driver holds at most two. What several
        partitions share (a shuffle's map side) is computed once and kept on the workers until the
        iteration ends or the iterator is dropped. A partition that waits on a worker Dask paused is
        told of, as an action's job is."""
        ctx = self.ctx
        with ctx._jobs.task_resources():
            jobs = _graph.PartitionJobs(ctx.client, barrier.run_stages(ctx.client, self._bag, cpus=ctx._barrier_cpus))
        action: set = set()  # the iteration is one action for accumulators
        pending = None
        pauses = PauseWatch(ctx.client, f"toLocalIterator of RDD {self.id()}")
        for i in range(len(jobs)):
            with ctx._jobs.task_resources():
                future = pending if pending is not None else jobs.submit(i)
                pending = jobs.submit(i + 1) if prefetchPartitions and i + 1 < len(jobs) else None
            part = pauses.result(future)
            self.ctx._accumulators.deliver(_graph.carried([part]), action)
            yield from part

    # -- output --------------------------------------------------------------------------
    def saveAsTextFile(
        self, path: str, compressionCodecClass: str | None = None, *, storage_options: dict[str, Any] | None = None
    ) -> None:
        """One ``part-NNNNN`` text file per partition under the directory ``path``, then ``_SUCCESS``."""
        _io.save_as_text_file(self, path, compressionCodecClass, storage_options)

    def saveAsPickleFile(
        self, path: str, batchSize: int = 10, *, storage_options: dict[str, Any] | None = None
    ) -> None:
        """Elements pickled in batches, one part file per partition, read back by ``pickleFile``."""
        _io.save_as_pickle_file(self, path, batchSize, storage_options)

    # -- persistence ---------------------------------------------------------------------
    @property
    def is_cached(self) -> bool:
        return self._stored is not None

    def cache(self) -> RDD:
        """Persist at ``MEMORY_ONLY``."""
        return self.persist(StorageLevel.MEMORY_ONLY)

    def persist(self, storageLevel: StorageLevel | None = None) -> RDD:
        """Keep the computed partitions on the workers at ``storageLevel`` (default MEMORY_ONLY)."""
        return persist.persist(self, storageLevel)

    def unpersist(self, blocking: bool = False) -> RDD:
        """Drop the persisted partitions (memory and disk); later actions recompute them."""
        return persist.unpersist(self, blocking)

    def getStorageLevel(self) -> StorageLevel:
        return self._stored.level if self._stored is not None else StorageLevel.NONE

    def toDebugString(self) -> bytes:
        """This RDD's lineage, UTF-8 encoded, laid out as Spark lays it out: one line per RDD with its
        partition count at the top and at each shuffle, the storage level of persisted RDDs and what they
        hold. Gives ids to the RDDs it prints, as PySpark does."""
        return _lineage.debug_string(self).encode("utf-8")

    # -- checkpoints ---------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Save this RDD in the context's checkpoint directory after the next action that computes it (or
        an RDD built from it), and from then on read it from there: its lineage is cut. The files are
        dlscale's safe pickle format (``saveAsPickleFile``): plain data only. Unless the RDD is persisted,
        saving computes it once more, as in Spark."""
        if self.ctx._checkpoint_dir is None:
            raise CheckpointError("Checkpoint directory has not been set in the SparkContext")
        if self._checkpoint_mark is None:
            self._checkpoint_mark = "reliable"
            self.ctx._to_checkpoint.add(self)

    def localCheckpoint(self) -> None:
        """Mark this RDD for a local checkpoint: persisted at ``MEMORY_AND_DISK`` (unless persisted already)
        and counted as checkpointed after the next action that computes it. Unlike Spark, the lineage is
        kept, so a block lost with its worker is computed again rather than failing the job."""
        if self._checkpoint_mark is None:
            if self._stored is None:
                self.persist(StorageLevel.MEMORY_AND_DISK)
            self._checkpoint_mark = "local"
            self.ctx._to_checkpoint.add(self)

    def isCheckpointed(self) -> bool:
        """Whether an action has checkpointed this RDD since ``checkpoint()`` or ``localCheckpoint()``."""
        return self._checkpointed

    def isLocallyCheckpointed(self) -> bool:
        """Whether ``localCheckpoint()`` was called."""
        return self._checkpoint_mark == "local"

    def getCheckpointFile(self) -> str | None:
        """The directory this RDD was checkpointed to, once it was: ``<checkpoint dir>/rdd-<id>``, a local one
        as Spark writes it (``file:/tmp/x/<uuid>/rdd-3``), which ``pickleFile`` reads."""
        return self._checkpoint_file

    def _checkpoint_lineage(self, bag: Bag) -> None:
        """After an action on ``bag``: checkpoint the RDDs marked for it that ``bag`` was computed from."""
        layers = bag.__dask_graph__().layers
        for rdd in list(self.ctx._to_checkpoint):
            if rdd._bag.name in layers:
                self.ctx._to_checkpoint.discard(rdd)
                if rdd._checkpoint_mark == "reliable":
                    url, options = self.ctx._checkpoint_dir
                    path = f"{url}/rdd-{rdd.id()}"
                    _io.save_as_pickle_file(rdd, path, 10, options)
                    level = rdd.getStorageLevel()
                    if level != StorageLevel.NONE:  # kept, now read from the files: a lost block is read again
                        rdd.unpersist(blocking=True)
                    rdd._bag = _io.pickle_file(path, (), options)
                    if level != StorageLevel.NONE:
                        rdd.persist(level)
                    rdd._checkpoint_file = path
                    rdd._parents = ()
                rdd._checkpointed = True

    # -- parts of PySpark that need Spark's JVM --------------------------------------------
    def toDF(self, schema: Any = None, sampleRatio: float | None = None) -> Any:
        """Not supported: dlscale has no Spark SQL."""
        raise UnsupportedOperationError(
            "RDD.toDF needs Spark SQL, which dlscale does not have: make a Dask DataFrame with "
            "rdd.to_bag().to_dataframe() instead"
        )

    def saveAsHadoopFile(
        self,
        path: str,
        outputFormatClass: str,
        keyClass: str | None = None,
        valueClass: str | None = None,
        keyConverter: str | None = None,
        valueConverter: str | None = None,
        conf: dict[str, str] | None = None,
        compressionCodecClass: str | None = None,
    ) -> None:
        """Not supported: Hadoop output formats need the JVM."""
        raise _hadoop_output("saveAsHadoopFile")

    def saveAsNewAPIHadoopFile(
        self,
        path: str,
        outputFormatClass: str,
        keyClass: str | None = None,
        valueClass: str | None = None,
        keyConverter: str | None = None,
        valueConverter: str | None = None,
        conf: dict[str, str] | None = None,
    ) -> None:
        """Not supported: Hadoop output formats need the JVM."""
        raise _hadoop_output("saveAsNewAPIHadoopFile")

    def saveAsHadoopDataset(
        self, conf: dict[str, str], keyConverter: str | None = None, valueConverter: str | None = None
    ) -> None:
        """Not supported: Hadoop output formats need the JVM."""
        raise _hadoop_output("saveAsHadoopDataset")

    def saveAsNewAPIHadoopDataset(
        self, conf: dict[str, str], keyConverter: str | None = None, valueConverter: str | None = None
    ) -> None:
        """Not supported: Hadoop output formats need the JVM."""
        raise _hadoop_output("saveAsNewAPIHadoopDataset")

    def saveAsSequenceFile(self, path: str, compressionCodecClass: str | None = None) -> None:
        """Not supported: SequenceFiles are a Hadoop format."""
        raise _hadoop_output("saveAsSequenceFile")

    def withResources(self, profile: Any) -> RDD:
        """Not supported: stage-level scheduling needs Spark's scheduler."""
        raise _resource_profiles("withResources")

    def getResourceProfile(self) -> Any:
        """Not supported: stage-level scheduling needs Spark's scheduler."""
        raise _resource_profiles("getResourceProfile")


def _hadoop_output(method: str) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"RDD.{method} needs Hadoop's output formats (Spark's JVM), which dlscale does not have: write with "
        "saveAsPickleFile (read back by SparkContext.pickleFile) or saveAsTextFile, to a path or any fsspec URL"
    )


def _resource_profiles(method: str) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"RDD.{method} needs Spark's stage-level scheduling (ResourceProfile), which dlscale does not have: "
        "give the workers resources instead (spark.executor.resource.<name>.amount in the SparkConf of a "
        "local[N] context, or dlscale run --resources GPU=1)"
    )
