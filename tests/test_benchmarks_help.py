"""Every benchmark's ``--help`` ends with what it measures, a line each: its runners, cases or rows
under a title (``benchmarks._common.command_line``'s ``cases``).

The modules are found, not listed, so that a new benchmark is covered as soon as it exists
(``_``-prefixed modules are the benchmarks' helpers). Where a module names its runners, cases or rows in
a constant, every one of them must have its line; names of a second kind (a compare workload, a
quality model) must be mentioned somewhere in the help.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_"))


def _broadcast_values(m: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Iterable[str]:
    monkeypatch.setattr(m, "SIZE", 1e-6)  # the values' names, not 100 MB of each
    return m.make_values()


def _small_model_rows(m: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Iterable[str]:
    return m._runs(None, {1: (None, None), 2: (None, None)})  # names and partials: nothing runs


Names = Callable[[ModuleType, pytest.MonkeyPatch], Iterable[str]]

LISTED: dict[str, Names] = {
    # module: the names each of which must have a line of its own in the cases section
    "allocator": lambda m, _: m.RUNS,
    "broadcast": _broadcast_values,
    "compare": lambda m, _: m.RUNNERS,
    "concurrent_steps": lambda m, _: m.RUNS,
    "elastic": lambda m, _: m.WAYS,
    "encoding": lambda m, _: ["clone", "copy_ into a buffer", *(f"{s:g}" for s in m.SPARSITIES)],
    "facade": lambda m, _: m.PIPELINES,
    "faults": lambda m, _: [f"{master}:{approach}" for master, approach in m.CONFIGS],
    "first_fit": lambda m, _: m.WAYS,
    "gpu_profile": lambda m, _: m.COMPRESSORS,
    "late_average": lambda m, _: m.GRID,
    "main_job": lambda m, _: m.ROWS,
    "momentum_masking": lambda m, _: m.SETTINGS,
    "parameter_averaging": lambda m, _: [f"averaging_frequency_{f}" for f in m.FREQUENCIES],
    "pyspark_tests": lambda m, _: m.SYSTEMS,
    "quality": lambda m, _: ["single", m.LARGE_BATCH, *m.COMPRESSORS, *m.PEERS],
    "round_trip": lambda m, _: m.TRANSPORTS,
    "scaling": lambda m, _: m.MODES,
    "small_model": _small_model_rows,
    "step_costs": lambda m, _: ["plain PyTorch", *m.COMPRESSORS],
    "step_ops": lambda m, _: ["plain", "network.step", *m.COMPRESSORS, m.DEVICE_KERNELS],
    "ticks": lambda m, _: m.TICKS,
    "transfer": lambda m, _: m.PAYLOADS,
}
MENTIONED: dict[str, Names] = {
    # module: names of a second kind, in the title or an option's help
    "broadcast": lambda m, _: m.SYSTEMS,
    "compare": lambda m, _: [*m.WORKLOADS, *m.LINKS],
    "concurrent_steps": lambda m, _: m.STEPS,
    "facade": lambda m, _: m.SYSTEMS,
    "gradient_sharing": lambda m, _: m.LINKS,
    "momentum_masking": lambda m, _: m.MODELS,
    "quality": lambda m, _: m.MODELS,
    "round_trip": lambda m, _: [*m.TRIPS, *m.BESIDE],
    "step_ops": lambda m, _: m.MODELS,
}


def cases_section(text: str) -> tuple[str, list[str]]:
    """The title and the lines of the cases section that ends ``text``, after the options."""
    lines = text.rstrip("\n").splitlines()
    assert "options:" in lines, text
    start = lines.index("options:")
    heads = [i for i, line in enumerate(lines) if i > start and line and not line[0].isspace()]
    assert heads, f"no section after the options:\n{text}"
    title, cases = lines[heads[-1]], lines[heads[-1] + 1 :]
    return title, cases


def test_modules_found() -> None:
    assert {"compare", "quality", "faults", "small_model"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_help_lists_cases(name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as ended:
        module.main(["--help"])
    assert ended.value.code in (0, None)
    text = capsys.readouterr().out
    title, cases = cases_section(text)
    assert title.endswith(":") and len(title) > 1, f"benchmarks.{name} --help: no title line ending in ':'\n{text}"
    assert cases and all(line.startswith("  ") and line.strip() for line in cases), (
        f"benchmarks.{name} --help: its cases are not one indented line each\n{text}"
    )
    if name in LISTED:
        for case in LISTED[name](module, monkeypatch):
            assert any(line.startswith(f"  {case}  ") for line in cases), (
                f"benchmarks.{name} --help lists no line for {case!r}\n{text}"
            )
    if name in MENTIONED:
        flat = " ".join(text.split())  # the options' help is wrapped
        for other in MENTIONED[name](module, monkeypatch):
            assert other in flat, f"benchmarks.{name} --help does not mention {other!r}\n{text}"
