"""PySpark's TorchDistributor as a baseline: the DDP training of ``benchmarks._ddp`` launched by Spark.

``torch_distributor_samples_per_s`` runs ``benchmarks._ddp.train_rank`` (DDP over gloo on 127.0.0.1)
through ``pyspark.ml.torch.distributor.TorchDistributor`` in local mode: what a Spark user would run
instead of dlscale. In local mode TorchDistributor uses the SparkSession only for its configuration: it
cloudpickles the function and its arguments to a file and runs ``torchrun --standalone`` with
``world_size`` processes on the driver's machine, giving each RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT. So the training, and its timing by the ranks, is that of ``benchmarks._ddp``, and
``launcher_seconds`` (the whole ``TorchDistributor.run``) shows the cost of launching it this way.

To run it over a rate-limited link, run the command line inside a namespace of ``benchmarks._links``::

    python -m benchmarks._torch_distributor --world-size 2 --epochs 1 --train 3840

prints one JSON line (the result without the state dict); the options are those of ``benchmarks._ddp``
but ``--port``, and torchrun's output goes to stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pyspark.ml.torch.distributor import TorchDistributor
from pyspark.sql import SparkSession

from benchmarks import _ddp

ROOT = Path(__file__).resolve().parent.parent


def _rank(tmp: str, *args: Any) -> None:
    """``train_rank`` in a torchrun process, whose environment says its rank and the world size.

    Returns nothing: in local mode every process, not only rank 0, pickles its return value to the same
    file, so rank 0's result goes through ``tmp`` as with ``benchmarks._ddp``.
    """
    # torchrun announces its store at the fully qualified host name; it listens on every address.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    _ddp.train_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), tmp, *args)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """The environment variables ``values`` set during the block, restored after it."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def torch_distributor_samples_per_s(
    world_size: int,
    make_module: _ddp.ModuleFactory,
    x: torch.Tensor,
    y: torch.Tensor,
    batch: int,
    epochs: int,
    optimizer_factory: _ddp.OptimizerFactory,
    threads_per_process: int = 1,
    **options: Any,
) -> dict[str, Any]:
    """Train as ``benchmarks._ddp.ddp_samples_per_s`` does (``options`` are the keywords of
    ``benchmarks._ddp.train_with``), launched by TorchDistributor in local mode on a local
    SparkSession (started and stopped here).

    Returns what ``ddp_samples_per_s`` returns, with ``launcher`` (``"TorchDistributor"``) and
    ``launcher_seconds`` (wall time of ``TorchDistributor.run``: torchrun, process start-up, imports,
    warm-up, training and evaluation).
    """

    def launch(tmp: str, args: tuple[Any, ...]) -> dict[str, Any]:
        spark = (
            SparkSession.builder.master("local[1]")
            .appName("dlscale-torch-distributor")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .getOrCreate()
        )
        try:
            spark.sparkContext.setLogLevel("ERROR")
            distributor = TorchDistributor(num_processes=world_size, local_mode=True, use_gpu=False)
            # TorchDistributor copies torchrun's output to stdout; stdout is for the result.
            with contextlib.redirect_stdout(sys.stderr):
                start = time.perf_counter()
                distributor.run(_rank, tmp, *args)
                seconds = time.perf_counter() - start
        finally:
            spark.stop()
        return {"launcher": "TorchDistributor", "launcher_seconds": seconds}

    # PYTHONPATH: torchrun's processes run a script in a temporary directory, yet must import the modules
    # that the pickled function and arguments refer to. SPARK_LOCAL_IP: the JVM binds to 127.0.0.1 only.
    pythonpath = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    with _environ(PYTHONPATH=pythonpath, SPARK_LOCAL_IP="127.0.0.1"):
        return _ddp.train_with(
            launch, world_size, make_module, x, y, batch, epochs, optimizer_factory, threads_per_process, **options
        )


def main(argv: list[str] | None = None) -> None:
    parser = _ddp.command_line("TorchDistributor (local mode, DDP over gloo) samples/s; prints one JSON line.")
    _ddp.run_command_line(torch_distributor_samples_per_s, parser.parse_args(argv))


if __name__ == "__main__":
    main()
