"""The first fit of a context on fresh workers, with and without the workers' warm-up imports.

Run from the repository root with ``python -m benchmarks.first_fit`` (``--repeats 1`` for a short run;
about a minute). Each repeat is a fresh driver process (``python -m benchmarks.first_fit --child``)
that starts ``SparkContext("local[2]")``, caches an RDD of 64 minibatches of 32 examples of a small
problem, and fits an MLP 20-64-2 three times for one epoch with parameter averaging (every minibatch).
It records the context's start, each fit and the whole script, two ways, alternating:

- ``warm``: the default: the workers import ``dlscale.worker.imports`` (torch, ``torch._dynamo``, which
  torch's optimizers import on first use, and dlscale's training modules) as they start;
- ``cold``: ``dlscale.worker.imports: []``: the workers import them on first use, in the first fit.

Results go to ``benchmarks/results/first_fit.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import command_line, header, parse, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "first_fit.json"
WAYS = {"warm": None, "cold": "[]"}
WAY_HELP = {
    "warm": "the default: workers import dlscale.worker.imports (torch, training modules) as they start",
    "cold": "dlscale.worker.imports: []: the workers import them on first use, in the first fit",
}
"""A line on each of :data:`WAYS`, for ``--help``."""


def child() -> dict[str, float]:
    """One driver's figures (seconds): the context's start, its three fits, the whole script."""
    began = time.perf_counter()
    import functools

    import torch

    from dlscale import ParameterAveragingTrainingMaster, SparkContext, SparkNet
    from dlscale.data import DataSet
    from dlscale.nn import Network

    torch.manual_seed(0)
    x = torch.randn(2048, 20)
    y = (x[:, 0] > 0).long()
    t = time.perf_counter()
    with SparkContext("local[2]") as sc, tempfile.TemporaryDirectory() as export:
        start = time.perf_counter() - t
        rdd = sc.parallelize(DataSet(x, y).batch_by(32), 4).cache()
        rdd.count()
        fits = []
        for _ in range(3):
            module = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
            net = Network(module, "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1))
            master = ParameterAveragingTrainingMaster(32, averaging_frequency=1, export_directory=export)
            t = time.perf_counter()
            SparkNet(sc, net, master).fit(rdd, epochs=1)
            net.settle()  # the trained state on the driver, as reading the network takes it
            fits.append(time.perf_counter() - t)
    return {
        "context_start": start,
        "first_fit": fits[0],
        "second_fit": fits[1],
        "third_fit": fits[2],
        "script": time.perf_counter() - began,
    }


def run(way: str) -> dict[str, float]:
    env = {**os.environ, "DASK_DLSCALE__PROGRESS": "false"}
    if WAYS[way] is not None:
        env["DASK_DLSCALE__WORKER__IMPORTS"] = WAYS[way]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.first_fit", "--child"], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = command_line(__doc__.splitlines()[0], cases=WAY_HELP, title="ways")
    parser.add_argument("--repeats", type=int, default=3, help="driver processes per way (default 3)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parse(parser, argv, RESULTS, repeats=1)
    if args.child:
        print(json.dumps(child()))
        return None
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            runs[way].append(run(way))
            print(way, {k: round(v, 2) for k, v in runs[way][-1].items()}, flush=True)
    report = header("first_fit", repeats=args.repeats)
    report["ways"] = {
        way: {
            "median_seconds": {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]},
            "runs": [{k: round(v, 3) for k, v in r.items()} for r in rs],
        }
        for way, rs in runs.items()
    }
    print("| way | context start (s) | first fit (s) | second fit (s) | script (s) |")
    print("|---|---|---|---|---|")
    for way, figures in report["ways"].items():
        m = figures["median_seconds"]
        print(
            f"| {way} | {m['context_start']:.2f} | {m['first_fit']:.2f} | {m['second_fit']:.2f} | {m['script']:.2f} |"
        )
    write_results(args.out, report)
    return report


if __name__ == "__main__":
    main()
