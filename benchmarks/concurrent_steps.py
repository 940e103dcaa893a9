"""Two training steps at once: compare's MLP step in two plain processes, in two Dask workers' tasks,
and in two parameter-averaging trainers, alternating.

Run from the repository root with ``python -m benchmarks.concurrent_steps`` (about 4 minutes).
``benchmarks.compare`` measures two trainers' steps about 13% slower than each of the machine's
ceiling's two independent processes, even with no averaging during the fit, and on
``benchmarks.small_model``'s model twice as slow. This separates where that goes, on both models:
``mlp``, compare's (784-2048-2048-10, minibatches of 64, ``STEPS["mlp"]`` steps a core), and
``small``, small_model's (64-256-10 on the digits, minibatches of 16, 20 epochs of its 75 minibatches:
750 steps a core); SGD lr 0.01 momentum 0.9, one thread. Each run takes the step on each of two
cores at once:

- ``two processes``: plain PyTorch in two fresh Python processes (the ceiling's way);
- ``two workers' tasks``: the same loop as a task on each worker of ``SparkContext("local[2]")``;
- ``two trainers``: ``ParameterAveragingTrainingMaster`` on ``local[2]`` fitting minibatch files
  in rounds of an epoch (``mlp``: one epoch of ``2 * STEPS["mlp"]`` files, averaged once, at the
  end), after a short fit; a trainer's step is its rounds' fitting time (loading included) over
  its minibatches.

The three alternate ``ROUNDS`` times, so that a slow spell of the machine falls on all of them;
figures are the medians over the rounds of each run's mean step (ms) over both cores (after
``WARMUP`` untimed steps). Results go to ``benchmarks/results/concurrent_steps.json``.
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

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
from dlscale.runtime.cluster import cluster_workers

RESULTS = Path(__file__).resolve().parent / "results" / "concurrent_steps.json"
WARMUP, ROUNDS = 10, 3
STEPS = {"mlp": 100, "small": 750}  # a core's timed steps
RUNS = ("two processes", "two workers' tasks", "two trainers")
RUN_HELP = {
    "two processes": "plain PyTorch steps in two fresh Python processes at once (the ceiling's way)",
    "two workers' tasks": 'the same loop as a task on each worker of SparkContext("local[2]")',
    "two trainers": "ParameterAveragingTrainingMaster on local[2] fitting minibatch files, rounds of an epoch",
}
"""A line on each of :data:`RUNS`, for ``--help``."""
SMALL_BATCH, SMALL_EPOCHS = 16, 20


def _workload(model: str) -> tuple[Callable[[], torch.nn.Module], torch.Tensor, torch.Tensor, int]:
    """The module factory, training data and batch size of ``model``."""
    if model == "mlp":
        x, y, _, _ = make_data()
        return mlp, x, y, BATCH
    x, y, _, _ = digits()
    return functools.partial(digits_mlp, 0), x, y, SMALL_BATCH


def steps(model: str) -> float:
    """``STEPS[model]`` plain steps on this thread after ``WARMUP`` untimed ones: the mean step (ms)."""
    torch.set_num_threads(1)
    factory, x, y, batch = _workload(model)
    module = factory()
    optimizer = SGD(module.parameters())
    start = 0.0
    for i in range(WARMUP + STEPS[model]):
        if i == WARMUP:
            start = time.perf_counter()
        at = (i % (len(x) // batch)) * batch
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(module(x[at : at + batch]), y[at : at + batch]).backward()
        optimizer.step()
    return 1000 * (time.perf_counter() - start) / STEPS[model]


def two_processes(model: str) -> float:
    """:func:`steps` in two fresh Python processes at once: their mean step (ms)."""
    code = f"import json; from benchmarks.concurrent_steps import steps; print(json.dumps(steps({model!r})))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a plain process failed")
    return statistics.mean(json.loads(o.strip().splitlines()[-1]) for o in outs)


def two_tasks(model: str) -> float:
    """:func:`steps` as a task on each worker of a fresh ``local[2]`` context, at once."""
    from dlscale import SparkContext

    with SparkContext("local[2]", "concurrent-steps") as sc:
        workers = list(cluster_workers(sc.client))
        futures = [sc.client.submit(steps, model, workers=[w], key=f"steps-{w}") for w in workers]
        return statistics.mean(f.result() for f in futures)


def two_trainers(model: str) -> float:
    """Two parameter-averaging trainers fitting in rounds of an epoch: their mean step (ms)."""
    from dlscale import ParameterAveragingTrainingMaster, SparkContext, SparkNet
    from dlscale.nn import Network

    factory, x, y, batch = _workload(model)
    files, epochs = (2 * STEPS[model], 1) if model == "mlp" else (len(x) // batch, SMALL_EPOCHS)
    with tempfile.TemporaryDirectory() as tmp, SparkContext("local[2]", "concurrent-steps") as sc:
        names = export_paths(sc, x[: files * batch], y[: files * batch], f"{tmp}/train", batch).collect()

        def fit(paths: list[str], epochs: int) -> Any:
            master = ParameterAveragingTrainingMaster(
                batch, averaging_frequency=-(-len(paths) // 2), collect_training_stats=True
            )
            spark_net = SparkNet(sc, Network(factory(), "cross_entropy", SGD), master)
            spark_net.fit_paths(sc.parallelize(paths, 2), epochs=epochs)
            return spark_net.training_stats

        fit(names[: 2 * WARMUP], 1)  # imports, connections, the first steps
        shares = [w for r in fit(names, epochs).rounds for w in r.workers]
        return 1000 * sum(w.fit_seconds for w in shares) / sum(len(w.batches) for w in shares)


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__.splitlines()[0], cases=RUN_HELP, title=f"runs (models: {', '.join(STEPS)})")
    args = parse(parser, argv, RESULTS)
    if args.smoke:
        shrink(globals(), WARMUP=2, STEPS={"mlp": 3, "small": 10}, ROUNDS=1, SMALL_EPOCHS=1)
    measured = {(model, run): [] for model in STEPS for run in RUNS}
    for r in range(ROUNDS):
        for model in STEPS:
            for run, measure in zip(RUNS, (two_processes, two_tasks, two_trainers), strict=True):
                measured[model, run].append(measure(model))
                print(f"round {r + 1}  {model:5s} {run:20s} step {measured[model, run][-1]:7.3f} ms")
    report: dict[str, Any] = {
        **header("concurrent_steps"),
        "setup": {
            "models": {"mlp": "MLP 784-2048-2048-10, batch 64", "small": "MLP 64-256-10 (digits), batch 16"},
            "steps_per_core": STEPS,
            "threads": 1,
            "warmup_steps": WARMUP,
            "rounds": ROUNDS,
        },
        "runs": [
            {"model": model, "run": run, "step_ms": statistics.median(times), "rounds": times}
            for (model, run), times in measured.items()
        ],
    }
    base = {r["model"]: r["step_ms"] for r in report["runs"] if r["run"] == RUNS[0]}
    for r in report["runs"]:
        r["vs_processes"] = r["step_ms"] / base[r["model"]]
        print(f"{r['model']:5s} {r['run']:20s} {r['step_ms']:7.3f} ms a step ({r['vs_processes']:.2f}x two processes')")
    write_results(args.out, report)


if __name__ == "__main__":
    main()
