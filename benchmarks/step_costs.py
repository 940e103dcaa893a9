"""What a gradient-sharing trainer's step costs besides its fit, with each compressor, alone and
beside a second process that fits: where the 2-worker run's time goes.

Run from the repository root with ``python -m benchmarks.step_costs`` (about a minute). On
compare's workload (the MLP 784-2048-2048-10, 5.8M parameters, SGD lr 0.01 momentum 0.9,
minibatches of 64, one thread), one process takes a trainer's steps as a summing trainer does,
through dlscale's ``Network`` and the compressor's own methods, with no cluster around it:

- ``fit``: the trainer's ``Keeping.fit`` (``Network.step``; a compressor that is not lossless: the
  parameters kept before it);
- ``encode``: ``Keeping.encode``: the compressor's ``compress`` of the residual; its message applied
  to the shared parameters (lossless) or, otherwise, the update taken out of the replica and the
  message applied to it; momentum masking;
- ``send``: the message's bytes (``stage``, ``to_bytes``);
- ``apply``: a peer's message read (``from_bytes``) and applied to the replica and the shared
  parameters (``Keeping.receive``). The peer's message is this trainer's previous one, applied to a
  second trainer's vectors, so that its own state is untouched and the message is of the real size.

A plain PyTorch step of the same model (compare's single process) is timed the same way. Each runs
``STEPS`` steps after ``WARMUP`` untimed ones (past ``"topk"``'s density warm-up), twice: alone,
with the machine's other core idle, and beside a second process that fits the same model in a loop,
as the other trainer of a 2-worker run (or the ceiling's other process) does. Figures are medians
over the steps, in milliseconds. From them, ``two_trainers_bound``: the most two trainers of each
compressor could train against one plain process alone, were nothing else on the machine (two
steps' examples in one step beside a fitting process, against one plain step alone). Results go to
``benchmarks/results/step_costs.json``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import BATCH, SGD, command_line, header, make_data, mlp, network, parse, shrink, write_results
from dlscale.data import DataSet
from dlscale.encoding import Layout, compressor
from dlscale.training.sharing._keeping import keeping

RESULTS = Path(__file__).resolve().parent / "results" / "step_costs.json"
COMPRESSORS = ("topk", "dl4j", "dense")
WARMUP = 25
STEPS = 60
PHASES = ("fit", "encode", "send", "apply")
RUN_HELP = {
    "plain PyTorch": "compare's single process: a plain PyTorch step",
    "topk": "a summing trainer's fit, encode, send and apply with SharedTrainingMaster's default, top-k",
    "dl4j": "the same with Deeplearning4j's threshold encoding",
    "dense": "the same with every value sent, uncompressed",
}
"""A line on the plain step and each of :data:`COMPRESSORS`, for ``--help``."""


def _plain_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """Compare's single process: one plain PyTorch step."""
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(module(x), y).backward()
    optimizer.step()


def _fit_forever(ready: Any, stop: Any) -> None:
    """The second process: :func:`_plain_step`, over and over, until ``stop`` is set."""
    torch.set_num_threads(1)
    x, y, _, _ = make_data()
    module = mlp()
    optimizer = SGD(module.parameters())
    i = 0
    while not stop.is_set():
        at = (i % (len(x) // BATCH)) * BATCH
        _plain_step(module, optimizer, x[at : at + BATCH], y[at : at + BATCH])
        i += 1
        if i == 5:
            ready.set()


@contextlib.contextmanager
def _beside(busy: bool) -> Iterator[None]:
    """A second process fitting in a loop while the block runs (when ``busy``)."""
    if not busy:
        yield
        return
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    process = ctx.Process(target=_fit_forever, args=(ready, stop), daemon=True)
    process.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the second fitting process did not start")
        yield
    finally:
        stop.set()
        process.join(30)


def _batches() -> list[DataSet]:
    x, y, _, _ = make_data()
    return [DataSet(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, (WARMUP + STEPS) * BATCH, BATCH)]


def _phases(steps: Callable[[DataSet], dict[str, float]], batches: list[DataSet]) -> dict[str, float]:
    """Median milliseconds of each phase over the timed steps."""
    times: dict[str, list[float]] = {}
    for i, batch in enumerate(batches):
        phases = steps(batch)
        if i >= WARMUP:
            for phase, seconds in phases.items():
                times.setdefault(phase, []).append(seconds)
    return {phase: 1e3 * statistics.median(t) for phase, t in times.items()}


def plain(batches: list[DataSet]) -> dict[str, float]:
    """Compare's single process: :func:`_plain_step`, timed."""
    module = mlp()
    optimizer = SGD(module.parameters())

    def step(batch: DataSet) -> dict[str, float]:
        t = time.perf_counter()
        _plain_step(module, optimizer, batch.features, batch.labels)
        return {"fit": time.perf_counter() - t}

    return _phases(step, batches)


def trainer(name: str, batches: list[DataSet]) -> dict[str, Any]:
    """A summing trainer's steps with compressor ``name``, through the trainer's own way of keeping its
    update (``dlscale.training.sharing._keeping``); also the message size."""
    codec = compressor(name)
    own, peer = (
        keeping(net, codec, codec.state(Layout.of(net.module.parameters())), "sum", momentum_masking=True)
        for net in (network(), network())
    )
    last: list[bytes] = []
    sizes: list[int] = []

    def step(batch: DataSet) -> dict[str, float]:
        t0 = time.perf_counter()
        # the peer's message, as the trainer applies its inbox before its fit (to the other replica)
        peer.receive([(codec, codec.from_bytes(payload)) for payload in last])
        t1 = time.perf_counter()
        own.fit(batch, alive=2)
        t2 = time.perf_counter()
        message = own.encode(alive=2)
        t3 = time.perf_counter()
        last[:] = [] if message is None else [codec.to_bytes(codec.stage(message))]
        t4 = time.perf_counter()
        sizes.append(len(last[0]) if last else 0)
        return {"apply": t1 - t0, "fit": t2 - t1, "encode": t3 - t2, "send": t4 - t3}

    phases = _phases(step, batches)
    return {**phases, "message_bytes": statistics.median(sizes[WARMUP:])}


def main(argv: list[str] | None = None) -> None:
    title = "runs (each beside nothing and beside a process that fits)"
    args = parse(command_line(__doc__.splitlines()[0], cases=RUN_HELP, title=title), argv, RESULTS)
    if args.smoke:
        shrink(globals(), WARMUP=2, STEPS=3)
    torch.set_num_threads(1)
    batches = _batches()
    report: dict[str, Any] = {
        **header("step_costs"),
        "setup": {
            "model": "MLP 784-2048-2048-10",
            "parameters": sum(p.numel() for p in mlp().parameters()),
            "batch": BATCH,
            "optimizer": "SGD lr 0.01 momentum 0.9",
            "threads": 1,
            "warmup_steps": WARMUP,
            "timed_steps": STEPS,
            "aggregation": "sum",
        },
        "runs": [],
    }
    for busy in (False, True):
        with _beside(busy):
            runs = [{"run": "plain PyTorch", **plain(batches)}]
            runs += [{"run": name, **trainer(name, batches)} for name in COMPRESSORS]
        for r in runs:
            r["beside"] = "a fitting process" if busy else "nothing"
            r["besides_fit"] = sum(r.get(p, 0.0) for p in PHASES if p != "fit")
            report["runs"].append(r)
            print(
                f"beside {r['beside']:17s} {r['run']:13s} "
                + " ".join(f"{p} {r[p]:6.2f}" for p in PHASES if p in r)
                + f"  ms a step (besides the fit {r['besides_fit']:.2f})",
                flush=True,
            )
    alone = next(r["fit"] for r in report["runs"] if r["run"] == "plain PyTorch" and r["beside"] == "nothing")
    report["two_trainers_bound"] = {}
    for r in report["runs"]:
        if r["run"] in COMPRESSORS and r["beside"] != "nothing":
            bound = 2 * alone / (r["fit"] + r["besides_fit"])
            report["two_trainers_bound"][r["run"]] = bound
            print(f"two {r['run']} trainers with nothing else on the machine: at most {bound:.2f}x one process")
    write_results(args.out, report, indent=1)


if __name__ == "__main__":
    main()
