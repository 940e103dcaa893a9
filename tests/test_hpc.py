"""dask-jobqueue as far as it can be tested without SLURM: the job script that ``slurm_cluster``
writes, its worker command run locally as a SLURM job would run it, and ``SLURMRunner`` with the
environment ``srun`` would give each task."""

from __future__ import annotations

import functools
import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dlscale import SharedTrainingMaster, SparkContext, SparkNet
from dlscale.data import DataSet, load_digits
from dlscale.hpc import slurm_cluster
from dlscale.nn import Network

pytest.importorskip("dask_jobqueue")


def small_network() -> Network:
    torch.manual_seed(0)
    return Network(
        torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)),
        "cross_entropy",
        functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    )


def test_job_script_and_its_workers(tmp_path: Path) -> None:
    cluster = slurm_cluster(
        cores=2,
        memory="2GB",
        processes=2,
        gpus=2,
        walltime="00:30:00",
        queue="gpu",
        scheduler_options={"host": "127.0.0.1", "dashboard_address": None},
        log_directory=str(tmp_path),
    )
    try:
        script = cluster.job_script()
        for expected in (
            "#SBATCH --gres=gpu:2",
            "#SBATCH -p gpu",
            "#SBATCH -t 00:30:00",
            "--nworkers 2",
            "--nthreads 1",
            "--resources GPU=1",
            "--preload dlscale.runtime.warmup",
            cluster.scheduler_address,
        ):
            assert expected in script, expected
        # what SLURM would run on the allocated node: the script's worker command
        command = shlex.split(script.strip().splitlines()[-1].replace("dummy-name", "slurm-job-1"))
        worker = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            with SparkContext(cluster=cluster) as sc:
                sc.client.wait_for_workers(2, timeout=60)
                workers = sc.client.scheduler_info(n_workers=-1)["workers"].values()
                assert [w["resources"] for w in workers] == [{"GPU": 1.0}] * 2
                imported = sc.client.run(
                    lambda: sorted({"torch._dynamo", "dlscale.training._worker"} & set(sys.modules))
                )
                assert list(imported.values()) == [["dlscale.training._worker", "torch._dynamo"]] * 2  # the preload
                x, y = load_digits()
                network = small_network()
                spark_net = SparkNet(
                    sc, network, SharedTrainingMaster(16, rng_seed=0, export_directory=str(tmp_path / "e"))
                )
                rdd = sc.parallelize(DataSet(x.flatten(1)[:400], y[:400]).batch_by(20), 4)
                spark_net.fit(rdd, epochs=3)
                assert spark_net.evaluate(rdd).accuracy() > 0.3  # learned something (chance is 0.1)
            assert cluster.status.name == "running"  # the context leaves a cluster it was given alone
        finally:
            worker.terminate()
            worker.wait(30)
    finally:
        cluster.close()


def test_slurm_cluster_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="gpus=3 cannot be shared evenly by processes=2"):
        slurm_cluster(cores=2, memory="1GB", processes=2, gpus=3)
    with pytest.raises(ValueError, match="cores must be an integer >= 1"):
        slurm_cluster(cores=0, memory="1GB")


RUNNER_JOB = textwrap.dedent("""
    import json, sys
    import torch
    from dask_jobqueue.slurm import SLURMRunner
    from distributed import Client
    from dlscale import SparkContext
    from dlscale.data import DataSet

    if __name__ == "__main__":
        out, scheduler_file = sys.argv[1], sys.argv[2]
        with SLURMRunner(scheduler_file=scheduler_file, scheduler_options={"host": "127.0.0.1",
                         "dashboard_address": None}, worker_options={"nthreads": 1}) as runner:
            with Client(runner) as client:
                client.wait_for_workers(runner.n_workers)
                with SparkContext(client=client) as sc:
                    total = sc.parallelize(range(100), 4).map(lambda v: v * 2).sum()
                    workers = len(client.scheduler_info(n_workers=-1)["workers"])
                json.dump({"total": total, "workers": workers}, open(out, "w"))
""")


def test_slurm_runner_with_the_environment_srun_gives(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(RUNNER_JOB)
    out, scheduler_file = tmp_path / "out.json", tmp_path / "scheduler-{job_id}.json"
    tasks = []
    for rank in range(4):  # scheduler, driver, two workers
        env = {**os.environ, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "4", "SLURM_JOB_ID": "4242"}
        tasks.append(
            subprocess.Popen(
                [sys.executable, str(job), str(out), str(scheduler_file)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )
    deadline = time.monotonic() + 120
    try:
        tasks[1].wait(max(1, deadline - time.monotonic()))
    finally:
        for task in tasks:
            if task.poll() is None:
                task.terminate()
            task.wait(30)
    assert tasks[1].returncode == 0, tasks[1].stderr.read().decode()[-2000:]
    assert json.loads(out.read_text()) == {"total": 9900, "workers": 2}
