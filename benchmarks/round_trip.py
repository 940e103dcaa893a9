"""A part's round trip between two parameter-averaging workers: through Dask's comms and over the
workers' own TCP connections, with and without a model stepping beside.

Run from the repository root with ``python -m benchmarks.round_trip`` (about a minute). Two workers
(``SparkContext("local[2]")``, one per ``dlscale.training.transport``: ``"dask"``, then ``"tcp"``)
each run a task that sends a part with the averaging plugin's own ``send`` and waits for the other's
in the session's mailbox, as a trainer does at a round's end: ``TRIPS`` round trips after ``WARMUP``,
the median in milliseconds. The part is the digits MLP's state in float32 (``small_model``'s 19,210
parameters and their momentum: 154 KB) and compare's MLP's (5.8M and momentum: 46.6 MB, fewer
trips). ``beside``: ``"a stepping model"`` runs a thread on each worker that fits the digits MLP in a
loop meanwhile, as a trainer of the next round or a streaming trainer does; ``"nothing"`` does not.
Results go to ``benchmarks/results/round_trip.json``.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import dask
import numpy as np
import torch

from benchmarks._common import command_line, header, parse, shrink, write_results
from dlscale import SparkContext
from dlscale.runtime.extensions import install
from dlscale.training.averaging._extension import AVERAGING
from dlscale.training.averaging._worker_plugin import plugin

RESULTS = Path(__file__).resolve().parent / "results" / "round_trip.json"
WARMUP = 20
TRIPS = {"digits MLP (154 KB)": 400, "compare's MLP (46.6 MB)": 20}
SIZES = {"digits MLP (154 KB)": 2 * 19_210, "compare's MLP (46.6 MB)": 2 * 5_824_010}
TRANSPORTS = ("dask", "tcp")
BESIDE = ("nothing", "a stepping model")
TRANSPORT_HELP = {
    "dask": 'dlscale.training.transport "dask": the part through Dask\'s comms',
    "tcp": 'dlscale.training.transport "tcp": over the workers\' own TCP connections',
}
"""A line on each of :data:`TRANSPORTS`, for ``--help``."""


def _stepping(stop: threading.Event) -> None:
    torch.set_num_threads(1)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    while not stop.is_set():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()


def _trips(session: str, peer: str, first: bool, size: int, trips: int, warmup: int, beside: bool) -> list[float]:
    """On a worker: ``trips`` round trips of a part of ``size`` float32 values with ``peer``, each
    sent with the plugin's ``send`` and awaited in the session's mailbox; seconds each."""
    from distributed import get_worker

    p = plugin(get_worker())
    box = p.mailboxes[session]
    payload = np.ones(size, np.float32)
    stop = threading.Event()
    if beside:
        threading.Thread(target=_stepping, args=(stop,), daemon=True).start()
    times = []
    try:
        for k in range(warmup + trips):
            t0 = time.perf_counter()
            for step in (0, 1) if first else (1, 0):
                key = (k, 0, step)
                if (step == 0) == first:
                    p.send(session, peer, key, {"k": k}, payload)
                elif box.wait(key, {peer}, 60.0) is None:
                    raise TimeoutError(f"trip {k}: no part from {peer}")
            box.forget(k)
            if k >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        stop.set()
    return times


def measure(transport: str) -> list[dict[str, Any]]:
    rows = []
    with dask.config.set({"dlscale.training.transport": transport}), SparkContext("local[2]", "round-trip") as sc:
        client = sc.client
        install(client, AVERAGING)
        a, b = sorted(client.scheduler_info()["workers"])
        for part, trips in TRIPS.items():
            for beside in BESIDE:
                session = f"round-trip-{transport}-{len(rows)}"
                client.run(lambda dask_worker, s=session: plugin(dask_worker).open(s) and None)
                futures = [
                    client.submit(
                        _trips,
                        session,
                        peer,
                        first,
                        SIZES[part],
                        trips,
                        WARMUP,
                        beside != BESIDE[0],
                        workers=[on],
                        pure=False,
                    )
                    for on, peer, first in ((a, b, True), (b, a, False))
                ]
                times = futures[0].result()
                futures[1].result()
                client.run(lambda dask_worker, s=session: plugin(dask_worker).close(s))
                ms = statistics.median(times) * 1e3
                rows.append({"transport": transport, "part": part, "beside": beside, "round_trip_ms": ms})
                print(f"{transport:5s} {part:26s} beside {beside:17s} {ms:8.3f} ms a round trip")
    return rows


def main(argv: list[str] | None = None) -> None:
    title = f"transports (parts: {', '.join(TRIPS)}; beside: {', '.join(BESIDE)})"
    args = parse(command_line(__doc__.splitlines()[0], cases=TRANSPORT_HELP, title=title), argv, RESULTS)
    if args.smoke:
        shrink(globals(), WARMUP=2, TRIPS={"digits MLP (154 KB)": 5}, SIZES={"digits MLP (154 KB)": 1000})
    rows = [row for transport in TRANSPORTS for row in measure(transport)]
    report = {
        **header("round_trip"),
        "setup": {"warmup": WARMUP, "trips": TRIPS, "values": SIZES, "dtype": "float32"},
        "runs": rows,
    }
    write_results(args.out, report)


if __name__ == "__main__":
    main()
