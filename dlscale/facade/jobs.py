"""Job control (PySpark's job groups, descriptions, local properties and job tags).

Every action runs as one job: its graph is submitted, and the thread that started it waits for the
results. Local properties (the job group, the description, the tags, anything set with
``setLocalProperty``) belong to the thread that sets them, as in PySpark: a thread starts with none,
unless it is an ``InheritableThread`` or runs a target wrapped by ``inheritable_thread_target`` (see
:mod:`dlscale.facade.threads`), and the job takes those of its thread. Cancelling a job
(``cancelJobGroup``, ``cancelJobsWithTag``, ``cancelAllJobs``, from any thread) cancels its futures, so
that its waiting tasks never start and the thread waiting for it raises
:class:`~dlscale.errors.JobCancelledError`, and interrupts its running tasks: each worker raises an
exception in the threads running the job's tasks, which stops them at their next Python instruction (a
call that blocks in native code, such as a sleep or a read, returns first).

The jobs keep a record for :class:`~dlscale.facade.status.StatusTracker`: every running job and the last
``retained`` finished ones (Spark's ``spark.ui.retainedJobs``), with their group, tags, stages (as Spark's
DAG scheduler cuts the lineage of the RDD an action computes, see :mod:`dlscale.facade._stages`) and
final status. Stage ids are numbered across the application, as Spark numbers them.

A job's tasks carry, as Dask annotations, the job's id, its thread's local properties, its result stage's
id and ``spark.task.cpus``, and, in a job with stages before its result stage, the stage of each task;
where the context limits how many tasks a worker runs at once by their CPUs (an embedded cluster), each
task also asks for that many of the worker's ``TASK_CPUS`` resource.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Any

import dask
import distributed
from dask._task_spec import Alias

from dlscale.errors import JobCancelledError
from dlscale.facade import _stages
from dlscale.facade.taskcontext import ANNOTATION, STAGE, TASK_CPUS
from dlscale.runtime.cluster import watching_pauses

__all__ = ["JobRecord", "Jobs", "call_site", "interruptible"]

JOB_GROUP = "spark.jobGroup.id"
JOB_DESCRIPTION = "spark.job.description"
INTERRUPT_ON_CANCEL = "spark.job.interruptOnCancel"
JOB_TAGS = "spark.job.tags"


class _TaskKilled(Exception):  # noqa: N818 - Spark's name, raised only inside a cancelled task
    """Raised in a worker thread running a task of a cancelled job."""


# worker side: the threads now running dlscale's task code, which an interrupt may stop
_interruptible: dict[int, int] = {}
_interruptible_lock = threading.Lock()


class interruptible:  # noqa: N801 - used as a context manager
    """Marks the calling worker thread as running a task's code until the block ends."""

    def __enter__(self) -> None:
        ident = threading.get_ident()
        with _interruptible_lock:
            _interruptible[ident] = _interruptible.get(ident, 0) + 1

    def __exit__(self, *exc: object) -> None:
        ident = threading.get_ident()
        with _interruptible_lock:
            if _interruptible[ident] == 1:
                del _interruptible[ident]
            else:
                _interruptible[ident] -= 1


def _interrupt(keys: list[Any], dask_worker: Any = None) -> int:
    """On a worker: raise :class:`_TaskKilled` in the threads running tasks ``keys``; how many there were."""
    wanted = set(keys)
    n = 0
    with _interruptible_lock:
        for ident, key in list(dask_worker.active_threads.items()):
            if key in wanted and ident in _interruptible:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(_TaskKilled))
                n += 1
    return n


@dataclass
class _Job:
    id: int
    properties: dict[str, str]
    futures: list[distributed.Future]
    keys: list[Any]
    stage_ids: list[int]
    stage_of: dict[Any, int]  # the stage of each task not in the result stage
    cancelled: str | None = None  # why, once cancelled
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def tags(self) -> set[str]:
        return _tags(self.properties)


@dataclass
class JobRecord:
    """What the status tracker knows of a job: its group, tags and name (its action and where the program
    called it, as Spark names a stage), its stages' ids and names (the result stage last, named as the job),
    and ``RUNNING``, ``SUCCEEDED`` or ``FAILED``."""

    id: int
    group: str | None
    tags: set[str]
    name: str
    stage_ids: list[int]
    stage_names: list[str]
    status: str = "RUNNING"


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def call_site() -> str:
    """Spark's name for a stage: the operation the program called and where (``collect at job.py:12``),
    the outermost dlscale function on the stack and the first frame outside dlscale."""
    frame = sys._getframe(1)
    action = "run"
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        action = frame.f_code.co_name
        frame = frame.f_back
    return action if frame is None else f"{action} at {frame.f_code.co_filename}:{frame.f_lineno}"


def _tasks_stages(graphs: list, layers: dict[str, int]) -> dict[Any, int]:
    """The stage of each task of ``graphs`` that computes one of the graph ``layers`` (layer name -> stage id):
    a task of the layer's own, or one that Dask fused from several layers, found through the alias that the
    last layer's key leaves behind."""
    if not layers:
        return {}
    stage_of: dict[Any, int] = {}
    fused: list[tuple[Any, int]] = []
    for graph in graphs:
        for key, node in graph.items():
            if isinstance(key, tuple) and key and (stage := layers.get(key[0])) is not None:
                stage_of[key] = stage
                if isinstance(node, Alias):
                    fused.append((node.target, stage))
    for key, stage in fused:
        stage_of.setdefault(key, stage)
    return stage_of


def _tags(properties: dict[str, str]) -> set[str]:
    value = properties.get(JOB_TAGS)
    return set(value.split(",")) if value else set()


def _check_tag(tag: str) -> None:
    if tag is None:
        raise ValueError("Spark job tag cannot be null.")
    if not isinstance(tag, str):
        raise TypeError(f"a job tag must be a str, got {type(tag).__name__}")
    if "," in tag:
        raise ValueError(f"Spark job tag cannot contain ','; got {tag!r}")
    if not tag:
        raise ValueError("Spark job tag cannot be an empty string.")


class Jobs:
    """The jobs of application ``application``: the threads' local properties, the jobs now running and the
    records of the last ``retained`` finished ones. A task that raises runs again, up to ``retries`` times.
    Tasks are told they have ``cpus`` CPUs (``spark.task.cpus``); with ``limit_cpus``, each asks for that many
    of its worker's ``TASK_CPUS`` resource, so that a worker offering its threads runs ``threads // cpus``
    tasks at once."""

    def __init__(
        self, application: str, *, retries: int = 0, retained: int = 1000, cpus: int = 1, limit_cpus: bool = False
    ) -> None:
        self._application = application
        self._retries = retries
        self._retained = retained
        self._cpus = cpus
        self._limit_cpus = limit_cpus
        self._local = threading.local()
        self._ids = itertools.count()
        self._stage_ids = itertools.count()
        self._running: dict[int, _Job] = {}
        self._records: dict[int, JobRecord] = {}  # running and retained finished jobs, by id
        self._stage_jobs: dict[int, int] = {}  # the stages of those jobs: stage id -> job id
        self._finished: deque[int] = deque()  # the retained finished jobs, oldest first
        self._lock = threading.Lock()

    # -- local properties -----------------------------------------------------------------
    def properties(self) -> dict[str, str]:
        """This thread's local properties (the dict itself)."""
        props = getattr(self._local, "properties", None)
        if props is None:
            props = self._local.properties = {}
        return props

    def set_properties(self, props: dict[str, str]) -> None:
        """Make ``props`` (the dict itself) this thread's local properties, as Spark's ``setLocalProperties``."""
        self._local.properties = props

    def set_property(self, key: str, value: str | None) -> None:
        if not isinstance(key, str):
            raise TypeError(f"a local property's key must be a str, got {type(key).__name__}")
        if value is None:
            self.properties().pop(key, None)
        else:
            self.properties()[key] = str(value)

    def tags(self) -> set[str]:
        return _tags(self.properties())

    def set_tags(self, tags: set[str]) -> None:
        self.set_property(JOB_TAGS, ",".join(sorted(tags)) if tags else None)

    def add_tag(self, tag: str) -> None:
        _check_tag(tag)
        self.set_tags(self.tags() | {tag})

    def remove_tag(self, tag: str) -> None:
        _check_tag(tag)
        self.set_tags(self.tags() - {tag})

    # -- running and cancelling -----------------------------------------------------------
    @contextlib.contextmanager
    def _job(self, collection: Any, site: str, rdd: Any = None) -> Iterator[_Job]:
        """A job for ``collection`` (a Dask collection or a list of them) started at ``site``, computing ``rdd``
        (whose lineage gives the job's stages; one stage without it), registered while the block runs so that
        it may be cancelled; a cancelled job's ``CancelledError`` is raised as ``JobCancelledError``."""
        parts = collection if isinstance(collection, list) else [collection]
        # the partitions of a bag share one graph: each graph once
        graphs = list({id(g): g for g in (c.__dask_graph__() for c in parts)}.values())
        keys = list({k for g in graphs for k in g})
        plan = _stages.plan(rdd, site)
        with self._lock:
            job_id = next(self._ids)
            stage_ids = [next(self._stage_ids) for _ in plan.names]
            stage_of = _tasks_stages(graphs, {layer: stage_ids[s] for layer, s in plan.layers.items()})
            job = _Job(job_id, dict(self.properties()), [], keys, stage_ids, stage_of)
            self._running[job.id] = job
            group = job.properties.get(JOB_GROUP)
            self._records[job.id] = JobRecord(job.id, group, job.tags, site, stage_ids, plan.names)
            self._stage_jobs.update(dict.fromkeys(stage_ids, job.id))
        succeeded = False
        try:
            yield job
            succeeded = True
        except CancelledError:
            if job.cancelled is None:
                raise
            raise JobCancelledError(f"Job {job.id} cancelled {job.cancelled}") from None
        finally:
            with self._lock:
                self._running.pop(job.id, None)
            self._finish(job.id, succeeded)

    def _finish(self, job_id: int, succeeded: bool) -> None:
        """Record the end of job ``job_id``, forgetting the oldest finished job beyond ``retained``."""
        with self._lock:
            self._records[job_id].status = "SUCCEEDED" if succeeded else "FAILED"
            self._finished.append(job_id)
            while len(self._finished) > self._retained:
                for stage_id in self._records.pop(self._finished.popleft()).stage_ids:
                    del self._stage_jobs[stage_id]

    def records(self) -> list[JobRecord]:
        """The records of the running jobs and the retained finished ones, oldest first."""
        with self._lock:
            return list(self._records.values())

    def record(self, job_id: int) -> JobRecord | None:
        """Job ``job_id``'s record, ``None`` if it is unknown or forgotten."""
        with self._lock:
            return self._records.get(job_id)

    def stage_record(self, stage_id: int) -> JobRecord | None:
        """The record of the job that stage ``stage_id`` belongs to, ``None`` if it is unknown or forgotten."""
        with self._lock:
            job_id = self._stage_jobs.get(stage_id)
            return None if job_id is None else self._records[job_id]

    @staticmethod
    def _track(client: distributed.Client, job: _Job, futures: list[distributed.Future]) -> None:
        """Count ``futures`` among the job's; cancel them at once if the job was cancelled meanwhile."""
        with job.lock:
            job.futures.extend(futures)
            job.keys.extend(f.key for f in futures)
            cancelled = job.cancelled is not None
        if cancelled:
            client.cancel(futures, force=True)

    def _annotation(self, job: _Job) -> Any:
        info = {
            "id": job.id,
            "app": self._application,
            "properties": job.properties,
            "cpus": self._cpus,
            "stage": job.stage_ids[-1],  # the result stage's
        }
        annotations = {ANNOTATION: info, **self._resources()}
        if job.stage_of:  # each task's stage, an int (Dask calls this for every task of what the job computes)
            stage_of, result = job.stage_of, job.stage_ids[-1]
            annotations[STAGE] = lambda key: stage_of.get(key, result)
        return dask.annotate(**annotations)

    def _resources(self) -> dict[str, Any]:
        return {"resources": {TASK_CPUS: self._cpus}} if self._limit_cpus else {}

    def task_resources(self) -> Any:
        """Around work that the context computes outside a job (persisting an RDD, ``toLocalIterator``): its
        tasks ask for ``spark.task.cpus`` of their worker's CPUs, as a job's do."""
        return dask.annotate(**self._resources()) if self._limit_cpus else contextlib.nullcontext()

    def _submit(self, client: distributed.Client, job: _Job, collection: Any) -> Any:
        """Start computing ``collection`` as ``job``; its future (or list of futures)."""
        with self._annotation(job):
            futures = client.compute(collection, retries=self._retries)
        self._track(client, job, futures if isinstance(futures, list) else [futures])
        return futures

    def run(
        self,
        client: distributed.Client,
        collection: Any,
        prepare: Callable[[Any, Callable[[list[distributed.Future]], None]], Any] | None = None,
        rdd: Any = None,
    ) -> Any:
        """Compute ``collection`` (a Dask collection or a list of them) as a job that may be cancelled, the job
        of an action on ``rdd`` when given (its stages are those of the RDD's lineage).
        ``prepare(collection, track)``, within the job, returns what to compute, handing ``track`` the futures
        of what it computes first (a barrier stage), so that cancelling the job cancels them too."""
        with self._job(collection, call_site(), rdd) as job:
            if prepare is not None:
                with self._annotation(job):
                    collection = prepare(collection, lambda futures: self._track(client, job, futures))
            futures = self._submit(client, job, collection)
            with watching_pauses(client, f"job {job.id}"):
                return client.gather(futures)

    def run_within(
        self, client: distributed.Client, collections: list, timeout: float, rdd: Any = None
    ) -> dict[int, Any]:
        """Compute ``collections`` as one job (of an action on ``rdd``) for at most ``timeout`` seconds
        (approximate actions): the results of those finished by then, by index. The others are cancelled and
        their running tasks interrupted, so nothing of the job runs on; a task's error is raised at once, as
        Spark fails the job."""
        with self._job(collections, call_site(), rdd) as job:
            futures = self._submit(client, job, collections)
            try:
                with contextlib.suppress(TimeoutError), watching_pauses(client, f"job {job.id}"):
                    for future in distributed.as_completed(futures, timeout=max(timeout, 0.0)):
                        if future.status != "finished":
                            future.result()  # the task's error, or CancelledError when the job was cancelled
                done = {i: f for i, f in enumerate(futures) if f.status == "finished"}
                return dict(zip(done, client.gather(list(done.values()))))
            finally:
                unfinished = [f for f in futures if f.status != "finished"]
                if unfinished and job.cancelled is None:
                    client.cancel(unfinished, force=True)
                    client.run(_interrupt, job.keys)

    def cancel(self, client: distributed.Client, which: Callable[[_Job], bool], reason: str) -> None:
        """Cancel the running jobs for which ``which`` holds: their futures, then their running tasks."""
        with self._lock:
            jobs = [j for j in self._running.values() if which(j)]
        keys: list[Any] = []
        for job in jobs:
            with job.lock:
                if job.cancelled is not None:
                    continue
                job.cancelled = reason
                futures = list(job.futures)
                keys.extend(job.keys)
            if futures:
                client.cancel(futures, force=True)
        if keys:
            client.run(_interrupt, keys)

    def cancel_group(self, client: distributed.Client, group: str) -> None:
        self.cancel(client, lambda j: j.properties.get(JOB_GROUP) == group, f"part of cancelled job group {group}")

    def cancel_tag(self, client: distributed.Client, tag: str) -> None:
        _check_tag(tag)
        self.cancel(client, lambda j: tag in j.tags, f"part of cancelled job tags {tag}")

    def cancel_all(self, client: distributed.Client) -> None:
        self.cancel(client, lambda j: True, "as part of cancellation of all jobs")
