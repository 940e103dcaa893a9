"""``TaskContext`` and ``BarrierTaskContext`` (PySpark's ``pyspark.TaskContext``): what a task knows about
itself, and how the tasks of a barrier stage meet.

A task's code runs with a context for the partition it computes; ``TaskContext.get()`` returns it in a
function given to an RDD operation and ``None`` elsewhere (on the driver). The job's local properties
travel to the workers as an annotation of the job's tasks; the attempt number is asked of the scheduler
when first read (the times the task ran before: its worker died, or it raised and was retried). A barrier
stage's tasks get a :class:`BarrierTaskContext`, whose ``barrier()`` and ``allGather()`` meet the stage's
other tasks at the scheduler (:mod:`dlscale.facade.barrier`).
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any

from distributed import get_worker
from distributed.utils import sync

from dlscale.errors import BarrierError
from dlscale.runtime.tasks import this_worker

__all__ = ["BarrierTaskContext", "BarrierTaskInfo", "ResourceInformation", "TaskContext"]

# {"id": job id, "app": the context's applicationId, "properties": the local properties of the job's thread,
#  "cpus": spark.task.cpus, "stage": the result stage's id}, see dlscale.facade.jobs
ANNOTATION = "dlscale_job"
# the id of the stage a task belongs to, where the job has stages before its result stage (see jobs)
STAGE = "dlscale_stage"
# The worker resource that stands for its CPUs where the context limits tasks by spark.task.cpus: a worker of
# an embedded cluster offers its threads, and each task asks for spark.task.cpus of them
TASK_CPUS = "dlscale-task-cpus"

_local = threading.local()  # .context: the TaskContext of the partition this thread computes


class ResourceInformation:
    """A resource of a task's worker (PySpark's ``ResourceInformation``): a Dask worker resource of
    quantity n has the addresses ``"0"`` to ``"n-1"``."""

    def __init__(self, name: str, addresses: list[str]) -> None:
        self._name = name
        self._addresses = addresses

    @property
    def name(self) -> str:
        return self._name

    @property
    def addresses(self) -> list[str]:
        return self._addresses

    def __repr__(self) -> str:
        return f"ResourceInformation(name={self._name!r}, addresses={self._addresses!r})"


def _partition_of(key: Any) -> int:
    return key[-1] if isinstance(key, tuple) and key and isinstance(key[-1], int) else 0


def _annotations_of(dask_key: Any) -> dict[str, Any]:
    try:
        ts = get_worker().state.tasks[dask_key]
    except (ValueError, KeyError):
        return {}
    return ts.annotations or {}


class TaskContext:
    """The context of the running task: ``TaskContext.get()`` in a task, ``None`` on the driver.
    ``TaskContext()`` is, as in PySpark, the running task's context too (and an empty one on the driver)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> TaskContext:
        current = TaskContext.get()
        if not args and not kwargs and isinstance(current, cls):
            return current
        return super().__new__(cls)

    def __init__(self, key: Any = None, dask_key: Any = None) -> None:
        if key is None and dask_key is None and hasattr(self, "_partition"):
            return  # TaskContext() in a task: the running task's context, as it is
        self._partition = _partition_of(key)
        self._dask_key = dask_key
        self._attempt_id: int | None = None
        self._attempt: int | None = None

    @property
    def _job(self) -> dict[str, Any]:
        return _annotations_of(self._dask_key).get(ANNOTATION, {})

    @classmethod
    def get(cls) -> TaskContext | None:
        """The running task's context, or ``None`` outside a task."""
        return getattr(_local, "context", None)

    def partitionId(self) -> int:
        """The index of the partition this task computes."""
        return self._partition

    def stageId(self) -> int:
        """The id of the stage this task belongs to, as Spark cuts the job's lineage at its shuffles: the
        shuffle map stage of the shuffle it computes the input of, else the job's result stage."""
        annotations = _annotations_of(self._dask_key)
        stage = annotations.get(STAGE)
        return stage if stage is not None else annotations.get(ANNOTATION, {}).get("stage", 0)

    def attemptNumber(self) -> int:
        """0 for the task's first attempt, then 1, 2, ... for each time it ran again: because its worker died,
        or because it raised and its master allows more attempts (``local[N, F]``)."""
        if self._attempt is None:
            self._attempt = get_worker().client.run_on_scheduler(_attempts_before, self._dask_key)
        return self._attempt

    def taskAttemptId(self) -> int:
        """An id of this attempt, unique within the application (not sequential, as Spark's are)."""
        if self._attempt_id is None:
            self._attempt_id = uuid.uuid4().int >> 65
        return self._attempt_id

    def getLocalProperty(self, key: str) -> str | None:
        """The local property ``key`` of the thread that started the job, or ``None``."""
        return self._job.get("properties", {}).get(key)

    def cpus(self) -> int:
        """The CPUs given to this task: ``spark.task.cpus`` of the context that started the job (1 unless
        set)."""
        cpus = self._job.get("cpus")
        if cpus is None:  # outside a job (an RDD being persisted): what the task asked of its worker, if anything
            try:
                ts = get_worker().state.tasks[self._dask_key]
            except (ValueError, KeyError):
                return 1
            cpus = (ts.resource_restrictions or {}).get(TASK_CPUS, 1)
        return int(cpus)

    def resources(self) -> dict[str, ResourceInformation]:
        """The resources of this task's worker (Dask worker resources), by name."""
        total = get_worker().state.total_resources
        return {
            name: ResourceInformation(name, [str(i) for i in range(int(n))])
            for name, n in total.items()
            if name != TASK_CPUS
        }


def _attempts_before(key: Any, dask_scheduler: Any = None) -> int:
    """The times task ``key`` ran before: those its worker died (Dask's ``suspicious``) and the retries it
    used up (its ``retries`` annotation counts down in ``ts.retries``)."""
    ts = dask_scheduler.tasks.get(key)
    if ts is None:
        return 0
    return ts.suspicious + (ts.annotations or {}).get("retries", 0) - ts.retries


@dataclass(frozen=True)
class BarrierStage:
    """One attempt of a barrier stage, as its tasks know it: its id at the scheduler's coordinator, and the
    addresses (``host:port``) of the workers its tasks run on, by partition."""

    id: str
    addresses: tuple[str, ...]


class BarrierTaskInfo:
    """Where one task of a barrier stage runs (PySpark's ``BarrierTaskInfo``): its worker's ``host:port``."""

    def __init__(self, address: str) -> None:
        self.address = address

    def __repr__(self) -> str:
        return f"BarrierTaskInfo(address={self.address!r})"


class BarrierTaskContext(TaskContext):
    """The context of a task in a barrier stage (``rdd.barrier().mapPartitions(f)``): all the stage's tasks
    run at once, and ``barrier()`` and ``allGather()`` wait until every one of them has made the same call.
    Every task must make the same calls in the same order, or the stage waits until
    ``dlscale.barrier.sync-timeout`` and fails."""

    def __init__(self, key: Any, dask_key: Any, stage: BarrierStage) -> None:
        super().__init__(key, dask_key)
        self._stage = stage
        self._calls = 0

    @classmethod
    def get(cls) -> BarrierTaskContext:
        """The running barrier task's context; raises outside a barrier stage (as PySpark)."""
        context = TaskContext.get()
        if not isinstance(context, BarrierTaskContext):
            raise BarrierError("It is not in a barrier stage.")
        return context

    def barrier(self) -> None:
        """Wait until every task of the stage has called ``barrier()`` as often as this one."""
        self._sync("barrier", None)

    def allGather(self, message: str = "") -> list[str]:
        """Wait until every task of the stage has called ``allGather``; the messages of all, by partition."""
        if not isinstance(message, str):
            raise TypeError("Argument `message` must be of type `str`")
        return self._sync("allGather", message)

    def getTaskInfos(self) -> list[BarrierTaskInfo]:
        """Where each task of the stage runs, by partition."""
        return [BarrierTaskInfo(a) for a in self._stage.addresses]

    def _sync(self, call: str, message: str | None) -> list:
        worker = get_worker()
        self._calls += 1
        reply = sync(
            worker.loop,
            worker.scheduler.dlscale_barrier_sync,
            stage=self._stage.id,
            rank=self._partition,
            epoch=self._calls,
            call=call,
            message=message,
        )
        if reply["status"] != "OK":
            raise BarrierError(reply["reason"])
        return list(reply["messages"])


class running:  # noqa: N801 - used as a context manager
    """Gives the calling thread the :class:`TaskContext` of partition ``key`` until the block ends (a
    :class:`BarrierTaskContext` in a barrier ``stage``)."""

    def __init__(self, key: Any, stage: BarrierStage | None = None) -> None:
        self.key = key
        self.stage = stage

    def __enter__(self) -> None:
        self.outer = getattr(_local, "context", None)
        worker = this_worker()  # None: a task run by Dask's local scheduler
        dask_key = None if worker is None else worker.get_current_task()
        if self.stage is None:
            _local.context = TaskContext(self.key, dask_key)
        else:
            _local.context = BarrierTaskContext(self.key, dask_key, self.stage)

    def __exit__(self, *exc: object) -> None:
        _local.context = self.outer
