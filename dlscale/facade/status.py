"""``StatusTracker`` (PySpark's ``SparkContext.statusTracker()``): the jobs of a context and their progress.

dlscale runs every action as one job, and Dask runs the job's whole graph at once; the job's stages are
those Spark's DAG scheduler would cut from the lineage of the RDD the action computes, one per shuffle
and the result stage last (see :mod:`dlscale.facade._stages`), numbered across the application. The
driver keeps the records of the running jobs and of the last finished ones (see
:class:`~dlscale.facade.jobs.Jobs`). The task counts of a stage come from :class:`TaskCounts`, a plugin
on the scheduler that follows the state of every task of the context's jobs from the moment the graph
arrives, each counted in the stage it belongs to: a task that has finished counts as completed even once
Dask has forgotten it, as a shuffle's map tasks are forgotten while the job runs on.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any, NamedTuple

from dask._task_spec import Alias
from distributed import Client
from distributed.diagnostics.plugin import SchedulerPlugin

from dlscale.facade.taskcontext import ANNOTATION, STAGE

if TYPE_CHECKING:
    from dlscale.facade.context import SparkContext

__all__ = ["SparkJobInfo", "SparkStageInfo", "StatusTracker"]

logger = logging.getLogger("dlscale")


class SparkJobInfo(NamedTuple):
    """A job: its id, its stages' ids (the result stage last) and ``RUNNING``, ``SUCCEEDED`` or ``FAILED``."""

    jobId: int
    stageIds: list[int]
    status: str


class SparkStageInfo(NamedTuple):
    """A stage, PySpark's fields: ``numFailedTasks`` counts failed attempts, retried ones included."""

    stageId: int
    currentAttemptId: int
    name: str
    numTasks: int
    numActiveTasks: int
    numCompletedTasks: int
    numFailedTasks: int


_PENDING, _ACTIVE, _COMPLETED = "pending", "active", "completed"


class TaskCounts(SchedulerPlugin):
    """On the scheduler: per stage of the jobs of application ``application``, its tasks and how many are
    running, have finished, or failed an attempt. A task counts as failed when it errs, or when it leaves
    ``processing`` having used up one of its retries. The counts of the stages of all but the last
    ``retained`` jobs are dropped."""

    def __init__(self, application: str, retained: int) -> None:
        self.name = plugin_name(application)
        self._application = application
        self._retained = retained
        self._scheduler: Any = None
        self._jobs: dict[int, list[int]] = {}  # job id -> the ids of its stages that have tasks
        self._stages: dict[int, Counter[str]] = {}  # stage id -> tasks by state, and "failed" attempts
        self._tasks: dict[Any, list[Any]] = {}  # key -> [stage id, state, retries left], until forgotten

    async def start(self, scheduler: Any) -> None:
        self._scheduler = scheduler

    def update_graph(self, scheduler: Any, *, annotations: dict[str, dict[Any, Any]], **kwargs: Any) -> None:
        stages = annotations.get(STAGE, {})
        for key, job in annotations.get(ANNOTATION, {}).items():
            ts = scheduler.tasks[key]
            # an alias only names another task's result (what Dask leaves of a task fused into another); Spark's
            # tasks are the partitions' (tuple keys), not the driver-side steps of an action (a reduction's
            # final combine, a collect's gathering of a partition)
            if (
                job.get("app") != self._application
                or key in self._tasks
                or isinstance(ts.run_spec, Alias)
                or not isinstance(key, tuple)
            ):
                continue
            stage = stages.get(key, job.get("stage", job["id"]))
            counts = self._stages.get(stage)
            if counts is None:
                counts = self._stages[stage] = Counter()
                self._jobs.setdefault(job["id"], []).append(stage)
                while len(self._jobs) > self._retained:
                    for old in self._jobs.pop(next(iter(self._jobs))):
                        self._stages.pop(old, None)
            counts["tasks"] += 1
            counts[_PENDING] += 1
            self._tasks[key] = [stage, _PENDING, ts.retries]

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        task = self._tasks.get(key)
        if task is None:
            return
        stage, state, retries = task
        counts = self._stages.get(stage)
        if counts is None or finish == "forgotten":
            del self._tasks[key]
        if counts is None:
            return
        if finish == "processing":
            new = _ACTIVE
        elif finish == "memory":
            new = _COMPLETED
        elif start == "processing":
            new = _PENDING
            ts = self._scheduler.tasks.get(key)
            left = retries if ts is None else ts.retries
            if finish == "erred" or left < retries:
                counts["failed"] += 1
                task[2] = left
        else:
            return
        counts[state] -= 1
        counts[new] += 1
        task[1] = new

    def counts(self, stages: list[int]) -> dict[int, tuple[int, int, int, int]]:
        """``(tasks, active, completed, failed)`` of each of ``stages`` that this plugin knows."""
        known = {s: c for s in stages if (c := self._stages.get(s)) is not None}
        return {s: (c["tasks"], c[_ACTIVE], c[_COMPLETED], c["failed"]) for s, c in known.items()}


def plugin_name(application: str) -> str:
    """The name of ``application``'s :class:`TaskCounts` on the scheduler."""
    return f"dlscale-status-{application}"


def install(client: Client, application: str, retained: int) -> bool:
    """Register the :class:`TaskCounts` of ``application`` on the scheduler of ``client``; whether it could be
    (a scheduler without dlscale cannot load it: the tracker then has no stage information)."""
    try:
        client.register_plugin(TaskCounts(application, retained))
    except Exception as e:
        logger.warning(
            "the status tracker of %s has no task counts: %s: %s", client.scheduler.address, type(e).__name__, e
        )
        return False
    return True


def uninstall(client: Client, application: str) -> None:
    """Unregister ``application``'s :class:`TaskCounts`; a scheduler that is gone is warned about."""
    try:
        client.unregister_scheduler_plugin(plugin_name(application))
    except Exception as e:  # stopping goes on: the plugin went with its scheduler
        logger.warning("could not remove the status tracker's plugin: %s: %s", type(e).__name__, e)


def _counts(name: str, stages: list[int], dask_scheduler: Any = None) -> dict[int, tuple[int, int, int, int]]:
    plugin = dask_scheduler.plugins.get(name)
    return {} if plugin is None else plugin.counts(stages)


class StatusTracker:
    """PySpark's low-level status API over a context's jobs: the running ones and the last
    ``spark.ui.retainedJobs`` (1000) finished ones. As in Spark, what it says may change between calls."""

    def __init__(self, sc: SparkContext) -> None:
        self._sc = sc

    def getJobIdsForGroup(self, jobGroup: str | None = None) -> list[int]:
        """The known jobs of group ``jobGroup`` (running, failed or succeeded); with ``None``, those of no group."""
        return [r.id for r in self._sc._jobs.records() if r.group == jobGroup]

    def getJobIdsForTag(self, jobTag: str) -> list[int]:
        """The known jobs tagged ``jobTag`` (Scala Spark's ``SparkStatusTracker.getJobIdsForTag``)."""
        return [r.id for r in self._sc._jobs.records() if jobTag in r.tags]

    def getActiveStageIds(self) -> list[int]:
        """The ids of the running stages: the stages of running jobs that have tasks left to finish (Dask
        runs a job's stages together, so a stage can be active while one it reads from runs), and the last
        stage of a running job whose tasks the scheduler has not received yet."""
        running = [r for r in self._sc._jobs.records() if r.status == "RUNNING"]
        if not running:
            return []
        if not self._sc._task_counts:
            return sorted(r.stage_ids[-1] for r in running)
        stages = [s for r in running for s in r.stage_ids]
        counts = self._sc.client.run_on_scheduler(_counts, plugin_name(self._sc.applicationId), stages)
        active = {s for s, (tasks, _, completed, _) in counts.items() if completed < tasks}
        active.update(r.stage_ids[-1] for r in running if not any(s in counts for s in r.stage_ids))
        return sorted(active)

    def getActiveJobsIds(self) -> list[int]:
        """The ids of the running jobs, in order."""
        return sorted(r.id for r in self._sc._jobs.records() if r.status == "RUNNING")

    def getJobInfo(self, jobId: int) -> SparkJobInfo | None:
        """Job ``jobId`` with its stages' ids, or ``None`` if it is unknown or was forgotten."""
        record = self._sc._jobs.record(jobId)
        return None if record is None else SparkJobInfo(jobId, list(record.stage_ids), record.status)

    def getStageInfo(self, stageId: int) -> SparkStageInfo | None:
        """Stage ``stageId`` with its task counts, asked of the scheduler; ``None`` if its job is unknown or
        was forgotten, or the scheduler keeps no counts. A stage none of whose tasks ran (its RDDs were
        persisted) has no tasks."""
        record = self._sc._jobs.stage_record(stageId)
        if record is None or not self._sc._task_counts:
            return None
        counts = self._sc.client.run_on_scheduler(_counts, plugin_name(self._sc.applicationId), [stageId])
        tasks, active, completed, failed = counts.get(stageId, (0, 0, 0, 0))
        name = record.stage_names[record.stage_ids.index(stageId)]
        return SparkStageInfo(stageId, 0, name, tasks, active, completed, failed)
