"""What a Dask worker's C allocator costs a training step: a plain step in a plain process, in a Dask
worker as Dask's nanny starts it, and in one whose allocator dlscale set for training.

Run from the repository root with ``python -m benchmarks.allocator`` (about 3 minutes). Dask's nanny
starts every worker with ``MALLOC_TRIM_THRESHOLD_=65536`` (``distributed.nanny.pre-spawn-environ``):
memory a task frees goes back to the system at once, and the next step's tensors are faulted in
again, page by page. dlscale's workers set glibc's thresholds from ``dlscale.worker.malloc-*``
(``dlscale.runtime.allocator``). Each run takes compare's plain PyTorch step (the MLP
784-2048-2048-10, minibatches of 64, SGD lr 0.01 momentum 0.9, one thread) ``STEPS`` times after
``WARMUP`` untimed ones, in a thread as a trainer does:

- ``process``: a plain Python process, glibc's defaults;
- ``worker, Dask's allocator``: a task on ``SparkContext("local[1]")`` with ``dlscale.worker.malloc-*``
  null (Dask's setting left);
- ``worker, dlscale's allocator``: the same with dlscale's defaults.

The three alternate ``ROUNDS`` times, so that a slow spell of the machine falls on all of them;
figures are the medians over the rounds of each round's median step (ms) and page faults a step.
Results go to ``benchmarks/results/allocator.json``.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dask
import torch

from benchmarks._common import BATCH, SGD, command_line, header, make_data, mlp, parse, shrink, write_results
from dlscale.runtime.allocator import PARAMETERS

RESULTS = Path(__file__).resolve().parent / "results" / "allocator.json"
WARMUP, STEPS, ROUNDS = 10, 60, 3
RUNS = ("process", "worker, Dask's allocator", "worker, dlscale's allocator")
RUN_HELP = {
    "process": "the steps in a plain Python process, glibc's defaults",
    "worker, Dask's allocator": "a task on local[1], dlscale.worker.malloc-* null: the nanny's MALLOC_TRIM_THRESHOLD_",
    "worker, dlscale's allocator": "the same task with dlscale.worker.malloc-* at dlscale's defaults",
}
"""A line on each of :data:`RUNS`, for ``--help``."""


def steps(_: Any = None) -> dict[str, float]:
    """``STEPS`` plain steps in a thread of this process: the median step (ms) and page faults a step."""
    out: dict[str, float] = {}

    def run() -> None:
        torch.set_num_threads(1)
        x, y, _, _ = make_data()
        module = mlp()
        optimizer = SGD(module.parameters())
        times, faults = [], []
        for i in range(WARMUP + STEPS):
            at = (i % (len(x) // BATCH)) * BATCH
            before, start = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.perf_counter()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(module(x[at : at + BATCH]), y[at : at + BATCH]).backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
        out.update(step_ms=1000 * statistics.median(times[WARMUP:]), faults=statistics.median(faults[WARMUP:]))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out


def in_process() -> dict[str, float]:
    """:func:`steps` in a fresh Python process (glibc's defaults)."""
    code = "import json; from benchmarks.allocator import steps; print(json.dumps(steps()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def in_worker(dlscale_allocator: bool) -> dict[str, float]:
    """:func:`steps` as a task of a fresh ``local[1]`` context, with or without dlscale's allocator."""
    from dlscale import SparkContext

    unset = {f"dlscale.worker.malloc-{name}": None for name in PARAMETERS}
    with dask.config.set({} if dlscale_allocator else unset), SparkContext("local[1]") as sc:
        return sc.parallelize([0], 1).map(steps).collect()[0]


def main(argv: list[str] | None = None) -> None:
    args = parse(command_line(__doc__.splitlines()[0], cases=RUN_HELP, title="runs"), argv, RESULTS)
    if args.smoke:
        shrink(globals(), WARMUP=2, STEPS=3, ROUNDS=1)
    measured: dict[str, list[dict[str, float]]] = {run: [] for run in RUNS}
    for r in range(ROUNDS):
        for run, measure in zip(RUNS, (in_process, lambda: in_worker(False), lambda: in_worker(True)), strict=True):
            got = measure()
            measured[run].append(got)
            print(f"round {r + 1}  {run:28s} step {got['step_ms']:6.1f} ms  faults {got['faults']:7.0f}")
    report: dict[str, Any] = {
        **header("allocator"),
        "setup": {
            "model": "MLP 784-2048-2048-10",
            "batch": BATCH,
            "threads": 1,
            "warmup_steps": WARMUP,
            "timed_steps": STEPS,
            "rounds": ROUNDS,
        },
        "runs": [
            {
                "run": run,
                "step_ms": statistics.median(m["step_ms"] for m in measured[run]),
                "faults_per_step": statistics.median(m["faults"] for m in measured[run]),
                "rounds": measured[run],
            }
            for run in RUNS
        ],
    }
    base = report["runs"][0]["step_ms"]
    for r in report["runs"]:
        r["vs_process"] = r["step_ms"] / base
        print(
            f"{r['run']:28s} {r['step_ms']:6.1f} ms a step ({r['vs_process']:.2f}x the process), "
            f"{r['faults_per_step']:,.0f} page faults a step"
        )
    write_results(args.out, report)


if __name__ == "__main__":
    main()
