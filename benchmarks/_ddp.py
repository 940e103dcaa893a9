"""PyTorch DistributedDataParallel as a baseline: samples/s of synchronous data-parallel training.

``ddp_samples_per_s`` trains a module with ``torch.nn.parallel.DistributedDataParallel`` over the
gloo backend in ``world_size`` processes (torch.multiprocessing, spawn) talking over 127.0.0.1: what a
PyTorch user would run instead of dlscale. Every step each process trains on its own minibatch of
``batch`` examples and DDP all-reduces the gradients, so a step covers a global batch of
``world_size * batch`` examples, as with a ``DistributedSampler``. With ``powersgd=True`` the gradients
are compressed by PyTorch's PowerSGD communication hook (rank-4 approximations with error feedback)
before they are all-reduced. ``train_rank`` is the training of one
process; ``benchmarks._torch_distributor`` runs the same under PySpark's TorchDistributor.

To run it over a rate-limited link, run the command line inside a namespace of ``benchmarks._links``::

    python -m benchmarks._ddp --world-size 2 --epochs 1 --train 3840

prints one JSON line (the result without the state dict). Without ``--data`` it trains the MLP of
``benchmarks._common`` on its data.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import os
import resource
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

from benchmarks._common import accuracy, make_data

ModuleFactory = Callable[[], torch.nn.Module]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

POWERSGD_RANK = 4  # matrix_approximation_rank: Vogels et al. reach full accuracy from rank 2 to 4
# Steps all-reduced densely before compressing: the first updates are large and change fast, so the
# low-rank approximation and its error feedback start from a trained-in direction; 10 steps is a few
# percent of the compare runs' steps (the default, 1000, would be more steps than they take).
POWERSGD_START = 10
TRIES = 3  # runs of a training whose process gloo aborts


def free_port() -> int:
    """A TCP port free on 127.0.0.1 just now (of this network namespace)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(n: int, world_size: int, batch: int) -> int:
    """Steps of an epoch: whole global batches only, so that every process does as many all-reduces."""
    return n // (world_size * batch)


def _shard(order: torch.Tensor, step: int, rank: int, world_size: int, batch: int) -> torch.Tensor:
    start = (step * world_size + rank) * batch
    return order[start : start + batch]


def train_rank(
    rank: int,
    world_size: int,
    tmp: str,
    make_module: ModuleFactory,
    optimizer_factory: OptimizerFactory,
    loss_fn: LossFn,
    batch: int,
    epochs: int,
    threads: int,
    warmup_steps: int,
    seed: int,
    powersgd: bool,
) -> None:
    """Process ``rank`` of the DDP training of ``ddp_samples_per_s`` on ``tmp/data.pt``; rank 0 writes
    ``tmp/result.pt``.

    Joins the gloo process group at MASTER_ADDR:MASTER_PORT of the environment and leaves it at the
    end. Each epoch is timed between barriers; after each, rank 0 evaluates on the test data (if any)
    with the clock stopped, while the others wait at the next epoch's barrier.
    """
    torch.set_num_threads(threads)
    # gloo binds to the address of the host name unless told which interface; in a namespace of
    # benchmarks._links only lo exists, and here everything is on 127.0.0.1 anyway.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        data = torch.load(Path(tmp) / "data.pt", weights_only=True)  # in memory, as the baseline's
        x, y = data["x"], data["y"]
        module = make_module()
        options: dict[str, Any] = {}
        if powersgd:
            # One bucket holding the whole model: on gloo, PowerSGD over several buckets aborts a rank
            # ("Received data size doesn't match expected size": the buckets' asynchronous all-reduces
            # of their factors are not matched in the same order on every rank; measured with 5 MiB
            # buckets on the MLP). An explicit bucket_cap_mb also sets the first bucket's cap, which
            # would otherwise be 1 MiB.
            grad_mib = sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20
            options["bucket_cap_mb"] = int(grad_mib) + 1
        model = torch.nn.parallel.DistributedDataParallel(module, **options)  # broadcasts rank 0's weights
        optimizer = optimizer_factory(model.parameters())
        steps = _steps(len(x), world_size, batch)

        def step(idx: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            return loss.detach()

        # Warm-up (first all-reduces, DDP's bucket rebuild, allocator), then back to the initial state,
        # so that the timed epochs train from the same weights as a baseline without warm-up.
        initial = copy.deepcopy(module.state_dict()), copy.deepcopy(optimizer.state_dict())
        warm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + 10**6))
        for s in range(min(warmup_steps, steps)):
            step(_shard(warm, s, rank, world_size, batch))
        module.load_state_dict(initial[0])
        optimizer.load_state_dict(initial[1])
        state = None
        if powersgd:  # registered after the warm-up (dense all-reduces, as PowerSGD's first steps) so
            # that its step count and error feedback start with the timed epochs
            state = powerSGD.PowerSGDState(
                None,
                matrix_approximation_rank=POWERSGD_RANK,
                start_powerSGD_iter=POWERSGD_START,
                use_error_feedback=True,
                warm_start=True,
            )
            model.register_comm_hook(state, powerSGD.powerSGD_hook)

        g = torch.Generator().manual_seed(seed)  # the same order on every rank, as set_epoch does
        loss = torch.tensor(float("nan"))
        seconds = cpu_seconds = 0.0
        epoch_seconds: list[float] = []
        epoch_accuracy: list[float] = []
        for _ in range(epochs):
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            order = torch.randperm(len(x), generator=g)
            for s in range(steps):
                loss = step(_shard(order, s, rank, world_size, batch))
            dist.barrier()
            seconds += time.perf_counter() - start
            cpu_seconds += time.process_time() - cpu_start
            epoch_seconds.append(seconds)
            if rank == 0 and "test_x" in data:
                epoch_accuracy.append(accuracy(module, data["test_x"], data["test_y"]))

        usage: list[Any] = [None] * world_size  # (peak RSS bytes, timed CPU seconds) of every rank
        dist.all_gather_object(usage, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, cpu_seconds))
        if rank == 0:
            result: dict[str, Any] = {
                "seconds": seconds,
                "final_loss": float(loss),
                "epoch_seconds": epoch_seconds,
                "epoch_accuracy": epoch_accuracy,
                "peak_rss_bytes": max(rss for rss, _ in usage),
                "cpu_seconds": sum(cpu for _, cpu in usage),
            }
            if epoch_accuracy:
                result["test_accuracy"] = epoch_accuracy[-1]
            if state is not None:  # elements all-reduced in the compressed steps
                result["powersgd_elements"] = state.total_numel_after_compression
            result["state_dict"] = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
            torch.save(result, Path(tmp) / "result.pt.part")
            os.replace(Path(tmp) / "result.pt.part", Path(tmp) / "result.pt")  # whole, or not there
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world_size: int, port: int, tmp: str, *args: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train_rank(rank, world_size, tmp, *args)


def train_with(
    launch: Callable[[str, tuple[Any, ...]], dict[str, Any]],
    world_size: int,
    make_module: ModuleFactory,
    x: torch.Tensor,
    y: torch.Tensor,
    batch: int,
    epochs: int,
    optimizer_factory: OptimizerFactory,
    threads_per_process: int = 1,
    *,
    test_x: torch.Tensor | None = None,
    test_y: torch.Tensor | None = None,
    loss_fn: LossFn = torch.nn.functional.cross_entropy,
    warmup_steps: int = 3,
    seed: int = 0,
    powersgd: bool = False,
) -> dict[str, Any]:
    """Train with DDP over gloo in ``world_size`` processes that ``launch(tmp, args)`` starts, each
    running ``train_rank(rank, world_size, tmp, *args)``; return the throughput of the timed epochs.

    ``make_module``, ``optimizer_factory`` and ``loss_fn`` go to the workers by pickling: module-level
    functions or ``functools.partial`` of them. The data goes through a temporary file (``torch.save``,
    loaded with ``weights_only=True``). Each epoch is one random order shared by all processes, cut
    into global batches of ``world_size * batch``; process ``r`` trains on the ``r``-th ``batch`` of
    each, and an incomplete last global batch is dropped. Timed: ``epochs`` epochs, after
    ``warmup_steps`` steps whose effect is undone; evaluation between epochs is not timed.

    ``powersgd`` compresses the gradients with PyTorch's PowerSGD hook (rank :data:`POWERSGD_RANK`,
    error feedback, dense for the first :data:`POWERSGD_START` timed steps).

    Returns samples/s (training examples of the timed epochs per second), seconds, steps,
    ``grad_bytes_per_step`` (bytes of the gradients a step), ``allreduced_bytes_per_step`` (bytes
    all-reduced a step, on average over the timed steps: the gradients, or PowerSGD's factors and
    uncompressed tensors), rank 0's final ``state_dict``
    (CPU tensors), ``final_loss`` (rank 0's last minibatch), ``epoch_seconds`` (training seconds so far
    at the end of each epoch), ``peak_rss_bytes`` (the largest peak resident set of the processes),
    ``cpu_seconds`` (user and system CPU time of all processes in the timed epochs), ``epoch_accuracy``
    (rank 0's test accuracy after each epoch; empty without test data) and ``test_accuracy`` (after the
    last epoch, when test data is given), with what ``launch`` returned.
    """
    steps = _steps(len(x), world_size, batch)
    if steps == 0:
        raise ValueError(f"{len(x)} examples make no global batch of {world_size} x {batch}")
    module = make_module()
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    with tempfile.TemporaryDirectory(prefix="dlscale-ddp-") as tmp:
        data = {"x": x.contiguous(), "y": y.contiguous()}
        if test_x is not None and test_y is not None:
            data.update(test_x=test_x.contiguous(), test_y=test_y.contiguous())
        torch.save(data, Path(tmp) / "data.pt")
        args = (
            make_module,
            optimizer_factory,
            loss_fn,
            batch,
            epochs,
            threads_per_process,
            warmup_steps,
            seed,
            powersgd,
        )
        launched = launch(tmp, args)
        result = torch.load(Path(tmp) / "result.pt", weights_only=True)
    samples = epochs * steps * world_size * batch
    allreduced = grad_bytes
    if powersgd:
        dense_steps = min(POWERSGD_START, epochs * steps)
        allreduced = (dense_steps * grad_bytes + 4 * result.pop("powersgd_elements")) / (epochs * steps)
    return {
        "world_size": world_size,
        "batch": batch,
        "global_batch": world_size * batch,
        "epochs": epochs,
        "steps_per_epoch": steps,
        "samples": samples,
        "samples_per_s": samples / result["seconds"],
        "threads_per_process": threads_per_process,
        "parameters": params,
        "grad_bytes_per_step": grad_bytes,
        "allreduced_bytes_per_step": allreduced,
        "powersgd": powersgd,
        **launched,
        **result,
    }


def ddp_samples_per_s(
    world_size: int,
    make_module: ModuleFactory,
    x: torch.Tensor,
    y: torch.Tensor,
    batch: int,
    epochs: int,
    optimizer_factory: OptimizerFactory,
    threads_per_process: int = 1,
    port: int | None = None,
    **options: Any,
) -> dict[str, Any]:
    """:func:`train_with` in processes started by ``torch.multiprocessing`` (spawn), meeting at
    127.0.0.1:``port`` (a free port by default); ``options`` are :func:`train_with`'s keywords.

    gloo sometimes aborts a process as it ends ("terminate called without an active exception",
    ``SIGABRT``). A run whose result was written before that (every rank had ended its training:
    rank 0 writes it after gathering from every rank) counts; one aborted before is run again, up
    to :data:`TRIES` runs in all, and the result says how many were (``aborted_before``)."""

    def launch(tmp: str, args: tuple[Any, ...]) -> dict[str, Any]:
        result = Path(tmp) / "result.pt"
        for attempt in range(TRIES):
            result.unlink(missing_ok=True)
            try:
                mp.spawn(_worker, nprocs=world_size, join=True, args=(world_size, port or free_port(), tmp, *args))
            except mp.ProcessExitedException as e:
                if e.signal_name == "SIGABRT" and result.exists():
                    return {"aborted_before": attempt}  # at its end: the training was done and recorded
                if e.signal_name != "SIGABRT" or attempt == TRIES - 1:
                    raise
                continue
            return {"aborted_before": attempt}
        raise AssertionError("unreachable")

    return train_with(
        launch, world_size, make_module, x, y, batch, epochs, optimizer_factory, threads_per_process, **options
    )


def _resolve(spec: str) -> Any:
    """The object named ``package.module:attribute``."""
    module, _, attr = spec.partition(":")
    return functools.reduce(getattr, attr.split("."), importlib.import_module(module))


def command_line(description: str) -> argparse.ArgumentParser:
    """The options of ``main`` but ``--port``, shared with ``benchmarks._torch_distributor``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64, help="examples per process per step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model",
        default="benchmarks._common:mlp",
        help="module:callable returning the nn.Module (default: the benchmark MLP)",
    )
    parser.add_argument(
        "--optimizer",
        default="benchmarks._common:SGD",
        help="module:callable(params) returning the optimizer (default: SGD lr 0.01 momentum 0.9)",
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="torch.save'd dict of tensors x, y and optionally test_x, test_y "
        "(default: benchmarks._common.make_data())",
    )
    parser.add_argument("--train", type=int, default=None, help="use only the first TRAIN training examples")
    return parser


def run_command_line(samples_per_s: Callable[..., dict[str, Any]], args: argparse.Namespace, **kwargs: Any) -> None:
    """Run ``samples_per_s`` (``ddp_samples_per_s`` or alike) on the workload of the parsed ``command_line``
    and ``kwargs``; print the result without the state dict as one JSON line."""
    if args.data is not None:
        data = torch.load(args.data, weights_only=True)
    else:
        data = dict(zip(("x", "y", "test_x", "test_y"), make_data(), strict=True))
    x, y = data["x"][: args.train], data["y"][: args.train]
    result = samples_per_s(
        args.world_size,
        _resolve(args.model),
        x,
        y,
        args.batch,
        args.epochs,
        _resolve(args.optimizer),
        args.threads,
        test_x=data.get("test_x"),
        test_y=data.get("test_y"),
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        **kwargs,
    )
    result.pop("state_dict")
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = command_line("DDP (gloo) samples/s; prints one JSON line.")
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)
    run_command_line(ddp_samples_per_s, args, port=args.port)


if __name__ == "__main__":
    main()
