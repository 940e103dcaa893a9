"""Spark's own PySpark unit tests, run unchanged on PySpark and on dlscale: how many pass on each.

Run from the repository root with ``python -m benchmarks.pyspark_tests --spark-tests DIR``. ``DIR``
holds test modules of Apache Spark's ``python/pyspark/tests`` (``test_rdd.py``, ``test_context.py``,
``test_join.py``, ...), copied from a checkout of https://github.com/apache/spark: they are Spark's
code and stay out of this repository. Tests that read ``SPARK_HOME/python/test_support`` (``hello.txt``,
``userlibrary.py``, ...) find it when ``DIR/test_support`` holds a copy of Spark's
``python/test_support``: both runs then get a ``SPARK_HOME`` of their own, the installed PySpark's
with that folder added.

Every module's test classes (those it defines, not the base classes it imports) run twice, each time
in a fresh subprocess, with the test bodies unchanged:

* **pyspark**: as PySpark's test runner would run it, on the installed PySpark (its JVM);
* **dlscale**: the same, except that before the module is imported every name that dlscale exports
  (``dir(dlscale)``) and that one of PySpark's public modules defines (:data:`BOUND_MODULES`:
  ``pyspark.SparkContext``, ``pyspark.statcounter.StatCounter``, ``pyspark.testing.utils``'s
  ``SparkConf`` ...) is bound to dlscale's object. PySpark's test base classes
  (``ReusedPySparkTestCase``, ``PySparkTestCase``) import ``SparkContext`` from ``pyspark`` when they
  set up, so they create dlscale's context. Every other name (``SparkFiles``, ``QuietTest``,
  serializers, ``py4j`` ...) stays PySpark's.

Both runs use the tests' own masters (``local[4]``, ``local-cluster[2,1,1024]`` ...), the
environment of Spark's own test runner (``SPARK_TESTING=1``, ``PYSPARK_PYTHON`` this interpreter) and
``PYTHONHASHSEED=0``. The test module is registered with cloudpickle (Dask's and PySpark's) to be
pickled by value, as it is not importable where tasks run. Each test gets ``--timeout`` seconds (120
by default): a watchdog in this process kills a subprocess whose test runs longer (its whole process
group: PySpark's JVM with it; dlscale's worker processes end with their driver), records a timeout,
and starts a new subprocess for the module's remaining tests. A subprocess that dies in a test
records a crash the same way.

Recorded per test and run: pass / fail / error / skip (or timeout / crash), the seconds, the
exception and the first lines of its traceback. Written to ``--out`` (default
``benchmarks/results/pyspark_tests.json``, with the machine's folders named ``SPARK_TESTS``, ``DLSCALE``,
``PYTHON_STDLIB`` and ``SITE_PACKAGES``): per module and test both outcomes, and the totals; a table
of the passes and the tests that pass on PySpark but not on dlscale are printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import types
import unittest
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks._common import command_line, header, java_missing, parse, unavailable, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "pyspark_tests.json"
SYSTEMS = ("pyspark", "dlscale")
SYSTEM_HELP = {
    "pyspark": "each test module as PySpark's test runner runs it, on the installed PySpark (its JVM)",
    "dlscale": "the same, PySpark's names that dlscale also exports bound to dlscale's objects",
}
"""A line on each of :data:`SYSTEMS`, for ``--help``."""
OUTCOMES = ("pass", "fail", "error", "skip", "timeout", "crash", "expected_failure", "unexpected_success")
DEFAULT_TIMEOUT = 120.0  # seconds a test may run before the watchdog kills its subprocess
POLL = 0.25  # seconds between the watchdog's looks at a subprocess's events
FINISH_GRACE = 30.0  # seconds a subprocess has to exit once its tests are done
TRACEBACK_LINES = 15
ERROR_CHARS = 1500
LOG_TAIL_LINES = 30

# PySpark's modules whose names, where dlscale exports the same name, the dlscale run binds to
# dlscale's: the public modules the tests import from, and pyspark.core's, which pyspark.rdd and
# pyspark.context re-export.
BOUND_MODULES = (
    "pyspark",
    "pyspark.conf",
    "pyspark.context",
    "pyspark.core.context",
    "pyspark.rdd",
    "pyspark.core.rdd",
    "pyspark.taskcontext",
    "pyspark.broadcast",
    "pyspark.accumulators",
    "pyspark.statcounter",
    "pyspark.storagelevel",
    "pyspark.resultiterable",
    "pyspark.files",
    "pyspark.testing.utils",
)

Record = dict[str, Any]

# A smoke run without --spark-tests runs this module, written in the way of Spark's tests, on both systems.
STAND_IN = '''"""A stand-in for Spark's test modules in a smoke run: PySpark's own test base class, a few tests."""

import unittest
from operator import add

from pyspark.testing.utils import ReusedPySparkTestCase


class StandInTests(ReusedPySparkTestCase):
    def test_count(self):
        self.assertEqual(self.sc.parallelize(range(100), 4).count(), 100)

    def test_reduce_by_key(self):
        pairs = self.sc.parallelize([("a", 1), ("b", 2), ("a", 3)], 2)
        self.assertEqual(sorted(pairs.reduceByKey(add).collect()), [("a", 4), ("b", 2)])

    @unittest.skip("a skipped test is recorded as such")
    def test_skipped(self):
        pass


if __name__ == "__main__":
    unittest.main()
'''


# -- in the subprocess: bind, import, run -------------------------------------------------------
def bind_dlscale() -> list[str]:
    """Bind, in each of :data:`BOUND_MODULES`, every name that dlscale also exports to dlscale's object.
    Returns the bound names, as ``module.name``."""
    import dlscale

    exported = [name for name in dir(dlscale) if not name.startswith("_")]
    bound = []
    for module_name in BOUND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in exported:
            if hasattr(module, name):
                setattr(module, name, getattr(dlscale, name))
                bound.append(f"{module_name}.{name}")
    return bound


def import_test_module(path: Path) -> types.ModuleType:
    """Import the test module at ``path`` under its file's name, pickled by value by cloudpickle."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    for pickler in ("cloudpickle", "pyspark.cloudpickle"):
        with contextlib.suppress(ImportError):
            importlib.import_module(pickler).register_pickle_by_value(module)
    return module


def flatten(suite: unittest.TestSuite) -> Iterator[unittest.TestCase]:
    """The test cases of a (nested) suite, in order."""
    for test in suite:
        if isinstance(test, unittest.TestSuite):
            yield from flatten(test)
        else:
            yield test


def selected(test_id: str, only: str | None) -> bool:
    """Whether ``--only`` selects a test: a glob on its id, or a plain string contained in it."""
    return only is None or fnmatch.fnmatchcase(test_id, only) or fnmatch.fnmatchcase(test_id, f"*{only}*")


def error_fields(err: tuple[type[BaseException], BaseException, types.TracebackType | None]) -> Record:
    """The exception (type and message) and the first lines of its traceback, without unittest's frames."""
    exc_type, value, tb = err
    while tb is not None and "__unittest" in tb.tb_frame.f_globals:
        tb = tb.tb_next
    lines = "".join(traceback.format_exception(exc_type, value, tb)).splitlines()
    exception = "".join(traceback.format_exception_only(exc_type, value)).strip()
    return {"error": exception[:ERROR_CHARS], "traceback": lines[:TRACEBACK_LINES]}


class EventResult(unittest.TestResult):
    """A ``TestResult`` that appends each test's start and outcome to a JSON-lines file as they happen,
    for the watchdog in the parent process to read."""

    def __init__(self, events: Any) -> None:
        super().__init__()
        self.events = events
        self.current: Record | None = None
        self.started = 0.0

    def emit(self, event: Record) -> None:
        self.events.write(json.dumps(event) + "\n")
        self.events.flush()

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self.current = {"outcome": "pass"}
        self.started = time.perf_counter()
        self.emit({"event": "start", "test": test.id()})

    def stopTest(self, test: unittest.TestCase) -> None:
        super().stopTest(test)
        record = self.current or {"outcome": "pass"}
        record["seconds"] = round(time.perf_counter() - self.started, 3)
        self.emit({"event": "end", "test": test.id(), **record})
        self.current = None

    def _outcome(self, test: unittest.TestCase, outcome: str, **fields: Any) -> None:
        if isinstance(test, unittest.TestCase) and self.current is not None:
            if self.current["outcome"] in ("pass", "expected_failure"):  # the first failure counts
                self.current = {"outcome": outcome, **fields}
        else:  # a class or module fixture (setUpClass, tearDownModule ...): unittest's _ErrorHolder
            self.emit({"event": "fixture", "description": str(test), "outcome": outcome, **fields})

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._outcome(test, "fail", **error_fields(err))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._outcome(test, "error", **error_fields(err))

    def addSubTest(self, test: unittest.TestCase, subtest: unittest.TestCase, err: Any) -> None:
        super().addSubTest(test, subtest, err)
        if err is not None:
            outcome = "fail" if issubclass(err[0], test.failureException) else "error"
            self._outcome(test, outcome, subtest=str(subtest), **error_fields(err))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._outcome(test, "skip", error=reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._outcome(test, "expected_failure", **error_fields(err))

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._outcome(test, "unexpected_success")


def run_child(spec_path: Path) -> None:
    """The subprocess: bind (dlscale's run), import the module, and run its selected tests that are
    not yet done, writing events as it goes."""
    spec = json.loads(spec_path.read_text())
    with open(spec["events"], "a", encoding="utf-8") as events:
        result = EventResult(events)
        bound = bind_dlscale() if spec["system"] == "dlscale" else []
        module = import_test_module(Path(spec["module"]))
        # the module's own test classes: not the base classes it imports (ReusedPySparkTestCase's own test)
        loaded = flatten(unittest.TestLoader().loadTestsFromModule(module))
        tests = [t for t in loaded if type(t).__module__ == module.__name__ and selected(t.id(), spec["only"])]
        result.emit({"event": "plan", "tests": [t.id() for t in tests], "bound": bound})
        skip = set(spec["skip"])
        unittest.TestSuite([t for t in tests if t.id() not in skip]).run(result)
        result.emit({"event": "finished"})


# -- in the parent: the watchdog ---------------------------------------------------------------
def spark_home_with_test_support(test_support: Path, root: Path) -> Path:
    """A ``SPARK_HOME`` under ``root``: links to every entry of the installed PySpark's, and a
    ``python`` folder of links to its entries plus ``test_support``."""
    from pyspark.find_spark_home import _find_spark_home

    real = Path(_find_spark_home())
    home = root / "spark_home"
    (home / "python").mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "python":
            (home / entry.name).symlink_to(entry)
    if (real / "python").is_dir():
        for entry in (real / "python").iterdir():
            (home / "python" / entry.name).symlink_to(entry)
    (home / "python" / "test_support").symlink_to(test_support.resolve())
    return home


def child_env(spark_home: Path | None) -> dict[str, str]:
    """The environment of both runs' subprocesses."""
    env = dict(os.environ)
    env.update({"SPARK_TESTING": "1", "PYSPARK_PYTHON": sys.executable, "PYTHONHASHSEED": "0"})
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    repo = str(Path(__file__).resolve().parent.parent)  # so that -m benchmarks.pyspark_tests imports
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    if spark_home is not None:
        env["SPARK_HOME"] = str(spark_home)
    return env


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the process group that ``proc`` leads (it was started in a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def log_tail(log: Path) -> list[str]:
    """The last lines of a subprocess's output."""
    try:
        return log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        return []


def test_class(test_id: str) -> str:
    """``module.Class`` of ``module.Class.test``."""
    return test_id.rsplit(".", 1)[0]


def run_module(
    system: str, module: Path, only: str | None, timeout: float, env: dict[str, str], work: Path, logs: Path
) -> Record:
    """Run one module's tests on one system, in as many subprocesses as timeouts and crashes need.
    Returns ``{"tests": {id: record}, "fixture_errors": [...], "bound": [...], ...}``."""
    done: dict[str, Record] = {}
    plan: list[str] | None = None
    run: Record = {"tests": done, "fixture_errors": [], "bound": [], "subprocesses": 0}
    start = time.perf_counter()
    while True:
        attempt = run["subprocesses"]
        run["subprocesses"] += 1
        events_path = work / f"{module.stem}.{system}.{attempt}.events"
        spec_path = work / f"{module.stem}.{system}.{attempt}.json"
        log = logs / f"{module.stem}.{system}.{attempt}.log"
        spec = {"system": system, "module": str(module), "only": only, "events": str(events_path), "skip": list(done)}
        spec_path.write_text(json.dumps(spec))
        events_path.touch()
        cwd = work / f"cwd.{module.stem}.{system}.{attempt}"
        cwd.mkdir()
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.pyspark_tests", "--child", str(spec_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        current: str | None = None
        last = started = time.monotonic()
        finished_at: float | None = None
        lost: tuple[str, str] | None = None  # (outcome, message) for the test the subprocess was in
        pending = b""
        with open(events_path, "rb") as events:
            while True:
                exited = proc.poll() is not None
                *lines, pending = (pending + events.read()).split(b"\n")  # the last one: half-written
                for line in lines:
                    event = json.loads(line)
                    last = time.monotonic()
                    kind = event.pop("event")
                    if kind == "plan":
                        plan, run["bound"] = event["tests"], event["bound"]
                    elif kind == "start":
                        current, started = event["test"], last
                    elif kind == "end":
                        done[event.pop("test")] = event
                        current = None
                    elif kind == "fixture":
                        run["fixture_errors"].append(event)
                        fill_fixture_error(event, plan or [], done)
                    elif kind == "finished":
                        finished_at = last
                now = time.monotonic()
                if exited:
                    if finished_at is None:
                        lost = ("crash", f"the subprocess exited with code {proc.returncode} before its tests ended")
                    break
                if finished_at is not None and now - finished_at > FINISH_GRACE:
                    break
                if finished_at is None and now - (started if current else last) > timeout:
                    lost = ("timeout", f"no result after {timeout:.0f} s: the subprocess was killed")
                    break
                time.sleep(POLL)
        kill_group(proc)
        if plan is None:  # the module did not import (or the subprocess died before its plan)
            run["import_error"] = {"error": lost[1] if lost else "no test plan", "traceback": log_tail(log)}
            break
        remaining = [t for t in plan if t not in done]
        if lost is not None and remaining:
            victim = current if current in remaining else remaining[0]
            done[victim] = {"outcome": lost[0], "error": lost[1], "traceback": log_tail(log)}
            done[victim]["seconds"] = round(time.monotonic() - started, 3) if current == victim else None
            remaining.remove(victim)
        if not remaining or lost is None:
            for test in remaining:  # ended without running them: say so rather than drop them
                done[test] = {"outcome": "error", "error": "not run by unittest", "traceback": [], "seconds": None}
            break
    run["tests"] = {t: done[t] for t in plan or [] if t in done}
    run["wall_seconds"] = round(time.perf_counter() - start, 1)
    return run


def fill_fixture_error(event: Record, plan: list[str], done: dict[str, Record]) -> None:
    """A failed ``setUpClass`` or ``setUpModule`` means its tests never run: record its error for each."""
    description = event["description"]  # "setUpClass (module.Class)", "setUpModule (module)"
    if not description.startswith(("setUpClass", "setUpModule")) or "(" not in description:
        return
    scope = description[description.index("(") + 1 : description.rindex(")")]
    for test in plan:
        if test not in done and (test_class(test) == scope or test.startswith(scope + ".")):
            done[test] = {
                "outcome": event["outcome"],
                "error": f"{description.split()[0]} failed: {event.get('error', '')}"[:ERROR_CHARS],
                "traceback": event.get("traceback", []),
                "seconds": None,
            }


# -- report -------------------------------------------------------------------------------------
def totals(records: list[Record]) -> dict[str, int]:
    """Outcome counts of a list of test records."""
    counts = Counter(r["outcome"] for r in records)
    return {"tests": len(records), **{o: counts.get(o, 0) for o in OUTCOMES}}


def module_report(module: Path, runs: dict[str, Record]) -> Record:
    """One module's entry of the results: both runs' outcomes per test, and their totals."""
    ids = list(dict.fromkeys(t for run in runs.values() for t in run["tests"]))
    tests = {t: {s: runs[s]["tests"].get(t) for s in runs} for t in ids}
    return {
        "file": str(module),
        "sha256": hashlib.sha256(module.read_bytes()).hexdigest(),
        "runs": {s: {k: v for k, v in run.items() if k != "tests"} for s, run in runs.items()},
        "totals": {s: totals([r for r in (tests[t][s] for t in ids) if r is not None]) for s in runs},
        "tests": tests,
    }


def passing(report: Record, system: str) -> set[str]:
    """Ids of the tests that pass on ``system`` in a module's report."""
    return {t for t, r in report["tests"].items() if (r.get(system) or {}).get("outcome") == "pass"}


def java_version() -> str | None:
    """The first line of ``java -version``."""
    try:
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (out.stderr or out.stdout).splitlines()
    return lines[0] if lines else None


def build_report(modules: dict[str, Record], settings: Record) -> Record:
    """Everything that goes into the results file."""
    import dask
    import distributed
    import pyspark

    all_tests = {(m, t): r for m, rep in modules.items() for t, r in rep["tests"].items()}
    summary = {s: totals([r[s] for r in all_tests.values() if r.get(s) is not None]) for s in SYSTEMS if modules}
    both = sum(len(passing(rep, "pyspark") & passing(rep, "dlscale")) for rep in modules.values())
    spark_only = sum(len(passing(rep, "pyspark") - passing(rep, "dlscale")) for rep in modules.values())
    dlscale_only = sum(len(passing(rep, "dlscale") - passing(rep, "pyspark")) for rep in modules.values())
    return {
        **header(
            "pyspark_tests",
            pyspark=pyspark.__version__,
            dask=dask.__version__,
            distributed=distributed.__version__,
            java=java_version(),
        ),
        "settings": settings,
        "totals": {**summary, "pass_both": both, "pass_pyspark_only": spark_only, "pass_dlscale_only": dlscale_only},
        "modules": modules,
    }


def portable(value: Any, places: dict[str, str]) -> Any:
    """``value`` with this machine's folders in its strings named by role (``places``: folder -> name), so
    that a results file says nothing of where it was made."""
    if isinstance(value, str):
        for folder, name in places.items():
            value = value.replace(folder, name)
        return value
    if isinstance(value, dict):
        return {portable(k, places): portable(v, places) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v, places) for v in value]
    return value


def places(spark_tests: Path) -> dict[str, str]:
    """The folders :func:`portable` names: Spark's tests, this repository, Python's standard library and where
    packages are installed (the longest first, so that a folder inside another is named by its own role)."""
    found = {
        str(spark_tests.resolve()): "SPARK_TESTS",
        str(Path(__file__).resolve().parent.parent): "DLSCALE",
        sysconfig.get_path("stdlib"): "PYTHON_STDLIB",
        **{path: "SITE_PACKAGES" for path in {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}},
    }
    return dict(sorted(found.items(), key=lambda item: -len(item[0])))


def print_report(report: Record) -> None:
    """The passes per module, then every test that passes on PySpark but not on dlscale."""
    rows = [["module", "tests", "pyspark pass", "dlscale pass", "both", "pyspark only", "dlscale only"]]
    for name, rep in report["modules"].items():
        spark, ours = passing(rep, "pyspark"), passing(rep, "dlscale")
        counts = [len(rep["tests"]), len(spark), len(ours), len(spark & ours), len(spark - ours), len(ours - spark)]
        rows.append([name, *map(str, counts)])
    t = report["totals"]
    if "pyspark" in t:
        n = t["pyspark"]["tests"]
        rows.append(["total", str(n), str(t["pyspark"]["pass"]), str(t["dlscale"]["pass"]), str(t["pass_both"])])
        rows[-1] += [str(t["pass_pyspark_only"]), str(t["pass_dlscale_only"])]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    print("\npass on pyspark, not on dlscale:")
    for rep in report["modules"].values():
        for test in sorted(passing(rep, "pyspark") - passing(rep, "dlscale")):
            r = rep["tests"][test]["dlscale"] or {"outcome": "missing", "error": ""}
            first = (r.get("error") or "").splitlines()[:1]
            print(f"  {test}: {r['outcome']}: {first[0][:150] if first else ''}")


def main(argv: list[str] | None = None) -> None:
    title = "systems (each runs every test module of --spark-tests, in a fresh subprocess)"
    parser = command_line(__doc__.split("\n\n")[0], cases=SYSTEM_HELP, title=title)
    parser.add_argument(
        "--spark-tests",
        type=Path,
        help="folder of Spark's test modules (test_*.py); a smoke run without it runs a stand-in module of its own",
    )
    parser.add_argument(
        "--only", help="run only the tests whose id (module.Class.test) matches this glob or contains it"
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per test (default 120)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: pyspark,dlscale")
    parser.add_argument("--logs", type=Path, help="keep each subprocess's output in this folder")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parse(parser, argv, RESULTS)
    if args.child:
        run_child(args.child)
        return
    stand_in = None
    if args.smoke and args.spark_tests is None:
        stand_in = args.spark_tests = Path(tempfile.mkdtemp(prefix="pyspark_tests-stand-in."))
        (stand_in / "test_stand_in.py").write_text(STAND_IN)
    if args.spark_tests is None or not args.spark_tests.is_dir():
        parser.error("--spark-tests DIR: a folder of Spark's python/pyspark/tests modules")
    systems = [s for s in args.systems.split(",") if s]
    if not set(systems) <= set(SYSTEMS):
        parser.error(f"--systems: of {', '.join(SYSTEMS)}")
    if "pyspark" in systems and java_missing():
        unavailable("pyspark_tests", java_missing(), args.smoke)
    modules = sorted(args.spark_tests.resolve().glob("test_*.py"))
    with tempfile.TemporaryDirectory(prefix="pyspark_tests.") as tmp:
        work = Path(tmp)
        logs = args.logs.resolve() if args.logs else work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        support = args.spark_tests / "test_support"
        spark_home = spark_home_with_test_support(support, work) if support.is_dir() else None
        env = child_env(spark_home)
        reports: dict[str, Record] = {}
        start = time.perf_counter()
        for module in modules:
            runs = {}
            for system in systems:
                print(f"{module.stem} on {system}", flush=True)
                runs[system] = run_module(system, module, args.only, args.timeout, env, work, logs)
            if any(run["tests"] or "import_error" in run for run in runs.values()):
                reports[module.stem] = module_report(module, runs)
        settings = {
            "spark_tests": str(args.spark_tests.resolve()),
            "only": args.only,
            "timeout_seconds": args.timeout,
            "systems": systems,
            "test_support": spark_home is not None,
            "bound_modules": list(BOUND_MODULES),
            "wall_seconds": round(time.perf_counter() - start, 1),
        }
        if args.logs is None:
            shutil.rmtree(logs, ignore_errors=True)
    report = portable(build_report(reports, settings), places(args.spark_tests))
    if stand_in is not None:
        shutil.rmtree(stand_in, ignore_errors=True)
    print_report(report)
    write_results(args.out, report, indent=1)


if __name__ == "__main__":
    main()
