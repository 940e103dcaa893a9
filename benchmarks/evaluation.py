"""Distributed evaluation and inference on two workers against single-process PyTorch forward passes.

Run from the repository root with ``python -m benchmarks.evaluation``. The model is the MLP
784-2048-2048-10 (5.8M parameters) of ``benchmarks._common``, untrained (speed does not
depend on the weights), on 25,600 examples of MNIST's shape in minibatches of 64. Measured in this
same script:

- **baselines**: a plain PyTorch loop of forward passes (``torch.no_grad``, arg-max) over the same
  minibatches held in memory, with one thread (one worker's share of the machine) and with every core;
- **evaluation**: ``do_evaluation`` with ``Evaluation(top_n=5)`` and ``ROCMultiClass(threshold_steps=100)``
  over the minibatch files (exported once before timing), on ``SparkContext("local[2]")`` (two worker
  processes of one thread each);
- **keyed inference**: ``feed_forward_with_key`` over a persisted pair RDD of one example per key, the
  outputs left on the workers (``count``), and the same with the outputs collected on the driver;
- **predict**: ``dlscale.predict`` over a persisted Dask array, the predictions persisted on the workers.

Every configuration runs ``REPEATS`` times in ABBA order and the median is reported, as are the time to
send the network to the workers, which every evaluation and inference call pays once, and the time
of one evaluation's worker tasks. Target: two
workers reach at least 1.7x the one-thread baseline's examples/s. Results go to
``benchmarks/results/evaluation.json``.
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dask.array as da
import torch
from distributed import get_task_stream, wait

from benchmarks._common import BATCH, command_line, export_paths, header, network, parse, shrink, timed, write_results
from dlscale import SparkContext, StorageLevel
from dlscale.evaluation import Evaluation, ROCMultiClass, do_evaluation
from dlscale.inference import feed_forward_with_key, predict
from dlscale.nn import Network, shipping

RESULTS = Path(__file__).resolve().parent / "results" / "evaluation.json"
EXAMPLES = 64 * 400
REPEATS = 3
TARGET = 1.7
RUN_HELP = {
    "pytorch_1_thread": "plain PyTorch forward passes (no_grad, arg-max) over in-memory minibatches, one thread",
    "pytorch_N_thread": "the same with every core (N: os.cpu_count())",
    "do_evaluation": 'do_evaluation, Evaluation and ROCMultiClass, minibatch files, SparkContext("local[2]")',
    "feed_forward_with_key": "feed_forward_with_key over a persisted pair RDD, its outputs counted on the workers",
    "feed_forward_with_key_collect": "the same, its outputs collected on the driver",
    "predict_dask_array": "dlscale.predict over a persisted Dask array, its predictions persisted",
}
"""A line on each run, for ``--help``."""


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(EXAMPLES, 784, generator=g), torch.randint(0, 10, (EXAMPLES,), generator=g)


def single_process(module: torch.nn.Module, x: torch.Tensor, threads: int) -> float:
    """Plain PyTorch: forward passes over in-memory minibatches; returns seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    module.eval()
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(x), BATCH):
            module(x[i : i + BATCH]).argmax(1)
    seconds = time.perf_counter() - start
    torch.set_num_threads(before)
    return seconds


def main(argv: list[str] | None = None) -> None:
    args = parse(command_line(__doc__.splitlines()[0], cases=RUN_HELP, title="runs"), argv, RESULTS)
    if args.smoke:
        shrink(globals(), EXAMPLES=64 * 8, REPEATS=1)
    x, y = make_data()
    net: Network = network()
    cores = os.cpu_count() or 1
    report: dict[str, Any] = {
        **header("evaluation"),
        "setup": {
            "model": "MLP 784-2048-2048-10",
            "parameters": net.num_params(),
            "batch": BATCH,
            "examples": EXAMPLES,
            "workers": 2,
            "threads_per_worker": 1,
            "evaluations": "Evaluation(top_n=5), ROCMultiClass(threshold_steps=100)",
        },
        "runs": {},
    }
    runs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, SparkContext("local[2]", "bench-evaluation") as sc:
        paths = export_paths(sc, x, y, f"{tmp}/test")
        pairs = sc.parallelize([(i, x[i].clone()) for i in range(EXAMPLES)], 8).persist(StorageLevel.MEMORY_ONLY)
        pairs.count()
        array = sc.client.persist(da.from_array(x.numpy(), chunks=(EXAMPLES // 8, 784)))
        wait(array)

        def evaluate() -> None:
            results = do_evaluation(
                net, paths, Evaluation(top_n=5), ROCMultiClass(threshold_steps=100), batch_size=BATCH
            )
            assert results[0].num_examples() == EXAMPLES

        def keyed() -> None:
            assert feed_forward_with_key(net, pairs, BATCH).count() == EXAMPLES

        def keyed_collect() -> None:
            assert len(feed_forward_with_key(net, pairs, BATCH).collect()) == EXAMPLES

        def predicted() -> None:
            out = sc.client.persist(predict(net, array, batch_size=BATCH))
            wait(out)
            del out

        configs: list[tuple[str, Callable[[], float]]] = [
            (f"pytorch_{t}_thread", functools.partial(single_process, net.module, x, t)) for t in sorted({1, cores})
        ]
        configs += [
            (name, functools.partial(timed, fn))
            for name, fn in [
                ("do_evaluation", evaluate),
                ("feed_forward_with_key", keyed),
                ("feed_forward_with_key_collect", keyed_collect),
                ("predict_dask_array", predicted),
            ]
        ]
        for _, run in configs[len(configs) - 4 :]:
            run()  # warm-up: worker imports, first network copies

        report["network_ship_s"] = statistics.median(
            timed(lambda: shipping.ship(sc.client, net, waiting="the benchmark").release()) for _ in range(REPEATS)
        )
        report["network_pickle_s"] = timed(lambda: shipping.serialise(net, False))
        print(
            f"sending the network to both workers: {report['network_ship_s']:.2f} s per call, of which "
            f"{report['network_pickle_s']:.2f} s pickling"
        )
        with get_task_stream(sc.client) as stream:
            evaluate()
        tasks = [t for t in stream.data if str(t["key"]).startswith("('evaluate")]
        report["evaluation_tasks"] = {
            "count": len(tasks),
            "examples_per_task": EXAMPLES / len(tasks),
            "mean_seconds": statistics.mean(
                sum(s["stop"] - s["start"] for s in t["startstops"] if s["action"] == "compute") for t in tasks
            ),
        }
        print(
            f"evaluation tasks: {len(tasks)} of {EXAMPLES / len(tasks):.0f} examples, "
            f"{report['evaluation_tasks']['mean_seconds']:.2f} s each"
        )
        for repeat in range(REPEATS):
            for name, run in configs if repeat % 2 == 0 else configs[::-1]:
                runs.setdefault(name, []).append(EXAMPLES / run())
                print(f"{name:32s} {runs[name][-1]:9.0f} examples/s")
    one = statistics.median(runs["pytorch_1_thread"])
    every = statistics.median(runs[f"pytorch_{cores}_thread"])
    for name, rates in runs.items():
        rate = statistics.median(rates)
        report["runs"][name] = {
            "examples_per_s": rate,
            "runs_examples_per_s": rates,
            "ratio_vs_1_thread": rate / one,
            f"ratio_vs_{cores}_threads": rate / every,
        }
        print(f"{name:32s} {rate:9.0f} examples/s  {rate / one:5.2f}x one thread  {rate / every:5.2f}x {cores} threads")
    measured = {name: report["runs"][name]["ratio_vs_1_thread"] for name in ("do_evaluation", "feed_forward_with_key")}
    report["target"] = {
        "ratio_vs_1_thread": TARGET,
        "measured": measured,
        "met": all(r >= TARGET for r in measured.values()),
    }
    print(f"target: >= {TARGET}x one thread: " + ", ".join(f"{k} {v:.2f}x" for k, v in measured.items()))
    write_results(args.out, report)


if __name__ == "__main__":
    main()
