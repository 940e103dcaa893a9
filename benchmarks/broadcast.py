"""Broadcast variables: dlscale's ``sc.broadcast`` against PySpark's and against Dask's own scatter.

Run from the repository root with ``python -m benchmarks.broadcast``. Each value (about 100 MB: a
numpy array, ``bytes``, a list of ten million ints, a dict) is broadcast on a 4-worker cluster and read
by one task per worker; the time measured runs from the call that broadcasts it until those tasks
have read it (PySpark ships a broadcast to its executors on first use, so the first use belongs in
the measurement). The three systems:

- dlscale: ``SparkContext("local[4]")``, ``sc.broadcast(value)``, then an action of 4 partitions whose
  tasks read ``b.value``;
- Dask: ``client.scatter(value, broadcast=True)`` on the same cluster (the same context's client), then
  one task per worker taking the future. Scatter sends a list or a dict element by element (one
  future per element for the value itself, or, wrapped in a one-element list to make it one value, each
  element serialized on its own, about a millisecond per element on the benchmark machine, linearly:
  1,000 / 10,000 / 100,000 ints took 0.57 / 7.6 / 85 s to serialize once): the list and dict rows time
  the wrapped form on 0.01% of the value and scale the time by 10,000, marked as extrapolated;
- PySpark: ``SparkContext("local[4]")``, ``sc.broadcast(value)``, then the same action.

Medians of the repeats, every repeat and the ratios against the targets are printed and written to
``benchmarks/results/broadcast.json``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dask
import distributed
import numpy as np
import pyspark

from benchmarks._common import (
    Targets,
    command_line,
    header,
    java_missing,
    parse,
    shrink,
    targets_met,
    timing_report,
    unavailable,
    write_results,
)
from dlscale import SparkContext
from dlscale.runtime.cluster import cluster_workers

WORKERS = 4
MB = 2**20
REPEATS = 3
SIZE = 1.0  # of the values' sizes below
PAUSE = 1  # seconds between repeats
SAMPLE = 10_000  # the wrapped Dask scatter of a list or dict is timed on 1/SAMPLE of the value
RESULTS = Path(__file__).resolve().parent / "results" / "broadcast.json"
SYSTEMS = ("dlscale", "dask", "pyspark")
VALUE_HELP = {
    "numpy": "a float64 numpy array of 100 MiB",
    "bytes": "100 MiB of random bytes",
    "list": f"a list of 10,000,000 ints (dask: 1/{SAMPLE:,} of it in a one-element list, time scaled up)",
    "dict": f"a dict of 2,500,000 int -> str items (dask: 1/{SAMPLE:,} of it, as the list)",
}
"""A line on each value :func:`make_values` makes, for ``--help``."""
TARGETS: Targets = {
    "dlscale / pyspark": ("dlscale", "pyspark", "<=", 1.0),
    "dlscale / dask": ("dlscale", "dask", "<=", 1.5),
}


def make_values() -> dict[str, Any]:
    """About 100 MB each (the list and dict in pickled form; in memory they are larger), times SIZE."""
    rng = np.random.default_rng(0)
    return {
        "numpy": rng.random(int(SIZE * 100 * MB) // 8),
        "bytes": rng.bytes(int(SIZE * 100 * MB)),
        "list": list(range(int(SIZE * 10_000_000))),
        "dict": {i: f"value-{i}" for i in range(int(SIZE * 2_500_000))},
    }


def sample(value: Any) -> Any:
    """1/SAMPLE of a list or dict."""
    if isinstance(value, dict):
        return dict(list(value.items())[: len(value) // SAMPLE])
    return value[: len(value) // SAMPLE]


def length(value: Any) -> int:
    return len(value)


def rdd_round(sc: Any, value: Any) -> float:
    """Broadcast ``value`` and read it in one task per slot; the seconds that took. The broadcast is
    destroyed afterwards, outside the time."""
    start = time.perf_counter()
    b = sc.broadcast(value)
    lengths = sc.parallelize(range(WORKERS), WORKERS).map(lambda _: len(b.value)).collect()
    seconds = time.perf_counter() - start
    assert lengths == [len(value)] * WORKERS
    b.destroy()
    return seconds


def dask_round(client: distributed.Client, value: Any) -> float:
    """``client.scatter(value, broadcast=True)`` and one task per worker reading it; the seconds that took."""
    workers = list(cluster_workers(client))
    wrapped = isinstance(value, (list, dict))
    start = time.perf_counter()
    future = (
        client.scatter([value], broadcast=True, hash=False)[0] if wrapped else client.scatter(value, broadcast=True)
    )
    reads = [client.submit(length, future, workers=[w], pure=False) for w in workers]
    lengths = client.gather(reads)
    seconds = time.perf_counter() - start
    assert lengths == [len(value)] * len(workers)
    del future, reads
    return seconds


def repeat(run: Callable[[], float]) -> list[float]:
    times = []
    for _ in range(REPEATS):
        gc.collect()
        times.append(run())
        time.sleep(PAUSE)  # let the workers free the last value before the next
    return times


def bench_dask(values: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """dlscale's broadcast and Dask's scatter, on one embedded cluster."""
    times: dict = {}
    with SparkContext(f"local[{WORKERS}]", "broadcast-benchmark") as sc:
        rdd_round(sc, [0])  # warm-up: the workers' first tasks and the replica policy
        dask_round(sc.client, np.zeros(1))
        for name, value in values.items():
            times[name] = {"dlscale": repeat(lambda v=value: rdd_round(sc, v))}
            if isinstance(value, (list, dict)):
                part = sample(value)
                times[name]["dask"] = [t * SAMPLE for t in repeat(lambda v=part: dask_round(sc.client, v))]
            else:
                times[name]["dask"] = repeat(lambda v=value: dask_round(sc.client, v))
            print(f"  {name}: {times[name]}", flush=True)
    return times


def bench_pyspark(values: dict[str, Any]) -> tuple[dict[str, list[float]], str]:
    """PySpark's broadcast in local mode, and the JVM's Java version."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_SUBMIT_ARGS"] = "--driver-memory 4g pyspark-shell"  # room for a 100 MB broadcast
    conf = pyspark.SparkConf().set("spark.ui.showConsoleProgress", "false").set("spark.ui.enabled", "false")
    sc = pyspark.SparkContext(f"local[{WORKERS}]", "broadcast-benchmark", conf=conf)
    sc.setLogLevel("ERROR")
    times: dict = {}
    try:
        java = sc._jvm.System.getProperty("java.version")
        rdd_round(sc, [0])  # warm-up: the Python workers
        for name, value in values.items():
            times[name] = repeat(lambda v=value: rdd_round(sc, v))
            print(f"  {name}: pyspark {times[name]}", flush=True)
    finally:
        sc.stop()
    return times, java


def build_report(times: dict[str, dict[str, list[float]]], java: str, run: dict[str, Any]) -> dict[str, Any]:
    values = {
        name: {
            **timing_report(per_system, TARGETS, digits=3),
            "dask_extrapolated_from": f"{100 / SAMPLE:g}%" if name in ("list", "dict") else None,
        }
        for name, per_system in times.items()
    }
    targets = targets_met(values.values(), TARGETS)
    return {
        **header(
            "broadcast",
            java=java,
            dask=dask.__version__,
            distributed=distributed.__version__,
            pyspark=pyspark.__version__,
            numpy=np.__version__,
        ),
        "run": run,
        "settings": {
            "cluster": f"local[{WORKERS}]: {WORKERS} Dask worker processes x 1 thread; {WORKERS} PySpark task slots",
            "repeats": REPEATS,
            "measured": "from the broadcast call until one task per worker has read the value",
            "values": {
                "numpy": "float64 array, 100 MiB",
                "bytes": "100 MiB",
                "list": "10,000,000 ints",
                "dict": "2,500,000 int -> str items",
            },
        },
        "values": values,
        "targets": targets,
    }


def markdown_table(report: dict[str, Any]) -> str:
    head = ["value", *(f"{s} (s)" for s in SYSTEMS), *TARGETS]
    rows = [head, ["---"] * len(head)]
    for name, v in report["values"].items():
        dask_cell = f"{v['seconds']['dask']['median']:.2f}" + (
            f" (extrapolated from {v['dask_extrapolated_from']})" if v["dask_extrapolated_from"] else ""
        )
        cells = [f"{v['seconds']['dlscale']['median']:.2f}", dask_cell, f"{v['seconds']['pyspark']['median']:.2f}"]
        ratios = [f"{r['value']:.2f} ({'met' if r['met'] else 'missed'})" for r in v["ratios"].values()]
        rows.append([name, *cells, *ratios])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__.splitlines()[0], cases=VALUE_HELP, title=f"values (each on {', '.join(SYSTEMS)})")
    args = parse(parser, argv, RESULTS)
    if java_missing():
        unavailable("broadcast", java_missing(), args.smoke)
    if args.smoke:
        shrink(globals(), SIZE=0.001, SAMPLE=100, REPEATS=1, PAUSE=0)
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    print("building values", flush=True)
    values = make_values()
    print("timing dlscale and dask", flush=True)
    times = bench_dask(values)
    print("timing pyspark", flush=True)
    spark_times, java = bench_pyspark(values)
    for name in values:
        times[name]["pyspark"] = spark_times[name]
    run = {
        "wall_seconds": round(time.perf_counter() - start, 1),
        "load_average_1min": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
    }
    report = build_report(times, java, run)
    print(markdown_table(report))
    print(f"targets: {json.dumps(report['targets'])}")
    write_results(args.out, report)


if __name__ == "__main__":
    main()
