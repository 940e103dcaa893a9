"""What Dask's sampling profiler costs a training step: a parameter-averaging fit with the workers'
profiler sampling the trainers and with it paused (dlscale's default).

Run from the repository root with ``python -m benchmarks.profiler`` (about 5 minutes). Every
``distributed.worker.profile.interval`` (10 ms) a worker's event loop samples the stack of each
thread running a task; dlscale pauses that while a trainer runs (``dlscale.runtime.profiling``)
unless ``dlscale.worker.profile-training`` is true. Each run starts ``SparkContext("local[2]")`` with
the setting, fits compare's MLP (``benchmarks._common``: 784-2048-2048-10, minibatches of 64, SGD lr
0.01 momentum 0.9) once to warm up, then times one ``fit_paths`` of an epoch with
``ParameterAveragingTrainingMaster(64, averaging_frequency=50, streaming=True)``; the two settings
alternate ``ROUNDS`` times so that a slow spell of the machine falls on both. Figures: each run's
fit time and its trainers' time a step (fitting, not taking averages), and the medians of each
setting. Results go to ``benchmarks/results/profiler.json``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import dask

from benchmarks._common import (
    BATCH,
    SGD,
    command_line,
    export_paths,
    header,
    make_data,
    mlp,
    parse,
    shrink,
    write_results,
)

RESULTS = Path(__file__).resolve().parent / "results" / "profiler.json"
ROUNDS = 3
FREQUENCY = 50
RUN_HELP = {
    "sampling": "dlscale.worker.profile-training true: Dask's profiler samples the trainers every 10 ms",
    "paused": "dlscale's default: the workers' profiler paused while a trainer runs",
}
"""A line on each setting, for ``--help``."""


def fit(sampling: bool, data: tuple[Any, ...]) -> dict[str, float]:
    """One timed fit on a fresh two-worker context whose workers sample the trainers or not."""
    from dlscale import ParameterAveragingTrainingMaster, SparkContext, SparkNet
    from dlscale.nn import Network

    x, y, _, _ = data

    def master() -> ParameterAveragingTrainingMaster:
        return ParameterAveragingTrainingMaster(
            BATCH, averaging_frequency=FREQUENCY, streaming=True, rng_seed=0, collect_training_stats=True
        )

    with (
        dask.config.set({"dlscale.worker.profile-training": sampling}),
        tempfile.TemporaryDirectory() as tmp,
        SparkContext("local[2]", "profiler") as sc,
    ):
        paths = export_paths(sc, x, y, f"{tmp}/train")
        SparkNet(sc, Network(mlp(), "cross_entropy", SGD), master()).fit_paths(sc.parallelize(paths.take(8)))
        spark_net = SparkNet(sc, Network(mlp(), "cross_entropy", SGD), master())
        start = time.perf_counter()
        spark_net.fit_paths(paths)
        seconds = time.perf_counter() - start
    shares = [w for r in spark_net.training_stats.rounds for w in r.workers]
    steps = sum(len(w.batches) for w in shares)
    fitting = sum(w.fit_seconds - w.averaging_seconds for w in shares)
    return {"seconds": seconds, "step_ms": 1000 * fitting / steps}


def main(argv: list[str] | None = None) -> None:
    args = parse(command_line(__doc__.splitlines()[0], cases=RUN_HELP, title="runs"), argv, RESULTS)
    if args.smoke:
        shrink(globals(), ROUNDS=1, FREQUENCY=2)
    data = make_data()
    runs: list[dict[str, Any]] = []
    for _ in range(ROUNDS):
        for sampling in (True, False):
            run = {"profiler": "sampling" if sampling else "paused", **fit(sampling, data)}
            runs.append(run)
            print(
                f"profiler {run['profiler']:8s}: fit {run['seconds']:.2f} s, {run['step_ms']:.1f} ms a step", flush=True
            )
    medians = {
        kind: {k: statistics.median(r[k] for r in runs if r["profiler"] == kind) for k in ("seconds", "step_ms")}
        for kind in ("sampling", "paused")
    }
    write_results(
        args.out,
        {
            **header("profiler"),
            "setup": {"frequency": FREQUENCY, "streaming": True, "workers": 2, "rounds": ROUNDS},
            "runs": runs,
            "medians": medians,
            "step_ratio": medians["sampling"]["step_ms"] / medians["paused"]["step_ms"],
        },
    )


if __name__ == "__main__":
    main()
