"""What the benchmarks share: the training workload most of them measure, the plain PyTorch loop they
compare against, timing, minibatch files to train from, and the head and writing of a results file.

The workload: an MLP 784-2048-2048-10 (5.8M parameters) trained with SGD (lr 0.01, momentum 0.9) in
minibatches of 64 on a synthetic 10-class problem of MNIST's shape, 25,600 training and 4,096 test
examples. Only torch is imported with this module; the helpers that need dlscale import it when
called, so that the DDP baseline's processes (``benchmarks._ddp``) never load dlscale.

Every benchmark takes ``--smoke``, ``--out`` and ``--allow-dirty`` (:func:`command_line`, :func:`parse`),
and its ``--help`` lists its runners or cases, a line each. Every results file names the code it ran
(:func:`provenance`): the commit, whether the tree was clean, the whole command line, when it started
and ended. A run from a tree with uncommitted changes writes to ``benchmarks/results/`` only with
``--allow-dirty``, and its file says ``"clean": false`` with the changed paths. A smoke run
checks that the benchmark still works, in seconds: small data, a few steps, one seed, one repeat;
its figures mean nothing, so its results go to ``--out`` or to a scratch folder
(:data:`SCRATCH`), never to ``benchmarks/results/``, and say ``"smoke": true``. The smoke switch
reaches the processes a benchmark starts through the environment (:data:`SMOKE_ENV`), so that the
shared workload is small in every one of them. A benchmark that cannot run on this machine (no
GPU, no Java for PySpark) says why with :func:`unavailable`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import operator
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dlscale import SparkContext
    from dlscale.facade.rdd import RDD
    from dlscale.nn import Network

SMOKE_ENV = "DLSCALE_BENCHMARK_SMOKE"
"""Set (to 1) in a smoke run's environment: the benchmark and every process it starts run small."""
SMOKE = os.environ.get(SMOKE_ENV) == "1"
RESULTS = Path(__file__).resolve().parent / "results"
"""The benchmarks' recorded figures; a smoke run never writes here."""
SCRATCH = Path(tempfile.gettempdir()) / "dlscale-benchmarks-smoke"
"""Where a smoke run's results go when no ``--out`` is given."""

SMOKE_TRAIN, SMOKE_TEST = 64 * 8, 512  # a smoke run's workload: 8 minibatches an epoch

BATCH = 64
TRAIN = SMOKE_TRAIN if SMOKE else 64 * 400  # 25,600 examples: 400 minibatches an epoch
TEST = SMOKE_TEST if SMOKE else 4096
SGD = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)


def make_data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``(x, y, test_x, test_y)``: ten noisy class prototypes in 784 dimensions, passed through a fixed
    nonlinearity."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(10, 784, generator=g)
    mix = torch.randn(784, 784, generator=g) / 28

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 10, (n,), generator=g)
        x = torch.tanh((prototypes[y] + 6.0 * torch.randn(n, 784, generator=g)) @ mix)
        return x, y

    return (*sample(TRAIN), *sample(TEST))


def digits() -> tuple[torch.Tensor, ...]:
    """``(x, y, test_x, test_y)``: scikit-learn's digits scaled to [0, 1], 1,200 training and 597 test
    images in a fixed random split: the small workload of the benchmarks that run many fits."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[perm[:1200]], y[perm[:1200]], x[perm[1200:]], y[perm[1200:]]


def mlp(seed: int = 0) -> torch.nn.Module:
    """The MLP 784-2048-2048-10, its initial weights fixed by ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(784, 2048),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 10),
    )


def network(seed: int = 0) -> Network:
    """:func:`mlp` as a dlscale ``Network`` with cross-entropy and :data:`SGD`."""
    from dlscale.nn import Network

    return Network(mlp(seed), "cross_entropy", SGD)


def accuracy(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy of a module, in evaluation mode (and left in training mode)."""
    module.eval()
    with torch.no_grad():
        accuracy = float((module(x).argmax(1) == y).float().mean())
    module.train()
    return accuracy


def train_epoch(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    generator: torch.Generator,
    batch: int = BATCH,
) -> int:
    """One epoch of the plain PyTorch baseline: a shuffled order drawn from ``generator``, then an SGD
    step on each whole minibatch of ``batch`` examples held in memory. Returns the steps taken."""
    order = torch.randperm(len(x), generator=generator)
    steps = len(x) // batch
    for i in range(0, steps * batch, batch):
        idx = order[i : i + batch]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(module(x[idx]), y[idx]).backward()
        optimizer.step()
    return steps


def plain_epochs(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, batch: int, epochs: int
) -> float:
    """Seconds of ``epochs`` of plain PyTorch: each a shuffled order (the seed 0's), then an SGD step on
    every minibatch of ``batch`` examples, the last one short."""
    order = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=order)
        for i in range(0, len(x), batch):
            at = perm[i : i + batch]
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(module(x[at]), y[at]).backward()
            optimizer.step()
    return time.perf_counter() - start


def timed(fn: Callable[[], Any]) -> float:
    """Seconds that ``fn()`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def export_paths(sc: SparkContext, x: torch.Tensor, y: torch.Tensor, url: str, batch: int = BATCH) -> RDD:
    """The whole minibatches of ``x`` and ``y``, in order, exported to ``url`` as ``.dlb`` files; returns
    the RDD of their paths, as training and evaluation from files take it."""
    from dlscale.data import DataSet, export_minibatches, list_paths

    whole = len(x) // batch * batch
    export_minibatches([DataSet(x[i : i + batch], y[i : i + batch]) for i in range(0, whole, batch)], url, batch)
    return list_paths(sc, url)


def command_line(
    description: str | None, cases: Mapping[str, str] | None = None, title: str = "runners"
) -> argparse.ArgumentParser:
    """A benchmark's argument parser, with the options every benchmark takes: ``--smoke``, ``--out`` and
    ``--allow-dirty``; ``cases`` (a name and one line each: the runners, cases or rows the benchmark
    measures) are listed under ``title`` at the end of its ``--help``. Add the benchmark's own, then
    :func:`parse`."""
    parser = argparse.ArgumentParser(
        description=description,
        epilog=listing(cases, title) if cases else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a smoke run: small data, a few steps, one seed, to check that the benchmark works (its figures "
        "mean nothing); results go to --out or a scratch folder, never to benchmarks/results/",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="FILE",
        help=f"the results file (default benchmarks/results/NAME.json; with --smoke, NAME.json in {SCRATCH})",
    )
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="write to benchmarks/results/ from a tree with uncommitted changes (the file says so and lists them)",
    )
    return parser


def listing(cases: Mapping[str, str], title: str) -> str:
    """``cases`` under ``title``, a line each, as the end of a ``--help``."""
    width = max(map(len, cases))
    return f"{title}:\n" + "\n".join(f"  {name:<{width}}  {line}" for name, line in cases.items())


def parse(
    parser: argparse.ArgumentParser, argv: list[str] | None, results: Path | None, **smoke_defaults: Any
) -> argparse.Namespace:
    """``parser``'s arguments, with ``args.out`` the results file: ``--out``, else ``results`` (None: the
    benchmark writes none unless asked), else in a smoke run a file of ``results``' name in :data:`SCRATCH`.
    A smoke run (``--smoke``, or a process that a smoke run started) takes ``smoke_defaults`` as the
    defaults of those options (``seeds=1``: one seed unless ``--seeds`` says otherwise), refuses an
    ``--out`` under ``benchmarks/results/`` and sets :data:`SMOKE_ENV` for the processes it starts.
    The run's :func:`provenance` is taken here, before anything is measured; one that would write
    under ``benchmarks/results/`` from a tree with uncommitted changes is refused without
    ``--allow-dirty``."""
    if smoke_defaults and (SMOKE or parser.parse_known_args(argv)[0].smoke):
        parser.set_defaults(**smoke_defaults)
    args = parser.parse_args(argv)
    args.smoke = args.smoke or SMOKE
    if args.smoke:
        name = results.name if results is not None else f"{Path(sys.argv[0]).stem}.json"
        args.out = (args.out or SCRATCH / name).resolve()
        if args.out.is_relative_to(RESULTS):
            parser.error(f"--smoke writes its results outside {RESULTS} (its figures mean nothing): --out FILE")
        os.environ[SMOKE_ENV] = "1"
        _smoke_workload()
    else:
        args.out = args.out or results
    global _RUN
    _RUN = provenance()
    if args.out is not None and args.out.resolve().is_relative_to(RESULTS) and not _RUN["clean"]:
        if not args.allow_dirty:
            changed = ", ".join(_RUN.get("changes", [])[:5]) or "not a git checkout"
            parser.error(
                f"the tree has uncommitted changes ({changed}): commit them, write elsewhere with --out FILE, "
                "or record this run as from a dirty tree with --allow-dirty"
            )
    return args


_RUN: dict[str, Any] | None = None
"""This process's :func:`provenance`, taken by :func:`parse`."""
OUTPUTS = ("benchmarks/results/", "docs/images/")
"""What runs write: changes there do not make the tree dirty (a run may follow another's uncommitted results)."""


def git(*args: str) -> str | None:
    """What ``git ARGS`` prints in this repository, or None where it fails (no git, not a checkout)."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=RESULTS.parent.parent, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout


def provenance() -> dict[str, Any]:
    """What code a run ran and how it was called: the commit (None outside a git checkout), whether
    the tree was clean (uncommitted changes outside :data:`OUTPUTS`, untracked files included, make it
    dirty: ``changes`` lists them), the command line as typed, and the start time (UTC)."""
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=all")
    changes = None if status is None else [line[3:] for line in status.splitlines() if not line[3:].startswith(OUTPUTS)]
    module = Path(sys.argv[0]).stem
    program = f"python -m benchmarks.{module}" if Path(sys.argv[0]).parent == RESULTS.parent else sys.argv[0]
    return {
        "commit": commit.strip() if commit else None,
        "clean": commit is not None and changes == [],
        **({"changes": changes} if changes else {}),
        "command": " ".join([program, *map(shlex.quote, sys.argv[1:])]),
        "started": _now(),
    }


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _smoke_workload() -> None:
    """The shared workload of a smoke run, in this process too (a flag given on the command line)."""
    global SMOKE, TRAIN, TEST
    SMOKE, TRAIN, TEST = True, SMOKE_TRAIN, SMOKE_TEST


def shrink(namespace: dict[str, Any], **sizes: Any) -> None:
    """A smoke run's sizes: each of ``sizes`` replaces the constant of that name in ``namespace`` (a
    benchmark's ``globals()``). A name the benchmark does not have is an error, so that a renamed
    constant is not silently left at its full size."""
    unknown = sorted(set(sizes) - set(namespace))
    if unknown:
        raise NameError(f"shrink: no constant {', '.join(unknown)} to set")
    namespace.update(sizes)


def unavailable(benchmark: str, reason: str, smoke: bool) -> None:
    """End a benchmark that cannot run on this machine, saying why: with status 1 for a real run (no
    figures were made), with status 0 for a smoke run, whose line ``not run here: REASON`` the smoke
    test reports as a skip. ``reason`` completes "benchmarks.NAME needs ..."."""
    if smoke:
        print(f"not run here: benchmarks.{benchmark} needs {reason}", flush=True)
        raise SystemExit(0)
    raise SystemExit(f"benchmarks.{benchmark} needs {reason}")


def java_missing() -> str | None:
    """Why PySpark cannot start here (no Java), or None."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "Java 17+ for PySpark (no `java` on PATH and no JAVA_HOME)"
    return None


def header(benchmark: str, **machine: Any) -> dict[str, Any]:
    """The head of a results file: the benchmark, its :func:`provenance`, the start date
    (UTC), and the machine (Python, torch, dlscale, cores, CPU, memory and platform, with the versions in
    ``machine``); ``"smoke": true`` in a smoke run. :func:`write_results` adds the end time."""
    from dlscale import __version__

    run = dict(_RUN or provenance())
    return {
        "benchmark": benchmark,
        **({"smoke": True} if SMOKE else {}),
        "provenance": run,
        "date": run["started"],
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "dlscale": __version__,
            "cpu_count": os.cpu_count(),
            "cpu": _cpu_model(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "platform": platform.platform(),
            **machine,
        },
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_results(path: Path, report: dict[str, Any], indent: int = 2, ran: bool = True) -> None:
    """Write ``report`` as JSON to ``path`` and say where, its ``provenance`` ended now (and naming the
    commit checked out then, when it differs); ``ran=False`` for a report redone from a recorded run's
    results (``--report``), whose provenance stays as recorded. A report without a :func:`header` is
    refused under ``benchmarks/results/``: every recorded figure names its code."""
    if "provenance" not in report:
        if path.resolve().is_relative_to(RESULTS):
            raise ValueError(
                f"{path}: a results file needs the run's provenance (benchmarks._common.header); "
                "a file from before runs recorded it cannot be written again: rerun the benchmark"
            )
    elif ran:
        report["provenance"]["ended"] = _now()
        head = git("rev-parse", "HEAD")
        if head and head.strip() != report["provenance"]["commit"]:
            report["provenance"]["commit_at_end"] = head.strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=indent) + "\n")
    print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")


# ratio -> (numerator, denominator, comparison, bound): the target is "ratio <comparison> bound"
Targets = dict[str, tuple[str, str, str, float]]
COMPARISONS = {"<=": operator.le, "<": operator.lt}


def timing_report(times: dict[str, list[float]], targets: Targets, digits: int = 4) -> dict[str, Any]:
    """Each system's median and repeats of ``times`` (seconds), and each of ``targets``' ratios of
    medians: its value, its target and whether it was met."""
    medians = {system: statistics.median(t) for system, t in times.items()}
    seconds = {s: {"median": round(medians[s], digits), "repeats": [round(t, digits) for t in times[s]]} for s in times}
    ratios = {}
    for ratio, (num, den, comparison, bound) in targets.items():
        value = medians[num] / medians[den]
        met = COMPARISONS[comparison](value, bound)
        ratios[ratio] = {"value": round(value, 3), "target": f"{comparison} {bound}", "met": met}
    return {"seconds": seconds, "ratios": ratios}


def targets_met(reports: Iterable[dict[str, Any]], targets: Targets) -> dict[str, Any]:
    """Each of ``targets`` and whether every one of the :func:`timing_report` ``reports`` met it."""
    reports = list(reports)
    return {
        ratio: {"target": f"{comparison} {bound}", "met": all(r["ratios"][ratio]["met"] for r in reports)}
        for ratio, (_, _, comparison, bound) in targets.items()
    }
