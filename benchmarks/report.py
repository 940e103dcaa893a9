"""The docs' figures, generated from the results files, never typed: each benchmark's latest table on
the code it ran, and each headline ratio over the commits it was measured on.

Run from the repository root::

    python -m benchmarks.report           # rewrite the generated blocks and the history plots
    python -m benchmarks.report --check   # write nothing; exit 1 naming each block that differs

A generated block lies between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->`` in a page of
``docs/`` (:data:`PAGES`); what is between is this module's, rewritten whole. Each block draws on the
latest results file of its benchmark that records its run (:func:`benchmarks._common.provenance`), and
names that file, its commit and its command, so that every figure in it can be found in the file.
Files from before runs recorded their commit are read only for the plots, and only where their name
carries a commit of this repository's history, drawn hollow (:func:`commit_of`). Hand-timed figures stay
outside the blocks, labelled "by hand". The default test run checks every block (:func:`check`).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS, git, listing

ROOT = RESULTS.parent.parent
DOCS = ROOT / "docs"
IMAGES = DOCS / "images"
PAGES = ("benchmarks.md", "training.md")
BLOCK = re.compile(r"(<!-- report:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /report:(?P=name) -->)", re.S)
LINKS = {"loopback": "loopback", "1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s"}
LABELS = {
    "ceiling": "ceiling: 2 independent processes",
    "defaults": "parameter averaging, its defaults (chosen)",
    "defaults_rdd": "parameter averaging, its defaults, `fit(rdd)`",
    "defaults_unread": "parameter averaging, its defaults, nothing read between fits",
    "defaults_evaluated": "parameter averaging, its defaults, `SparkNet.evaluate` between fits (timed)",
    "averaging_f5": "averaging every 5 (DL4J's default)",
    "ddp": "DDP (gloo)",
    "ddp_powersgd": "DDP + PowerSGD",
    "torch_distributor": "PySpark's TorchDistributor",
    "averaging_f10": "averaging every 10",
    "averaging_f50": "averaging every 50",
    "averaging_f50_fp16": "averaging every 50, float16 exchange",
    "averaging_f50_rdd": "averaging every 50, `fit(rdd)`",
    "averaging_auto": 'averaging `"auto"` (an earlier chooser)',
    "diloco_f50": "DiLoCo every 50",
    "streaming_f10": "streaming every 10",
    "streaming_f20": "streaming every 20",
    "streaming_f50": "streaming every 50",
    "streaming_f50_fp16": "streaming every 50, float16 exchange",
    "streaming_f50_int8": "streaming every 50, int8 exchange",
    "streaming_f50_onefit": "streaming every 50, every epoch in one fit",
    "streaming_auto": 'streaming `"auto"` (an earlier chooser)',
    "sharing": "gradient sharing, its defaults",
}
"""The comparison's runners as the docs name them."""


# -- the results ------------------------------------------------------------------------------------------
@functools.cache
def results() -> tuple[tuple[Path, dict[str, Any]], ...]:
    """Every results file and its contents, in name order."""
    return tuple((p, json.loads(p.read_text())) for p in sorted(RESULTS.glob("*.json")))


def recorded(benchmark: str, accept: Callable[[dict[str, Any]], bool] = lambda r: True) -> tuple[Path, dict] | None:
    """The latest results file of ``benchmark`` that records its run on a clean tree (and that ``accept``
    takes), or None."""
    found = [
        (p, r)
        for p, r in results()
        if r.get("benchmark") == benchmark and r.get("provenance", {}).get("clean") and not r.get("smoke") and accept(r)
    ]
    return max(found, key=lambda pr: pr[1]["provenance"]["started"], default=None)


def date_of(report: dict[str, Any]) -> str:
    """When a results file's run started (``timestamp`` in the oldest files)."""
    return report.get("date") or report["timestamp"]


@functools.cache
def history() -> dict[str, int]:
    """Each commit of HEAD's history (full hash) and its place, oldest first."""
    return {c: i for i, c in enumerate((git("rev-list", "--reverse", "HEAD") or "").split())}


def commit_of(path: Path, report: dict[str, Any]) -> tuple[str, bool] | None:
    """The commit a results file ran on and whether the file recorded it (False: taken from the file's
    name, as runs before the commit was recorded were named); None when neither says one of HEAD's."""
    run = report.get("provenance")
    if run is not None:
        return (run["commit"], True) if run.get("clean") and run.get("commit") in history() else None
    named = named_commit(path)
    full = [c for c in history() if named and c.startswith(named)]
    return (full[0], False) if len(full) == 1 else None


def named_commit(path: Path) -> str | None:
    """The abbreviated commit a results file's name ends with (``compare-mlp-5676906.json``,
    ``...-5676906-b.json``), as runs were named before they recorded their commit; or None."""
    named = re.search(r"-([0-9a-f]{7,40})(?:-[a-z])?\.json$", path.name)
    return named.group(1) if named else None


def _source(path: Path, report: dict[str, Any]) -> str:
    """The line that heads a block: the commit, the date, the command and the file."""
    run = report["provenance"]
    return (
        f"On **{run['commit'][:7]}** ({run['started'][:10]}, a clean tree), `{run['command']}` "
        f"([{path.name}](../benchmarks/results/{path.name}))"
    )


# -- the blocks ---------------------------------------------------------------------------------------------
def _full_cpu_run(report: dict[str, Any]) -> bool:
    """A comparison of every epoch on the CPU (not ``--quick``, not ``--device cuda``)."""
    return not report.get("quick") and report["machine"].get("device", "cpu") == "cpu"


def _compare_file() -> tuple[Path, dict[str, Any]] | None:
    return recorded("compare", _full_cpu_run)


def _runs(report: dict[str, Any]) -> dict[tuple[str, str, str, int], dict[str, Any]]:
    """A comparison's runs by workload, link, runner and workers; of the single process's, the baseline."""
    return {
        (r["workload"], r["link"], r["runner"], r["workers"]): r
        for r in report["runs"]
        if "error" not in r and r.get("baseline", True)
    }


def block_compare() -> str:
    """dlscale against its peers: every 2-worker runner against one process, per link, and the targets.

    Per workload, each runner's samples/s against the single process on each link, its accuracy beside,
    and the targets the file records."""
    found = _compare_file()
    if found is None:
        return "No recorded run of `benchmarks.compare` yet.\n"
    path, report = found
    runs = _runs(report)
    lines = [f"{_source(path, report)}.", ""]
    for workload, spec in report["setup"]["workloads"].items():
        single = runs.get((workload, "loopback", "single", 1))
        if single is None:
            continue
        links = [link for link in LINKS if any(k[0] == workload and k[1] == link and k[3] == 2 for k in runs)]
        runners = list(dict.fromkeys(k[2] for k in runs if k[0] == workload and k[3] == 2))
        others = [
            r["samples_per_s"]
            for r in report["runs"]
            if (r["workload"], r["runner"]) == (workload, "single") and "error" not in r and r is not single
        ]
        again = f"; again in the same run, {', '.join(f'{v:,.0f}' for v in others)}" if others else ""
        lines += [
            f"**{spec['title']}**, {spec['epochs']} epochs, 2 workers; each cell is samples/s against the single "
            f"process's {single['samples_per_s']:,.0f} (its test accuracy {single['test_accuracy']:.3f}{again}), "
            "the run's test accuracy beside it:",
            "",
            "| 2 workers | " + " | ".join(LINKS[link] for link in links) + " |",
            "|---|" + "---|" * len(links),
        ]
        for runner in runners:
            cells = []
            for link in links:
                r = runs.get((workload, link, runner, 2))
                cells.append("" if r is None else f"{r['vs_single']:.2f}x ({r['test_accuracy']:.3f})")
            lines.append(f"| {LABELS.get(runner, runner)} | " + " | ".join(cells) + " |")
        lines.append("")
    targets = report.get("targets", {})
    if targets:
        lines += ["| target (`benchmarks/compare.py`) | at least | measured | met |", "|---|---|---|---|"]
        for name, t in targets.items():
            by = f" ({LABELS.get(t['runner'], t['runner'])})" if "runner" in t else ""
            lines.append(f"| `{name}` | {t['target']}x | {t['measured']:.2f}x{by} | {'yes' if t['met'] else 'no'} |")
        lines.append("")
    return "\n".join(lines)


def _small_model_file() -> tuple[Path, dict[str, Any]] | None:
    return recorded("small_model")


def block_small_model() -> str:
    """The small model: each row's examples/s against the single process, and its accuracy."""
    found = _small_model_file()
    if found is None:
        return "No recorded run of `benchmarks.small_model` yet.\n"
    path, report = found
    setup = report["setup"]
    single = report["runs"]["single"]
    lines = [
        f"{_source(path, report)}: the {setup['model']}, batch {setup['batch']}, {setup['epochs']} epochs in one "
        f"fit, the median of {setup['repeats']} repeats; the single process {single['examples_per_s']:,.0f} "
        "examples/s.",
        "",
        "| row | examples/s | against the single process | test accuracy |",
        "|---|---|---|---|",
    ]
    for name, r in report["runs"].items():
        lines.append(f"| {name} | {r['examples_per_s']:,.0f} | {r['vs_single']:.2f}x | {r['accuracy']:.3f} |")
    sharing, averaging = report["target"], report["averaging_target"]
    lines += [
        "",
        f"Targets (`benchmarks/small_model.py`): the best 2-worker averaging at least {averaging['bound']}x one "
        f"process: {averaging['vs_single']:.2f}x ({averaging['best']}), {'met' if averaging['met'] else 'missed'}; "
        f"gradient sharing on 2 workers at least {sharing['bound']}x: {sharing['sharing_2_workers_vs_single']:.2f}x, "
        f"{'met' if sharing['met'] else 'missed'}; the defaults on 2 workers against 1: "
        f"{averaging['default_2_vs_1_worker']:.2f}x"
        + (
            f"; the defaults on 2 workers at least {averaging['bound']}x one process: "
            f"{averaging['defaults_vs_single']:.2f}x, {'met' if averaging['defaults_met'] else 'missed'}, "
            f"{averaging['defaults_vs_best']:.2f} of the best row."
            if "defaults_vs_single" in averaging
            else "."
        ),
    ]
    return "\n".join(lines) + "\n"


def block_main_job() -> str:
    """The main job's training against the same model in one process, and its fit's closing line."""
    found = recorded("main_job")
    if found is None:
        return "No recorded run of `benchmarks.main_job` yet.\n"
    path, report = found
    setup, runs, target = report["setup"], report["runs"], report["target"]
    lines = [
        f"{_source(path, report)}: `python -m dlscale.demo` ({setup['epochs']} epochs, minibatches of "
        f"{setup['batch']}, 2 workers, a checkpoint every epoch) against its CNN in one process, the median "
        f"of {setup['repeats']} repeats.",
        "",
        "| row | training seconds | against one process | test accuracy |",
        "|---|---|---|---|",
    ]
    for name, r in runs.items():
        lines.append(f"| {name} | {r['seconds']:.2f} | {r['vs_single']:.2f}x | {r['accuracy']:.3f} |")
    lines += [
        "",
        f"Its fit's closing line: {runs['main job']['closing_line']}",
        "",
        f"Target (`benchmarks/main_job.py`): the main job at least {target['bound']}x one process: "
        f"{target['main_job_vs_single']:.2f}x, {'met' if target['met'] else 'missed'}.",
    ]
    return "\n".join(lines) + "\n"


QUALITY_METHODS = {
    ("chosen", None): "parameter averaging, its defaults (frequency and streaming chosen)",
    ("averaging f5", None): "parameter averaging every 5 (DL4J's default)",
    ("topk", "sum"): "gradient sharing, its defaults",
    ("ddp", None): "DDP",
    ("ddp_powersgd", None): "DDP + PowerSGD",
    ("sync_sum", "sum"): "synchronous SGD, W minibatches summed a step (in one process)",
}
"""The quality block's rows: the masters' defaults and the peers (the results file holds every method)."""


def block_quality() -> str:
    """Training quality: each master's and peer's accuracy against one process, mean of the seeds.

    Per model, the points each method's mean test accuracy over the seeds lies above or below the
    single process's, on 2 and 4 workers, and the commits the runs ran on."""
    found = recorded("quality", lambda r: not r.get("quick"))
    if found is None:
        return "No recorded run of `benchmarks.quality` yet.\n"
    path, report = found
    rows = {(r["model"], r["method"], r["aggregation"], r["workers"]): r for r in report["summary"]}
    models = [m for m in report["setup"]["models"] if (m, "single", None, 1) in rows]
    workers = sorted({k[3] for k in rows if k[3] > 1})
    seeds = sorted({len(r["seeds"]) for r in rows.values()})
    lines = [
        f"{_source(path, report)}: the mean test accuracy of {'/'.join(map(str, seeds))} seeds against the single "
        "process's, in points; rows kept from earlier runs name the commits they ran on.",
        "",
        "| model (one process) | method | " + " | ".join(f"{w} workers" for w in workers) + " | ran on |",
        "|---|---|" + "---|" * len(workers) + "---|",
    ]
    for model in models:
        single = rows[(model, "single", None, 1)]
        title = f"{report['setup']['models'][model]['title']} ({single['mean']:.3f})"
        for (method, aggregation), label in QUALITY_METHODS.items():
            cells = [rows.get((model, method, aggregation, w)) for w in workers]
            if not any(cells):
                continue
            points = ["" if c is None else f"{100 * (c['mean'] - single['mean']):+.1f}" for c in cells]
            commits = sorted({c for row in (single, *filter(None, cells)) for c in row.get("commits", ["unrecorded"])})
            ran_on = ", ".join(c if c == "unrecorded" else c[:7] for c in commits)
            lines.append(f"| {title} | {label} | " + " | ".join(points) + f" | {ran_on} |")
            title = ""
    return "\n".join(lines) + "\n"


def block_faults() -> str:
    """Training through killed workers: fits completed, accuracy lost, fits that lost data.

    Per master and approach, with the commit each row ran on."""
    found = recorded("faults", lambda r: "configs" in r)
    if found is None:
        return "No recorded run of `benchmarks.faults` yet.\n"
    path, report = found
    lines = [
        f"{_source(path, report)}; rows kept from earlier runs name their own commits.",
        "",
        "| master | approach | faulted fits completed | points below the unfaulted mean (worst) | fits losing data "
        "| commit |",
        "|---|---|---|---|---|---|",
    ]
    for c in report["configs"]:
        lines.append(
            f"| {c['master']} | {c['approach']} | {c['completed']} of {c['fits']} | {c['points_below_mean']:.1f} "
            f"({c['points_below_worst']:.1f}) | {c['data_lost_fits']} | {(c.get('commit') or 'unrecorded')[:7]} |"
        )
    return "\n".join(lines) + "\n"


def block_faults_kill_every() -> str:
    """A kill every few seconds through a fit of about 75 s: time and accuracy against the same job
    unfaulted, and the exactly-once tally, per certificate of ``dlscale certify``."""
    found = recorded("faults", lambda r: "kill_every" in r)
    if found is None:
        return "No recorded run of `benchmarks.faults --kill-every` yet.\n"
    path, report = found
    lines = [
        f"{_source(path, report)}: a worker killed every {report['kill_every']:g} s.",
        "",
        "| master | kills | fit seconds unfaulted / faulted | fit time ratio (bound 1.3) | minibatches redone / lost "
        "| accuracy unfaulted / faulted | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in report["certificates"]:
        accuracy = f"{c['unfaulted_accuracy']:.3f} / {c['faulted_accuracy']:.3f}" if c["faulted_accuracy"] else "-"
        verdict = "passed" if c["passed"] else "failed: " + "; ".join(c["failed_bounds"])
        lines.append(
            f"| {c['master']} | {c['kills']} | {c['unfaulted_fit_seconds']:.1f} / {c['faulted_fit_seconds']:.1f} | "
            f"{c['fit_time_ratio']:.2f}x | {c['tally']['redone']} / {c['tally']['lost']} of {c['tally']['planned']} "
            f"| {accuracy} | {verdict} |"
        )
    lines.append("")
    for master in dict.fromkeys(c["master"] for c in report["certificates"]):
        mine = [c for c in report["certificates"] if c["master"] == master]
        faulted, unfaulted = sum(c["faulted_fit_seconds"] for c in mine), sum(c["unfaulted_fit_seconds"] for c in mine)
        ratios = ", ".join(f"{c['fit_time_ratio']:.2f}x" for c in mine)
        lines.append(
            f"- {master}: its fits {faulted:.1f} s faulted against {unfaulted:.1f} s unfaulted over "
            f"{len(mine)} certificate(s), {faulted / unfaulted:.2f}x (each: {ratios})."
        )
    return "\n".join(lines) + "\n"


def block_auto() -> str:
    """The defaults' choice against trying every configuration of a grid: per workload and link, what
    the fit chose, its predicted and measured speedups, and the defaults against one process and the
    best configuration tried."""
    found = recorded("auto")
    if found is None:
        return "No recorded run of `benchmarks.auto` yet.\n"
    path, report = found
    repeats = report["setup"].get("repeats")
    lines = [
        f"{_source(path, report)}"
        + (f", each configuration the median of {repeats} runs" if repeats else "")
        + ". Predicted and measured: the last fit's receipt, against one trainer at the "
        "fit's measured step; error: the largest of the row's fits, predicted over measured; the other columns "
        "against the single process, the whole fit timed as a user calls it.",
        "",
        "| workload | link | chosen | predicted | measured | error | defaults | best tried | defaults / best |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        last = r["receipts"][-1] if r["receipts"] else None
        chosen = f"every {last['frequency']}{', streaming' if last['streaming'] else ''}" if last else "nothing"
        told = f"{last['predicted']:.2f}x | {last['measured']:.2f}x" if last else " | "
        lines.append(
            f"| {r['workload']} | {LINKS.get(r['link'], r['link'])} | {chosen} | {told} | {r['largest_error']:+.0%} | "
            f"{r['defaults_vs_single']:.2f}x | {LABELS.get(r['best'], r['best'])}, {r['best_vs_single']:.2f}x | "
            f"{r['defaults_vs_best']:.2f} |"
        )
    t = report["targets"]
    lines += [
        "",
        f"Targets (`benchmarks/auto.py`): the defaults at least {t['defaults_vs_best']} of the best tried and never "
        f"slower than one process, predicted within {t['prediction_error']:.0%} of measured, on every row: "
        f"{'met' if t['met'] else 'missed'} (rows missed: "
        + (
            ", ".join(f"{r['workload']} on {LINKS.get(r['link'], r['link'])}" for r in report["rows"] if not r["met"])
            or "none"
        )
        + ").",
    ]
    return "\n".join(lines) + "\n"


def block_index() -> str:
    """Every benchmark, its latest results file, the code it ran and the command that reruns it."""
    lines = [
        "| benchmark | latest results | run on | rerun |",
        "|---|---|---|---|",
    ]
    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("[!_]*.py") if p.stem != "report")
    for name in names:
        mine = [(p, r) for p, r in results() if r.get("benchmark") == name and not r.get("smoke")]
        if not mine:
            lines.append(f"| `{name}` | none | | `python -m benchmarks.{name}` |")
            continue
        path, report = max(mine, key=lambda pr: date_of(pr[1]))
        run = report.get("provenance")
        if run is not None:
            on = f"{run['commit'][:7]}{'' if run['clean'] else ' (uncommitted changes)'}, {run['started'][:10]}"
            command = run["command"]
        else:
            named = named_commit(path)
            on = (
                f"{named[:7]} (by the file's name), {date_of(report)[:10]}"
                if named
                else f"not recorded, {date_of(report)[:10]}"
            )
            command = f"python -m benchmarks.{name}"
        lines.append(f"| `{name}` | [{path.name}](../benchmarks/results/{path.name}) | {on} | `{command}` |")
    return "\n".join(lines) + "\n"


PICKS = (
    (
        "2+ workers on a fast link (loopback, 10 Gbit/s and up), a model of millions of parameters",
        "`ParameterAveragingTrainingMaster(batch)`, its defaults: the fit chooses the frequency and streams",
        ("mlp", "loopback", "defaults"),
    ),
    (
        "the same on a slow link (1 Gbit/s, shared), a fit per epoch, the network read between (on the driver)",
        "the same",
        ("mlp", "1gbit", "defaults"),
    ),
    (
        "the same, a fit per epoch with `spark_net.evaluate(test)` between (DL4J's loop; timed with the fits)",
        "the same: the evaluation runs on the state the workers hold",
        ("mlp", "1gbit", "defaults_evaluated"),
    ),
    (
        "the same, a fit per epoch, the network read after the last (DL4J's example loop)",
        "the same",
        ("mlp", "1gbit", "defaults_unread"),
    ),
    (
        "the same, nothing needed between epochs",
        "every epoch in one `fit_paths(paths, epochs=...)` (here streaming every 50)",
        ("mlp", "1gbit", "streaming_f50_onefit"),
    ),
    (
        "a small model, steps under a millisecond",
        "the defaults, one fit of every epoch (they average about once an epoch, streaming)",
        ("small_model", "averaging (2 workers, defaults)"),
    ),
    (
        "DL4J's own default, for a port that must average as DL4J does",
        "`ParameterAveragingTrainingMaster(batch, averaging_frequency=5)`",
        ("mlp", "1gbit", "averaging_f5"),
    ),
    (
        "asynchronous training, DL4J's `SharedTrainingMaster`",
        "`SharedTrainingMaster(batch)`",
        ("mlp", "loopback", "sharing"),
    ),
    (
        "for comparison: PyTorch DDP on the same 2 workers",
        "`DistributedDataParallel` over gloo",
        ("mlp", "loopback", "ddp"),
    ),
)
"""docs/training.md's "which to pick": the situation, the setting, and the run whose figure it quotes."""


def block_pick() -> str:
    """Which master and settings to pick, each with its measured figure (docs/training.md).

    The figures come from the latest runs of :func:`block_compare` and :func:`block_small_model`."""
    compare, small = _compare_file(), _small_model_file()
    runs = _runs(compare[1]) if compare else {}
    lines = ["| situation | setting | measured, 2 workers against one process |", "|---|---|---|"]
    for situation, setting, where in PICKS:
        if where[0] == "small_model":
            r = small[1]["runs"].get(where[1]) if small else None
            on = small[1]["provenance"]["commit"][:7] if small else ""
            figure = (
                f"{r['vs_single']:.2f}x, accuracy {r['accuracy']:.3f} (small_model on {on})"
                if r
                else "not measured in the latest run"
            )
        else:
            r = runs.get((*where, 2))
            figure = (
                f"{r['vs_single']:.2f}x on {LINKS[where[1]]}, accuracy {r['test_accuracy']:.3f} "
                f"(compare on {compare[1]['provenance']['commit'][:7]})"
                if r
                else "not measured in the latest run"
            )
        lines.append(f"| {situation} | {setting} | {figure} |")
    sources = [f"[{p.name}](../benchmarks/results/{p.name})" for p, _ in filter(None, (compare, small))]
    lines += ["", f"The figures: {' and '.join(sources) or 'no recorded run yet'} ([benchmarks](benchmarks.md))."]
    return "\n".join(lines) + "\n"


BLOCKS: dict[str, Callable[[], str]] = {
    "compare": block_compare,
    "auto": block_auto,
    "small_model": block_small_model,
    "main_job": block_main_job,
    "quality": block_quality,
    "faults": block_faults,
    "faults_kill_every": block_faults_kill_every,
    "index": block_index,
    "pick": block_pick,
}
"""Every generated block by its marker's name."""


# -- the plots ----------------------------------------------------------------------------------------------
HEADLINES = [
    (link, runner)
    for link in ("loopback", "1gbit")
    for runner in ("ceiling", "averaging_f50", "streaming_f50", "streaming_f50_onefit", "sharing", "ddp")
]
"""The headline ratios plotted over commits: compare's MLP, 2 workers, per link and runner."""


def series() -> dict[tuple[str, str], list[tuple[int, float, bool]]]:
    """Each headline ratio's points: (place of its commit in HEAD's history, value, recorded)."""
    out: dict[tuple[str, str], list[tuple[int, float, bool]]] = {}
    for path, report in results():
        if report.get("benchmark") != "compare" or report.get("smoke") or not _full_cpu_run(report):
            continue
        commit = commit_of(path, report)
        if commit is None:
            continue
        runs = _runs(report)
        for link, runner in HEADLINES:
            r = runs.get(("mlp", link, runner, 2))
            if r is not None and "vs_single" in r:
                out.setdefault((link, runner), []).append((history()[commit[0]], r["vs_single"], commit[1]))
    return out


def plot() -> Path:
    """docs/images/history-compare-mlp.png: compare's MLP ratios over the commits they ran on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = series()
    places = sorted({x for pts in points.values() for x, _, _ in pts})
    order = {x: i for i, x in enumerate(places)}
    commits = {i: c for c, i in history().items()}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, link in zip(axes, ("loopback", "1gbit"), strict=True):
        for i, runner in enumerate(r for lk, r in HEADLINES if lk == link):
            pts = sorted(points.get((link, runner), []))
            if not pts:
                continue
            colour = f"C{i}"
            ax.plot([order[x] for x, _, _ in pts], [v for _, v, _ in pts], color=colour, alpha=0.5)
            for x, v, rec in pts:
                ax.scatter(order[x], v, color=colour, facecolors=colour if rec else "none", zorder=3)
            ax.plot([], [], color=colour, marker="o", label=LABELS[runner])
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(places)), [commits[x][:7] for x in places], rotation=90, fontsize=7)
        ax.set_title(f"compare's MLP, 2 workers, {LINKS[link]}")
        ax.set_xlabel("commit (oldest first; hollow: the commit taken from the file's name)")
    axes[0].set_ylabel("samples/s against one process")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    IMAGES.mkdir(parents=True, exist_ok=True)
    path = IMAGES / "history-compare-mlp.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- the pages ----------------------------------------------------------------------------------------------
def render(text: str, page: str) -> str:
    """``text`` with each generated block rewritten; an unknown block's name is an error."""

    def one(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise KeyError(f"docs/{page}: no generated block {name!r}; known: {', '.join(BLOCKS)}")
        return f"<!-- report:{name} -->\n{BLOCKS[name]()}<!-- /report:{name} -->"

    return BLOCK.sub(one, text)


def check(pages: Iterable[str] = PAGES) -> list[str]:
    """Each block of ``pages`` that differs from what the results give, as ``page: name``."""
    stale = []
    for page in pages:
        text = (DOCS / page).read_text()
        for old, new in zip(BLOCK.finditer(text), BLOCK.finditer(render(text, page)), strict=True):
            if old["body"] != new["body"]:
                stale.append(f"docs/{page}: {old['name']}")
    return stale


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=listing({name: fn.__doc__.split("\n")[0] for name, fn in BLOCKS.items()}, "blocks"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each block that differs")
    if parser.parse_args(argv).check:
        stale = check()
        if stale:
            raise SystemExit(
                "blocks that differ from the results (python -m benchmarks.report):\n  " + "\n  ".join(stale)
            )
        print("every generated block is as the results give it")
        return
    for page in PAGES:
        path = DOCS / page
        text = path.read_text()
        new = render(text, page)
        if new != text:
            path.write_text(new)
            print(f"wrote docs/{page}")
    print(f"wrote {plot().relative_to(ROOT)}")


if __name__ == "__main__":
    main()
