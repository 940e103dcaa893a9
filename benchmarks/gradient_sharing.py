"""Gradient sharing on two workers against single-process PyTorch and PyTorch DDP, on loopback and
over a link limited to 1 Gbit/s.

Run from the repository root with ``python -m benchmarks.gradient_sharing`` (as root, for the
network namespaces; without them only loopback is measured). Workload: the MLP 784-2048-2048-10
(5.8M parameters), minibatches of 64, SGD (lr 0.01, momentum 0.9), the synthetic 10-class task of
``benchmarks._common``. For each link, in one process inside a network namespace whose
loopback carries that link (``benchmarks._links``):

- **single process**: a plain PyTorch loop, one thread;
- **DDP**: ``DistributedDataParallel`` over gloo, 2 processes of one thread, 64 examples each a step;
- **dlscale**: ``SharedTrainingMaster`` on ``SparkContext("local[2]")`` (2 workers of one thread),
  ``fit_paths`` on minibatch files exported before timing, default threshold settings.

Each trains one epoch after a warm-up; samples/s count the epoch's examples. Also reported: test
accuracy, bytes sent per step and the compression against the dense update. Targets: dlscale ≥ 1.8×
single process on both links. Results go to ``benchmarks/results/gradient_sharing.json``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import _common, _ddp, _links
from benchmarks._common import (
    BATCH,
    SGD,
    accuracy,
    command_line,
    export_paths,
    header,
    make_data,
    mlp,
    network,
    parse,
    shrink,
    timed,
    write_results,
)
from dlscale import SharedTrainingMaster, SparkContext, SparkNet
from dlscale.data import DataSet

RESULTS = Path(__file__).resolve().parent / "results" / "gradient_sharing.json"
LINKS = ("loopback", "1gbit")
TARGET = 1.8
RUNNER_HELP = {
    "single_process": "a plain PyTorch loop, one thread",
    "ddp": "DistributedDataParallel over gloo, 2 processes of one thread, 64 examples each a step",
    "dlscale": 'SharedTrainingMaster on SparkContext("local[2]"), fit_paths on minibatch files',
}
"""A line on each runner, for ``--help``."""


def single_process(x: torch.Tensor, y: torch.Tensor, tx: torch.Tensor, ty: torch.Tensor) -> dict[str, float]:
    torch.set_num_threads(1)
    net = network()
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=g)
    batches = [DataSet(x[order[i : i + BATCH]], y[order[i : i + BATCH]]) for i in range(0, len(x), BATCH)]
    net.fit(batches[:3])  # warm-up
    net = network()
    seconds = timed(lambda: net.fit(batches))
    return {"samples_per_s": len(x) / seconds, "seconds": seconds, "test_accuracy": accuracy(net.module, tx, ty)}


def ddp(x: torch.Tensor, y: torch.Tensor, tx: torch.Tensor, ty: torch.Tensor) -> dict[str, float]:
    result = _ddp.ddp_samples_per_s(2, mlp, x, y, BATCH, 1, SGD, test_x=tx, test_y=ty)
    return {k: result[k] for k in ("samples_per_s", "seconds", "test_accuracy", "grad_bytes_per_step")}


def dlscale_sharing(x: torch.Tensor, y: torch.Tensor, tx: torch.Tensor, ty: torch.Tensor) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, SparkContext("local[2]", "bench-gradient-sharing") as sc:
        paths = export_paths(sc, x, y, f"{tmp}/train")
        SparkNet(sc, network(), SharedTrainingMaster(BATCH)).fit_paths(sc.parallelize(paths.take(20)))  # warm-up
        net = network()
        spark_net = SparkNet(sc, net, SharedTrainingMaster(BATCH, rng_seed=0, collect_training_stats=True))
        seconds = timed(lambda: (spark_net.fit_paths(paths), net.settle()))  # the state on the driver too
        trainers = spark_net.training_stats.trainers
    steps = sum(t.minibatches for t in trainers)
    sent = sum(t.bytes_sent for t in trainers)
    dense = 4 * net.num_params()
    busy = {p: sum(t.seconds(p) for t in trainers) for p in ("fit", "encode", "send", "apply", "wait")}
    return {
        "samples_per_s": len(x) / seconds,
        "seconds": seconds,
        "test_accuracy": accuracy(net.module, tx, ty),
        "steps": steps,
        "bytes_sent_per_step": sent / steps,
        "dense_update_bytes": dense,
        "compression": dense * steps / max(sent, 1),
        "trainer_seconds": busy,
        "minibatches_per_trainer": [t.minibatches for t in trainers],
    }


def inner(link: str) -> dict[str, Any]:
    """Every measurement on one link (run inside that link's namespace)."""
    x, y, tx, ty = make_data()
    out = {"link": link, "single_process": single_process(x, y, tx, ty)}
    out["ddp"] = ddp(x, y, tx, ty)
    out["dlscale"] = dlscale_sharing(x, y, tx, ty)
    base = out["single_process"]["samples_per_s"]
    for name in ("ddp", "dlscale"):
        out[name]["ratio_vs_single_process"] = out[name]["samples_per_s"] / base
    return out


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__.split("\n\n")[0], cases=RUNNER_HELP, title=f"runners (on {', '.join(LINKS)})")
    parser.add_argument("--inner", metavar="LINK", help=argparse.SUPPRESS)
    args = parse(parser, argv, RESULTS)
    if args.smoke:  # loopback, in a namespace of its own where they can be made (as every link is)
        shrink(globals(), LINKS=("loopback",))
    if args.inner:
        print(json.dumps(inner(args.inner)))
        return
    reason = _links.available()
    report: dict[str, Any] = {
        **header("gradient_sharing"),
        "setup": {
            "model": "MLP 784-2048-2048-10",
            "batch": BATCH,
            "train_examples": _common.TRAIN,
            "epochs": 1,
            "workers": 2,
            "threads_per_worker": 1,
            "optimizer": "SGD lr 0.01 momentum 0.9",
        },
        "links": {},
    }
    for link in LINKS if reason is None else ("loopback",):
        if reason is None:
            with _links.limited_namespace(_links.LINKS[link]) as ns:
                done = _links.run_in_namespace(
                    ns, ["python", "-m", "benchmarks.gradient_sharing", "--inner", link], timeout=1800
                )
            if done.returncode:
                raise RuntimeError(f"the {link} run failed:\n{done.stderr[-4000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
        else:
            print(f"network namespaces unavailable ({reason}): loopback only")
            result = inner(link)
        report["links"][link] = result
        d, p = result["dlscale"], result["ddp"]
        print(
            f"{link}: single process {result['single_process']['samples_per_s']:.0f} samples/s; "
            f"DDP {p['samples_per_s']:.0f} ({p['ratio_vs_single_process']:.2f}x); dlscale {d['samples_per_s']:.0f} "
            f"({d['ratio_vs_single_process']:.2f}x, target {TARGET}x), {d['bytes_sent_per_step']:.0f} bytes a step "
            f"({d['compression']:.0f}x compression), accuracy {d['test_accuracy']:.4f} vs "
            f"{result['single_process']['test_accuracy']:.4f}"
        )
    write_results(args.out, report, indent=1)


if __name__ == "__main__":
    main()
