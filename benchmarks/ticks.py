"""What Dask's event-loop tick costs a fit on the embedded cluster: a parameter-averaging fit with every
process of the cluster ticking at Dask's 20 ms and at dlscale's 500 ms (``dlscale.local.tick-interval``).

Run from the repository root with ``python -m benchmarks.ticks`` (about 5 minutes). Every
``distributed.admin.tick.interval`` the scheduler, each nanny and each worker wake their event loop to
time how responsive it is; at 20 ms that is 50 wake-ups a second in each of five processes, on a
machine whose two cores the two trainers keep busy. Each run starts ``SparkContext("local[2]")`` with
the setting, fits once to warm up, then times one ``fit_paths`` with
``ParameterAveragingTrainingMaster(streaming=True)``: of compare's MLP (``benchmarks._common``:
784-2048-2048-10, minibatches of 64, one epoch of 400 minibatches, every 50) and of the small model
(``benchmarks.small_model``: the digits MLP 64-256-10, minibatches of 16, 20 epochs, once an epoch).
The two settings alternate ``ROUNDS`` times so that a slow spell of the machine falls on both.
Figures: each run's fit time and the CPU seconds each process used during it (the driver, which runs
the scheduler; the nannies; the workers), and the medians of each setting. Results go to
``benchmarks/results/ticks.json``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import dask
import psutil

from benchmarks._common import (
    BATCH,
    SGD,
    command_line,
    digits,
    export_paths,
    header,
    make_data,
    mlp,
    parse,
    shrink,
    write_results,
)
from benchmarks.quality import digits_mlp
from benchmarks.small_model import OPTIMIZER as SMALL_OPTIMIZER

RESULTS = Path(__file__).resolve().parent / "results" / "ticks.json"
ROUNDS = 3
TICKS = {"dask": "20ms", "dlscale": "500ms"}
TICK_HELP = {
    "dask": f"distributed.admin.tick.interval {TICKS['dask']} in every process of the cluster: Dask's default",
    "dlscale": f"{TICKS['dlscale']} in every process: dlscale.local.tick-interval's default",
}
"""A line on each of :data:`TICKS`, for ``--help``."""
MLP_MINIBATCHES, MLP_FREQUENCY = 400, 50
SMALL_BATCH, SMALL_EPOCHS, SMALL_FREQUENCY = 16, 20, 38  # once an epoch: each worker's share of 75


def _cpu(processes: list[psutil.Process]) -> dict[int, float]:
    return {p.pid: sum(p.cpu_times()[:2]) for p in processes}


def fit(tick: str, workload: str, data: tuple[Any, ...]) -> dict[str, Any]:
    """One timed fit on a fresh two-worker context whose processes tick every ``tick``."""
    from dlscale import ParameterAveragingTrainingMaster, SparkContext, SparkNet
    from dlscale.nn import Network

    x, y = data[0], data[1]
    mlp_workload = workload == "mlp"
    batch, frequency = (BATCH, MLP_FREQUENCY) if mlp_workload else (SMALL_BATCH, SMALL_FREQUENCY)
    epochs = 1 if mlp_workload else SMALL_EPOCHS

    def network() -> Network:
        return (
            Network(mlp(), "cross_entropy", SGD)
            if mlp_workload
            else Network(digits_mlp(0), "cross_entropy", SMALL_OPTIMIZER)
        )

    def master() -> ParameterAveragingTrainingMaster:
        return ParameterAveragingTrainingMaster(batch, averaging_frequency=frequency, streaming=True, rng_seed=0)

    with (
        dask.config.set({"dlscale.local.tick-interval": tick}),
        tempfile.TemporaryDirectory() as tmp,
        SparkContext("local[2]", "ticks") as sc,
    ):
        paths = export_paths(sc, x, y, f"{tmp}/train", batch=batch)
        SparkNet(sc, network(), master()).fit_paths(sc.parallelize(paths.take(8), 2))
        me = psutil.Process()
        nannies = [p for p in me.children() if "dask" in " ".join(p.cmdline())]
        workers = [w for n in nannies for w in n.children()]
        spark_net = SparkNet(sc, network(), master())
        before, start = _cpu([me, *nannies, *workers]), time.perf_counter()
        spark_net.fit_paths(paths, epochs=epochs)
        seconds = time.perf_counter() - start
        after = _cpu([me, *nannies, *workers])
    used = {pid: after[pid] - before[pid] for pid in before}
    return {
        "seconds": seconds,
        "cpu_seconds": {
            "driver": used[me.pid],
            "nannies": sum(used[p.pid] for p in nannies),
            "workers": sum(used[p.pid] for p in workers),
        },
    }


def main(argv: list[str] | None = None) -> None:
    title = "ticks (workloads: mlp, small)"
    args = parse(command_line(__doc__.splitlines()[0], cases=TICK_HELP, title=title), argv, RESULTS)
    if args.smoke:
        shrink(globals(), ROUNDS=1, MLP_MINIBATCHES=16, MLP_FREQUENCY=2, SMALL_EPOCHS=1)
    x, y, _, _ = make_data()
    n = MLP_MINIBATCHES * BATCH
    workloads = {"mlp": (x[:n], y[:n]), "small": digits()[:2]}
    runs: list[dict[str, Any]] = []
    for _ in range(ROUNDS):
        for workload, data in workloads.items():
            for setting, tick in TICKS.items():
                run = {"workload": workload, "tick": setting, "interval": tick, **fit(tick, workload, data)}
                runs.append(run)
                cpu = ", ".join(f"{k} {v:.2f}" for k, v in run["cpu_seconds"].items())
                print(f"{workload:5s} tick {tick:5s}: fit {run['seconds']:.2f} s; CPU s: {cpu}", flush=True)
    medians: dict[str, dict[str, Any]] = {}
    for workload in workloads:
        for setting in TICKS:
            mine = [r for r in runs if r["workload"] == workload and r["tick"] == setting]
            medians[f"{workload}/{setting}"] = {
                "seconds": statistics.median(r["seconds"] for r in mine),
                "cpu_seconds": {
                    k: statistics.median(r["cpu_seconds"][k] for r in mine) for k in mine[0]["cpu_seconds"]
                },
            }
    write_results(
        args.out,
        {
            **header("ticks"),
            "setup": {
                "workers": 2,
                "rounds": ROUNDS,
                "ticks": TICKS,
                "mlp": {"minibatches": MLP_MINIBATCHES, "batch": BATCH, "frequency": MLP_FREQUENCY, "streaming": True},
                "small": {
                    "batch": SMALL_BATCH,
                    "epochs": SMALL_EPOCHS,
                    "frequency": SMALL_FREQUENCY,
                    "streaming": True,
                },
            },
            "runs": runs,
            "medians": medians,
            "speedup": {w: medians[f"{w}/dask"]["seconds"] / medians[f"{w}/dlscale"]["seconds"] for w in workloads},
        },
    )


if __name__ == "__main__":
    main()
