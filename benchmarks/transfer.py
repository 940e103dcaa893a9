"""Moving one partition between processes: dlscale's ``Partition`` against a plain ``list``.

``distributed`` serialises a plain list element by element; a ``Partition`` crosses as one unit.
Run with ``python -m benchmarks.transfer``; writes ``benchmarks/results/transfer.json``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import distributed
import torch

from benchmarks._common import command_line, header, parse, shrink, write_results
from dlscale.facade._graph import Partition
from dlscale.runtime.cluster import cluster_workers

REPEATS = 5
RESULTS = Path(__file__).parent / "results" / "transfer.json"


def pairs(n: int) -> list:
    return [(f"w{i}", i) for i in range(n)]


def tensors(n: int) -> list:
    return [torch.rand(n) for _ in range(4)]


PAYLOADS: dict[str, tuple[Callable[[int], list], int]] = {
    "100k (str, int) pairs": (pairs, 100_000),
    "4 tensors of 16 MiB": (tensors, 4 * 2**20),
}
PAYLOAD_HELP = {
    "100k (str, int) pairs": "a list of 100,000 (str, int) tuples",
    "4 tensors of 16 MiB": "a list of 4 float32 tensors of 4 Mi elements",
}
"""A line on each of :data:`PAYLOADS`, for ``--help``."""


def make(kind: str, payload: str) -> list:
    build, n = PAYLOADS[payload]
    data = build(n)
    return Partition(data) if kind == "Partition" else data


def time_transfers(client: distributed.Client, kind: str, payload: str) -> dict[str, Any]:
    """Median seconds to move the payload worker -> worker, and worker -> client."""
    a, b = list(cluster_workers(client))
    w2w, w2c = [], []
    for _ in range(REPEATS):
        src = client.submit(make, kind, payload, workers=[a], pure=False)
        distributed.wait(src)
        start = time.perf_counter()
        client.submit(len, src, workers=[b], pure=False).result()
        w2w.append(time.perf_counter() - start)
        start = time.perf_counter()
        src.result()
        w2c.append(time.perf_counter() - start)
        del src
    return {"worker_to_worker_s": statistics.median(w2w), "worker_to_client_s": statistics.median(w2c)}


def main(argv: list[str] | None = None) -> None:
    title = "payloads (each as a list and as a Partition, worker to worker and worker to client)"
    args = parse(command_line(__doc__.splitlines()[0], cases=PAYLOAD_HELP, title=title), argv, RESULTS)
    if args.smoke:
        shrink(
            globals(),
            REPEATS=1,
            PAYLOADS={"1k (str, int) pairs": (pairs, 1000), "4 tensors of 16 KiB": (tensors, 4096)},
        )
    results: dict[str, dict] = {}
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster:
        with distributed.Client(cluster) as client:
            for payload in PAYLOADS:
                results[payload] = {kind: time_transfers(client, kind, payload) for kind in ("list", "Partition")}
                base, ours = results[payload]["list"], results[payload]["Partition"]
                results[payload]["speedup_worker_to_worker"] = base["worker_to_worker_s"] / ours["worker_to_worker_s"]
                results[payload]["speedup_worker_to_client"] = base["worker_to_client_s"] / ours["worker_to_client_s"]
    print(
        "| payload | list w->w (s) | Partition w->w (s) | speed-up "
        "| list w->client (s) | Partition w->client (s) | speed-up |"
    )
    print("|---|---|---|---|---|---|---|")
    for payload, r in results.items():
        print(
            f"| {payload} | {r['list']['worker_to_worker_s']:.3f} | {r['Partition']['worker_to_worker_s']:.3f} "
            f"| {r['speedup_worker_to_worker']:.1f}x | {r['list']['worker_to_client_s']:.3f} "
            f"| {r['Partition']['worker_to_client_s']:.3f} | {r['speedup_worker_to_client']:.1f}x |"
        )
    write_results(
        args.out, {**header("transfer", distributed=distributed.__version__), "repeats": REPEATS, "results": results}
    )


if __name__ == "__main__":
    main()
