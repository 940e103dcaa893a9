"""Barrier execution mode (PySpark's ``rdd.barrier()``): stages whose tasks run all at once and meet.

``rdd.barrier().mapPartitions(f)`` makes an RDD whose partitions are computed by one barrier stage: every
task of the stage runs at the same time on a worker thread of its own, and ``barrier()`` and
``allGather()`` of :class:`~dlscale.facade.taskcontext.BarrierTaskContext` wait for all of them. Spark
added the mode for distributed training: the tasks of a stage can start ``torch.distributed`` together.

Dask starts a task when its inputs are ready and a thread is free, which promises no such thing. So an
action whose graph holds a barrier stage runs the stage first, on its own (:func:`run_stages`): its input
partitions are computed, each of its tasks is placed on a worker thread of its own (on the worker that
holds its input where it can), a stage with more tasks than the cluster has threads is refused at once
(as Spark refuses it), and the tasks meet at the scheduler, whose :class:`BarrierCoordinator` answers their
calls. The rest of the action then reads the stage's results.

When a task fails, the stage is aborted: the tasks waiting at a barrier are released with an error, the
running ones are interrupted, and the action raises, naming the task (Spark, with one attempt per task,
does the same). When a worker running one of its tasks is lost, the whole stage runs again, up to
``dlscale.barrier.stage-attempts`` times in all (Spark's ``spark.stage.maxConsecutiveAttempts``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from dask._task_spec import Task, TaskRef
from dask.bag import Bag
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.utils import parse_timedelta
from distributed import as_completed, wait
from distributed.comm.addressing import get_address_host_port
from distributed.diagnostics.plugin import SchedulerPlugin

from dlscale import config
from dlscale.errors import BarrierError
from dlscale.facade import _graph, _ops
from dlscale.facade.jobs import _interrupt
from dlscale.facade.taskcontext import BarrierStage
from dlscale.runtime.cluster import cluster_workers
from dlscale.runtime.extensions import Extension, install

if TYPE_CHECKING:
    from distributed import Client, Future
    from distributed.scheduler import Scheduler

    from dlscale.facade.rdd import RDD

__all__ = [
    "BARRIER",
    "BarrierCoordinator",
    "RDDBarrier",
    "has_stages",
    "pipelined",
    "run_stages",
    "stage_bag",
    "stage_of",
]

logger = logging.getLogger("dlscale")


class RDDBarrier:
    """An RDD whose next operation runs as a barrier stage (PySpark's ``RDDBarrier``, from ``RDD.barrier()``)."""

    def __init__(self, rdd: RDD) -> None:
        self.rdd = rdd

    def mapPartitions(self, f: Callable[[Iterator[Any]], Iterable[Any]], preservesPartitioning: bool = False) -> RDD:
        """``f`` over each partition, all partitions' tasks at once in a barrier stage."""
        f = _ops.user_function(f, "mapPartitions", "f")
        return self._stage(partial(_ops.map_partitions, f), preservesPartitioning)

    def mapPartitionsWithIndex(
        self, f: Callable[[int, Iterator[Any]], Iterable[Any]], preservesPartitioning: bool = False
    ) -> RDD:
        """``f(index, partition)`` for each partition, all at once in a barrier stage."""
        f = _ops.user_function(f, "mapPartitionsWithIndex", "f")
        return self._stage(partial(_ops.map_partitions_with_index, f), preservesPartitioning)

    def _stage(self, func: Callable[[int, Iterable[Any]], Iterable[Any]], preserves: bool) -> RDD:
        out = self.rdd._derive(stage_bag(self.rdd._bag, func), self.rdd.partitioner if preserves else None)
        out._barrier = True
        return out


def stage_bag(parent: Bag, func: Callable[[int, Iterable[Any]], Iterable[Any]]) -> Bag:
    """A barrier stage computing ``func(i, partition i of parent)``."""
    name, n = _graph._name("barrier"), parent.npartitions
    dsk = {(name, i): Task((name, i), _outside_stage, (name, i), TaskRef((parent.name, i))) for i in range(n)}
    graph = HighLevelGraph.from_collections(name, BarrierLayer(dsk, parent.name, func, n), dependencies=[parent])
    return Bag(graph, name, n)


def stage_of(bag: Bag) -> BarrierLayer | None:
    """The barrier stage that computes ``bag``'s partitions, if one does."""
    layer = bag.__dask_graph__().layers.get(bag.name)
    return layer if isinstance(layer, BarrierLayer) else None


def pipelined(bag: Bag, func: Callable[[int, Iterable[Any]], Iterable[Any]]) -> Bag:
    """``bag``, computed by a barrier stage, with ``func`` run after the stage's function in the same tasks: as
    Spark pipelines the narrow operations after ``barrier().mapPartitions`` into the barrier stage, so that
    they too run in the barrier tasks (``rdd.barrier().mapPartitions(f).map(g)``: ``g`` may call
    ``barrier()``)."""
    layer = stage_of(bag)
    assert layer is not None
    inputs = bag.__dask_graph__().cull_layers([layer.parent])
    return stage_bag(Bag(inputs, layer.parent, layer.npartitions), partial(_then, layer.func, func))


def _then(
    first: Callable[[int, Iterable[Any]], Iterable[Any]],
    then: Callable[[int, Iterable[Any]], Iterable[Any]],
    i: int,
    part: Iterable[Any],
) -> Iterable[Any]:
    return then(i, first(i, part))


class BarrierLayer(MaterializedLayer):
    """The graph layer of a barrier stage: placeholders, which :func:`run_stages` replaces by the results of
    the stage's tasks, and what it needs to run them (the input layer's name and the function)."""

    def __init__(self, mapping: dict, parent: str, func: Callable[[int, Iterable[Any]], Iterable[Any]], n: int) -> None:
        super().__init__(mapping)
        self.parent = parent
        self.func = func
        self.npartitions = n


def _outside_stage(key: Any, _part: Any) -> None:
    raise BarrierError(
        f"partition {key} of a barrier stage was computed outside dlscale's RDD actions: a barrier stage runs "
        "only through them (collect, count, reduce, foreach, ..., persist, toLocalIterator), which start all "
        "its tasks together"
    )


# -- the driver's side ---------------------------------------------------------------------------
def _collections(collection: Any) -> list:
    return collection if isinstance(collection, list) else [collection]


def _stage_layers(c: Any) -> list[str]:
    graph = c.__dask_graph__()
    layers = graph.layers if isinstance(graph, HighLevelGraph) else {}
    return [name for name, layer in layers.items() if isinstance(layer, BarrierLayer)]


def has_stages(collection: Any) -> bool:
    """Whether the graph of ``collection`` (a Dask collection or a list of them) holds a barrier stage."""
    return any(_stage_layers(c) for c in _collections(collection))


def run_stages(
    client: Client, collection: Any, track: Callable[[list[Future]], None] | None = None, *, cpus: int = 1
) -> Any:
    """``collection`` (a Dask collection or a list of them) with every barrier stage in its graph run and
    replaced by the stage's results. ``track`` is handed the futures of each computation it starts (so that
    the job they belong to can cancel them). A stage shared by several collections runs once. A task takes
    ``cpus`` of its worker's threads (``spark.task.cpus`` where the context limits tasks by CPUs)."""
    done: dict[str, list[Future]] = {}
    out = [_without_stages(client, c, done, track, cpus) for c in _collections(collection)]
    return out if isinstance(collection, list) else out[0]


def _without_stages(client: Client, c: Any, done: dict, track: Callable | None, cpus: int) -> Any:
    if not _stage_layers(c):
        return c
    graph = c.__dask_graph__()
    layers, deps = dict(graph.layers), {name: set(d) for name, d in graph.dependencies.items()}
    while stages := [name for name, layer in layers.items() if isinstance(layer, BarrierLayer)]:
        name = next(s for s in stages if not _stage_below(s, layers, deps))  # the stages it reads run first
        layer = layers[name]
        if name not in done:
            inputs = HighLevelGraph(layers, deps).cull_layers([layer.parent])
            done[name] = _run_stage(client, name, layer, Bag(inputs, layer.parent, layer.npartitions), track, cpus)
        layers[name] = MaterializedLayer({(name, i): f for i, f in enumerate(done[name])})
        deps[name] = set()
    rebuild, args = c.__dask_postpersist__()
    return rebuild(HighLevelGraph(layers, deps), *args)


def _stage_below(name: str, layers: dict, deps: dict) -> bool:
    seen, stack = set(), list(deps[name])
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            if isinstance(layers[n], BarrierLayer):
                return True
            stack.extend(deps[n])
    return False


def _slots(workers: dict[str, dict], cpus: int) -> dict[str, int]:
    """The tasks each worker runs at once: its threads, ``cpus`` for each task."""
    return {address: w["nthreads"] // cpus for address, w in workers.items()}


def _check_slots(workers: dict[str, dict], n: int, cpus: int) -> None:
    slots = sum(_slots(workers, cpus).values())
    if n > slots:
        per_task = f", {cpus} per task (spark.task.cpus)" if cpus > 1 else ""
        raise BarrierError(
            f"a barrier stage of {n} tasks needs {n} task slots at once, and the cluster has {slots} "
            f"(worker threads on {len(workers)} workers{per_task}): barrier mode runs all of a stage's tasks "
            "together. Add workers or threads, or repartition the RDD to fewer partitions"
        )


def _place(client: Client, inputs: list[Future], rerun: bool, cpus: int) -> list[str]:
    """A worker for each task, one task per ``cpus`` worker threads, on the worker that holds its input where
    it can. A stage run again after a lost worker first waits up to ``dlscale.barrier.slots-wait`` for enough
    threads (the nanny restarting the worker, or another joining)."""
    deadline = time.monotonic() + (parse_timedelta(config.get("barrier.slots-wait")) if rerun else 0)
    while True:
        workers = cluster_workers(client)
        if sum(_slots(workers, cpus).values()) >= len(inputs) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    _check_slots(workers, len(inputs), cpus)
    free = _slots(workers, cpus)
    holders = client.who_has(inputs)
    placement: list[str | None] = [None] * len(inputs)
    for i, f in enumerate(inputs):
        for address in holders.get(f.key, ()):
            if free.get(address, 0) > 0:
                placement[i], free[address] = address, free[address] - 1
                break
    for i, address in enumerate(placement):
        if address is None:
            address = max(free, key=free.__getitem__)
            placement[i], free[address] = address, free[address] - 1
    return placement  # type: ignore[return-value]


def _host_port(address: str) -> str:
    host, port = get_address_host_port(address)
    return f"{host}:{port}"


def _run_stage(
    client: Client, name: str, layer: BarrierLayer, inputs_bag: Bag, track: Callable | None, cpus: int
) -> list[Future]:
    """Run barrier stage ``name`` over the partitions of ``inputs_bag``: the futures of its tasks' results.

    A stage that failed because a worker was lost runs again, whole, up to ``dlscale.barrier.stage-attempts``
    times in all; any other failure raises at once.
    """
    _check_slots(cluster_workers(client), layer.npartitions, cpus)  # at once, before the inputs are computed (as Spark)
    install(client, BARRIER)
    inputs = _computed_inputs(client, inputs_bag, track)
    attempts = int(config.get("barrier.stage-attempts"))
    timeout = parse_timedelta(config.get("barrier.sync-timeout"))
    attempt = 0
    while True:
        attempt += 1
        futures = _run_attempt(
            client, name, layer, inputs, track, cpus=cpus, attempt=attempt, attempts=attempts, timeout=timeout
        )
        if futures is not None:
            return futures


def _computed_inputs(client: Client, inputs_bag: Bag, track: Callable | None) -> list[Future]:
    """The stage's input partitions, computed before any of its tasks starts, so that they all start together."""
    inputs = client.compute(inputs_bag.to_delayed())
    if track is not None:
        track(inputs)
    wait(inputs)
    for f in inputs:
        if f.status == "error":
            f.result()  # the error of the stage's input, as the action would raise it without a barrier
    return inputs


def _run_attempt(
    client: Client,
    name: str,
    layer: BarrierLayer,
    inputs: list[Future],
    track: Callable | None,
    *,
    cpus: int,
    attempt: int,
    attempts: int,
    timeout: float,
) -> list[Future] | None:
    """One run of the whole stage: its tasks' futures when all succeeded; ``None`` when a worker was lost and
    attempts are left (the stage is to run again); else raises :class:`BarrierError`.

    Whatever happens, the coordinator forgets the stage afterwards; unless it finished, its tasks are
    cancelled and the running ones interrupted (as when the action is stopped midway).
    """
    placement = _place(client, inputs, rerun=attempt > 1, cpus=cpus)
    stage = BarrierStage(f"{name}-{attempt}-{uuid.uuid4().hex[:8]}", tuple(map(_host_port, placement)))
    client.run_on_scheduler(_begin, stage.id, placement, timeout)
    futures: list[Future] = []
    finished = False
    try:
        for i, address in enumerate(placement):
            futures.append(_submit_task(client, stage, name, layer, inputs[i], i, address, attempt))
        if track is not None:
            track(futures)
        failed = _first_failure(futures)
        if failed is None:
            finished = True
            return futures
        lost = client.run_on_scheduler(_end, stage.id, f"barrier task {failed} failed")
        if lost is not None and attempt < attempts:
            logger.warning(
                "barrier stage %s: %s; running the whole stage again (attempt %d of %d)",
                name,
                lost,
                attempt + 1,
                attempts,
            )
            return None
        error = futures[failed].exception()
        cause = lost or f"barrier task {failed} (partition {failed}) on {placement[failed]} failed"
        raise _stage_failure(name, attempt, cause, error) from error
    finally:
        client.run_on_scheduler(_end, stage.id, "the stage finished" if finished else "the action was stopped")
        if not finished:
            _stop(client, futures)


def _submit_task(
    client: Client,
    stage: BarrierStage,
    name: str,
    layer: BarrierLayer,
    part: Future,
    i: int,
    address: str,
    attempt: int,
) -> Future:
    """Submit the stage's task ``i`` to the worker ``address`` chosen for it, under a key of this attempt."""
    return client.submit(
        _graph.compute_barrier_partition,
        stage,
        (name, i),
        layer.func,
        i,
        part,
        key=(f"{name}-attempt{attempt}", i),
        workers=[address],
        allow_other_workers=True,  # a lost worker's task may run elsewhere, to fail at its barrier
        pure=False,
    )


def _stage_failure(name: str, attempt: int, cause: str, error: BaseException | None) -> BarrierError:
    """The error an action raises when stage ``name`` failed on its last attempt, for ``cause``: the task's error."""
    return BarrierError(
        f"barrier stage {name} failed after {attempt} attempt{'s' * (attempt > 1)}: {cause}: "
        f"{type(error).__name__}: {error}"
    )


def _first_failure(futures: list[Future]) -> int | None:
    """Wait for the stage's tasks until one fails (its partition) or all have finished (``None``)."""
    index = {f.key: i for i, f in enumerate(futures)}
    for f in as_completed(futures):
        if f.status == "cancelled":
            raise CancelledError(f.key)
        if f.status == "error":
            return index[f.key]
    return None


def _stop(client: Client, futures: list[Future]) -> None:
    """Cancel the stage's tasks and interrupt those running (the waiting ones were released by the coordinator)."""
    if futures:
        client.cancel(futures, force=True)
        client.run(_interrupt, [f.key for f in futures])


def _begin(stage: str, workers: list[str], timeout: float, dask_scheduler: Scheduler) -> None:
    dask_scheduler.plugins[BarrierCoordinator.name].begin(stage, workers, timeout)


def _end(stage: str, reason: str, dask_scheduler: Scheduler) -> str | None:
    return dask_scheduler.plugins[BarrierCoordinator.name].end(stage, reason)


# -- the scheduler's side ------------------------------------------------------------------------
@dataclass
class _Epoch:
    """The tasks' n-th ``barrier()`` or ``allGather()`` call: who made which, with what message."""

    calls: dict[int, str] = field(default_factory=dict)
    messages: dict[int, str | None] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    answered: int = 0


@dataclass
class _Stage:
    workers: list[str]  # by partition
    timeout: float
    epochs: dict[int, _Epoch] = field(default_factory=dict)
    aborted: str | None = None
    lost: str | None = None  # why, when a worker running one of its tasks was lost

    def abort(self, reason: str) -> None:
        if self.aborted is None:
            self.aborted = reason
        for epoch in self.epochs.values():
            epoch.done.set()


def _error(reason: str) -> dict[str, Any]:
    return {"status": "error", "reason": reason}


class BarrierCoordinator(SchedulerPlugin):
    """Where the tasks of barrier stages meet: the scheduler's ``dlscale_barrier_sync`` handler answers a
    task's ``barrier()`` or ``allGather()`` once every task of its stage has made the same call, and releases
    them all with an error when the stage is aborted (a task failed, the action stopped, a worker was lost)."""

    name = "dlscale-barrier"

    def __init__(self) -> None:
        self.stages: dict[str, _Stage] = {}

    def start(self, scheduler: Scheduler) -> None:
        scheduler.handlers["dlscale_barrier_sync"] = self.sync

    def begin(self, stage: str, workers: list[str], timeout: float) -> None:
        self.stages[stage] = _Stage(list(workers), timeout)

    def end(self, stage: str, reason: str) -> str | None:
        """Forget ``stage``, releasing its waiting tasks with ``reason``; why a worker of it was lost, if one was."""
        state = self.stages.pop(stage, None)
        if state is None:
            return None
        state.abort(f"the barrier stage was aborted: {reason}")
        return state.lost

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        for state in self.stages.values():
            ranks = [i for i, address in enumerate(state.workers) if address == worker]
            if ranks and state.aborted is None:
                state.lost = f"worker {worker} running barrier task{'s' * (len(ranks) > 1)} {ranks} was lost"
                state.abort(state.lost)

    async def sync(self, stage: str, rank: int, epoch: int, call: str, message: str | None) -> dict[str, Any]:
        state = self.stages.get(stage)
        if state is None:
            return _error(f"barrier stage {stage} is over")
        if state.aborted is not None:
            return _error(state.aborted)
        current = state.epochs.setdefault(epoch, _Epoch())
        current.calls[rank], current.messages[rank] = call, message
        n = len(state.workers)
        if len(current.calls) == n:
            if len(set(current.calls.values())) > 1:
                state.abort(
                    f"different barrier sync types found for sync {epoch}: "
                    + ", ".join(f"task {r} called {c}()" for r, c in sorted(current.calls.items()))
                    + "; every task must make the same calls in the same order"
                )
            current.done.set()
        try:
            await asyncio.wait_for(current.done.wait(), state.timeout)
        except TimeoutError:
            missing = sorted(set(range(n)) - set(current.calls))
            state.abort(
                f"{call}() number {epoch} timed out after {state.timeout:g} s (dlscale.barrier.sync-timeout): "
                f"task{'s' * (len(missing) > 1)} {missing} did not make it"
            )
        if state.aborted is not None:
            return _error(state.aborted)
        current.answered += 1
        if current.answered == n:
            del state.epochs[epoch]
        return {"status": "OK", "messages": [current.messages[r] for r in range(n)]}


BARRIER = Extension(BarrierCoordinator.name, scheduler_plugin=BarrierCoordinator)
