"""dlscale against its peers in one run: the same model, data and batch size trained by single-process
PyTorch, independent single processes side by side (the machine's ceiling), PyTorch DDP (gloo),
DDP with PowerSGD compression, PySpark's TorchDistributor (local mode), dlscale's
ParameterAveragingTrainingMaster and its SharedTrainingMaster, on 1 and 2 workers, over loopback
and over links limited to 1 Gbit/s and 100 Mbit/s.

Run from the repository root, as root for the limited links (without root only loopback runs, and
it says so)::

    python -m benchmarks.compare            # the full comparison; about 40 minutes on 2 cores
    python -m benchmarks.compare --quick    # a small smoke run of every runner on loopback (compare-quick-*.json)
    python -m benchmarks.compare --report   # the table, plots and projection again from the last results
    python -m benchmarks.compare --runners single,sharing --links loopback,1gbit   # a part, on its own
    python -m benchmarks.compare --device cuda --runners single,sharing --links loopback   # on a GPU

Every run is a fresh process inside the link's network namespace (``benchmarks._links``), so that
its CPU time, peak memory and link traffic are its own. Per run: samples/s over the timed epochs,
seconds and test accuracy after each epoch (time to accuracy), the bytes a worker sends per
minibatch it trains by the method's own count and the bytes that crossed the link per minibatch
trained, the compression against the dense update (gradient sharing; also the trainers' time in
each phase, and each fit's fixed costs: seconds before its first step and after its last), CPU
utilisation of the machine, peak resident memory of the largest process, and final test
accuracy. Evaluation between epochs is not timed. Results go to
``benchmarks/results/compare.json``, plots to ``docs/images/compare-*.png``, and the scaling model
(``benchmarks.scaling``) is projected from the measured gradient-sharing run. A run of some
runners only (``--runners``) goes to ``benchmarks/results/compare-<runners>.json`` and leaves the
complete run's results and plots alone. ``--device cuda`` trains every run on the machine's GPU (the
single process, each of the ceiling's processes, dlscale's workers through ``DLSCALE_DEVICE``; the
launchers' runs, which need a GPU per rank, are left out) and writes
``benchmarks/results/compare-cuda-<runners>.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import queue
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import torch

from benchmarks import _ddp, _links
from benchmarks._common import (
    BATCH,
    SGD,
    accuracy,
    command_line,
    export_paths,
    header,
    make_data,
    mlp,
    parse,
    train_epoch,
    write_results,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "compare.json"
IMAGES = ROOT / "docs" / "images"
TARGETS = {
    "sharing_vs_single_loopback": 1.25,  # gradient sharing, the MLP on 2 workers, against the single process
    "averaging_vs_single_mlp": 1.7,  # the best parameter averaging within ACCURACY_POINTS, MLP, 2 workers, each link
    "averaging_vs_single_cnn": 1.5,  # the same on the CNN
    "averaging_vs_ddp_loopback": 1.4,  # that best averaging against DDP, MLP on loopback
    "averaging_vs_ddp_powersgd_1gbit": 3.0,  # and against DDP+PowerSGD, MLP at 1 Gbit/s
}
"""The comparison's targets, the one place they are set: each results file records them with what was
measured (``targets``), and the docs' tables read them from there."""
ACCURACY_POINTS = 1.0  # averaging's runs count for its targets within this many points of the single process
ACCURACY_SHARE = 0.95  # time to accuracy: to this share of the single process's final test accuracy


def cnn(seed: int = 0) -> torch.nn.Module:
    """A small CNN for 1x28x28 inputs: two 5x5 convolutions (16 and 32 channels) with pooling, then a
    linear layer (18,346 parameters)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 28, 28)),
        torch.nn.Conv2d(1, 16, 5),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 5),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 10),
    )


WORKLOADS: dict[str, dict[str, Any]] = {
    "mlp": {"title": "MLP 784-2048-2048-10", "module": mlp, "epochs": 2},
    "cnn": {"title": "CNN conv16-conv32-linear", "module": cnn, "epochs": 3},
}
AVERAGING = (
    "defaults",
    "defaults_rdd",
    "defaults_unread",
    "defaults_evaluated",
    "averaging_f5",
    "averaging_f10",
    "averaging_f50",
    "averaging_f50_fp16",
    "diloco_f50",
    "averaging_f50_rdd",
    "streaming_f10",
    "streaming_f20",
    "streaming_f50",
    "streaming_f50_fp16",
    "streaming_f50_int8",
    "streaming_f50_onefit",
)
"""dlscale's parameter averaging: with its defaults (the frequency and streaming chosen by the fit, a
receipt of the choice recorded), also by ``fit(rdd)``, as a user calls it, in DL4J's example loop
(``_unread``: a fit an epoch, the network read after the last only) and with ``SparkNet.evaluate``
between the fits (``_evaluated``, timed with them); every 5 (DL4J's), 10 or 50
minibatches, the states exchanged in 16 bits, DiLoCo's
Nesterov outer step (lr 0.7, momentum 0.9), ``fit(rdd)`` (the default export, its first
epoch exporting) in place of ``fit_paths``, and streaming rounds (``streaming=True``), their states
exchanged in 16 and 8 bits too, and every epoch in one fit (``_onefit``: ``fit_paths(paths, epochs=...)``,
as on a slow link, where each fit's start and end send the whole state; its test accuracy is then
known at the end only)."""
RUNNERS = ("single", "ceiling", "ddp", "ddp_powersgd", "torch_distributor", *AVERAGING, "sharing")
RUNNER_HELP = {
    "single": "plain PyTorch in one process of one thread: the baseline (always runs)",
    "ceiling": "independent single processes side by side, one per worker, no communication",
    "ddp": "PyTorch DDP over gloo, a process of one thread per worker",
    "ddp_powersgd": "DDP with the PowerSGD communication hook",
    "torch_distributor": "PySpark's TorchDistributor in local mode (DDP over gloo)",
    "defaults": "ParameterAveragingTrainingMaster(64), its defaults (frequency, streaming chosen), fit_paths per epoch",
    "defaults_rdd": "the same, fit(rdd) per epoch in place of fit_paths (its first epoch exporting the RDD)",
    "defaults_unread": "the defaults, fit_paths per epoch with the network read after the last fit only",
    "defaults_evaluated": "the defaults, fit_paths per epoch and SparkNet.evaluate after each, timed with the fits",
    "averaging_f5": "ParameterAveragingTrainingMaster averaging every 5 minibatches (DL4J's default), no streaming",
    "averaging_f10": "ParameterAveragingTrainingMaster averaging every 10 minibatches, a fit_paths per epoch",
    "averaging_f50": "the same, averaging every 50 minibatches",
    "averaging_f50_fp16": "averaging every 50, the states exchanged in 16 bits",
    "diloco_f50": "averaging every 50 with DiLoCo's Nesterov outer step (lr 0.7, momentum 0.9)",
    "averaging_f50_rdd": "averaging every 50, fit(rdd) in place of fit_paths (its first epoch exporting the RDD)",
    "streaming_f10": "streaming rounds (streaming=True) every 10 minibatches",
    "streaming_f20": "streaming rounds every 20 minibatches",
    "streaming_f50": "streaming rounds every 50 minibatches",
    "streaming_f50_fp16": "streaming every 50, the states exchanged in 16 bits",
    "streaming_f50_int8": "streaming every 50, the states exchanged in int8 (a float32 scale per 1,024 values)",
    "streaming_f50_onefit": "streaming every 50, every epoch in one fit_paths (test accuracy at the end only)",
    "sharing": "SharedTrainingMaster (gradient sharing) with its defaults, a fit_paths per epoch",
}
"""A line on each of :data:`RUNNERS`, for ``--help``."""
DEVICE_RUNNERS = ("single", "ceiling", *AVERAGING, "sharing")  # those that run on one shared GPU
# Runs that move dense tensors every step or round take minutes a epoch at 100 Mbit/s: there they
# train one epoch of a part of the data, enough for a steady samples/s but not for time to accuracy.
SHORT = {"100mbit": (("ddp", "torch_distributor", *AVERAGING), 6400)}
LINKS = ("loopback", "1gbit", "100mbit")
SMOKE_RUNNERS = "single,ceiling,ddp,sharing"  # a smoke run's default


# -- measuring a run --------------------------------------------------------------------------------
def _family() -> list[psutil.Process]:
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def _cpu(processes: list[psutil.Process]) -> dict[int, tuple[str, float, float]]:
    """Per process: its role (see :func:`_role`), its CPU seconds, and those of its main thread."""
    out = {}
    for p in processes:
        try:
            t = p.cpu_times()
            out[p.pid] = (_role(p), t.user + t.system, _main_thread_cpu(p.pid))
        except (psutil.Error, OSError):
            pass
    return out


def _role(p: psutil.Process) -> str:
    """``"driver"`` (this process), ``"nanny"`` (an embedded cluster's ``python -m dask spec``), ``"worker"``
    (a process a nanny started), or ``"other"`` (a launcher's rank, a ceiling's process)."""
    if p.pid == os.getpid():
        return "driver"
    if _is_nanny(p):
        return "nanny"
    parent = p.parent()
    return "worker" if parent is not None and _is_nanny(parent) else "other"


def _is_nanny(p: psutil.Process) -> bool:
    return p.cmdline()[2:5] == ["-m", "dask", "spec"]


def _main_thread_cpu(pid: int) -> float:
    """CPU seconds of process ``pid``'s main thread (a Dask server's event loop; the driver's own code)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_by_role(
    before: dict[int, tuple[str, float, float]], after: dict[int, tuple[str, float, float]]
) -> dict[str, float]:
    """CPU seconds spent between two :func:`_cpu` readings, by role and, for the driver and the workers,
    split into the main thread's (the driver's own code; a worker's event loop) and the other threads'
    (the driver's: the client's and an embedded scheduler's event loop; a worker's: its tasks, such as
    the trainers, and their helper threads), of the processes alive at both ends or started between."""
    out: dict[str, float] = {}
    for pid, (role, total, main) in after.items():
        _, total0, main0 = before.get(pid, (role, 0.0, 0.0))
        if role in ("driver", "worker"):
            out[f"{role} main thread"] = out.get(f"{role} main thread", 0.0) + main - main0
            out[f"{role} other threads"] = out.get(f"{role} other threads", 0.0) + (total - main) - (total0 - main0)
        else:
            out[role] = out.get(role, 0.0) + total - total0
    return {k: round(v, 2) for k, v in out.items()}


def _peak_rss() -> int:
    """The largest peak resident set (VmHWM) among this process and its descendants now alive."""
    peak = 0
    for p in _family():
        try:
            with open(f"/proc/{p.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
        except OSError:
            pass
    return peak


def _link_bytes() -> int:
    """Bytes sent on this namespace's loopback so far."""
    return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())


@contextmanager
def measured(out: dict[str, Any]) -> Iterator[None]:
    """Record the CPU utilisation (and its CPU seconds by role, :func:`_cpu_by_role`), link bytes and
    peak memory of the block into ``out`` (processes started and ended inside it count for the CPU
    time their parent has waited for)."""
    family = _family()
    cpu0, bytes0, t0 = _cpu(family), _link_bytes(), time.perf_counter()
    own0 = os.times()
    yield
    wall = time.perf_counter() - t0
    family = _family()
    cpu1 = _cpu(family)
    own1 = os.times()
    lived = sum(cpu1[pid][1] - cpu0.get(pid, ("", 0.0))[1] for pid in cpu1)
    waited = (own1.children_user + own1.children_system) - (own0.children_user + own0.children_system)
    out["cpu_utilisation"] = (lived + waited) / wall / (os.cpu_count() or 1)
    out["cpu_seconds"] = {**_cpu_by_role(cpu0, cpu1), "processes ended": round(waited, 2)}
    out["peak_rss"] = _peak_rss()  # while a run's worker processes are still alive
    out["link_bytes"] = _link_bytes() - bytes0
    out["wall_seconds"] = wall


# -- the runners (each inside its own process) -------------------------------------------------------
def _data(quick: bool) -> tuple[torch.Tensor, ...]:
    x, y, tx, ty = make_data()
    if quick:
        x, y, tx, ty = x[:2560], y[:2560], tx[:1024], ty[:1024]
    return x, y, tx, ty


def _train_alone(
    workload: dict[str, Any],
    epochs: int,
    data: tuple[torch.Tensor, ...],
    before_epoch: Callable[[], Any],
    device: str = "cpu",
) -> tuple[int, float, list[tuple[float, float]]]:
    """The plain PyTorch loop of one thread on ``device`` (data held there): steps, training seconds, and
    (seconds so far, test accuracy) after each epoch. ``before_epoch`` runs, untimed, before each epoch."""
    x, y, tx, ty = (t.to(device) for t in data)
    torch.set_num_threads(1)
    module = workload["module"]().to(device)
    optimizer = SGD(module.parameters())
    g = torch.Generator().manual_seed(0)
    elapsed, curve, steps = 0.0, [], 0
    for _ in range(epochs):
        before_epoch()
        start = time.perf_counter()
        steps += train_epoch(module, optimizer, x, y, g)
        if x.is_cuda:
            torch.cuda.synchronize()  # the epoch's steps are done, not only queued
        elapsed += time.perf_counter() - start
        curve.append((elapsed, accuracy(module, tx, ty)))
    return steps, elapsed, curve


def run_single(
    workload: dict[str, Any], epochs: int, data: tuple[torch.Tensor, ...], out: dict[str, Any], device: str
) -> None:
    with measured(out):
        steps, elapsed, curve = _train_alone(workload, epochs, data, lambda: None, device)
    out.update(samples=steps * BATCH, seconds=elapsed, minibatches=steps, curve=curve, bytes_per_minibatch=0)


def _ceiling_process(
    rank: int,
    workload_name: str,
    epochs: int,
    quick: bool,
    barrier: Any,
    results: multiprocessing.Queue,
    device: str,
) -> None:
    """One of the ceiling's processes: the single process's training, each epoch started together
    with the others'."""
    steps, elapsed, curve = _train_alone(WORKLOADS[workload_name], epochs, _data(quick), barrier.wait, device)
    results.put((rank, steps, elapsed, curve, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def run_ceiling(workload_name: str, workers: int, epochs: int, quick: bool, out: dict[str, Any], device: str) -> None:
    """The machine's ceiling: ``workers`` independent single processes training at the same time, with
    no communication. Their samples/s is the sum of theirs; the curve is the first process's."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(workers, timeout=600), ctx.Queue()
    processes = [
        ctx.Process(target=_ceiling_process, args=(rank, workload_name, epochs, quick, barrier, results, device))
        for rank in range(workers)
    ]
    done: list[tuple[Any, ...]] = []
    with measured(out):
        for p in processes:
            p.start()
        while len(done) < workers:
            try:
                done.append(results.get(timeout=5))
            except queue.Empty:
                if any(p.exitcode for p in processes):
                    raise RuntimeError(
                        f"a ceiling process failed: exit codes {[p.exitcode for p in processes]}"
                    ) from None
        for p in processes:
            p.join()
    done.sort()
    out.update(
        samples=sum(steps for _, steps, *_ in done) * BATCH,
        seconds=max(elapsed for _, _, elapsed, *_ in done),
        samples_per_s=sum(steps * BATCH / elapsed for _, steps, elapsed, *_ in done),
        minibatches=sum(steps for _, steps, *_ in done),
        curve=done[0][3],
        bytes_per_minibatch=0,
        peak_rss_reported=max(peak for *_, peak in done),
    )


def run_launcher(
    launcher: Callable[..., dict[str, Any]],
    workload: dict[str, Any],
    workers: int,
    epochs: int,
    data: tuple[torch.Tensor, ...],
    out: dict[str, Any],
    **options: Any,
) -> None:
    """DDP or TorchDistributor: processes of one thread, each ``BATCH`` examples a step, gradients
    all-reduced (a ring moves 2(W-1)/W of them out of every process), or with ``options``
    ``powersgd=True`` PowerSGD's factors of them."""
    x, y, tx, ty = data
    with measured(out):
        r = launcher(workers, workload["module"], x, y, BATCH, epochs, SGD, 1, test_x=tx, test_y=ty, **options)
    if r["powersgd"]:
        out["compression"] = r["grad_bytes_per_step"] / r["allreduced_bytes_per_step"]
    out.update(
        samples=r["samples"],
        seconds=r["seconds"],
        minibatches=r["samples"] // BATCH,
        curve=list(zip(r["epoch_seconds"], r["epoch_accuracy"], strict=True)),
        bytes_per_minibatch=2 * (workers - 1) / workers * r["allreduced_bytes_per_step"],
        dense_update_bytes=r["grad_bytes_per_step"],
        peak_rss_reported=r.get("peak_rss_bytes"),
        **({"launcher_seconds": r["launcher_seconds"]} if "launcher_seconds" in r else {}),
    )


def run_dlscale(
    master_name: str,
    workload: dict[str, Any],
    workers: int,
    epochs: int,
    data: tuple[torch.Tensor, ...],
    out: dict[str, Any],
    device: str,
) -> None:
    """A SparkNet on ``local[workers]`` (one thread each, training on ``device``) fitting minibatch
    files exported before timing, one ``fit_paths`` per epoch so that the network can be evaluated
    between epochs (one for them all with ``_onefit``). A fit's time includes its state's arrival on
    the driver (``Network.settle``) where the network is read after it: after every fit, or after the
    last alone with ``_unread`` and ``_onefit``; with ``_evaluated`` it includes the test set's
    evaluation on the cluster (``SparkNet.evaluate``, of an RDD persisted on the workers before
    timing) in place of the driver's."""
    from dlscale import (
        ParameterAveragingTrainingMaster,
        SharedTrainingMaster,
        SparkContext,
        SparkNet,
    )
    from dlscale.data import DataSet
    from dlscale.nn import Network

    x, y, tx, ty = data
    os.environ["DLSCALE_DEVICE"] = device  # the workers' environment is this process's

    def master() -> Any:
        if master_name == "sharing":
            return SharedTrainingMaster(BATCH, rng_seed=0, collect_training_stats=True)
        return ParameterAveragingTrainingMaster(
            BATCH, rng_seed=0, collect_training_stats=True, **averaging(master_name)
        )

    with tempfile.TemporaryDirectory() as tmp, SparkContext(f"local[{workers}]", f"compare-{master_name}") as sc:
        paths = export_paths(sc, x, y, f"{tmp}/train")
        warm = Network(workload["module"](), "cross_entropy", SGD)
        SparkNet(sc, warm, master()).fit_paths(sc.parallelize(paths.take(4 * workers)))  # imports, connections
        net = Network(workload["module"](), "cross_entropy", SGD)
        spark_net = SparkNet(sc, net, master())
        elapsed, curve, edges, rounds, choices = 0.0, [], [], [], []
        rdd = sc.parallelize(DataSet(x, y).batch_by(BATCH), workers) if master_name.endswith("_rdd") else None
        fits, per_fit = (1, epochs) if master_name.endswith("_onefit") else (epochs, 1)
        unread, evaluated = master_name.endswith("_unread"), master_name.endswith("_evaluated")
        test = None
        if evaluated:  # on the workers before timing, as a persisted test set is
            test = sc.parallelize(DataSet(tx, ty).batch_by(BATCH), workers).persist()
            test.count()
        with measured(out):
            for fit in range(fits):
                start, wall = time.perf_counter(), time.time()
                if rdd is None:
                    spark_net.fit_paths(paths, epochs=per_fit)
                else:
                    spark_net.fit(rdd)
                returned = time.time()
                read = not unread or fit == fits - 1
                if test is not None:
                    score = spark_net.evaluate(test).accuracy()  # on the state the workers hold
                elif read:
                    net.settle()  # the state on the driver, as the evaluation reads it
                elapsed += time.perf_counter() - start
                edges.append(_edges(spark_net.training_stats, wall, returned))
                rounds.append(spark_net.training_stats.rounds[sum(map(len, rounds)) :])  # this fit's
                if test is not None:
                    curve.append((elapsed, score))
                elif read:
                    curve.append((elapsed, accuracy(net.module, tx, ty)))
                choices.append(spark_net.training_stats.choice)
    stats = spark_net.training_stats  # of every epoch's fit
    out["fit_edges_seconds"] = edges
    if stats.choice is not None:  # each fit's receipt: the choice, why, its predicted and measured speedups
        out["choices"] = choices
    if stats.trainers:
        sent = sum(t.bytes_sent for t in stats.trainers)
        steps = sum(t.minibatches for t in stats.trainers)
        out["trainer_seconds"] = {
            p: sum(t.seconds(p) for t in stats.trainers) for p in ("fit", "encode", "send", "apply", "wait")
        }
        out["steps"] = steps
    else:
        steps = sum(len(w.batches) for r in stats.rounds for w in r.workers)
        streaming = stats.choice["streaming"] if stats.choice else averaging(master_name).get("streaming", False)
        per_fit = [_round_seconds(r, streaming) for r in rounds]
        out["trainer_seconds"] = {k: sum(f[k] for f in per_fit) for k in ("fit", "wait", "straggler", "averaging")}
    dense = 4 * net.num_params()
    out.update(samples=steps * BATCH, seconds=elapsed, minibatches=steps, curve=curve, dense_update_bytes=dense)
    if master_name == "sharing":  # each message goes to every peer (plain mode)
        out.update(bytes_per_minibatch=sent / steps * (workers - 1), bytes_sent_per_step=sent / steps)
        if sent:  # a lone trainer sends nothing
            out["compression"] = dense * steps / sent
    else:  # a round's allreduce: each worker sends 2 (W - 1) / W times its state (parameters and momentum)
        frequency = stats.averaging_frequency or averaging(master_name).get("averaging_frequency")
        width = {"fp16": 2, "int8": 1 + 4 / 1024}.get(master_name.rsplit("_", 1)[-1], 4)  # int8: and its scales
        state = 2 * width * net.num_params()
        averaged = sum(map(len, rounds))  # rounds averaged, each sending its state once a worker
        out.update(
            averaging_frequency=frequency,
            bytes_per_minibatch=2 * (workers - 1) * state * averaged / steps if workers > 1 and steps else 0,
        )


def averaging(runner: str) -> dict[str, Any]:
    """The ``ParameterAveragingTrainingMaster`` settings of an averaging runner (see :data:`AVERAGING`):
    none for the defaults; a frequency given, streaming as given (``False`` unless ``streaming_``)."""
    parts = runner.split("_")
    if parts[0] == "defaults":
        return {}
    settings: dict[str, Any] = {"averaging_frequency": int(parts[1][1:]), "streaming": parts[0] == "streaming"}
    if "fp16" in parts:
        settings["exchange_dtype"] = "float16"
    if "int8" in parts:
        settings["exchange_dtype"] = "int8"
    if parts[0] == "diloco":
        settings["outer_optimizer"] = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    return settings


def _round_seconds(rounds: list[Any], streaming: bool = False) -> dict[str, float]:
    """Where a parameter-averaging trainer's time went in one fit's ``rounds``, summed over its rounds
    and averaged over the trainers: fitting (``fit``, minibatches' loading included), of which waiting
    for a minibatch (``wait``); between one round's fitting and the next's, waiting for the slowest
    trainer to end its fitting (``straggler``), then the averaging itself (``averaging``: the
    allreduce, the commit, the next round's start). With ``streaming`` rounds a trainer goes on without
    waiting at a round's end: ``averaging`` is the time it spent taking the last round's average
    during its fitting (waiting for a slower trainer included) and between its rounds, ``fit`` the rest."""
    totals = {"fit": 0.0, "wait": 0.0, "straggler": 0.0, "averaging": 0.0}
    trainers = {w.worker for r in rounds for w in r.workers}
    for r in rounds:
        totals["fit"] += sum(w.fit_seconds - w.averaging_seconds for w in r.workers)
        totals["wait"] += sum(w.wait_seconds for w in r.workers)
        totals["averaging"] += sum(w.averaging_seconds for w in r.workers)
    for a, b in zip(rounds, rounds[1:]):
        last = max(w.end for w in a.workers)
        starts = {w.worker: w.start for w in b.workers}
        for w in a.workers:
            if w.worker not in starts:
                continue
            if streaming:
                totals["averaging"] += starts[w.worker] - w.end
            else:
                totals["straggler"] += last - w.end
                totals["averaging"] += starts[w.worker] - last
    return {k: v / max(1, len(trainers)) for k, v in totals.items()}


def _edges(stats: Any, start: float, end: float) -> list[float]:
    """A fit's fixed costs, from its trainers' timelines (gradient sharing) or rounds (parameter
    averaging): seconds from the call of ``fit_paths`` to the first trainer's first step (the network
    sent, or the last fit's trainers taken back), and from the last trainer's last step to the
    call's return (the last round's averaging; the state's arrival on the driver is not in it)."""
    spans = [(p[1], p[1] + p[2]) for t in stats.trainers if t.phases for p in t.phases]
    spans += [(w.start, w.end) for r in stats.rounds for w in r.workers]
    spans = [s for s in spans if start <= s[0] <= end]
    if not spans:
        return [float("nan"), float("nan")]
    return [min(s[0] for s in spans) - start, end - max(s[1] for s in spans)]


def inner(link: str, workload_name: str, runner: str, workers: int, quick: bool, device: str) -> dict[str, Any]:
    workload = WORKLOADS[workload_name]
    epochs = 1 if quick else workload["epochs"]
    data = _data(quick)
    short_runners, examples = SHORT.get(link, ((), 0))
    short = runner in short_runners and not quick
    if short:
        epochs, data = 1, (data[0][:examples], data[1][:examples], *data[2:])
    out: dict[str, Any] = {
        "link": link,
        "workload": workload_name,
        "runner": runner,
        "workers": workers,
        "device": device,
        "epochs": epochs,
        "batch": BATCH,
        "train_examples": len(data[0]),
        "short": short,
    }
    if runner == "single":
        run_single(workload, epochs, data, out, device)
    elif runner == "ceiling":
        run_ceiling(workload_name, workers, epochs, quick, out, device)
    elif runner in ("ddp", "ddp_powersgd"):
        run_launcher(_ddp.ddp_samples_per_s, workload, workers, epochs, data, out, powersgd=runner == "ddp_powersgd")
    elif runner == "torch_distributor":
        from benchmarks._torch_distributor import torch_distributor_samples_per_s

        run_launcher(torch_distributor_samples_per_s, workload, workers, epochs, data, out)
    else:
        run_dlscale(runner, workload, workers, epochs, data, out, device)
    out.setdefault("samples_per_s", out["samples"] / out["seconds"])
    out["link_bytes_per_minibatch"] = out["link_bytes"] / out["minibatches"]
    out["test_accuracy"] = out["curve"][-1][1]
    out["peak_rss"] = max(out["peak_rss"], out.pop("peak_rss_reported", None) or 0)  # ranks that have ended
    return out


# -- the driver ---------------------------------------------------------------------------------------
def plan(quick: bool, links: tuple[str, ...]) -> list[tuple[str, str, str, int]]:
    """``(link, workload, runner, workers)`` in the order they run: the single process and one-worker
    runs on loopback only (nothing crosses a link; the ceiling of one process is the single process),
    the two-worker runs on every link. The single process runs first and again last of its workload's
    loopback runs (but in a quick run): :func:`summarise` takes the faster as the baseline, so that a
    slow spell of the machine during one of them does not flatter every ratio."""
    runs = []
    for link in links:
        for workload in WORKLOADS:
            if link == "loopback":
                runs.append((link, workload, "single", 1))
                runs += [(link, workload, r, 1) for r in RUNNERS[2:] if not quick]
            runs += [(link, workload, r, 2) for r in RUNNERS[1:]]
            if link == "loopback" and not quick:
                runs.append((link, workload, "single", 1))
    return runs


def _one(
    ns: str | None, link: str, workload: str, runner: str, workers: int, quick: bool, device: str
) -> dict[str, Any]:
    argv = [
        "python",
        "-m",
        "benchmarks.compare",
        "--inner",
        link,
        workload,
        runner,
        str(workers),
        *(["--quick"] if quick else []),
        f"--device={device}",
    ]
    if ns is None:
        done = subprocess.run(
            [sys.executable, *argv[1:]], check=False, cwd=ROOT, capture_output=True, text=True, timeout=1800
        )
    else:
        done = _links.run_in_namespace(ns, argv, timeout=1800)
    if done.returncode:
        return {
            "link": link,
            "workload": workload,
            "runner": runner,
            "workers": workers,
            "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}",
        }
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios against the single process, time to accuracy, and the targets: gradient sharing's and
    parameter averaging's against the single process and the peers. The baseline of a workload is its
    fastest single-process run (``"baseline": true``; :func:`plan` runs it twice)."""
    singles = [r for r in runs if r["runner"] == "single" and "error" not in r]
    singles.sort(key=lambda r: r["samples_per_s"])
    single = {r["workload"]: r for r in singles}  # the fastest last
    for r in singles:
        r["baseline"] = r is single[r["workload"]]
    for r in runs:
        base = single.get(r["workload"])
        if "error" in r or base is None:
            continue
        r["vs_single"] = r["samples_per_s"] / base["samples_per_s"]
        r["accuracy_vs_single_points"] = 100 * (r["test_accuracy"] - base["test_accuracy"])
        goal = ACCURACY_SHARE * base["test_accuracy"]
        r["accuracy_target"] = goal
        r["time_to_accuracy"] = None if r["short"] else next((t for t, a in r["curve"] if a >= goal), None)

    def find(link: str, runner: str) -> dict[str, Any] | None:
        return next(
            (
                r
                for r in runs
                if (r["link"], r["workload"], r["runner"], r["workers"]) == (link, "mlp", runner, 2)
                and "error" not in r
            ),
            None,
        )

    targets = {}
    r = find("loopback", "sharing")
    if r is not None and "vs_single" in r:
        targets["sharing_vs_single_loopback"] = _target("sharing_vs_single_loopback", r["vs_single"], "sharing")
    for link in ("loopback", "1gbit"):
        for workload in WORKLOADS:
            near = [  # parameter averaging's runs within ACCURACY_POINTS of the single process
                r
                for r in runs
                if (r["link"], r["workload"], r["workers"]) == (link, workload, 2)
                and r["runner"] in AVERAGING
                and "vs_single" in r
                and -r["accuracy_vs_single_points"] <= ACCURACY_POINTS
            ]
            if not near:
                continue
            best = max(near, key=lambda r: r["vs_single"])
            targets[f"averaging_vs_single_{workload}_{link}"] = _target(
                f"averaging_vs_single_{workload}", best["vs_single"], best["runner"]
            )
            peer = {"loopback": "ddp", "1gbit": "ddp_powersgd"}[link]
            d = next(
                (
                    r
                    for r in runs
                    if (r["link"], r["workload"], r["runner"], r["workers"]) == (link, workload, peer, 2)
                    and "error" not in r
                ),
                None,
            )
            if d is not None and workload == "mlp":
                name = f"averaging_vs_{peer}_{link}"
                targets[name] = _target(name, best["samples_per_s"] / d["samples_per_s"], best["runner"])
    return targets


def _target(name: str, measured: float, runner: str) -> dict[str, Any]:
    """A target of :data:`TARGETS` (at least ``TARGETS[name]``), what ``runner`` measured, and whether it met it."""
    return {"target": TARGETS[name], "measured": measured, "runner": runner, "met": measured >= TARGETS[name]}


def table(runs: list[dict[str, Any]]) -> str:
    head = (
        "| workload | link | run | workers | samples/s | vs single | time to accuracy | test accuracy | "
        "bytes/minibatch | link bytes/minibatch | compression | CPU | peak RSS |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in runs:
        if "error" in r:
            lines.append(
                f"| {r['workload']} | {r['link']} | {r['runner']} | {r['workers']} | failed: {r['error']} |" + " |" * 8
            )
            continue
        tta = (
            "part of an epoch"
            if r["short"]
            else f"{r['time_to_accuracy']:.1f} s"
            if r.get("time_to_accuracy") is not None
            else "not reached"
        )
        comp = f"{r['compression']:.0f}x" if "compression" in r else ""
        lines.append(
            f"| {r['workload']} | {r['link']} | {r['runner']} | {r['workers']} | {r['samples_per_s']:,.0f} | "
            f"{r.get('vs_single', float('nan')):.2f} | {tta} | {r['test_accuracy']:.3f} | "
            f"{r['bytes_per_minibatch']:,.0f} | {r['link_bytes_per_minibatch']:,.0f} | {comp} | "
            f"{r['cpu_utilisation']:.0%} | {r['peak_rss'] / 2**20:,.0f} MiB |"
        )
    return "\n".join(lines)


def plots(runs: list[dict[str, Any]]) -> list[str]:
    """One PNG per workload: samples/s of every two-worker run per link (bars, with the single
    process and the ceiling on loopback as lines), and test accuracy against training time on
    loopback (lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMAGES.mkdir(parents=True, exist_ok=True)
    written = []
    ok = [r for r in runs if "error" not in r]
    for workload, spec in WORKLOADS.items():
        mine = [r for r in ok if r["workload"] == workload]
        if not mine:
            continue
        fig, (bars, curves) = plt.subplots(1, 2, figsize=(13, 4.5))
        links = [link for link in LINKS if any(r["link"] == link for r in mine)]
        runners = [n for n in RUNNERS[2:] if any(r["runner"] == n for r in mine)]
        width = 0.8 / max(1, len(runners))
        for i, name in enumerate(runners):
            values = [
                next(
                    (r["samples_per_s"] for r in mine if (r["link"], r["runner"], r["workers"]) == (link, name, 2)), 0.0
                )
                for link in links
            ]
            bars.bar([j + i * width for j in range(len(links))], values, width, label=name.replace("_", " "))
        single = next((r for r in mine if r["runner"] == "single" and r.get("baseline", True)), None)
        if single is not None:
            bars.axhline(single["samples_per_s"], color="black", linestyle="--", label="single process")
        ceiling = next((r for r in mine if (r["link"], r["runner"], r["workers"]) == ("loopback", "ceiling", 2)), None)
        if ceiling is not None:
            bars.axhline(ceiling["samples_per_s"], color="grey", linestyle=":", label="ceiling (2 processes)")
        bars.set_xticks([j + width * (len(runners) - 1) / 2 for j in range(len(links))], links)
        bars.set_ylabel("samples/s (2 workers)")
        bars.set_title(f"{spec['title']}: throughput")
        bars.legend(fontsize=8)
        for r in mine:
            if r["link"] == "loopback" and (r["workers"] == 2 or r["runner"] == "single"):
                ts, accs = zip(*r["curve"], strict=True)
                curves.plot(ts, accs, marker="o", label=f"{r['runner'].replace('_', ' ')} ({r['workers']})")
        curves.set_xlabel("training seconds (loopback)")
        curves.set_ylabel("test accuracy")
        curves.set_title(f"{spec['title']}: accuracy against time")
        curves.legend(fontsize=8)
        fig.tight_layout()
        path = IMAGES / f"compare-{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path.relative_to(ROOT)))
    return written


def write_report(
    runs: list[dict[str, Any]],
    quick: bool,
    namespaces: str,
    runners: tuple[str, ...] = RUNNERS,
    device: str = "cpu",
    out: Path | None = None,
    recorded: dict[str, Any] | None = None,
) -> None:
    """Ratios, targets, plots and the scaling projection of ``runs``; written to ``out``, else to
    :data:`RESULTS`, or for a part of the runners, another device or a quick run to a file of their own
    (``compare-[quick-][DEVICE-]RUNNERS.json``), without plots or projection. ``recorded``: the results
    file whose runs these are (``--report``), whose provenance, date and machine the report keeps."""
    complete = runners == RUNNERS and device == "cpu" and not quick
    prefix = ("quick-" if quick else "") + (f"{device}-" if device != "cpu" else "")
    results = out or (RESULTS if complete else RESULTS.with_name(f"compare-{prefix}{'-'.join(runners)}.json"))
    targets = summarise(runs)
    gpu = {"gpu": torch.cuda.get_device_name(0)} if device == "cuda" else {}
    head = (
        header("compare", namespaces=namespaces, device=device, **gpu)
        if recorded is None
        else {k: recorded[k] for k in ("benchmark", "provenance", "date", "machine") if k in recorded}
    )
    report = {
        **head,
        "quick": quick,
        "setup": {
            "batch": BATCH,
            "optimizer": "SGD lr 0.01 momentum 0.9",
            "threads_per_worker": 1,
            "accuracy_share_for_time_to_accuracy": ACCURACY_SHARE,
            "workloads": {k: {"title": v["title"], "epochs": v["epochs"]} for k, v in WORKLOADS.items()},
        },
        "runs": runs,
        "targets": targets,
        "plots": plots(runs) if complete else [],
    }
    sharing = next(
        (
            r
            for r in runs
            if (r["workload"], r["runner"], r["workers"], r["link"]) == ("mlp", "sharing", 2, "loopback")
            and "error" not in r
        ),
        None,
    )
    if sharing is not None and not quick and complete:
        from benchmarks import scaling

        report["scaling"] = scaling.project(scaling.measured_from(sharing))
        scaling.plot(report["scaling"], IMAGES / "scaling.png")
        report["plots"].append(str((IMAGES / "scaling.png").relative_to(ROOT)))
    if not complete:
        report["runners"] = list(runners)
    print(table(runs))
    for name, t in targets.items():
        print(f"target {name}: {t['measured']:.2f} against {t['target']} ({'met' if t['met'] else 'not met'})")
    write_results(results, report, indent=1, ran=recorded is None)


def main(argv: list[str] | None = None) -> None:
    parser = command_line(
        __doc__.split("\n\n")[0],
        cases=RUNNER_HELP,
        title=f"runners (workloads: {', '.join(WORKLOADS)}; links: {', '.join(LINKS)})",
    )
    parser.add_argument("--quick", action="store_true", help="small data, one epoch, loopback only")
    parser.add_argument("--links", default=",".join(LINKS), help="comma-separated links to measure")
    parser.add_argument(
        "--runners",
        default=",".join(RUNNERS),
        help="comma-separated runners to measure (single always runs: it is the baseline)",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workloads to measure")
    parser.add_argument(
        "--report", action="store_true", help="redo the table, plots and projection from the runs of the last results"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help=f"where every run trains (cuda: the runners {', '.join(DEVICE_RUNNERS)}, on the machine's GPU)",
    )
    parser.add_argument("--inner", nargs=4, metavar=("LINK", "WORKLOAD", "RUNNER", "WORKERS"), help=argparse.SUPPRESS)
    # a smoke run: quick (loopback, in a namespace of its own where they can be made), the MLP alone
    args = parse(parser, argv, None, quick=True, runners=SMOKE_RUNNERS, workloads="mlp")
    if args.smoke and args.report:
        parser.error("--report redoes the recorded run's report: not in a smoke run")
    if args.inner:
        link, workload, runner, workers = args.inner
        print(json.dumps(inner(link, workload, runner, int(workers), args.quick, args.device)))
        return
    if args.report:
        last = json.loads(RESULTS.read_text())
        write_report(last["runs"], last["quick"], last["machine"]["namespaces"], recorded=last)
        return
    asked = set(args.runners.split(","))
    if asked - set(RUNNERS):
        parser.error(f"--runners: unknown {', '.join(sorted(asked - set(RUNNERS)))}; known: {', '.join(RUNNERS)}")
    runners = tuple(r for r in RUNNERS if r == "single" or r in asked)
    if args.device != "cpu" and set(runners) - set(DEVICE_RUNNERS):
        parser.error(
            f"--device {args.device}: {', '.join(sorted(set(runners) - set(DEVICE_RUNNERS)))} need a GPU per rank; "
            f"on one GPU, --runners takes {', '.join(DEVICE_RUNNERS)}"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU here")
    workloads = set(args.workloads.split(","))
    if workloads - set(WORKLOADS):
        parser.error(
            f"--workloads: unknown {', '.join(sorted(workloads - set(WORKLOADS)))}; known: {', '.join(WORKLOADS)}"
        )
    reason = _links.available()
    links = ("loopback",) if args.quick else tuple(args.links.split(","))
    if reason is not None and links != ("loopback",):
        print(f"network namespaces unavailable ({reason}): loopback only, outside a namespace")
        links = ("loopback",)
    runs = []
    for link in links:
        with _links.limited_namespace(_links.LINKS[link]) if reason is None else _nothing() as ns:
            for _, workload, runner, workers in [
                p for p in plan(args.quick, links) if p[0] == link and p[2] in runners and p[1] in workloads
            ]:
                t0 = time.perf_counter()
                r = _one(ns, link, workload, runner, workers, args.quick, args.device)
                runs.append(r)
                what = r.get("error") or f"{r['samples_per_s']:,.0f} samples/s, accuracy {r['test_accuracy']:.3f}"
                print(
                    f"{link:9s} {workload:4s} {runner:18s} {workers}: {what} ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    write_report(
        runs,
        args.quick,
        reason or "available",
        runners,
        args.device,
        args.out,
    )


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


if __name__ == "__main__":
    main()
