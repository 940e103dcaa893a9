"""Threshold encoding: encode + apply of one update against one copy of the same buffer.

Run from the repository root with ``python -m benchmarks.encoding``. The update is a float32
vector of 5.8 million elements (a 5.8M-parameter network, 23 MB) of standard normal values; the
threshold is set so that a given fraction of it is sent: 1e-4, 1e-3 and 1e-2 (sparse messages) and
0.1 (a bitmap message). What is timed is ``encode(residual, t)`` followed by ``apply(message,
replica)``, one trainer's share of a step, and the baseline is ``residual.clone()``, one copy of the
same buffer, in this same script.

Every timed operation starts from the same state: the residual is refilled from the update just
before it (untimed), so the encoder and the copy find the same data in the same caches. Each
repeat times the copy and every case once, in turn; the figures are medians of the repeats. This
is done with ``torch.set_num_threads(1)`` and with torch's default number of threads. The headline
is one thread: the encoder's numpy steps use one thread whatever the setting, so one thread compares
like with like. Target: encode + apply ≤ 3 × one copy at a sparsity of 1e-3.

Results go to ``benchmarks/results/encoding.json``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._common import command_line, header, parse, shrink, timed, write_results
from dlscale.encoding import apply, decode, encode

RESULTS = Path(__file__).resolve().parent / "results" / "encoding.json"
LENGTH = 5_800_000
SPARSITIES = (1e-4, 1e-3, 1e-2, 0.1)
REPEATS = 51
TARGET = 3.0
HEADLINE = 1e-3
CASE_HELP = {
    "clone": "the baseline: residual.clone(), one copy of the update's buffer",
    "copy_ into a buffer": "into.copy_(residual): a copy into a buffer allocated before",
    "0.0001": "encode(residual, t) + apply(message, replica), t sending 1e-4 of it: a sparse message",
    "0.001": "the same at 1e-3, sparse: the target's case (at most 3x clone, one thread)",
    "0.01": "the same at 1e-2, sparse",
    "0.1": "the same at 0.1: a bitmap message",
}
"""A line on the baselines and on each of :data:`SPARSITIES` (as ``f"{s:g}"``), for ``--help``."""


def thresholds(update: torch.Tensor) -> dict[float, float]:
    """The threshold that sends (about) each fraction of ``update``."""
    magnitudes = np.sort(np.abs(update.numpy()))
    return {s: float(magnitudes[int(len(magnitudes) * (1 - s))]) for s in SPARSITIES}


def check(update: torch.Tensor, threshold: float) -> dict[str, Any]:
    """Encode once and check the result against plain torch before anything is timed."""
    residual = update.clone()
    message = encode(residual, threshold)
    t = message.threshold
    expected = torch.where(update >= t, t, torch.where(update <= -t, -t, 0.0))
    replica = torch.zeros_like(update)
    apply(message, replica)
    assert torch.equal(decode(message), expected) and torch.equal(replica, expected)
    assert torch.equal(residual, update - expected)
    return {"form": message.form, "count": message.count, "sparsity": message.sparsity, "message bytes": message.nbytes}


def run(update: torch.Tensor, limits: dict[float, float]) -> dict[str, Any]:
    residual = torch.empty_like(update)
    replica = torch.zeros_like(update)
    into = torch.empty_like(update)
    times: dict[str, list[float]] = {"clone": [], "copy_ into a buffer": []}
    for s in SPARSITIES:
        times.update({f"encode {s:g}": [], f"apply {s:g}": [], f"encode+apply {s:g}": []})
    for _ in range(REPEATS + 1):  # the first repeat warms up and is dropped
        residual.copy_(update)
        times["clone"].append(timed(residual.clone))
        residual.copy_(update)
        times["copy_ into a buffer"].append(timed(lambda: into.copy_(residual)))
        for s in SPARSITIES:
            residual.copy_(update)
            start = time.perf_counter()
            message = encode(residual, limits[s])
            middle = time.perf_counter()
            apply(message, replica)
            end = time.perf_counter()
            times[f"encode {s:g}"].append(middle - start)
            times[f"apply {s:g}"].append(end - middle)
            times[f"encode+apply {s:g}"].append(end - start)
    times = {k: v[1:] for k, v in times.items()}
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "threads": torch.get_num_threads(),
        "median ms": ms,
        "encode+apply / clone": {f"{s:g}": ms[f"encode+apply {s:g}"] / ms["clone"] for s in SPARSITIES},
        "seconds": times,
    }


def main(argv: list[str] | None = None) -> None:
    title = "cases (each with one thread and with torch's default threads)"
    args = parse(command_line(__doc__.splitlines()[0], cases=CASE_HELP, title=title), argv, RESULTS)
    if args.smoke:
        shrink(globals(), LENGTH=100_000, REPEATS=2)
    default_threads = torch.get_num_threads()
    update = torch.randn(LENGTH, generator=torch.Generator().manual_seed(0))
    limits = thresholds(update)
    report: dict[str, Any] = {
        **header("encoding", numpy=np.__version__),
        "data": {"elements": LENGTH, "bytes": 4 * LENGTH, "values": "standard normal, seed 0", "repeats": REPEATS},
        "cases": {f"{s:g}": {"threshold": limits[s], **check(update, limits[s])} for s in SPARSITIES},
        "headline": f"one thread, sparsity {HEADLINE:g}",
    }
    torch.set_num_threads(1)
    report["one thread"] = run(update, limits)
    torch.set_num_threads(default_threads)
    report["default threads"] = run(update, limits)
    headline = report["one thread"]["encode+apply / clone"][f"{HEADLINE:g}"]
    report["target"] = {"encode+apply / clone at 1e-3, one thread": f"<= {TARGET}", "met": headline <= TARGET}

    for setting in ("one thread", "default threads"):
        r = report[setting]
        ms = r["median ms"]
        print(
            f"{setting} ({r['threads']}): clone {ms['clone']:.2f} ms, copy_ into a buffer "
            f"{ms['copy_ into a buffer']:.2f} ms"
        )
        for s in SPARSITIES:
            case = report["cases"][f"{s:g}"]
            print(
                f"  sparsity {s:g} ({case['form']}, {case['message bytes']} bytes): encode {ms[f'encode {s:g}']:.2f} ms"
                f" + apply {ms[f'apply {s:g}']:.2f} ms = {ms[f'encode+apply {s:g}']:.2f} ms, "
                f"{r['encode+apply / clone'][f'{s:g}']:.2f} x clone"
            )
    print(
        f"target encode+apply <= {TARGET} x clone at sparsity {HEADLINE:g}, one thread: "
        f"{'met' if report['target']['met'] else 'missed'} ({headline:.2f})"
    )
    write_results(args.out, report)


if __name__ == "__main__":
    sys.exit(main())
