"""The defaults' choice against trying every configuration: ``ParameterAveragingTrainingMaster`` left
to choose its frequency and streaming, beside each configuration of a grid, on compare's MLP and CNN
(over loopback and a link limited to 1 Gbit/s) and the small model (the digits MLP 64-256-10, loopback).

Each compare workload runs as ``benchmarks.compare`` runs it (2 workers, a ``fit_paths`` per epoch, a
warm-up fit first, timed as a user calls it; the single process on loopback); the small model
as ``benchmarks.small_model`` does (one fit of its 20 epochs, a fresh master for each). Every
configuration runs ``--repeats`` times, each repeat running them all in turn (so that a slow spell of
the machine weighs on all alike), and the run of median speed stands for it. A row: the choice the
defaults made (their receipts: frequency, streaming, the speedup predicted over one trainer at the
fit's measured step and the one measured), the defaults against the single process, the best
configuration of the grid against it, and the prediction's error.

Targets: the defaults at least 0.9 of the best configuration tried on every row, and never slower than
the single process; predicted within 15% of measured on every fit. Results go to
``benchmarks/results/auto.json``.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import _links, compare, small_model
from benchmarks._common import command_line, digits, header, parse, shrink, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "auto.json"
GRID = ("averaging_f5", "streaming_f20", "streaming_f50", "averaging_f50")
"""compare's runners tried beside the defaults: DL4J's every 5, and rounds of 20 and 50 with and
without streaming (the bounds the defaults choose within)."""
SMALL_GRID = {"every 5": (5, False), "every 20, streaming": (20, True), "once an epoch, streaming": (38, True)}
LINKS = ("loopback", "1gbit")
WORKLOADS = ("mlp", "cnn")
BOUND_OF_BEST, BOUND_ERROR = 0.9, 0.15
CASES = {
    "defaults": "ParameterAveragingTrainingMaster(batch) with nothing else given: frequency and streaming chosen",
    **{r: compare.RUNNER_HELP[r] for r in GRID},
    **{f"small: {name}": f"the small model, averaging {name}" for name in SMALL_GRID},
}


def _receipts(choices: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Each fit's receipt, as the row shows it."""
    return [
        {
            "frequency": c["frequency"],
            "streaming": c["streaming"],
            "source": c["source"],
            "predicted": c["predicted"],
            "measured": c["measured"],
            "error": c["predicted"] / c["measured"] - 1,
            "line": c["line"],
        }
        for c in choices
        if c is not None and c.get("measured")
    ]


def _row(workload: str, link: str, single: float, defaults: dict[str, Any], tried: dict[str, float]) -> dict[str, Any]:
    """A row of the table: the defaults' choice and speed against the single process and the grid."""
    receipts = _receipts(defaults.get("choices") or [])
    best = max(tried, key=tried.get)
    rate = defaults["samples_per_s"]
    worst = max((abs(r["error"]) for r in receipts), default=math.nan)
    return {
        "workload": workload,
        "link": link,
        "receipts": receipts,
        "defaults_vs_single": rate / single,
        "defaults_accuracy": defaults.get("test_accuracy"),
        "best": best,
        "best_vs_single": tried[best] / single,
        "defaults_vs_best": rate / tried[best],
        "largest_error": worst,
        "met": rate / tried[best] >= BOUND_OF_BEST and rate >= single and worst <= BOUND_ERROR,
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median speed among ``runs``, with every run's speed beside it (``repeats``)."""
    ranked = sorted(runs, key=lambda r: r["samples_per_s"])
    return {**ranked[len(ranked) // 2], "repeats": [r["samples_per_s"] for r in runs]}


def compare_rows(
    workloads: tuple[str, ...], links: tuple[str, ...], grid: tuple[str, ...], repeats: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The compare workloads' rows, each configuration run as ``benchmarks.compare`` runs it, ``repeats``
    times in turn with the others (the single process too, on a link's first pass), its median kept."""
    runs, rows = [], []
    reason = _links.available()
    singles: dict[str, float] = {}
    for link in links if reason is None else ("loopback",):
        with _links.limited_namespace(_links.LINKS[link]) if reason is None else compare._nothing() as ns:
            for workload in workloads:
                runners = ("defaults", *grid) if workload in singles else ("single", "defaults", *grid)
                results: dict[str, list[dict[str, Any]]] = {runner: [] for runner in runners}
                for _ in range(repeats):
                    for runner in runners:
                        r = compare._one(ns, link, workload, runner, 1 if runner == "single" else 2, False, "cpu")
                        if "error" in r:
                            raise RuntimeError(f"{link} {workload} {runner}: {r['error']}")
                        results[runner].append(r)
                        print(f"{link:9s} {workload:4s} {runner:14s} {r['samples_per_s']:,.0f} samples/s", flush=True)
                median = {runner: _median(r) for runner, r in results.items()}
                runs += median.values()
                if "single" in median:
                    singles[workload] = median.pop("single")["samples_per_s"]
                tried = {k: v["samples_per_s"] for k, v in median.items() if k != "defaults"}
                rows.append(_row(workload, link, singles[workload], median["defaults"], tried))
    return rows, runs


def small_rows(repeats: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The small model's row: one fit of its 20 epochs on ``local[2]``, a fresh master each, the median
    of ``repeats`` runs of each configuration against the single process's."""
    from dlscale import SparkContext

    data = digits()
    with tempfile.TemporaryDirectory() as tmp, SparkContext("local[2]", "auto-small") as sc:
        _, paths = small_model._prepared(sc, data, f"{tmp}/2", 2)
        configs = {"defaults": (None, None), **SMALL_GRID}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ("single", *configs)}
        for _ in range(repeats):
            runs["single"].append(small_model.single_process(data))
            for name, (frequency, streaming) in configs.items():
                runs[name].append(small_model.averaging(sc, paths, data, frequency, streaming))
    rows = {name: small_model.median_run(r) for name, r in runs.items()}
    examples = len(data[0]) * small_model.EPOCHS
    defaults = {
        "samples_per_s": rows["defaults"]["examples_per_s"],
        "test_accuracy": rows["defaults"]["accuracy"],
        "choices": [rows["defaults"]["choice"]],
    }
    tried = {name: rows[name]["examples_per_s"] for name in SMALL_GRID}
    row = _row("small", "loopback", rows["single"]["examples_per_s"], defaults, tried)
    row["examples"] = examples
    return [row], rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | link | chosen | predicted | measured | error | defaults vs one process | best tried | "
        "defaults vs best |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        last = r["receipts"][-1] if r["receipts"] else None
        chosen = f"every {last['frequency']}{', streaming' if last['streaming'] else ''}" if last else "nothing"
        lines.append(
            f"| {r['workload']} | {r['link']} | {chosen} | "
            + (f"{last['predicted']:.2f}x | {last['measured']:.2f}x | " if last else "| | ")
            + f"{r['largest_error']:+.0%} | {r['defaults_vs_single']:.2f}x | {r['best']} "
            f"({r['best_vs_single']:.2f}x) | {r['defaults_vs_best']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__.split("\n\n")[0], cases=CASES, title="configurations")
    parser.add_argument("--links", default=",".join(LINKS), help="comma-separated links (default loopback,1gbit)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="compare's workloads (default mlp,cnn)")
    parser.add_argument(
        "--repeats", type=int, default=small_model.REPEATS, help="runs of each configuration, the median kept"
    )
    args = parse(parser, argv, RESULTS, workloads="mlp", links="loopback", repeats=1)
    if args.smoke:
        shrink(vars(small_model), EPOCHS=1, REPEATS=1)
    workloads = tuple(w for w in args.workloads.split(",") if w)
    links = tuple(args.links.split(","))
    unknown = (set(workloads) - set(WORKLOADS)) | (set(links) - set(LINKS))
    if unknown:
        parser.error(f"unknown workload or link: {', '.join(sorted(unknown))}")
    grid = GRID[:1] if args.smoke else GRID
    rows, runs = compare_rows(workloads, links, grid, args.repeats) if workloads else ([], [])
    small, small_runs = small_rows(args.repeats)
    rows += small
    report = {
        **header("auto"),
        "setup": {
            "grid": GRID,
            "small_grid": SMALL_GRID,
            "links": links,
            "workloads": workloads,
            "repeats": args.repeats,
        },
        "rows": rows,
        "runs": runs,
        "small_runs": small_runs,
        "targets": {
            "defaults_vs_best": BOUND_OF_BEST,
            "prediction_error": BOUND_ERROR,
            "met": all(r["met"] for r in rows),
        },
    }
    write_results(args.out, report)
    print(table(rows))


if __name__ == "__main__":
    main()
