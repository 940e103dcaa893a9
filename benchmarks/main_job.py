"""The main job's training against the same model in one process: is the README's first command worth
its cluster?

Run from the repository root with ``python -m benchmarks.main_job`` (about 2 minutes). Each repeat
(``REPEATS``; the rows in turn within each, so that a slow spell of the machine weighs on both alike;
the median in the table) runs each row in a fresh process (spawned: nothing of another row's threads
or clusters):

- **single**: the main job's CNN (``dlscale.demo.digits_cnn``) and optimizer (SGD, lr 0.05, momentum
  0.9) in plain PyTorch on one thread, over the main job's 1,500 training images in minibatches of 32
  for ``EPOCHS`` epochs, the training timed whole;
- **main job**: ``dlscale.demo.main`` as ``python -m dlscale.demo`` runs it (its embedded ``local[2]``
  cluster, its minibatch files, parameter averaging with its defaults, a checkpoint every epoch), its
  ``train_seconds`` (the ``fit_paths`` call, as its report gives it) and test accuracy, and its fit's
  closing line (what it chose and why, the speedup it predicted and the one it measured).

Target: the main job at least as fast as the same model in one process (``vs_single`` >= 1.0).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import logging
import multiprocessing
import statistics
import tempfile
from typing import Any

import torch

from benchmarks._common import RESULTS, accuracy, command_line, header, parse, plain_epochs, shrink, write_results

EPOCHS = 15  # the main job's default
BATCH = 32  # the main job's default minibatch size per worker
REPEATS = 3
ROWS = {
    "single": "the main job's CNN and SGD in plain PyTorch, one thread, in a fresh process, the training timed",
    "main job": "python -m dlscale.demo in a fresh process: its training seconds, accuracy and closing line",
}


def single(epochs: int) -> dict[str, Any]:
    """Plain PyTorch on one thread: the main job's model, data and optimizer, the training timed."""
    from dlscale import demo

    torch.set_num_threads(1)
    x, y, test_x, test_y = demo._split()
    torch.manual_seed(0)
    module = demo.digits_cnn()
    seconds = plain_epochs(module, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9), x, y, BATCH, epochs)
    return {"seconds": seconds, "accuracy": accuracy(module, test_x, test_y)}


def main_job(epochs: int) -> dict[str, Any]:
    """``dlscale.demo.main`` on a scratch storage root: its training seconds, accuracy and closing line."""
    from dlscale import demo

    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dlscale.training").addHandler(handler)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        report = demo.main(["--storage", tmp, "--epochs", str(epochs), "--batch-size", str(BATCH)])
    closing = [line for line in said if " minibatches in " in line]
    return {
        "seconds": report["train_seconds"],
        "accuracy": report["accuracy"],
        "closing_line": closing[-1] if closing else None,
    }


def fresh(row: Any, epochs: int) -> dict[str, Any]:
    """``row(epochs)`` in a fresh process."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(row, epochs).result()


def main(argv: list[str] | None = None) -> None:
    args = parse(command_line(__doc__.splitlines()[0], cases=ROWS, title="rows"), argv, RESULTS / "main_job.json")
    if args.smoke:
        shrink(globals(), EPOCHS=1, REPEATS=1)
    rows = {"single": single, "main job": main_job}
    repeats: dict[str, list[dict[str, Any]]] = {name: [] for name in rows}
    for _ in range(REPEATS):
        for name, row in rows.items():
            repeats[name].append(fresh(row, EPOCHS))
    runs = {}
    for name, results in repeats.items():
        seconds = statistics.median(r["seconds"] for r in results)
        median = next(r for r in results if r["seconds"] == seconds)
        runs[name] = {**median, "repeats": [r["seconds"] for r in results]}
    for row in runs.values():
        row["vs_single"] = runs["single"]["seconds"] / row["seconds"]
    ratio = runs["main job"]["vs_single"]
    report = {
        **header("main_job"),
        "setup": {"model": "dlscale.demo.digits_cnn", "epochs": EPOCHS, "batch": BATCH, "repeats": REPEATS},
        "runs": runs,
        "target": {"main_job_vs_single": ratio, "bound": 1.0, "met": ratio >= 1.0},
    }
    write_results(args.out, report)
    for name, row in runs.items():
        seconds, ratio, accuracy = row["seconds"], row["vs_single"], row["accuracy"]
        print(f"{name:10s} {seconds:6.2f} s  {ratio:.2f}x single  test accuracy {accuracy:.3f}")
    print(runs["main job"]["closing_line"])


if __name__ == "__main__":
    main()
