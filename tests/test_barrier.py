"""Barrier execution mode: ``rdd.barrier().mapPartitions(f)`` runs a stage's tasks all at once, and they meet
with ``barrier()`` and ``allGather()``; compared with PySpark, and on real worker processes that fail, are
killed (SIGKILL) and are cancelled."""

from __future__ import annotations

import base64
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import dask
import numpy as np
import pytest

from dlscale import BarrierError, BarrierTaskContext, JobCancelledError, SparkContext


def gathered_sums(c: Any, barrier_context: Any) -> list:
    """A program as a PySpark user writes it: each task shares its partition's sum with the others."""

    def share(index: int, it: Any) -> list:
        ctx = barrier_context.get()
        ctx.barrier()
        sums = ctx.allGather(str(sum(it)))
        ctx.barrier()
        return [(index, ctx.partitionId(), sums, len(ctx.getTaskInfos()))]

    def then_gather(s: int) -> list:  # a narrow operation after the stage runs in its tasks (Spark pipelines it)
        return barrier_context.get().allGather(str(s))

    rdd = c.parallelize(range(20), 2)
    sums = rdd.barrier().mapPartitions(lambda it: [sum(it)])
    return [
        rdd.barrier().mapPartitionsWithIndex(share).collect(),
        sums.map(lambda s: s * 10).collect(),
        sums.filter(bool).map(then_gather).collect(),
        [rdd._is_barrier(), sums._is_barrier(), sums.map(str)._is_barrier(), sums.cache().map(str)._is_barrier()],
    ]


@pytest.mark.pyspark
def test_barrier_stage_as_pyspark(sc: SparkContext, spark: Any) -> None:
    from pyspark import BarrierTaskContext as SparkBarrierTaskContext

    expected = gathered_sums(spark, SparkBarrierTaskContext)
    assert gathered_sums(sc, BarrierTaskContext) == expected
    assert expected[0][0][2] == ["45", "145"]

    def outside(c: Any, barrier_context: Any) -> str:
        with pytest.raises(Exception) as raised:
            c.parallelize(range(4), 2).map(lambda x: barrier_context.get()).collect()
        return "It is not in a barrier stage." in str(raised.value)

    assert outside(sc, BarrierTaskContext) and outside(spark, SparkBarrierTaskContext)
    with pytest.raises(BarrierError, match="TypeError: Argument `message` must be of type `str`"):
        sc.parallelize([1], 1).barrier().mapPartitions(lambda it: BarrierTaskContext.get().allGather(1)).collect()


def test_task_infos_name_the_workers_the_tasks_run_on(sc: SparkContext) -> None:
    def where(it: Any) -> list:
        ctx = BarrierTaskContext.get()
        address = sc_address = ctx.getTaskInfos()[ctx.partitionId()].address
        return [(sc_address, address, os.getpid())]

    found = sc.parallelize(range(4), 2).barrier().mapPartitions(where).collect()
    pids = sc.client.run(os.getpid)  # by worker address
    by_pid = {pid: address.removeprefix("tcp://") for address, pid in pids.items()}
    assert sorted(address for address, _, _ in found) == sorted(by_pid.values())  # one task per worker thread
    assert all(by_pid[pid] == address for address, _, pid in found)


def test_more_tasks_than_slots_is_refused_at_once_before_computing_anything(sc: SparkContext, tmp_path: Path) -> None:
    def touch(x: int) -> int:
        (tmp_path / str(x)).touch()
        return x

    started = time.monotonic()
    with pytest.raises(BarrierError, match="needs 3 task slots at once, and the cluster has 2"):
        sc.parallelize(range(3), 3).map(touch).barrier().mapPartitions(lambda it: it).collect()
    assert time.monotonic() - started < 2
    assert list(tmp_path.iterdir()) == []


def test_an_all_reduce_written_on_all_gather(sc: SparkContext) -> None:
    rng = np.random.default_rng(0)
    data = [rng.standard_normal(1000) for _ in range(6)]

    def all_reduce(it: Any) -> list:
        local = np.sum(list(it), axis=0)
        ctx = BarrierTaskContext.get()
        parts = ctx.allGather(base64.b64encode(local.tobytes()).decode())
        total = np.sum([np.frombuffer(base64.b64decode(p)) for p in parts], axis=0)
        return [total]

    results = sc.parallelize(data, 2).barrier().mapPartitions(all_reduce).collect()
    assert len(results) == 2
    for r in results:
        np.testing.assert_allclose(r, np.sum(data, axis=0), rtol=1e-12)


def test_torch_distributed_started_from_a_barrier_stage(sc: SparkContext) -> None:
    def train(it: Any) -> list:
        import torch
        import torch.distributed as dist

        ctx = BarrierTaskContext.get()
        rank, infos = ctx.partitionId(), ctx.getTaskInfos()
        host = infos[0].address.rsplit(":", 1)[0]
        port = ""
        if rank == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = str(s.getsockname()[1])
        port = ctx.allGather(port)[0]
        group = f"tcp://{host}:{port}"
        dist.init_process_group("gloo", init_method=group, rank=rank, world_size=len(infos))
        try:
            t = torch.tensor([float(sum(it))])
            dist.all_reduce(t)
            return [t.item()]
        finally:
            dist.destroy_process_group()

    assert sc.parallelize(range(10), 2).barrier().mapPartitions(train).collect() == [45.0, 45.0]


def test_a_failed_task_fails_the_stage_and_releases_the_others(sc: SparkContext) -> None:
    def fails(index: int, it: Any) -> Any:
        ctx = BarrierTaskContext.get()
        if index == 1:
            raise ValueError("bad partition")
        ctx.barrier()  # released with an error when the stage is aborted
        return it

    started = time.monotonic()
    with pytest.raises(BarrierError, match=r"barrier task 1 \(partition 1\).*ValueError: bad partition") as raised:
        sc.parallelize(range(4), 2).barrier().mapPartitionsWithIndex(fails).collect()
    assert time.monotonic() - started < 10
    assert isinstance(raised.value.__cause__, ValueError)
    assert _open_stages(sc) == 0
    assert sc.parallelize(range(4), 2).barrier().mapPartitions(lambda it: [sum(it)]).collect() == [1, 5]


def _open_stages(c: SparkContext) -> int:
    return c.client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.plugins["dlscale-barrier"].stages))


def test_mismatched_calls_and_timeouts_fail_the_stage_naming_the_tasks(sc: SparkContext) -> None:
    def mixed(index: int, it: Any) -> Any:
        ctx = BarrierTaskContext.get()
        ctx.barrier() if index == 0 else ctx.allGather("x")
        return it

    with pytest.raises(BarrierError, match=r"task 0 called barrier\(\), task 1 called allGather\(\)"):
        sc.parallelize(range(4), 2).barrier().mapPartitionsWithIndex(mixed).collect()

    def one_late(index: int, it: Any) -> Any:
        ctx = BarrierTaskContext.get()
        if index == 0:
            ctx.barrier()
        else:
            time.sleep(3)
        return it

    with dask.config.set({"dlscale.barrier.sync-timeout": "1s"}):
        with pytest.raises(BarrierError, match=r"timed out after 1 s .*task \[1\] did not make it"):
            sc.parallelize(range(4), 2).barrier().mapPartitionsWithIndex(one_late).collect()


def test_cancelling_the_job_group_stops_a_barrier_stage(sc: SparkContext, tmp_path: Path) -> None:
    marker = tmp_path / "waiting"

    def waits(index: int, it: Any) -> Any:
        ctx = BarrierTaskContext.get()
        if index == 0:
            marker.touch()
            ctx.barrier()  # partition 1 never gets there
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return it

    outcome: dict[str, Any] = {}

    def action() -> None:
        sc.setJobGroup("barrier-doomed", "to cancel")
        try:
            sc.parallelize(range(4), 2).barrier().mapPartitionsWithIndex(waits).collect()
        except Exception as e:
            outcome["raised"], outcome["at"] = e, time.monotonic()
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)

    thread = threading.Thread(target=action)
    thread.start()
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    cancelled = time.monotonic()
    sc.cancelJobGroup("barrier-doomed")
    thread.join(30)
    assert isinstance(outcome["raised"], JobCancelledError)
    assert outcome["at"] - cancelled < 2
    assert _open_stages(sc) == 0
    assert sc.parallelize(range(4), 2).map(lambda x: x + 1).sum() == 10  # both worker threads free again


def test_a_killed_worker_runs_the_whole_stage_again(tmp_path: Path) -> None:
    with SparkContext("local[2]", "barrier-kill") as ctx:
        runs = ctx.accumulator(0)

        def stage(index: int, it: Any) -> list:
            barrier_context = BarrierTaskContext.get()
            (tmp_path / f"start-{index}-{uuid.uuid4().hex}").write_text(str(os.getpid()))
            runs.add(1)
            if index == 1 and not (tmp_path / "killed").exists():
                time.sleep(120)  # the test kills this task's worker meanwhile
            barrier_context.barrier()
            return [sum(it)]

        result: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: result.update(
                sums=ctx.parallelize(range(10), 2).barrier().mapPartitionsWithIndex(stage).collect()
            )
        )
        thread.start()
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("start-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        (victim,) = tmp_path.glob("start-1-*")
        (tmp_path / "killed").touch()
        os.kill(int(victim.read_text()), signal.SIGKILL)
        thread.join(120)
        assert result["sums"] == [10, 35]
        starts = [p.name.split("-")[1] for p in tmp_path.glob("start-*")]
        assert starts.count("0") >= 2 and starts.count("1") >= 2  # the whole stage ran again
        assert runs.value == 2  # what the tasks added counts once: for the attempt that succeeded
        assert _open_stages(ctx) == 0
