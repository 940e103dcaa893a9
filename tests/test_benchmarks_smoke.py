"""Every benchmark under ``benchmarks/`` still runs: each module's smoke run (``--smoke``: small data, a
few steps, one seed), as ``python -m benchmarks.NAME --smoke --out FILE`` from the repository root.

The modules are found, not listed, so that a new benchmark is covered as soon as it exists
(``_``-prefixed modules are the benchmarks' helpers). A smoke run must end with status 0 and write
its results, marked ``"smoke": true``, to ``--out`` only: ``benchmarks/results/`` and the plots in
``docs/images/`` stay as they were. A benchmark that cannot run on this machine (a GPU, Java for
PySpark) prints ``not run here: ...`` and ends with status 0; its test is skipped with that reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(
    p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_") and p.stem != "report"
)  # report renders the docs from the results: it measures nothing (tests/test_benchmark_report.py)
KEPT = (ROOT / "benchmarks" / "results", ROOT / "docs" / "images")  # what a smoke run must not touch
TIMEOUT = 300  # seconds; a smoke run takes well under a minute on 2 cores
NOT_RUN = re.compile(r"^not run here: (?P<reason>.+)$", re.MULTILINE)


def snapshot() -> dict[str, str]:
    """The files under :data:`KEPT` and a digest of each."""
    return {
        str(path.relative_to(ROOT)): hashlib.sha256(path.read_bytes()).hexdigest()
        for folder in KEPT
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def test_modules_found() -> None:
    assert {"compare", "minibatch_io", "gpu_profile", "pyspark_tests"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_smoke(module: str, tmp_path: Path) -> None:
    out = tmp_path / "results" / f"{module}.json"
    before = snapshot()
    env = {k: v for k, v in os.environ.items() if k != "DLSCALE_BENCHMARK_SMOKE"}  # the flag says it
    argv = [sys.executable, "-m", f"benchmarks.{module}", "--smoke", "--out", str(out)]
    with subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,  # on a timeout, its whole process group goes: workers, ranks, JVMs
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"benchmarks.{module} --smoke ran past {TIMEOUT} s:\n{stdout[-5000:]}\n{stderr[-5000:]}")
    output = f"stdout:\n{stdout[-6000:]}\nstderr:\n{stderr[-6000:]}"
    assert snapshot() == before, f"benchmarks.{module} --smoke changed benchmarks/results/ or docs/images/"
    assert proc.returncode == 0, f"benchmarks.{module} --smoke ended with status {proc.returncode}\n{output}"
    skipped = NOT_RUN.search(stdout)
    if skipped and not out.exists():
        pytest.skip(skipped["reason"])
    assert out.is_file(), f"benchmarks.{module} --smoke wrote no {out}\n{output}"
    report = json.loads(out.read_text())
    assert report.get("smoke") is True, f"{out} does not say it is a smoke run's"
