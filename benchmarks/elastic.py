"""A worker that joins a gradient-sharing fit while it runs, and one that is retired while it runs.

Run from the repository root with ``python -m benchmarks.elastic`` (``--seeds 1`` for a short run). The
main job's CNN (``dlscale.demo.digits_cnn``, 12,778 parameters) trains on scikit-learn's digits reshaped
to 8x8 images (1,200 training and 597 test images) with gradient sharing (its defaults, minibatches of
32, ``--epochs`` epochs), four ways, each with ``--seeds`` seeds (the order of the minibatches):

- ``two``: ``SparkContext("local[2]")``, both workers from the start;
- ``one``: ``SparkContext("local[1]")`` throughout;
- ``joins``: ``SparkContext("local[1]")``, and once a quarter of the fit's minibatches are trained, the
  driver asks the embedded cluster for a second worker (``cluster.scale(2)``): a new worker process
  starts, joins, and the fit takes it in at the end of its current segment;
- ``retires``: ``SparkContext("local[2]")``, and once a quarter of the fit's minibatches are trained, the
  driver scales the embedded cluster down to one worker (``cluster.scale(1)``): the second worker is
  retired in order, its trainer handing its minibatches and residual on before its process closes.

Each way runs one unrecorded fit first (the workers' first imports). Recorded per fit: seconds,
examples per second, test accuracy, and for ``joins`` the minibatches the newcomer trained against
those left when it was asked for, and the seconds from asking to its first acknowledged minibatch;
for ``retires`` the minibatches the retired worker trained, the trainers' minibatches in all (every
one once: the planned number) and the warnings the fit gave about lost trainers.
Results go to ``benchmarks/results/elastic.json``.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import accuracy, command_line, digits, header, parse, write_results
from dlscale import SharedTrainingMaster, SparkContext, SparkNet
from dlscale.data import DataSet
from dlscale.demo import digits_cnn
from dlscale.errors import TrainerLostWarning
from dlscale.nn import Network, build
from dlscale.nn.listeners import TrainingListener
from dlscale.runtime.cluster import cluster_workers

RESULTS = Path(__file__).resolve().parent / "results" / "elastic.json"
BATCH = 32
WAYS = ("two", "one", "joins", "retires")
WAY_HELP = {
    "two": 'SparkContext("local[2]"), both workers from the start',
    "one": 'SparkContext("local[1]") throughout',
    "joins": "local[1], a second worker asked for (cluster.scale(2)) a quarter into the fit",
    "retires": "local[2], scaled down to one worker (cluster.scale(1)) a quarter into the fit",
}
"""A line on each of :data:`WAYS`, for ``--help``."""


class ScaleAt(TrainingListener):
    """Scales ``cluster`` to ``workers`` once the fit has trained ``at`` minibatches."""

    def __init__(self, cluster: Any, at: int, workers: int) -> None:
        self.cluster, self.at, self.workers = cluster, at, workers
        self.scaled_at: int | None = None
        self.asked: float | None = None

    def iteration_done(self, network: Any, iteration: int, epoch: int, score: float, examples: int) -> None:
        if self.scaled_at is None and iteration >= self.at:
            self.cluster.scale(self.workers)
            self.scaled_at, self.asked = iteration, time.time()


def network(seed: int) -> Network:
    torch.manual_seed(seed)
    return build(digits_cnn, {}, "cross_entropy", functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))


def fit(way: str, seed: int, epochs: int, data: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    x, y, tx, ty = data
    train = DataSet(x.reshape(-1, 1, 8, 8), y)
    planned = epochs * -(-len(x) // BATCH)
    with SparkContext("local[2]" if way in ("two", "retires") else "local[1]", f"elastic-{way}") as sc:
        workers = cluster_workers(sc.client)
        first = set(workers)
        retired = next((a for a, info in workers.items() if info["name"] == 1), None)  # scale(1) retires it
        net = network(seed)
        spark_net = SparkNet(sc, net, SharedTrainingMaster(BATCH, rng_seed=seed, collect_training_stats=True))
        scaler = {"joins": 2, "retires": 1}.get(way)
        if scaler is not None:
            scaler = ScaleAt(sc.client.cluster, planned // 4, scaler)
            spark_net.set_listeners(scaler)
        rdd = sc.parallelize(train.batch_by(BATCH), 2).cache()
        rdd.count()
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TrainerLostWarning)
            spark_net.fit(rdd, epochs=epochs)
        seconds = time.perf_counter() - start
    result: dict[str, Any] = {
        "way": way,
        "seed": seed,
        "seconds": seconds,
        "examples_per_second": epochs * len(x) / seconds,
        "accuracy": accuracy(net.module, tx.reshape(-1, 1, 8, 8), ty),
        "minibatches": net.iteration,
    }
    trainers = spark_net.training_stats.trainers
    result["trainers_minibatches"] = sum(t.minibatches for t in trainers)
    result["lost_warnings"] = sum(issubclass(w.category, TrainerLostWarning) for w in caught)
    if way == "retires" and scaler is not None and scaler.scaled_at is not None:
        result["retired_minibatches"] = sum(t.minibatches for t in trainers if t.worker == retired)
    if way == "joins" and scaler is not None and scaler.scaled_at is not None:
        joined = [t for t in trainers if t.worker not in first]
        result["left_when_asked"] = planned - scaler.scaled_at
        result["newcomer_minibatches"] = sum(t.minibatches for t in joined)
        result["newcomer_share"] = result["newcomer_minibatches"] / result["left_when_asked"]
        firsts = [start for t in joined for phase, start, _ in t.phases if phase == "fit"]
        result["seconds_to_join"] = min(firsts) - scaler.asked if firsts else None
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = command_line(__doc__.splitlines()[0], cases=WAY_HELP, title="ways")
    parser.add_argument("--seeds", type=int, default=3, help="fits of each way (default 3)")
    parser.add_argument("--epochs", type=int, default=100, help="epochs a fit (default 100)")
    args = parse(parser, argv, RESULTS, seeds=1, epochs=8)
    data = digits()
    report = header("elastic", epochs=args.epochs, batch=BATCH)
    report["fits"] = []
    for way in WAYS:
        if not args.smoke:
            fit(way, 100, 2, data)  # the workers' first imports, unrecorded
        for seed in range(args.seeds):
            result = fit(way, seed, args.epochs, data)
            report["fits"].append(result)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()})
    summary = {}
    for way in WAYS:
        fits = [f for f in report["fits"] if f["way"] == way]
        summary[way] = {
            "examples_per_second": statistics.mean(f["examples_per_second"] for f in fits),
            "seconds": statistics.mean(f["seconds"] for f in fits),
            "accuracy": statistics.mean(f["accuracy"] for f in fits),
        }
        if way == "retires":
            summary[way]["lost_warnings"] = sum(f["lost_warnings"] for f in fits)
            summary[way]["every_minibatch_once"] = all(f["trainers_minibatches"] == f["minibatches"] for f in fits)
        if way == "joins":
            summary[way]["newcomer_share"] = statistics.mean(f.get("newcomer_share", 0.0) for f in fits)
            summary[way]["seconds_to_join"] = statistics.mean(f.get("seconds_to_join") or 0.0 for f in fits)
    report["summary"] = summary
    print("\nway      examples/s  seconds  accuracy  newcomer's share of the rest")
    for way, s in summary.items():
        share = f"{s['newcomer_share']:.0%}" if "newcomer_share" in s else ""
        if way == "retires":
            share = f"(lost-trainer warnings: {s['lost_warnings']}, every minibatch once: {s['every_minibatch_once']})"
        print(f"{way:8} {s['examples_per_second']:10.0f} {s['seconds']:8.1f} {s['accuracy']:9.4f}  {share}")
    write_results(args.out, report)
    return report


if __name__ == "__main__":
    main()
