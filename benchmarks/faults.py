"""Training through a lost worker: a worker process killed (SIGKILL) at a random point of every fit.

Run from the repository root with ``python -m benchmarks.faults`` (``--fits 3`` for a short run). On
``SparkContext("local[3]")`` (three worker processes of one thread), scikit-learn's digits (1,200
training and 597 test images) train an MLP 64-32-10 (SGD, lr 0.05, momentum 0.9, minibatches of 16,
6 epochs) with both training masters (parameter averaging every 5 minibatches, plain and with streaming
rounds, ``streaming``; gradient sharing with its defaults) and both ways of holding the RDD's
minibatches ("export" and "direct"). The training RDD is persisted in memory before the fits.

After one unrecorded fit of each (the workers' first imports), each of the six runs ``--fits`` fits,
each with its own seed (the order of the minibatches), that kill a random worker after a random
number of steps (10% to 90% of the fit's); the first ``--baseline`` seeds also fit without a fault,
just before, for the accuracy and time to compare with.
The worker's nanny starts a new process, which joins the cluster, and the next fit waits for it
(Dask's ``distributed.deploy.lost-worker-timeout`` is raised from 15 s to 300 s for this: on a busy
machine the new process can take longer than 15 s to start, and the local cluster then closes its
nanny, leaving two workers for good).
Recorded per fit: whether it finished (and the error if not), test accuracy, seconds, and whether
the persisted RDD still holds every example afterwards. Targets: every faulted fit completes, within
2 points of the unfaulted accuracy, nothing lost. Results go to ``benchmarks/results/faults.json``.

``--kill-every SECONDS`` measures a punisher instead: a random worker process killed every SECONDS
(5: torchft's punisher's default) through a fit of about 75 s, for each master, as a user would
check their own job: ``dlscale certify benchmarks/_punished_job.py --workers 3 --kill-every 5s
--max-time-ratio 1.3 --max-metric-drop 0.02 -- MASTER EPOCHS`` (the digits MLP 64-128-10, one fit;
:data:`KILL_EVERY_EPOCHS` sized for about 75 s unfaulted here), once per ``--fits``. Recorded per
certificate: kills, seconds unfaulted and faulted (the script's and the fit's), the exactly-once
tally, test accuracy, and the verdict. Targets: within 1.3x the unfaulted time and 2 points of its
accuracy, nothing lost. Results go to ``benchmarks/results/faults-kill-every.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import dask
import torch

from benchmarks._common import accuracy, command_line, digits, header, parse, shrink, write_results
from dlscale import (
    ParameterAveragingTrainingMaster,
    SharedTrainingMaster,
    SparkContext,
    SparkNet,
    TrainerLostWarning,
)
from dlscale.data import DataSet
from dlscale.nn import Network
from dlscale.nn.listeners import TrainingListener

RESULTS = Path(__file__).resolve().parent / "results" / "faults.json"
KILL_EVERY_RESULTS = RESULTS.with_name("faults-kill-every.json")
KILL_EVERY_JOB = Path(__file__).resolve().parent / "_punished_job.py"
KILL_EVERY_EPOCHS = {"averaging": 780, "sharing": 310}  # one fit of about 75 s unfaulted on local[3] here
KILL_EVERY_BOUNDS = ("--max-time-ratio", "1.3", "--max-metric-drop", "0.02")
BATCH = 16
EPOCHS = 6
AVERAGING_FREQUENCY = 5
WORKERS = 3
FIT_TIMEOUT = 600  # seconds before a fit counts as hung
CONFIGS = [(m, a) for m in ("averaging", "streaming", "sharing") for a in ("export", "direct")]
CONFIG_HELP = {
    "averaging:export": f"ParameterAveragingTrainingMaster every {AVERAGING_FREQUENCY} minibatches, the RDD exported",
    "averaging:direct": "the same, the minibatches held in the workers' memory (rdd_training_approach direct)",
    "streaming:export": "parameter averaging with streaming rounds (streaming=True), the RDD exported",
    "streaming:direct": "the same, the minibatches held in the workers' memory",
    "sharing:export": "SharedTrainingMaster with its defaults, the RDD exported to minibatch files",
    "sharing:direct": "the same, the minibatches held in the workers' memory",
}
"""A line on each of :data:`CONFIGS` (as ``master:approach``), for ``--help``."""


def _network() -> Network:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    return Network(module, "cross_entropy", functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))


def _master(kind: str, approach: str, seed: int, directory: str) -> Any:
    if kind in ("averaging", "streaming"):
        return ParameterAveragingTrainingMaster(
            BATCH,
            averaging_frequency=AVERAGING_FREQUENCY,
            streaming=kind == "streaming",
            rdd_training_approach=approach,
            export_directory=directory,
            rng_seed=seed,
        )
    return SharedTrainingMaster(BATCH, rdd_training_approach=approach, export_directory=directory, rng_seed=seed)


def _steps(kind: str, examples: int) -> int:
    """The iterations a fit counts: minibatches per worker with averaging, every minibatch with sharing."""
    minibatches = -(-examples // BATCH)
    if kind in ("averaging", "streaming"):
        rounds = -(-minibatches // (AVERAGING_FREQUENCY * WORKERS))
        return EPOCHS * rounds * AVERAGING_FREQUENCY
    return EPOCHS * minibatches


class _Kill(TrainingListener):
    """Kills worker process ``pid`` once the fit has passed ``at`` iterations."""

    def __init__(self, pid: int, at: int) -> None:
        self.pid, self.at, self.killed_at = pid, at, None

    def iteration_done(self, network: Network, iteration: int, epoch: int, score: float, examples: int) -> None:
        if self.killed_at is None and iteration >= self.at:
            os.kill(self.pid, signal.SIGKILL)
            self.killed_at = iteration


def _workers(sc: SparkContext) -> dict[str, int]:
    """The pids of the cluster's workers, once a killed one is gone and its successor has joined."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        sc.client.wait_for_workers(WORKERS, timeout=300)
        with contextlib.suppress(OSError):  # a killed worker not yet removed
            pids = sc.client.run(os.getpid)
            if len(pids) == WORKERS:
                return pids
        time.sleep(0.5)
    raise TimeoutError(f"the cluster did not get back to {WORKERS} workers")


def _fit(sc: SparkContext, rdd: Any, kind: str, approach: str, seed: int, kill: bool, data: tuple) -> dict[str, Any]:
    _, _, tx, ty = data
    rng = random.Random(seed)
    pids = _workers(sc)
    net = _network()
    with tempfile.TemporaryDirectory() as directory:
        master = _master(kind, approach, seed, directory)
        spark_net = SparkNet(sc, net, master)
        killer = None
        if kill:
            steps = _steps(kind, len(data[0]))
            victim = rng.choice(sorted(pids))
            killer = _Kill(pids[victim], rng.randint(steps // 10, steps * 9 // 10))
            spark_net.set_listeners(killer)
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", TrainerLostWarning)
                    spark_net.fit(rdd, epochs=EPOCHS)
            except Exception as e:  # noqa: BLE001 - recorded
                outcome["error"] = f"{type(e).__name__}: {e}"

        start = time.perf_counter()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(FIT_TIMEOUT)
        seconds = time.perf_counter() - start
        if thread.is_alive():
            outcome["error"] = f"did not finish in {FIT_TIMEOUT} s"
        master.delete_temp_files()
    completed = "error" not in outcome
    return {
        "seed": seed,
        "killed_at": killer.killed_at if killer else None,
        "steps": _steps(kind, len(data[0])),
        "completed": completed,
        "error": outcome.get("error"),
        "accuracy": accuracy(net.module, tx, ty) if completed else None,
        "seconds": seconds,
    }


def _examples(rdd: Any) -> tuple[int, int]:
    """The examples a persisted RDD of DataSets yields, and the sum of their labels."""
    return rdd.map(lambda d: (d.num_examples(), int(d.labels.sum()))).reduce(lambda a, b: (a[0] + b[0], a[1] + b[1]))


def _summary(kind: str, approach: str, unfaulted: list[dict], faulted: list[dict]) -> dict[str, Any]:
    """Per master and approach: fits completed, and the accuracy and time of those against the
    unfaulted fits (the same seeds' where both ran)."""
    done = [f for f in faulted if f["completed"]]
    base = statistics.mean(u["accuracy"] for u in unfaulted)
    by_seed = {u["seed"]: u["accuracy"] for u in unfaulted}
    paired = [100 * (by_seed[f["seed"]] - f["accuracy"]) for f in done if f["seed"] in by_seed]
    accuracies = [f["accuracy"] for f in done]
    return {
        "master": kind,
        "approach": approach,
        "fits": len(faulted),
        "completed": len(done),
        "unfaulted_fits": len(unfaulted),
        "unfaulted_accuracy": base,
        "unfaulted_accuracy_min": min(by_seed.values()),
        "unfaulted_accuracy_max": max(by_seed.values()),
        "faulted_accuracy": statistics.mean(accuracies) if done else None,
        "faulted_accuracy_worst": min(accuracies) if done else None,
        "points_below_mean": 100 * (base - statistics.mean(accuracies)) if done else None,
        "points_below_worst": 100 * (base - min(accuracies)) if done else None,
        "points_below_same_seed_mean": statistics.mean(paired) if paired else None,
        "points_below_same_seed_worst": max(paired) if paired else None,
        "data_lost_fits": sum(f["data_intact"] is False for f in faulted),
        "unfaulted_seconds": statistics.mean(u["seconds"] for u in unfaulted),
        "faulted_seconds": statistics.mean(f["seconds"] for f in done) if done else None,
        "faulted_seconds_worst": max(f["seconds"] for f in done) if done else None,
    }


def _table(summaries: list[dict[str, Any]]) -> str:
    lines = [
        "| master | rdd approach | faulted fits completed | unfaulted accuracy: mean [range] | "
        "faulted accuracy: mean (worst) | points below the unfaulted mean: mean (worst) | "
        "points below the same seed unfaulted: mean (worst) | fits losing data | "
        "seconds unfaulted / faulted: mean (faulted worst) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        base = f"{s['unfaulted_accuracy']:.3f} [{s['unfaulted_accuracy_min']:.3f}-{s['unfaulted_accuracy_max']:.3f}]"
        if s["completed"]:
            faulted = f"{s['faulted_accuracy']:.3f} ({s['faulted_accuracy_worst']:.3f})"
            below = f"{s['points_below_mean']:.1f} ({s['points_below_worst']:.1f})"
            same = f"{s['points_below_same_seed_mean']:.1f} ({s['points_below_same_seed_worst']:.1f})"
            seconds = f"{s['unfaulted_seconds']:.1f} / {s['faulted_seconds']:.1f} ({s['faulted_seconds_worst']:.1f})"
        else:
            faulted = below = same = seconds = "-"
        lines.append(
            f"| {s['master']} | {s['approach']} | {s['completed']} of {s['fits']} | {base} | {faulted} | {below} | "
            f"{same} | {s['data_lost_fits']} | {seconds} |"
        )
    return "\n".join(lines)


def _certified(master: str, epochs: int, kill_every: float) -> dict[str, Any]:
    """``dlscale certify`` of the punished job with ``master`` for ``epochs`` epochs: its certificate's
    figures and its exit status."""
    with tempfile.TemporaryDirectory() as directory:
        output = Path(directory) / "certificate.json"
        command = [
            *(sys.executable, "-m", "dlscale.cli", "certify", str(KILL_EVERY_JOB), "--workers", str(WORKERS)),
            *("--kill-every", f"{kill_every}s", *KILL_EVERY_BOUNDS, "--output", str(output), "--", master, str(epochs)),
        ]
        status = subprocess.run(command, check=False).returncode
        if not output.exists():
            raise RuntimeError(f"dlscale certify wrote no certificate (exit status {status}): {' '.join(command)}")
        cert = json.loads(output.read_text())
    runs = cert["runs"]
    faulted = runs["faulted"] or {}
    fits = faulted.get("fits", [])
    tally = {k: sum(f["tally"][k] for f in fits) for k in ("planned", "once", "redone", "lost")}
    return {
        "master": master,
        "epochs": epochs,
        "exit_status": status,
        "kills": cert["faults"]["counts"]["kill"],
        "unfaulted_seconds": runs["unfaulted"]["seconds"],
        "faulted_seconds": faulted.get("seconds"),
        "time_ratio": cert["time_ratio"],
        "fit_time_ratio": cert["fit_time_ratio"],
        "unfaulted_fit_seconds": sum(f["seconds"] for f in runs["unfaulted"]["fits"]),
        "faulted_fit_seconds": sum(f["seconds"] for f in fits),
        "workers_lost": sum(len(f["workers_lost"]) for f in fits),
        "tally": tally,
        "unfaulted_accuracy": runs["unfaulted"]["metrics"].get("accuracy"),
        "faulted_accuracy": faulted.get("metrics", {}).get("accuracy"),
        "passed": cert["verdict"]["passed"],
        "failed_bounds": [c["message"] for c in cert["verdict"]["checks"] if not c["passed"]],
    }


def _kill_every(args: argparse.Namespace) -> None:
    """The punisher: certificates of each master's job under a kill every ``args.kill_every`` seconds."""
    report: dict[str, Any] = {
        **header("faults"),
        "kill_every": args.kill_every,
        "setup": {"workers": WORKERS, "job": KILL_EVERY_JOB.name, "model": [64, 128, 10], "bounds": KILL_EVERY_BOUNDS},
        "certificates": [],
    }
    for i in range(args.fits):
        for master, epochs in KILL_EVERY_EPOCHS.items():
            run = _certified(master, epochs, args.kill_every)
            report["certificates"].append(run)
            print(
                f"{master} {i + 1}/{args.fits}: {run['kills']} kills, {run['faulted_fit_seconds']:.1f} s against "
                f"{run['unfaulted_fit_seconds']:.1f} s (fit {run['fit_time_ratio']:.2f}x, script "
                f"{run['time_ratio']:.2f}x), {run['tally']['redone']} redone, {run['tally']['lost']} lost, accuracy "
                f"{run['faulted_accuracy']} against {run['unfaulted_accuracy']}: "
                f"{'passed' if run['passed'] else 'FAILED ' + '; '.join(run['failed_bounds'])}",
                flush=True,
            )
            write_results(args.out, report, indent=1)


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__.split("\n\n")[0], cases=CONFIG_HELP, title="configs")
    parser.add_argument("--fits", type=int, default=20, help="faulted fits per master and approach (default 20)")
    parser.add_argument(
        "--baseline", type=int, default=3, help="of those, how many seeds also fit without a fault (default 3)"
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=[f"{m}:{a}" for m, a in CONFIGS],
        choices=[f"{m}:{a}" for m, a in CONFIGS],
        help="the masters and approaches to run (default all six); the others' results already in "
        "the results file are kept",
    )
    parser.add_argument(
        "--kill-every",
        type=float,
        metavar="SECONDS",
        help="instead, certify each master's job of about 75 s under a kill every SECONDS, --fits times (default 2)",
    )
    chosen = parser.parse_known_args(argv)[0]
    results = KILL_EVERY_RESULTS if chosen.kill_every else RESULTS
    if chosen.kill_every:
        parser.set_defaults(fits=2)
    args = parse(parser, argv, results, fits=1, baseline=1, configs=["averaging:export", "sharing:direct"])
    if args.smoke:
        shrink(globals(), EPOCHS=2, KILL_EVERY_EPOCHS={"averaging": 20, "sharing": 5})
    if args.kill_every:
        _kill_every(args)
        return
    configs = [tuple(c.split(":")) for c in args.configs]
    kept = []
    if args.out.exists() and len(configs) < len(CONFIGS):
        earlier = json.loads(args.out.read_text())
        for c in earlier["configs"]:
            if f"{c['master']}:{c['approach']}" not in args.configs:
                kept.append({**c, "date": c.get("date", earlier["date"]), "commit": c.get("commit")})
    data = digits()
    x, y, _, _ = data
    report: dict[str, Any] = {
        **header("faults"),
        "setup": {
            "workers": WORKERS,
            "threads_per_worker": 1,
            "model": [64, 32, 10],
            "optimizer": "SGD lr 0.05 momentum 0.9",
            "batch": BATCH,
            "epochs": EPOCHS,
            "averaging_frequency": AVERAGING_FREQUENCY,
            "fits": args.fits,
            "baseline_fits": args.baseline,
        },
        "configs": list(kept),
    }
    summaries = [{k: v for k, v in c.items() if not k.endswith("_runs")} for c in kept]
    with (
        dask.config.set({"distributed.deploy.lost-worker-timeout": "300s"}),
        SparkContext(f"local[{WORKERS}]", "faults") as sc,
    ):
        rdd = sc.parallelize([DataSet(x[i : i + 4], y[i : i + 4]) for i in range(0, len(x), 4)], WORKERS).persist()
        expected = _examples(rdd)
        for kind, approach in configs:  # one fit of each first, unrecorded: imports and first pickling
            _fit(sc, rdd, kind, approach, 0, False, data)
        for kind, approach in configs:
            unfaulted, faulted = [], []
            for i in range(args.fits):
                seed = 1000 + i
                if i < args.baseline:
                    unfaulted.append(_fit(sc, rdd, kind, approach, seed, False, data))
                    if not unfaulted[-1]["completed"]:
                        raise RuntimeError(f"{kind} {approach}: an unfaulted fit failed: {unfaulted[-1]['error']}")
                run = _fit(sc, rdd, kind, approach, seed, True, data)
                hung = bool(run["error"]) and run["error"].startswith("did not finish")
                if not hung:
                    _workers(sc)
                run["data_intact"] = None if hung else _examples(rdd) == expected
                faulted.append(run)
                outcome = f"accuracy {run['accuracy']:.3f}" if run["completed"] else run["error"]
                if i < args.baseline:
                    outcome += f" (unfaulted {unfaulted[-1]['accuracy']:.3f} in {unfaulted[-1]['seconds']:.1f} s)"
                print(
                    f"{kind} {approach} fit {i + 1}/{args.fits}: killed at {run['killed_at']}/{run['steps']}, "
                    f"{outcome}, {run['seconds']:.1f} s, data intact {run['data_intact']}",
                    flush=True,
                )
                if hung:
                    print(f"{kind} {approach}: a fit hung; the rest of these fits are not run", flush=True)
                    break
            summary = {**_summary(kind, approach, unfaulted, faulted), "date": report["date"]}
            summary["commit"] = report["provenance"]["commit"]
            summaries.append(summary)
            report["configs"].append({**summary, "unfaulted_runs": unfaulted, "faulted_runs": faulted})
            report["table"] = _table(summaries)
            write_results(args.out, report, indent=1)  # after each master and approach: a long run
        rdd.unpersist()
    print(report["table"])


if __name__ == "__main__":
    main()
