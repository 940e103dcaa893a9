"""The dlscale command, spark-submit's counterpart: run a script on a cluster,
certify that it survives worker faults, export data to minibatch files,
evaluate or apply a saved network, and compare versions across a cluster.

examples:
  dlscale run train.py --workers 2 --worker-memory 8GB -- --epochs 3
  dlscale certify train.py --workers 3 --kill-every 5s --max-time-ratio 1.5
  dlscale export data.npz train/ --batch-size 64
  dlscale evaluate model.dln test/ --top-n 5 --output results/eval.json
  dlscale predict model.dln test/ predictions/
  dlscale info --master tcp://scheduler:8786

A user error is reported in one line (exit status 2); --debug, or
DLSCALE_DEBUG=1 in the environment, shows its traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from dlscale import __version__
from dlscale.errors import DlscaleError
from dlscale.facade.conf import SUBMIT_ENV, SparkConf

DEFAULT_MASTER = "local[2]"
WIDTH = 80  # what dlscale info fits in


def _resource(text: str) -> tuple[str, float]:
    name, _, amount = text.partition("=")
    try:
        return name.strip(), float(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=AMOUNT such as GPU=1, got {text!r}") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _duration(text: str) -> float:
    from dask.utils import parse_timedelta

    try:
        seconds = parse_timedelta(text, default="seconds")
    except (TypeError, ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a duration such as 5s or 500ms, got {text!r}") from None
    if not seconds or seconds <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive duration, got {text!r}")
    return float(seconds)


def _bound(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of at least 0, got {text!r}")
    return value


def _cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--master",
        metavar="URL",
        help=f"local[N], local[*], tcp://host:port or tls://host:port (default {DEFAULT_MASTER})",
    )
    p.add_argument(
        "--workers", type=_positive, metavar="N", help="worker processes of an embedded cluster (overrides local[N])"
    )
    p.add_argument(
        "--threads-per-worker", type=_positive, metavar="T", help="threads per worker process of an embedded cluster"
    )
    p.add_argument(
        "--worker-memory", metavar="SIZE", help="memory limit per worker of an embedded cluster, e.g. 8GB or 512m"
    )
    p.add_argument(
        "--resources",
        type=_resource,
        action="append",
        default=[],
        metavar="NAME=AMOUNT",
        help="an abstract resource each worker of an embedded cluster offers, e.g. GPU=1 (repeatable)",
    )


def _settings(args: argparse.Namespace) -> dict[str, str]:
    """The SparkConf settings the cluster flags stand for."""
    settings = {"spark.master": args.master} if args.master else {}
    if args.workers:
        settings["spark.executor.instances"] = str(args.workers)
    if args.threads_per_worker:
        settings["spark.executor.cores"] = str(args.threads_per_worker)
    if args.worker_memory:
        settings["spark.executor.memory"] = str(_memory_bytes(args.worker_memory))
    for name, amount in args.resources:
        settings[f"spark.executor.resource.{name}.amount"] = str(amount)
    return settings


def _memory_bytes(text: str) -> int:
    """``--worker-memory`` in bytes."""
    from dlscale.facade.conf import spark_size_to_bytes

    try:
        return spark_size_to_bytes(text, "--worker-memory")
    except ValueError as e:
        raise ValueError(f"argument --worker-memory: {e}") from e


def _context(args: argparse.Namespace) -> Any:
    from dlscale import SparkContext

    conf = SparkConf().setAll(_settings(args).items()).setIfMissing("spark.master", DEFAULT_MASTER)
    return SparkContext(conf=conf, appName=f"dlscale {args.command}")


def _import_modules(names: Sequence[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ImportError(f"argument --import: cannot import {name}: {e}") from e


def _load_network(args: argparse.Namespace) -> Any:
    from dlscale.nn import Network

    _import_modules(args.imports)
    return Network.load(args.model)


# -- subcommands ---------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """Run ``script`` with the cluster flags handed to its SparkContext; returns its exit status."""
    if not os.path.isfile(args.script):
        raise FileNotFoundError(f"argument script: no such file: {args.script}")
    env = dict(os.environ)
    env[SUBMIT_ENV] = json.dumps(_settings(args))
    return subprocess.call([sys.executable, args.script, *args.script_args], env=env)


def certify(args: argparse.Namespace) -> int:
    """Run a script unfaulted, then under faults, each on a fresh embedded cluster; print the
    certificate and write it as JSON. Returns 0 when every bound holds, 1 when one does not."""
    from dlscale import certify as certifying

    plan = certifying.Plan(**_certify_plan(args))
    output = os.path.abspath(args.output)
    if not os.path.isdir(os.path.dirname(output)):
        raise FileNotFoundError(f"argument --output: no such directory: {os.path.dirname(output)}")
    cert = certifying.certify(plan)
    with open(output, "w", encoding="utf-8") as f:
        json.dump(cert, f, indent=2)
        f.write("\n")
    print(certifying.render(cert))
    print(f"certificate written to {args.output}")
    return 0 if cert["verdict"]["passed"] else 1


def _certify_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The fields of the :class:`dlscale.certify.Plan` that certify's flags describe, checked before
    any cluster starts."""
    if args.module and args.script:
        raise ValueError(f"argument -m: give a script or -m MODULE, not both (got {args.script} too)")
    if args.module:
        if importlib.util.find_spec(args.module) is None:
            raise ImportError(f"argument -m: no module named {args.module}")
        argv, label = ["-m", args.module], f"-m {args.module}"
    elif args.script:
        if not os.path.isfile(args.script):
            raise FileNotFoundError(f"argument script: no such file: {args.script}")
        argv, label = [args.script], args.script
    else:
        raise ValueError("argument script: give the script to certify, or -m MODULE")
    if args.workers < 2:
        raise ValueError("argument --workers: certify needs at least 2 (a fault never takes the last running worker)")
    if (args.stop_every is None) != (args.stop_for is None):
        given, missing = ("--stop-for", "--stop-every") if args.stop_every is None else ("--stop-every", "--stop-for")
        raise ValueError(f"argument {given}: needs {missing} too")
    return {
        "argv": [*argv, *args.script_args],
        "label": label,
        "workers": args.workers,
        "threads_per_worker": args.threads_per_worker,
        "memory_limit": _memory_bytes(args.worker_memory) if args.worker_memory else None,
        "kill_every": args.kill_every,
        "stop_every": args.stop_every,
        "stop_for": args.stop_for,
        "max_time_ratio": args.max_time_ratio,
        "max_metric_drop": args.max_metric_drop,
        "command_line": args.command_line,
    }


def export(args: argparse.Namespace) -> int:
    """Write the arrays of an ``.npz`` file as minibatch files."""
    import numpy as np
    import torch

    from dlscale.data import DataSet, export_minibatches

    try:
        data = np.load(args.source, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"argument source: cannot read {args.source} as .npz: {e}") from e
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"argument source: {args.source} holds one array (.npy), not an .npz file of arrays")
    with data:
        missing = [k for k in (args.features, args.labels) if k not in data]
        if missing:
            raise ValueError(
                f"{args.source} has no array {missing[0]!r} (it has {sorted(data.files)}); "
                "name them with --features and --labels"
            )
        x, y = torch.from_numpy(data[args.features]), torch.from_numpy(data[args.labels])
    batches = [
        DataSet(x[i : i + args.batch_size], y[i : i + args.batch_size]) for i in range(0, len(x), args.batch_size)
    ]
    paths = export_minibatches(batches, args.destination, args.batch_size)
    print(f"wrote {len(x)} examples as {len(paths)} minibatch files of {args.batch_size} to {args.destination}")
    return 0


def evaluate(args: argparse.Namespace) -> int:
    """Evaluate a saved classifier on minibatch files; print the report, optionally save it as JSON."""
    from dlscale import SparkNet, write_string_to_file
    from dlscale.data import list_paths
    from dlscale.evaluation import Evaluation, RegressionEvaluation

    network = _load_network(args)
    with _context(args) as sc:
        kind = RegressionEvaluation() if args.regression else Evaluation(top_n=args.top_n)
        (result,) = SparkNet(sc, network).do_evaluation(list_paths(sc, args.data), kind, batch_size=args.batch_size)
    print(result.stats())
    if args.output:
        write_string_to_file(args.output, result.to_json())
        print(f"wrote {args.output}")
    return 0


def predict(args: argparse.Namespace) -> int:
    """Apply a saved network to minibatch files; one ``.npy`` file of outputs per input file."""
    from dlscale.data import list_paths
    from dlscale.inference import predict_files

    network = _load_network(args)
    with _context(args) as sc:
        written = predict_files(network, list_paths(sc, args.data), args.output, batch_size=args.batch_size)
    print(f"wrote the outputs of {sum(written)} examples in {len(written)} files to {args.output}")
    return 0


PACKAGES = ("python", "dlscale", "torch", "numpy", "dask", "distributed", "cloudpickle", "msgpack", "fsspec")


def info(args: argparse.Namespace) -> int:
    """Versions on the client, the scheduler and every worker; returns 1 when they disagree."""
    with _context(args) as sc:
        versions = sc.client.run(_versions)
        versions["client"] = _versions()
        versions["scheduler"] = sc.client.run_on_scheduler(_versions)
        print(f"cluster: {sc.master}, {len(versions) - 2} workers")
    table, mismatched = version_table(versions)
    print(table)
    if mismatched:
        message = (
            f"MISMATCH: {', '.join(mismatched)} differ between processes; install the same versions "
            "everywhere (tasks and pickled networks may fail in confusing ways otherwise)"
        )
        print("\n" + textwrap.fill(message, WIDTH))
        return 1
    print(f"\nall {len(versions)} processes run the same versions")
    return 0


def _versions() -> dict[str, str | None]:
    import platform
    from importlib import metadata

    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in PACKAGES[1:]:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def version_table(versions: dict[str, dict[str, str | None]]) -> tuple[str, list[str]]:
    """A table of package versions, one row per package, within :data:`WIDTH` columns however many
    processes (client, scheduler, workers) there are: a package whose version differs between them
    gets a row per version, naming the processes that run it. Also returns those packages."""
    names = ["client", "scheduler", *sorted(k for k in versions if k not in ("client", "scheduler"))]
    packages = list(dict.fromkeys(p for n in names for p in versions[n]))
    lines = [f"{'package':12s} version"]
    mismatched = []
    for p in packages:
        found: dict[str, list[str]] = {}
        for n in names:
            found.setdefault(versions[n].get(p) or "not installed", []).append(n)
        if len(found) == 1:
            lines.append(f"{p:12s} {next(iter(found))}")
            continue
        mismatched.append(p)
        lines.append(f"{p:12s} differs between processes:")
        width = max(len(v) for v in found)
        for version, where in found.items():
            lines += textwrap.wrap(
                ", ".join(where),
                WIDTH,
                initial_indent=f"{'':13s}{version:{width}s}  ",
                subsequent_indent=" " * (15 + width),
                break_on_hyphens=False,
            )
    return "\n".join(lines), mismatched


# -- the parser ------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    """The ``dlscale`` argument parser."""
    main_parser = argparse.ArgumentParser(
        prog="dlscale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    main_parser.add_argument("--version", action="version", version=f"dlscale {__version__}")
    main_parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = main_parser.add_subparsers(dest="command", metavar="COMMAND")
    # --debug after the command too; SUPPRESS keeps a command's default from hiding the main parser's value
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")

    def command(name: str, fn: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[debug])
        p.set_defaults(run=fn)
        return p

    p = command(
        "run",
        run,
        "run a Python script whose SparkContext uses the cluster given here; the script's own arguments follow --",
    )
    p.add_argument("script", help="the script to run")
    p.add_argument("script_args", nargs="*", metavar="-- ARGS", help="the script's own arguments, after --")
    _cluster_flags(p)

    _certify_flags(command("certify", certify, CERTIFY_HELP))

    p = command("export", export, "write the arrays of an .npz file as minibatch files")
    p.add_argument("source", help="an .npz file")
    p.add_argument("destination", help="a directory URL for the minibatch files (must not exist)")
    p.add_argument("--batch-size", type=_positive, default=64, help="examples per file (default 64)")
    p.add_argument("--features", default="x", help="name of the features array in the .npz file (default x)")
    p.add_argument("--labels", default="y", help="name of the labels array in the .npz file (default y)")

    for name, fn, help_text in (
        ("evaluate", evaluate, "evaluate a saved network on minibatch files"),
        ("predict", predict, "apply a saved network to minibatch files"),
    ):
        _network_flags(command(name, fn, help_text), name)

    p = command("info", info, "versions on the client, the scheduler and every worker, mismatches flagged")
    _cluster_flags(p)
    return main_parser


def _network_flags(p: argparse.ArgumentParser, name: str) -> None:
    """The flags of ``evaluate`` and ``predict``, which apply a saved network to minibatch files."""
    p.add_argument("model", help="a network archive written by Network.save")
    p.add_argument("data", help="a directory URL of minibatch files")
    if name == "predict":
        p.add_argument("output", help="a directory URL for the outputs (one .npy file per input file)")
    else:
        p.add_argument("--top-n", type=_positive, default=1, help="also report top-N accuracy")
        p.add_argument("--regression", action="store_true", help="regression metrics instead of classification")
        p.add_argument("--output", help="write the evaluation as JSON to this URL")
    p.add_argument("--batch-size", type=_positive, default=None, help="examples per forward pass (default 64)")
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (e.g. the one that registers the network's model factory)",
    )
    _cluster_flags(p)


CERTIFY_HELP = (
    "run a training script twice on a fresh local cluster, unfaulted and then with worker processes killed, "
    "and certify that it survives: nothing lost, both runs succeed, within the bounds given"
)


def _certify_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``certify``: the script, its clusters, the faults, the bounds and the output."""
    p.add_argument("script", nargs="?", help="the script to certify (or -m MODULE)")
    p.add_argument("script_args", nargs="*", metavar="-- ARGS", help="the script's own arguments, after --")
    p.add_argument("-m", dest="module", metavar="MODULE", help="certify a module, run as python -m runs it")
    p.add_argument("--workers", type=_positive, default=2, metavar="N", help="worker processes (default 2)")
    p.add_argument(
        "--threads-per-worker", type=_positive, default=1, metavar="T", help="threads per worker (default 1)"
    )
    p.add_argument("--worker-memory", metavar="SIZE", help="memory limit per worker, e.g. 8GB or 512m")
    p.add_argument(
        "--kill-every",
        type=_duration,
        required=True,
        metavar="DURATION",
        help="kill a random worker this often, e.g. 5s",
    )
    p.add_argument(
        "--stop-every", type=_duration, metavar="DURATION", help="also stop (SIGSTOP) a random worker this often"
    )
    p.add_argument("--stop-for", type=_duration, metavar="DURATION", help="for this long each time, e.g. 3s")
    p.add_argument(
        "--max-time-ratio", type=_bound, metavar="R", help="fail when the faulted run takes over R times as long"
    )
    p.add_argument(
        "--max-metric-drop", type=_bound, metavar="D", help="fail when a reported metric is over D worse under faults"
    )
    p.add_argument(
        "--output",
        default="certificate.json",
        metavar="PATH",
        help="where to write the certificate as JSON (default certificate.json)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dlscale`` command: its exit status, 2 after a user error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    command_parser = parser()
    args = command_parser.parse_args(argv[:split])
    if args.command is None:
        command_parser.print_help()
        return 0
    if getattr(args, "script_args", None):
        command_parser.error(f"the script's own arguments go after --: {' '.join(args.script_args)}")
    args.script_args = argv[split + 1 :]
    args.command_line = ["dlscale", *argv]
    if args.script_args and args.command not in ("run", "certify"):
        command_parser.error(
            f"only 'dlscale run' passes arguments after -- (to its script; so does certify); got {args.script_args}"
        )
    try:
        return args.run(args)
    except Exception as e:
        if args.debug or os.environ.get("DLSCALE_DEBUG", "") not in ("", "0"):
            raise
        print(f"dlscale: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: Exception) -> str:
    """What went wrong, on one line: the message of a dlscale error or an OS, value, type or import
    error, else the exception's type too."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or repr(e)
    plain = (DlscaleError, OSError, ValueError, TypeError, ImportError)
    return text if isinstance(e, plain) else f"{type(e).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
