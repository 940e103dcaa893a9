"""Gradient sharing on a small model, where a step's fixed costs, not the update's size, decide.

Run from the repository root with ``python -m benchmarks.small_model`` (about 2 minutes).
scikit-learn's digits (1,200 training and 597 test images), the MLP 64-256-10 of
``benchmarks.quality`` (19,210 parameters), SGD (lr 0.01, momentum 0.9), minibatches of 16, 20
epochs (1,500 minibatches), each run ``REPEATS`` times (the median goes in the table), the rows
in turn within each repeat, with ``local[1]`` and ``local[2]`` open side by side, so that a slow
spell of the machine (the single process ran anywhere from 31,000 to 51,000 examples/s in runs an
hour apart) weighs on every row alike:

- **single**: plain PyTorch, one thread, the whole training timed, in a process of its own (started
  for each repeat, so that neither the driver's event loops nor the open clusters share its
  interpreter: in the driver, beside the two clusters, the same loop ran 2-11% slower in 5 of 6
  alternated pairs);
- **ddp**: PyTorch DDP over gloo, 2 processes × 1 thread, 16 examples each a step; as in
  ``benchmarks.compare``, its timed epochs only (after a few warm-up steps), not starting the
  processes;
- **sharing**: dlscale's ``SharedTrainingMaster`` with its defaults on ``SparkContext("local[1]")``
  and ``("local[2]")``, one ``fit_paths`` of the 20 epochs on minibatch files exported before, timed
  whole: shipping the network, opening the sessions and gathering the trainers' states included;
  with its trainers' phase timings per minibatch; on 2 workers also with ``dlscale.training.sharing.lease``
  at each of ``LEASES`` (minibatches a trainer takes from the scheduler in one call), and on 1
  worker also with ``prefetch=0`` (each minibatch loaded by the trainer's own thread when it is
  needed, not by a thread beside it);
- **averaging**: dlscale's ``ParameterAveragingTrainingMaster`` on ``local[1]`` and ``local[2]`` with
  its defaults (the frequency and streaming chosen by the fit), one ``fit_paths`` of the 20 epochs
  timed whole, and on ``local[2]`` averaging every 5 minibatches (DL4J's default) and once an epoch
  (``averaging_frequency`` 38: each worker's share of an epoch's 75 minibatches), each without and
  with streaming rounds: what a user with a small model could pick instead of gradient sharing; with the CPU the whole
  machine spent during the fit and its seconds by role, as ``benchmarks.compare`` records them
  (``cpu_seconds``: the driver's own thread and its event loops, the nannies, the workers' event loops
  and their tasks, the trainers), and, as ``benchmarks.compare`` records them, the fit's fixed costs
  before its first step and after its last (``fit_edges_seconds``) and where a trainer's time went
  (``trainer_seconds``: fitting, waiting for a minibatch, waiting for the slowest trainer at a
  round's end, averaging): where a round's cost goes on the machine; and on 2 workers, with the
  defaults, as DL4J's examples train: **a fit per epoch**, 20 calls of
  ``fit_paths`` on one ``SparkNet`` (its trainers parked between them), the 20 timed together
  (``fit_edges_seconds``: the first fit's head and the last fit's tail).

Targets: sharing on 2 workers at least as fast as the single process over the whole fit; the best
averaging on 2 workers at least 1.3x the single process, and no 2-worker fit with a master's
defaults slower than its 1-worker fit. Results go to ``benchmarks/results/small_model.json``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

import dask
import torch

from benchmarks import _ddp
from benchmarks._common import (
    accuracy,
    command_line,
    digits,
    export_paths,
    header,
    parse,
    plain_epochs,
    shrink,
    write_results,
)
from benchmarks.compare import _edges, _round_seconds, measured
from benchmarks.quality import digits_mlp
from dlscale import ParameterAveragingTrainingMaster, SharedTrainingMaster, SparkContext, SparkNet, config
from dlscale.nn import Network

RESULTS = Path(__file__).resolve().parent / "results" / "small_model.json"
BATCH, EPOCHS, LR, REPEATS = 16, 20, 0.01, 3
LEASES = (1, 4)  # besides the default
ONCE_AN_EPOCH = 38  # on 2 workers: each worker's share of an epoch's 75 minibatches
AVERAGING_FREQUENCIES = (5, ONCE_AN_EPOCH)  # DL4J's default, once an epoch on 2 workers
DEFAULTS = "defaults"  # the rows of the master's defaults: frequency and streaming chosen by the fit
OPTIMIZER = functools.partial(torch.optim.SGD, lr=LR, momentum=0.9)
PHASES = ("fit", "encode", "send", "apply", "wait")
ROW_HELP = {
    "single": "plain PyTorch, one thread, in a fresh process, the whole training timed",
    "ddp (2 processes)": "PyTorch DDP over gloo, 2 processes of one thread, its timed epochs",
    "sharing (1 worker)": 'SharedTrainingMaster\'s defaults on SparkContext("local[1]"), one fit_paths',
    "sharing (1 worker, prefetch 0)": "the same, each minibatch loaded by the trainer's own thread",
    "averaging (1 worker, defaults)": "ParameterAveragingTrainingMaster's defaults on local[1]",
    "sharing (2 workers)": "SharedTrainingMaster's defaults on local[2]",
    "sharing (2 workers, lease 1)": "the same, dlscale.training.sharing.lease 1 (minibatches a trainer takes a call)",
    "sharing (2 workers, lease 4)": "the same, dlscale.training.sharing.lease 4",
    "averaging (2 workers, defaults)": "the defaults on local[2]: frequency and streaming chosen by the fit",
    "averaging (2 workers, frequency 5)": "ParameterAveragingTrainingMaster on local[2], every 5 (DL4J's default)",
    "averaging (2 workers, frequency 5, streaming)": "the same with streaming rounds (streaming=True)",
    "averaging (2 workers, frequency 38)": "averaging once an epoch (each worker's share of 75 minibatches)",
    "averaging (2 workers, frequency 38, streaming)": "once an epoch, streaming rounds",
    "a fit per epoch: averaging (2 workers, defaults)": "one fit_paths an epoch, as DL4J's examples do, the defaults",
}
"""A line on each row (:func:`_runs`), for ``--help``."""


def single_process(data: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """:func:`single` in a fresh process (spawned: nothing of this one's threads or clusters)."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(single, data).result()


def single(data: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Plain PyTorch on one thread: examples/s over the whole training, and test accuracy."""
    x, y, tx, ty = data
    torch.set_num_threads(1)
    module = digits_mlp(0)
    seconds = plain_epochs(module, OPTIMIZER(module.parameters()), x, y, BATCH, EPOCHS)
    return {"examples_per_s": EPOCHS * len(x) / seconds, "seconds": seconds, "accuracy": accuracy(module, tx, ty)}


def ddp(data: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """DDP over gloo, 2 processes of one thread: examples/s of its timed epochs (a run whose process
    gloo aborts is run again, and counted)."""
    x, y, tx, ty = data
    r = _ddp.ddp_samples_per_s(
        2, functools.partial(digits_mlp, 0), x, y, BATCH, EPOCHS, OPTIMIZER, 1, test_x=tx, test_y=ty
    )
    return {
        "examples_per_s": r["samples_per_s"],
        "seconds": r["seconds"],
        "accuracy": r["test_accuracy"],
        "aborted_before": r["aborted_before"],
    }


def sharing(sc: SparkContext, paths: Any, data: tuple[torch.Tensor, ...], **options: Any) -> dict[str, Any]:
    """One ``fit_paths`` of every epoch with ``SharedTrainingMaster``'s defaults but ``options``, timed whole."""
    _, _, tx, ty = data
    net = Network(digits_mlp(0), "cross_entropy", OPTIMIZER)
    master = SharedTrainingMaster(BATCH, rng_seed=0, collect_training_stats=True, **options)
    spark_net = SparkNet(sc, net, master)
    start = time.perf_counter()
    spark_net.fit_paths(paths, epochs=EPOCHS)
    net.settle()  # the trained state on the driver, as reading the network takes it
    seconds = time.perf_counter() - start
    trainers = spark_net.training_stats.trainers
    steps = sum(t.minibatches for t in trainers)
    return {
        "examples_per_s": sum(t.examples for t in trainers) / seconds,
        "seconds": seconds,
        "accuracy": accuracy(net.module, tx, ty),
        "trainers": len(trainers),
        "phase_ms_per_minibatch": {p: 1000 * sum(t.seconds(p) for t in trainers) / steps for p in PHASES},
        "busy_seconds": sum(t.seconds(p) for t in trainers for p in PHASES) / len(trainers),
    }


def averaging(
    sc: SparkContext,
    paths: Any,
    data: tuple[torch.Tensor, ...],
    frequency: int | None,
    streaming: bool | None = False,
    fits: int = 1,
) -> dict[str, Any]:
    """``fits`` calls of ``fit_paths`` with ``ParameterAveragingTrainingMaster`` sharing every epoch
    (one of all of them, or one per epoch as DL4J's examples train, the trainers parked between
    them), timed whole."""
    x, _, tx, ty = data
    net = Network(digits_mlp(0), "cross_entropy", OPTIMIZER)
    master = ParameterAveragingTrainingMaster(
        BATCH, averaging_frequency=frequency, streaming=streaming, rng_seed=0, collect_training_stats=True
    )
    spark_net = SparkNet(sc, net, master)
    usage: dict[str, Any] = {}
    with measured(usage):
        start, wall = time.perf_counter(), time.time()
        for _ in range(fits):
            spark_net.fit_paths(paths, epochs=EPOCHS // fits)
        net.settle()  # the trained state on the driver, as reading the network takes it
        seconds = time.perf_counter() - start
    stats = spark_net.training_stats
    return {
        "examples_per_s": EPOCHS * len(x) / seconds,
        "seconds": seconds,
        "accuracy": accuracy(net.module, tx, ty),
        "averaging_frequency": stats.averaging_frequency or frequency,
        "cpu_utilisation": usage["cpu_utilisation"],
        "cpu_seconds": usage["cpu_seconds"],
        "fit_edges_seconds": _edges(stats, wall, time.time()),
        "trainer_seconds": _round_seconds(stats.rounds, stats.choice["streaming"] if stats.choice else bool(streaming)),
        "choice": stats.choice,
    }


def _averaging_target(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The best 2-worker averaging against the bound of 1.3x the single process, and whether the default
    defaults on 2 workers are at least as fast as on 1; and the defaults on 2 workers against the bound."""
    two = {k: r for k, r in rows.items() if k.startswith("averaging (2 workers")}
    best = max(two, key=lambda k: two[k]["vs_single"])
    one, both = rows[f"averaging (1 worker, {DEFAULTS})"], rows[f"averaging (2 workers, {DEFAULTS})"]
    return {
        "best": best,
        "vs_single": two[best]["vs_single"],
        "bound": 1.3,
        "met": two[best]["vs_single"] >= 1.3,
        "defaults_vs_single": both["vs_single"],
        "defaults_met": both["vs_single"] >= 1.3,
        "defaults_vs_best": both["examples_per_s"] / two[best]["examples_per_s"],
        "default_2_vs_1_worker": both["examples_per_s"] / one["examples_per_s"],
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median examples/s, with every run's examples/s beside it."""
    ranked = sorted(runs, key=lambda r: r["examples_per_s"])
    return {**ranked[len(ranked) // 2], "repeats": [r["examples_per_s"] for r in runs]}


def _prepared(sc: SparkContext, data: tuple[torch.Tensor, ...], folder: str, workers: int) -> tuple[SparkContext, Any]:
    """``sc`` with the digits exported to ``folder`` and each master's first fit done (its imports, its
    first pickling, the workers' connections): the timed fits start warm."""
    paths = export_paths(sc, data[0], data[1], folder, batch=BATCH)
    paths = sc.parallelize(paths.collect(), workers)
    few = sc.parallelize(paths.take(2 * workers), workers)
    sharing(sc, few, data)
    for frequency in AVERAGING_FREQUENCIES:
        averaging(sc, few, data, frequency)
    averaging(sc, few, data, None, None)
    return sc, paths


def _runs(data: tuple[torch.Tensor, ...], contexts: dict[int, tuple[SparkContext, Any]]) -> dict[str, Any]:
    """Every row's run, by name, in the order a repeat runs them."""
    runs: dict[str, Any] = {
        "single": functools.partial(single_process, data),
        "ddp (2 processes)": functools.partial(ddp, data),
    }
    for workers, (sc, paths) in contexts.items():
        label = f"{workers} worker{'s' * (workers > 1)}"
        runs[f"sharing ({label})"] = functools.partial(sharing, sc, paths, data)
        if workers == 1:
            runs["sharing (1 worker, prefetch 0)"] = functools.partial(sharing, sc, paths, data, prefetch=0)
        for lease in LEASES if workers > 1 else ():
            runs[f"sharing (2 workers, lease {lease})"] = functools.partial(_with_lease, lease, sc, paths, data)
        runs[f"averaging ({label}, {DEFAULTS})"] = functools.partial(averaging, sc, paths, data, None, None)
        for frequency in AVERAGING_FREQUENCIES if workers > 1 else ():
            name = f"averaging ({label}, frequency {frequency})"
            runs[name] = functools.partial(averaging, sc, paths, data, frequency)
            runs[f"{name[:-1]}, streaming)"] = functools.partial(averaging, sc, paths, data, frequency, True)
        if workers > 1:  # DL4J's loop of a fit per epoch: each fit's fixed costs paid every epoch
            loop = functools.partial(averaging, sc, paths, data, None, None, EPOCHS)
            runs[f"a fit per epoch: averaging ({label}, {DEFAULTS})"] = loop
    return runs


def _with_lease(lease: int, *args: Any) -> dict[str, Any]:
    with dask.config.set({"dlscale.training.sharing.lease": lease}):
        return sharing(*args)


def main(argv: list[str] | None = None) -> None:
    args = parse(command_line(__doc__.splitlines()[0], cases=ROW_HELP, title="rows"), argv, RESULTS)
    if args.smoke:
        shrink(globals(), EPOCHS=1, REPEATS=1, LEASES=(4,), AVERAGING_FREQUENCIES=(5,))
    data = digits()
    with (
        tempfile.TemporaryDirectory() as tmp,
        SparkContext("local[1]", "small-model-1") as one,
        SparkContext("local[2]", "small-model-2") as two,
    ):
        runs = _runs(data, {1: _prepared(one, data, f"{tmp}/1", 1), 2: _prepared(two, data, f"{tmp}/2", 2)})
        repeats: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
        for _ in range(REPEATS):  # each repeat runs every row once: a slow spell of the machine hits them alike
            for name, run in runs.items():
                repeats[name].append(run())
    rows = {name: median_run(results) for name, results in repeats.items()}
    base = rows["single"]["examples_per_s"]
    for row in rows.values():
        row["vs_single"] = row["examples_per_s"] / base
    ratio = rows["sharing (2 workers)"]["vs_single"]
    report = {
        **header("small_model"),
        "setup": {
            "model": "MLP 64-256-10",
            "batch": BATCH,
            "epochs": EPOCHS,
            "lr": LR,
            "repeats": REPEATS,
            "lease": config.get("training.sharing.lease"),
        },
        "runs": rows,
        "target": {"sharing_2_workers_vs_single": ratio, "bound": 1.0, "met": ratio >= 1.0},
        "averaging_target": _averaging_target(rows),
    }
    write_results(args.out, report)
    for name, row in rows.items():
        rate, ratio, acc = row["examples_per_s"], row["vs_single"], row["accuracy"]
        print(f"{name:30s} {rate:9,.0f} examples/s  {ratio:.2f}x single  test accuracy {acc:.3f}")


if __name__ == "__main__":
    main()
