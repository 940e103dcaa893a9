"""dlscale on HPC batch systems through dask-jobqueue (``pip install "dlscale[hpc]"``).

:func:`slurm_cluster` builds a ``SLURMCluster`` whose jobs each run a fixed number of worker
processes, with a job's GPUs requested from SLURM (``--gres``) and shared out one resource per
worker (``--resources GPU=n``), so that trainers placed by resource land one per GPU. Hand it to
``SparkContext(cluster=...)`` and scale it with ``cluster.scale(jobs=...)``. For allocations where
``srun`` starts every process at once, dask-jobqueue's ``SLURMRunner`` is the alternative (see
``docs/running.md``).
"""

from __future__ import annotations

from typing import Any


def slurm_cluster(
    *, cores: int, memory: str, processes: int = 1, gpus: int = 0, walltime: str = "01:00:00", **kwargs: Any
) -> Any:
    """A ``dask_jobqueue.SLURMCluster`` of jobs with ``cores`` cores, ``memory`` and ``gpus`` GPUs
    each, running ``processes`` workers of ``cores // processes`` threads and ``gpus // processes``
    GPUs; other keyword arguments (``queue``, ``account``, ``job_extra_directives``, ...) go to
    ``SLURMCluster``. Its workers import torch and dlscale's training modules as they start
    (``--preload dlscale.runtime.warmup``), not during the first fit. No job is submitted until the
    cluster is scaled."""
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError as e:
        raise ImportError('slurm_cluster needs dask-jobqueue: pip install "dlscale[hpc]"') from e
    for name, value, minimum in (("cores", cores, 1), ("processes", processes, 1), ("gpus", gpus, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if cores % processes:
        raise ValueError(f"cores={cores} cannot be shared evenly by processes={processes}")
    if gpus % processes:
        raise ValueError(
            f"gpus={gpus} cannot be shared evenly by processes={processes}: give each worker "
            "the same number of GPUs (usually one worker per GPU)"
        )
    directives = list(kwargs.pop("job_extra_directives", []))
    worker_args = [*kwargs.pop("worker_extra_args", []), "--preload", "dlscale.runtime.warmup"]
    if gpus:
        directives.append(f"--gres=gpu:{gpus}")
        worker_args += ["--resources", f"GPU={gpus // processes}"]
    return SLURMCluster(
        cores=cores,
        processes=processes,
        memory=memory,
        walltime=walltime,
        job_extra_directives=directives,
        worker_extra_args=worker_args,
        **kwargs,
    )
