"""Facade overhead: the same pipelines on dlscale, plain dask.bag and PySpark.

Run from the repository root with ``python -m benchmarks.facade``. Each pipeline is built and
run (to an action) on the same data with the same number of partitions: on dlscale's
``SparkContext("local[2]")``, on plain dask.bag computed by that context's own client (so the
Dask cluster is identical), and on PySpark's ``SparkContext("local[2]")``. The medians, every
repeat and the ratios against the targets are printed and written to
``benchmarks/results/facade.json``.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from functools import partial
from operator import add, itemgetter
from pathlib import Path
from typing import Any

import dask
import dask.bag as db
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

# Sizes are multiples of PARTITIONS * 1024, so that PySpark's slicing of a list (in batches of
# 1024 elements) and dask.bag's from_sequence put the same elements in each partition.
PARTITIONS = 8
N_INTS = 2_048_000
N_LINES = 204_800
WORDS_PER_LINE = 5
VOCABULARY = 10_000
N_FLOATS = 2_048_000
BINS = 16
REPEATS = 5
SEED = 0
RDDContext = SparkContext | pyspark.SparkContext
RESULTS = Path(__file__).resolve().parent / "results" / "facade.json"
SYSTEMS = ("dlscale", "dask.bag", "pyspark")
TARGETS: Targets = {
    "dlscale / dask.bag": ("dlscale", "dask.bag", "<=", 1.1),
    "dlscale / pyspark": ("dlscale", "pyspark", "<", 1.0),
}
PIPELINES = {
    "narrow": "parallelize ints -> map -> filter -> map -> sum",
    "word_count": "parallelize lines -> flatMap(split) -> map((w, 1)) -> reduceByKey(add) -> collect",
    "numpy_partitions": "parallelize floats -> mapPartitions(numpy histogram) -> collect",
}


# -- element and partition functions, shared by the three systems ------------------------------
def triple(x: int) -> int:
    return 3 * x


def is_even(x: int) -> bool:
    return x % 2 == 0


def increment(x: int) -> int:
    return x + 1


def split_words(line: str) -> list[str]:
    return line.split()


def one(word: str) -> tuple[str, int]:
    return (word, 1)


def add_count(total: int, pair: tuple[str, int]) -> int:
    return total + pair[1]


def histogram(values: Iterable[float]) -> list[int]:
    """Counts of the partition's z-scores in ``BINS`` bins over [-4, 4)."""
    arr = np.fromiter(values, dtype=np.float64)
    z = (arr - arr.mean()) / arr.std()
    counts, _ = np.histogram(z, bins=BINS, range=(-4.0, 4.0))
    return counts.tolist()


# -- inputs -------------------------------------------------------------------------------------
def make_inputs() -> dict[str, list]:
    """The input collection of each pipeline (sizes divisible by ``PARTITIONS``)."""
    rng = random.Random(SEED)
    vocabulary = [f"w{i}" for i in range(VOCABULARY)]
    lines = [" ".join(rng.choices(vocabulary, k=WORDS_PER_LINE)) for _ in range(N_LINES)]
    return {
        "narrow": list(range(N_INTS)),
        "word_count": lines,
        "numpy_partitions": [rng.random() for _ in range(N_FLOATS)],
    }


# -- pipelines: RDD API (dlscale and PySpark alike) and dask.bag ---------------------------------
def rdd_narrow(sc: RDDContext, data: list[int]) -> int:
    return sc.parallelize(data, PARTITIONS).map(triple).filter(is_even).map(increment).sum()


def rdd_word_count(sc: RDDContext, lines: list[str]) -> list[tuple[str, int]]:
    return sc.parallelize(lines, PARTITIONS).flatMap(split_words).map(one).reduceByKey(add).collect()


def rdd_numpy_partitions(sc: RDDContext, values: list[float]) -> list[int]:
    return sc.parallelize(values, PARTITIONS).mapPartitions(histogram).collect()


def bag_narrow(client: distributed.Client, data: list[int]) -> int:
    bag = db.from_sequence(data, npartitions=PARTITIONS).map(triple).filter(is_even).map(increment)
    return client.compute(bag.sum(), sync=True)


def bag_word_count(client: distributed.Client, lines: list[str]) -> list[tuple[str, int]]:
    bag = db.from_sequence(lines, npartitions=PARTITIONS).map(split_words).flatten().map(one)
    return client.compute(bag.foldby(itemgetter(0), add_count, 0, add), sync=True)


def bag_numpy_partitions(client: distributed.Client, values: list[float]) -> list[int]:
    bag = db.from_sequence(values, npartitions=PARTITIONS).map_partitions(histogram)
    return client.compute(bag, sync=True)


RDD_PIPELINES = {"narrow": rdd_narrow, "word_count": rdd_word_count, "numpy_partitions": rdd_numpy_partitions}
BAG_PIPELINES = {"narrow": bag_narrow, "word_count": bag_word_count, "numpy_partitions": bag_numpy_partitions}


# -- timing -------------------------------------------------------------------------------------
def normalise(pipeline: str, result: Any) -> Any:
    """A comparable form of a result (word counts come back in any order)."""
    return sorted(result) if pipeline == "word_count" else result


def time_runs(runs: dict[str, Callable[[], Any]]) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Run each once to warm up, then time ``REPEATS`` rounds, alternating the runs in each round."""
    results = {name: run() for name, run in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(REPEATS):
        for name, run in runs.items():
            gc.collect()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times, results


def bench_dask(inputs: dict[str, list]) -> tuple[dict, dict]:
    """Times and results of dlscale and plain dask.bag on one embedded Dask cluster."""
    times: dict = {}
    results: dict = {}
    with SparkContext("local[2]", "facade-benchmark") as sc:
        for name, data in inputs.items():
            runs = {
                "dlscale": partial(RDD_PIPELINES[name], sc, data),
                "dask.bag": partial(BAG_PIPELINES[name], sc.client, data),
            }
            times[name], results[name] = time_runs(runs)
            print(f"  {name}: dlscale and dask.bag done", flush=True)
    return times, results


def bench_pyspark(inputs: dict[str, list]) -> tuple[dict, dict, str]:
    """Times and results of PySpark in local mode, and the JVM's Java version."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONHASHSEED"] = "0"
    conf = pyspark.SparkConf().set("spark.ui.showConsoleProgress", "false")
    sc = pyspark.SparkContext("local[2]", "facade-benchmark", conf=conf)
    sc.setLogLevel("ERROR")
    times: dict = {}
    results: dict = {}
    try:
        java = sc._jvm.System.getProperty("java.version")
        for name, data in inputs.items():
            t, r = time_runs({"pyspark": partial(RDD_PIPELINES[name], sc, data)})
            times[name], results[name] = t["pyspark"], r["pyspark"]
            print(f"  {name}: pyspark done", flush=True)
    finally:
        sc.stop()
    return times, results, java


def check_results(dask_results: dict, spark_results: dict) -> None:
    """Fail unless the three systems computed the same thing for every pipeline."""
    for name in PIPELINES:
        expected = normalise(name, spark_results[name])
        for system in ("dlscale", "dask.bag"):
            if normalise(name, dask_results[name][system]) != expected:
                raise AssertionError(f"{system} and pyspark disagree on the {name} pipeline")


# -- report -------------------------------------------------------------------------------------
def build_report(dask_times: dict, spark_times: dict, java: str, run: dict[str, Any]) -> dict[str, Any]:
    """Everything that goes into ``facade.json``."""
    pipelines = {
        name: {"description": text, **timing_report({**dask_times[name], "pyspark": spark_times[name]}, TARGETS)}
        for name, text in PIPELINES.items()
    }
    targets = targets_met(pipelines.values(), TARGETS)
    return {
        **header(
            "facade",
            java=java,
            dask=dask.__version__,
            distributed=distributed.__version__,
            pyspark=pyspark.__version__,
            numpy=np.__version__,
        ),
        "run": run,
        "settings": {
            "partitions": PARTITIONS,
            "warmup_runs": 1,
            "repeats": REPEATS,
            "cluster": "local[2]: 2 Dask worker processes x 1 thread; 2 PySpark task slots",
            "sizes": {
                "ints": N_INTS,
                "lines": N_LINES,
                "words": N_LINES * WORDS_PER_LINE,
                "vocabulary": VOCABULARY,
                "floats": N_FLOATS,
            },
        },
        "pipelines": pipelines,
        "targets": targets,
    }


def markdown_table(report: dict[str, Any]) -> str:
    """The medians and ratios as a markdown table."""
    header = ["pipeline", *(f"{s} (s)" for s in SYSTEMS), *TARGETS]
    rows = [header, ["---"] * len(header)]
    for name, p in report["pipelines"].items():
        ratios = [f"{r['value']:.2f} ({'met' if r['met'] else 'missed'})" for r in p["ratios"].values()]
        rows.append([name, *(f"{p['seconds'][s]['median']:.3f}" for s in SYSTEMS), *ratios])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__.splitlines()[0], cases=PIPELINES, title=f"pipelines (each on {', '.join(SYSTEMS)})")
    args = parse(parser, argv, RESULTS)
    if java_missing():
        unavailable("facade", java_missing(), args.smoke)
    if args.smoke:
        shrink(globals(), N_INTS=PARTITIONS * 1024, N_LINES=PARTITIONS * 1024, N_FLOATS=PARTITIONS * 1024, REPEATS=1)
    # the inputs travel inside the task graph on purpose: that is what parallelize does
    warnings.filterwarnings("ignore", message="Sending large graph", category=UserWarning)
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    print("building inputs", flush=True)
    inputs = make_inputs()
    print("timing dlscale and dask.bag", flush=True)
    dask_times, dask_results = bench_dask(inputs)
    print("timing pyspark", flush=True)
    spark_times, spark_results, java = bench_pyspark(inputs)
    check_results(dask_results, spark_results)
    run = {
        "wall_seconds": round(time.perf_counter() - start, 1),
        "load_average_1min": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
    }
    report = build_report(dask_times, spark_times, java, run)
    print(markdown_table(report))
    print(f"targets: {json.dumps(report['targets'])}")
    write_results(args.out, report)


if __name__ == "__main__":
    main()
