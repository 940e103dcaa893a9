"""Training quality of gradient sharing: test accuracy over several seeds, single process against
``SharedTrainingMaster`` with each compressor on 2 and 4 workers, with the bytes each trainer sent
against what dense updates would have sent, and beside them what a PyTorch user would run instead:
DDP and DDP with the PowerSGD hook on as many processes.

Run from the repository root::

    python -m benchmarks.quality              # every model, 3 seeds, 2 and 4 workers
    python -m benchmarks.quality --quick      # one seed, 2 workers, a few epochs: a smoke run
    python -m benchmarks.quality --models digits_mlp,digits_cnn --workers 2 --seeds 0,1
    python -m benchmarks.quality --workers 2 --aggregations sum,mean   # both ways of combining updates
    python -m benchmarks.quality --compressors topk --peers ""   # no DDP rows
    python -m benchmarks.quality --compressors "" --workers 2    # DDP rows alone
    python -m benchmarks.quality --compressors topk --masking off   # without momentum masking
    python -m benchmarks.quality --averaging 5,20,auto --compressors "" --peers ""   # parameter averaging
    python -m benchmarks.quality --averaging 5,s5 --compressors "" --peers ""   # and with streaming rounds
    python -m benchmarks.quality --report     # the table again from the last results

Models (``MODELS``): scikit-learn's digits (1,200 training and 597 test images) with an MLP, a
CNN and a CNN with BatchNorm, and the MLP and CNN of ``benchmarks.compare`` on its synthetic task,
with less data or fewer epochs than there so that the whole run stays near an hour on two cores.
Each seed fixes the model's initial weights and the order of minibatches. The single-process
reference is plain PyTorch: the same initial weights, optimizer, minibatches, epochs and per-epoch
minibatch order as the scheduler of gradient sharing hands out (``np.random.default_rng([seed,
epoch]).permutation``). Beside it, ``sync_sum`` trains in one process on the gradients of W
consecutive minibatches of that order summed a step: the W-fold fewer sequential steps of W
trainers whose updates are all summed, without their staleness or compression. Every shared fit
runs on an embedded ``SparkContext("local[W]")`` (W worker processes of one thread), from
minibatch files exported once. The peers (``PEERS``) run ``benchmarks._ddp`` in W processes of one
thread over gloo: each takes its own minibatch of the model's batch a step and DDP averages the
gradients (a global batch of W times the batch, W times fewer steps an epoch, as a
``DistributedSampler`` gives; an epoch's incomplete last global batch is dropped), from the same
initial weights (the seed's) and with an order of examples of the seed. Results go to
``benchmarks/results/quality.json``, replacing the runs of the same model, method, workers and seed
and keeping the others, so that a part can be rerun on its own (``--quick`` writes
``quality-quick.json`` instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_digits

from benchmarks import _ddp, compare
from benchmarks._common import accuracy, command_line, header, make_data, mlp, parse, write_results
from dlscale import ParameterAveragingTrainingMaster, SharedTrainingMaster, SparkContext, SparkNet
from dlscale.data import DataSet, export_minibatches
from dlscale.encoding.registry import COMPRESSORS, DEFAULT
from dlscale.nn import Network
from dlscale.runtime.cluster import cluster_workers
from dlscale.training.sharing.master import AGGREGATIONS

RESULTS = Path(__file__).resolve().parent / "results" / "quality.json"
AGGREGATION = SharedTrainingMaster(1).aggregation  # the default
SEEDS = (0, 1, 2)
WORKERS = (2, 4)
PEERS = {"ddp": False, "ddp_powersgd": True}  # name: with PowerSGD
LARGE_BATCH = "sync_sum"  # the method name of single's rows with several minibatches a step
UNMASKED = " unmasked"  # a compressor's method name ends so when its fits ran without momentum masking
METHOD_HELP = {
    "single": "plain PyTorch in one process, in gradient sharing's minibatch order: the reference",
    LARGE_BATCH: "one process summing the gradients of W consecutive minibatches a step",
    "topk": "SharedTrainingMaster's default compressor: per-tensor top-k (--compressors)",
    "dl4j": "SharedTrainingMaster with Deeplearning4j's threshold encoding (--compressors)",
    "dense": "SharedTrainingMaster sending every value, uncompressed (--compressors)",
    f"<compressor>{UNMASKED}": "a compressor's fits without momentum masking (--masking off)",
    "ddp": "PyTorch DDP over gloo, W processes of one thread (--peers)",
    "ddp_powersgd": "DDP with the PowerSGD hook (--peers)",
    "averaging f<N>": "ParameterAveragingTrainingMaster every N minibatches, no streaming (--averaging N)",
    "streaming f<N>": "the same with streaming rounds (--averaging sN)",
    "chosen": "ParameterAveragingTrainingMaster with its defaults: frequency and streaming chosen by the fit",
}
"""A line on each method (a row of the table), for ``--help``."""


def digits_mlp(seed: int) -> torch.nn.Module:
    """An MLP 64-256-10 (19,210 parameters)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def digits_cnn(seed: int, batch_norm: bool = False) -> torch.nn.Module:
    """Two 3x3 convolutions (16 and 32 channels, padded) on the 8x8 digits, a 2x2 max pool and a
    linear layer (9,930 parameters; 10,026 with a BatchNorm after each convolution)."""
    torch.manual_seed(seed)

    def norm(channels: int) -> list[torch.nn.Module]:
        return [torch.nn.BatchNorm2d(channels)] if batch_norm else []

    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 8, 8)),
        torch.nn.Conv2d(1, 16, 3, padding=1),
        *norm(16),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        *norm(32),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 10),
    )


@dataclasses.dataclass(frozen=True)
class Model:
    """A model, the data it trains on and how: SGD with momentum 0.9, ``batch`` examples a step."""

    title: str
    data: str  # "digits" or "compare"
    train: int | None  # training examples used (None: all)
    module: Callable[[int], torch.nn.Module]
    lr: float
    batch: int
    epochs: int
    quick_epochs: int

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)


MODELS = {
    "digits_mlp": Model("digits MLP 64-256-10", "digits", None, digits_mlp, 0.01, 16, 20, 3),
    "digits_cnn": Model("digits CNN conv16-conv32-linear", "digits", None, digits_cnn, 0.05, 32, 10, 2),
    "digits_cnn_bn": Model(
        "digits CNN with BatchNorm", "digits", None, functools.partial(digits_cnn, batch_norm=True), 0.05, 32, 10, 2
    ),
    # compare's workloads on part of its 25,600 training examples, to keep the whole run near an hour
    "compare_mlp": Model("compare's MLP 784-2048-2048-10", "compare", 6400, mlp, 0.01, 64, 1, 1),
    "compare_cnn": Model("compare's CNN conv16-conv32-linear", "compare", 12_800, compare.cnn, 0.01, 64, 3, 1),
}


def load(model: Model, quick: bool) -> tuple[torch.Tensor, ...]:
    """``(x, y, test_x, test_y)`` of ``model``: digits split as the test suite splits it (1,200 / 597,
    pixels scaled to [0, 1]), or the first ``model.train`` of ``benchmarks.compare``'s training
    examples and all its 4,096 test examples (2,560 and 1,024 when ``quick``)."""
    if model.data == "digits":
        x, y = load_digits(return_X_y=True)
        x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        return x[perm[:1200]], y[perm[:1200]], x[perm[1200:]], y[perm[1200:]]
    x, y, tx, ty = make_data()
    train, test = (2560, 1024) if quick else (model.train, len(tx))
    return x[:train], y[:train], tx[:test], ty[:test]


def minibatches(x: torch.Tensor, y: torch.Tensor, batch: int) -> list[DataSet]:
    """Consecutive minibatches of ``batch`` examples (the last may be fewer): what both methods train on."""
    return [DataSet(x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch)]


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of ``n`` minibatches in ``epoch``: the one gradient sharing's scheduler hands out
    for ``rng_seed=seed`` in a network's first fit."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def single(
    model: Model,
    batches: list[DataSet],
    test: tuple[torch.Tensor, torch.Tensor],
    seed: int,
    epochs: int,
    per_step: int = 1,
) -> float:
    """Test accuracy after plain PyTorch training, one thread, in the minibatch order gradient
    sharing's scheduler hands out. With ``per_step`` W > 1 each step sums the gradients of W
    consecutive minibatches of that order (the last group of an epoch may be fewer): what summing
    every trainer's update reaches with no staleness and no compression, in the fewer sequential
    steps that W trainers take (``sync_sum``)."""
    torch.set_num_threads(1)
    module = model.module(seed)
    optimizer = model.optimizer(module.parameters())
    module.train()
    for epoch in range(epochs):
        order = epoch_order(seed, epoch, len(batches))
        for start in range(0, len(order), per_step):
            optimizer.zero_grad()
            for i in order[start : start + per_step]:
                torch.nn.functional.cross_entropy(module(batches[i].features), batches[i].labels).backward()
            optimizer.step()
    return accuracy(module, *test)


def shared(
    sc: SparkContext,
    model: Model,
    paths: list[str],
    test: tuple[torch.Tensor, torch.Tensor],
    seed: int,
    epochs: int,
    compressor: str,
    aggregation: str,
    momentum_masking: bool = True,
) -> dict[str, Any]:
    """Test accuracy and bytes sent after gradient sharing on ``sc``'s workers."""
    net = Network(model.module(seed), "cross_entropy", model.optimizer)
    master = SharedTrainingMaster(
        model.batch,
        compressor=compressor,
        aggregation=aggregation,
        momentum_masking=momentum_masking,
        rng_seed=seed,
        collect_training_stats=True,
    )
    spark_net = SparkNet(sc, net, master)
    start = time.perf_counter()
    spark_net.fit_paths(sc.parallelize(paths, len(paths)), epochs=epochs)
    net.settle()  # the trained state on the driver, as reading the network takes it
    seconds = time.perf_counter() - start
    trainers = spark_net.training_stats.trainers
    dense = 4 * net.num_params()  # a dense float32 update
    sent = sum(t.bytes_sent for t in trainers)
    messages = sum(t.messages_sent for t in trainers)
    return {
        "accuracy": accuracy(net.module, *test),
        "seconds": seconds,
        "trainers": len(trainers),
        "minibatches": sum(t.minibatches for t in trainers),
        "messages_sent": messages,
        "bytes_sent": sent,
        "dense_bytes": dense * messages,
        "bytes_sent_per_trainer": sent / len(trainers),
        "compression": dense * messages / max(sent, 1),
    }


def averaged(
    sc: SparkContext,
    model: Model,
    paths: list[str],
    test: tuple[torch.Tensor, torch.Tensor],
    seed: int,
    epochs: int,
    frequency: int | None,
    streaming: bool | None = False,
) -> dict[str, Any]:
    """Test accuracy after parameter averaging on ``sc``'s workers every ``frequency`` minibatches (with
    streaming rounds or not; ``None``: as the fit chooses), and the bytes its allreduces sent (each
    trainer 2 (W - 1) / W times its state, parameters and momentum, a round)."""
    net = Network(model.module(seed), "cross_entropy", model.optimizer)
    master = ParameterAveragingTrainingMaster(
        model.batch, averaging_frequency=frequency, streaming=streaming, rng_seed=seed, collect_training_stats=True
    )
    spark_net = SparkNet(sc, net, master)
    start = time.perf_counter()
    spark_net.fit_paths(sc.parallelize(paths, len(paths)), epochs=epochs)
    net.settle()  # the trained state on the driver, as reading the network takes it
    seconds = time.perf_counter() - start
    stats = spark_net.training_stats
    workers = len(cluster_workers(sc.client))
    state = 2 * 4 * net.num_params()
    sent = len(stats.rounds) * 2 * (workers - 1) * state  # by all trainers
    steps = sum(len(w.batches) for r in stats.rounds for w in r.workers)
    return {
        "accuracy": accuracy(net.module, *test),
        "seconds": seconds,
        "trainers": workers,
        "minibatches": steps,
        "averaging_frequency": stats.averaging_frequency or frequency,
        "messages_sent": len(stats.rounds),
        "bytes_sent": sent,
        "dense_bytes": 4 * net.num_params() * steps,  # one dense update a minibatch
        "bytes_sent_per_trainer": sent / workers,
        "compression": 4 * net.num_params() * steps / max(sent, 1),
    }


def peer(
    model: Model,
    x: torch.Tensor,
    y: torch.Tensor,
    test: tuple[torch.Tensor, torch.Tensor],
    seed: int,
    epochs: int,
    workers: int,
    powersgd: bool,
) -> dict[str, Any]:
    """Test accuracy after DDP (with PowerSGD when ``powersgd``) in ``workers`` processes."""
    r = _ddp.ddp_samples_per_s(
        workers,
        functools.partial(model.module, seed),
        x,
        y,
        model.batch,
        epochs,
        model.optimizer,
        test_x=test[0],
        test_y=test[1],
        warmup_steps=0,
        seed=seed,
        powersgd=powersgd,
    )
    steps = r["steps_per_epoch"] * epochs
    return {
        "accuracy": r["test_accuracy"],
        "seconds": r["seconds"],
        "trainers": workers,
        "minibatches": steps * workers,
        "messages_sent": steps,
        "bytes_sent": r["allreduced_bytes_per_step"] * steps * workers,
        "dense_bytes": r["grad_bytes_per_step"] * steps * workers,
        "bytes_sent_per_trainer": r["allreduced_bytes_per_step"] * steps,
        "compression": r["grad_bytes_per_step"] / r["allreduced_bytes_per_step"],
        "aborted_before": r["aborted_before"],
    }


# -- the report -------------------------------------------------------------------------------------------
def _method(compressor: str, masking: bool) -> str:
    """The method name of a compressor's runs: its own, or with :data:`UNMASKED` after it."""
    return compressor if masking else compressor + UNMASKED


def _key(run: dict[str, Any]) -> tuple[Any, ...]:
    return run["model"], run["method"], run["aggregation"], run["workers"], run["seed"]


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model, method, aggregation and workers: mean, std, min and max of test accuracy over the
    seeds, the commits its runs ran on (a run kept from an earlier file without one: "unrecorded"),
    and the mean bytes sent per trainer against dense updates."""
    groups: dict[tuple[str, str, str | None, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["model"], r["method"], r["aggregation"], r["workers"]), []).append(r)
    order = {m: i for i, m in enumerate(MODELS)}
    compressors = [_method(c, k) for c in dict.fromkeys((DEFAULT, *sorted(COMPRESSORS))) for k in (True, False)]
    methods = {m: i for i, m in enumerate(dict.fromkeys(("single", LARGE_BATCH, *compressors, *PEERS)))}
    rows = []
    for (model, method, aggregation, workers), rs in sorted(
        groups.items(),
        key=lambda kv: (
            order.get(kv[0][0], len(order)),
            kv[0][3],
            methods.get(kv[0][1], len(methods)),
            kv[0][2] != AGGREGATION,
        ),
    ):
        accs = [r["accuracy"] for r in rs]
        row: dict[str, Any] = {
            "model": model,
            "method": method,
            "aggregation": aggregation,
            "workers": workers,
            "seeds": sorted(r["seed"] for r in rs),
            "mean": statistics.fmean(accs),
            "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "min": min(accs),
            "max": max(accs),
            "commits": sorted({r.get("commit") or "unrecorded" for r in rs}),
        }
        if method not in ("single", LARGE_BATCH):
            row["bytes_sent_per_trainer"] = statistics.fmean(r["bytes_sent_per_trainer"] for r in rs)
            row["dense_bytes_per_trainer"] = statistics.fmean(r["dense_bytes"] / r["trainers"] for r in rs)
            row["compression"] = sum(r["dense_bytes"] for r in rs) / max(sum(r["bytes_sent"] for r in rs), 1)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    singles = {r["model"]: r["mean"] for r in rows if r["method"] == "single"}
    lines = [
        "| model | method | aggregation | workers | seeds | mean accuracy | vs single (points) | std | min | max | "
        "bytes sent per trainer | dense bytes per trainer | compression |",
        "|" + "---|" * 13,
    ]
    for r in rows:
        base = singles.get(r["model"])
        gap = "" if base is None or r["method"] == "single" else f"{100 * (r['mean'] - base):+.1f}"
        sent = (
            f"{r['bytes_sent_per_trainer']:,.0f} | {r['dense_bytes_per_trainer']:,.0f} | {r['compression']:,.1f}x"
            if "compression" in r
            else " | | "
        )
        lines.append(
            f"| {r['model']} | {r['method']} | {r['aggregation'] or ''} | {r['workers']} | {len(r['seeds'])} | "
            f"{r['mean']:.3f} | {gap} | "
            f"{r['std']:.3f} | {r['min']:.3f} | {r['max']:.3f} | {sent} |"
        )
    return "\n".join(lines)


def write_report(path: Path, report: dict[str, Any], ran: bool = True) -> None:
    report["summary"] = summarise(report["runs"])
    print(table(report["summary"]), flush=True)
    write_results(path, report, indent=1, ran=ran)


# -- the driver --------------------------------------------------------------------------------------------
def _names(value: str, known: tuple[str, ...], what: str, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    names = tuple(value.split(","))
    unknown = set(names) - set(known)
    if unknown:
        parser.error(f"--{what}: unknown {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    return names


def _averaging(value: str, parser: argparse.ArgumentParser) -> tuple[str, int | None, bool | None]:
    """A row of ``--averaging`` (``5``, ``s20``, ``chosen``): its method's name, frequency and streaming."""
    if value == "chosen":
        return "chosen", None, None
    streaming = value.startswith("s")
    frequency = value[streaming:]
    if not frequency.isdigit():
        parser.error(f"--averaging: {value!r} is not a frequency, one after 's', or 'chosen'")
    return f"{'streaming' if streaming else 'averaging'} f{frequency}", int(frequency), streaming


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__.split("\n\n")[0], cases=METHOD_HELP, title="methods (on each model of --models)")
    parser.add_argument("--quick", action="store_true", help="one seed, 2 workers, few epochs, less data")
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help="comma-separated models (default all): " + ", ".join(f"{n} ({m.title})" for n, m in MODELS.items()),
    )
    parser.add_argument("--workers", default=None, help="comma-separated worker counts (default 2,4; quick: 2)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; quick: 0)")
    parser.add_argument(
        "--compressors",
        default=",".join(sorted(COMPRESSORS, key=lambda c: c != DEFAULT)),
        help="comma-separated compressors (empty: none)",
    )
    parser.add_argument(
        "--aggregations", default=AGGREGATION, help=f"comma-separated aggregations (default {AGGREGATION})"
    )
    parser.add_argument(
        "--masking",
        default="on",
        help="comma-separated momentum masking of the shared fits: on (the default), off (rows named "
        f"'<compressor>{UNMASKED}')",
    )
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated peers to run beside (empty: none)")
    parser.add_argument(
        "--averaging",
        default="5",
        help="comma-separated frequencies of parameter averaging to run (rows 'averaging f<frequency>'; "
        "s<frequency>: with streaming rounds, rows 'streaming f<frequency>'; 'chosen': the master's "
        "defaults, frequency and streaming chosen by the fit; empty: none; default 5, DL4J's)",
    )
    parser.add_argument("--report", action="store_true", help="the table again from the last results")
    args = parse(parser, argv, RESULTS, quick=True, models="digits_mlp", compressors=DEFAULT, peers="ddp")
    if args.report:
        write_report(args.out, json.loads(RESULTS.read_text()), ran=False)
        return
    models = _names(args.models, tuple(MODELS), "models", parser)
    compressors = _names(args.compressors, tuple(COMPRESSORS), "compressors", parser) if args.compressors else ()
    aggregations = _names(args.aggregations, AGGREGATIONS, "aggregations", parser)
    maskings = tuple(m == "on" for m in _names(args.masking, ("on", "off"), "masking", parser))
    peers = _names(args.peers, tuple(PEERS), "peers", parser) if args.peers else ()
    frequencies = tuple(_averaging(f, parser) for f in args.averaging.split(",")) if args.averaging else ()
    workers = tuple(int(w) for w in (args.workers or ("2" if args.quick else ",".join(map(str, WORKERS)))).split(","))
    seeds = tuple(int(s) for s in (args.seeds or ("0" if args.quick else ",".join(map(str, SEEDS)))).split(","))
    path = RESULTS.with_name("quality-quick.json") if args.quick and args.out == RESULTS else args.out
    report: dict[str, Any] = {**header("quality"), "quick": args.quick, "runs": []}
    if not args.quick and path.exists():
        mine = {(m, "single", None, 1, s) for m in models for s in seeds}
        mine |= {(m, LARGE_BATCH, "sum", w, s) for m in models for w in workers for s in seeds}
        mine |= {
            (m, _method(c, k), a, w, s)
            for m in models
            for c in compressors
            for k in maskings
            for a in aggregations
            for w in workers
            for s in seeds
        }
        mine |= {(m, p, None, w, s) for m in models for p in peers for w in workers for s in seeds}
        mine |= {(m, f[0], None, w, s) for m in models for f in frequencies for w in workers for s in seeds}
        report["runs"] = [r for r in json.loads(path.read_text())["runs"] if _key(r) not in mine]
    report["setup"] = {
        "optimizer": "SGD momentum 0.9",
        "threads_per_worker": 1,
        "models": {
            name: {
                "title": m.title,
                "train_examples": m.train,
                "lr": m.lr,
                "batch": m.batch,
                "epochs": m.quick_epochs if args.quick else m.epochs,
            }
            for name, m in MODELS.items()
        },
    }

    def record(run: dict[str, Any]) -> None:
        report["runs"].append({**run, "commit": report["provenance"]["commit"]})
        write_results(path, {**report, "summary": summarise(report["runs"])}, indent=1)

    with tempfile.TemporaryDirectory(prefix="dlscale-quality-") as tmp:
        exported: dict[str, tuple[list[DataSet], list[str], tuple[torch.Tensor, torch.Tensor]]] = {}
        for name in models:
            model = MODELS[name]
            x, y, tx, ty = load(model, args.quick)
            batches = minibatches(x, y, model.batch)
            exported[name] = (batches, export_minibatches(batches, f"{tmp}/{name}", model.batch), (tx, ty))
            epochs = model.quick_epochs if args.quick else model.epochs
            for p, w, seed in itertools.product(peers, workers, seeds):  # no cluster either: before the shared fits
                r = peer(model, x, y, (tx, ty), seed, epochs, w, PEERS[p])
                print(
                    f"{name:14s} {p:13s} {w} workers seed {seed}: accuracy {r['accuracy']:.3f}, "
                    f"{r['compression']:.1f}x compression ({r['seconds']:.0f} s)",
                    flush=True,
                )
                record({"model": name, "method": p, "aggregation": None, "workers": w, "seed": seed, **r})
        for name in models:  # single-process references first: they take no cluster
            model = MODELS[name]
            batches, _, test = exported[name]
            epochs = model.quick_epochs if args.quick else model.epochs
            for seed in seeds:
                acc = single(model, batches, test, seed, epochs)
                print(f"{name:14s} single          seed {seed}: accuracy {acc:.3f}", flush=True)
                record(
                    {
                        "model": name,
                        "method": "single",
                        "aggregation": None,
                        "workers": 1,
                        "seed": seed,
                        "accuracy": acc,
                    }
                )
                for w in workers:
                    acc = single(model, batches, test, seed, epochs, per_step=w)
                    print(f"{name:14s} {LARGE_BATCH:13s} {w} workers seed {seed}: accuracy {acc:.3f}", flush=True)
                    record(
                        {
                            "model": name,
                            "method": LARGE_BATCH,
                            "aggregation": "sum",
                            "workers": w,
                            "seed": seed,
                            "accuracy": acc,
                        }
                    )
        for w in workers if compressors or frequencies else ():
            with SparkContext(f"local[{w}]", f"quality-{w}") as sc:
                for name in models:
                    model = MODELS[name]
                    _, paths, test = exported[name]
                    epochs = model.quick_epochs if args.quick else model.epochs
                    for (method, frequency, streaming), seed in itertools.product(frequencies, seeds):
                        r = averaged(sc, model, paths, test, seed, epochs, frequency, streaming)
                        print(
                            f"{name:14s} {method:13s} {w} workers seed {seed}: accuracy {r['accuracy']:.3f} "
                            f"({r['seconds']:.0f} s)",
                            flush=True,
                        )
                        record({"model": name, "method": method, "aggregation": None, "workers": w, "seed": seed, **r})
                    for compressor, masking, aggregation, seed in itertools.product(
                        compressors, maskings, aggregations, seeds
                    ):
                        r = shared(sc, model, paths, test, seed, epochs, compressor, aggregation, masking)
                        method = _method(compressor, masking)
                        print(
                            f"{name:14s} {method:8s} {aggregation:4s} {w} workers seed {seed}: accuracy "
                            f"{r['accuracy']:.3f}, {r['compression']:.1f}x compression ({r['seconds']:.0f} s)",
                            flush=True,
                        )
                        record(
                            {
                                "model": name,
                                "method": method,
                                "aggregation": aggregation,
                                "workers": w,
                                "seed": seed,
                                **r,
                            }
                        )
    write_report(path, report)


if __name__ == "__main__":
    main()
