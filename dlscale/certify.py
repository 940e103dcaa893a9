"""``dlscale certify``: a certificate that a user's training script survives worker faults.

The script runs twice, unchanged, each time on a fresh embedded cluster that this process starts
(nannies on 127.0.0.1, which restart a killed worker): once without faults, as the baseline, then
while a thread here kills a random worker process every ``kill_every`` seconds (and, optionally,
stops one with ``SIGSTOP`` for a while). The script's ``SparkContext`` reaches the cluster as under
``dlscale run``: its master comes through the environment. What the script's driver records (each
fit's tally of minibatches, the metrics it reports with ``dlscale.report``; see
:mod:`dlscale.monitor.record`) is read back after each run, and the certificate compares the runs
against the bounds asked for: nothing lost, both runs succeed with as many fits, and optionally the
time ratio and the drop of each metric.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import dask.config

from dlscale import config
from dlscale.facade.conf import SUBMIT_ENV
from dlscale.facade.embedded import EmbeddedCluster
from dlscale.monitor import record

logger = logging.getLogger(__name__)

LOST_WORKER_TIMEOUT = "300s"
"""How long a nanny may take to bring back a killed worker before the cluster gives up on it: Dask's
15 s default is too short for a new worker process that imports torch on a busy machine."""

TALLY = ("planned", "once", "redone", "lost")
"""A fit's count of minibatches: planned, fitted into the result once, fitted again after a lost
trainer held them, never fitted."""

LOWER_IS_BETTER = ("loss", "error", "mse", "mae", "perplexity")
"""A metric whose name contains one of these drops when it rises; any other drops when it falls."""

_RETRY = 0.5  # seconds before a fault that found no worker to take is tried again


@dataclass(frozen=True)
class Plan:
    """What to certify: the command that runs the script (after the interpreter), the cluster, the
    faults and the bounds (``None``: not checked)."""

    argv: list[str]
    label: str
    workers: int
    kill_every: float
    threads_per_worker: int = 1
    memory_limit: str | int | float | None = None
    stop_every: float | None = None
    stop_for: float | None = None
    max_time_ratio: float | None = None
    max_metric_drop: float | None = None
    command_line: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Fault:
    """A fault injected: seconds since the script started, ``kill`` or ``stop``, the worker, its pid."""

    time: float
    kind: str
    worker: str
    pid: int


class FaultInjector:
    """A thread that kills a random worker process every ``kill_every`` seconds and, with
    ``stop_every``, stops one (``SIGSTOP``) for ``stop_for`` seconds, until :meth:`stop`. The periods
    count from when the script's ``SparkContext`` connects (a client other than this one appears on
    the scheduler): a fault while the script still imports its modules would only slow its start.

    A fault takes a worker that is running (neither stopped nor lost) and only while another one
    is running too: with none left the script could not go on, which is an outage rather than a
    fault; a fault that finds no such worker waits for one. Killed is the worker process, not its
    nanny, which starts a new one."""

    def __init__(self, address: str, plan: Plan, rng: random.Random | None = None) -> None:
        self.address, self.plan, self.started = address, plan, 0.0
        self.rng = rng or random.Random()
        self.faults: list[Fault] = []
        self.connected: float | None = None  # seconds from the script's start to its client's connection
        self._stopped: dict[str, tuple[int, float]] = {}  # worker: pid, when to resume it
        self._killed: set[str] = set()  # addresses not to ask again (a new worker gets a new one)
        self._done = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="dlscale-certify-faults", daemon=True)

    def start(self, started: float) -> None:
        """Start injecting faults, timed from ``started`` (``time.perf_counter``'s, the script's start)."""
        self.started = started
        self._thread.start()

    def stop(self) -> None:
        """Stop injecting faults and resume every stopped worker; raises ``RuntimeError`` when the
        injector failed (the certificate would understate the faults)."""
        self._done.set()
        self._thread.join()
        self._resume(float("inf"))
        if self._error is not None:
            raise RuntimeError(f"the fault injector failed: {self._error}") from self._error

    def _run(self) -> None:
        try:
            self._inject_until_done()
        except Exception as e:  # noqa: BLE001 - raised by stop(), in the certifying thread
            self._error = e

    def _inject_until_done(self) -> None:
        from distributed import Client

        with Client(self.address, timeout=60) as client:
            connected = self._wait_for_the_script(client)
            if connected is None:
                return
            self.connected = round(connected - self.started, 3)
            due = {"kill": connected + self.plan.kill_every, "stop": float("inf")}
            if self.plan.stop_every:
                due["stop"] = connected + self.plan.stop_every
            while True:
                wake = min([*due.values(), *(at for _, at in self._stopped.values())])
                if self._done.wait(max(0.0, wake - time.perf_counter())):
                    return
                now = time.perf_counter()
                self._resume(now)
                for kind, at in due.items():
                    if now >= at:
                        every = self.plan.kill_every if kind == "kill" else self.plan.stop_every
                        due[kind] = now + (every if self._inject(client, kind) else _RETRY)

    def _wait_for_the_script(self, client: Any) -> float | None:
        """When (``time.perf_counter``'s) a client other than ``client`` connected to the scheduler;
        ``None`` when stopped before."""
        while not self._done.wait(0.1):
            clients = client.run_on_scheduler(_client_ids)
            if set(clients) - {client.id, "fire-and-forget"}:
                return time.perf_counter()
        return None

    def _inject(self, client: Any, kind: str) -> bool:
        """Inject one fault of ``kind`` into a random running worker; whether there was one to take."""
        running = self._running(client)
        if len(running) < 2:
            return False
        worker = self.rng.choice(sorted(running))
        pid = running[worker]
        try:
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        except ProcessLookupError:  # gone since it answered
            return False
        if kind == "stop":
            self._stopped[worker] = (pid, time.perf_counter() + self.plan.stop_for)
        else:
            self._killed.add(worker)
        fault = Fault(round(time.perf_counter() - self.started, 3), kind, worker, pid)
        self.faults.append(fault)
        logger.info("%.1f s: %s %s (pid %d)", fault.time, "killed" if kind == "kill" else "stopped", worker, pid)
        return True

    def _running(self, client: Any) -> dict[str, int]:
        """The pid of each worker that answers, stopped and killed ones left out (they would not answer)."""
        try:
            known = client.run_on_scheduler(_worker_addresses)
            asked = [w for w in known if w not in self._stopped and w not in self._killed]
            pids = client.run(os.getpid, workers=asked, on_error="return") if asked else {}
        except (OSError, TimeoutError) as e:  # the scheduler busy with a lost worker: try again
            logger.debug("no worker pids: %s", e)
            return {}
        return {w: pid for w, pid in pids.items() if isinstance(pid, int)}

    def _resume(self, now: float) -> None:
        """Resume (``SIGCONT``) each stopped worker whose time is up at ``now``."""
        for worker, (pid, at) in list(self._stopped.items()):
            if at <= now:
                with contextlib.suppress(ProcessLookupError):  # killed while stopped
                    os.kill(pid, signal.SIGCONT)
                del self._stopped[worker]


def _worker_addresses(dask_scheduler: Any) -> list[str]:
    return list(dask_scheduler.workers)


def _client_ids(dask_scheduler: Any) -> list[str]:
    return list(dask_scheduler.clients)


# -- the runs ------------------------------------------------------------------------------
@contextlib.contextmanager
def local_cluster(plan: Plan) -> Iterator[EmbeddedCluster]:
    """A fresh embedded cluster of ``plan.workers`` nannies on 127.0.0.1, without a dashboard, that
    waits :data:`LOST_WORKER_TIMEOUT` for a killed worker to come back; closed on the way out."""
    memory = config.get("local.memory-limit") if plan.memory_limit is None else plan.memory_limit
    settings: dict[str, Any] = {
        "worker": {
            "memory": {
                name: value
                for name in ("target", "spill", "pause")
                if (value := config.get(f"local.memory-{name}")) is not None
            }
        }
    }
    if (tick := config.get("local.tick-interval")) is not None:
        settings["admin"] = {"tick": {"interval": tick}}
    with dask.config.set({"distributed.deploy.lost-worker-timeout": LOST_WORKER_TIMEOUT}):
        cluster = EmbeddedCluster(
            plan.workers,
            threads_per_worker=plan.threads_per_worker,
            memory_limit=memory,
            dashboard_address=None,
            config={"distributed": settings},
        )
        try:
            yield cluster
        finally:
            cluster.close()


def _environment(address: str, record_path: str, workers: int) -> dict[str, str]:
    """The script's environment: its ``SparkContext`` on the cluster at ``address``, its records to
    ``record_path``. As on an embedded cluster of ``workers``, and unless the environment already
    says otherwise, its client talks to the workers directly and a fit waits for all of them (on a
    bare scheduler address it would start with the first)."""
    env = dict(os.environ)
    env[SUBMIT_ENV] = json.dumps({"spark.master": address})
    env[record.RECORD_ENV] = record_path
    env.setdefault("DASK_DISTRIBUTED__CLIENT__DIRECT_TO_WORKERS", "True")
    env.setdefault("DASK_DLSCALE__TRAINING__MIN_WORKERS", str(workers))
    return env


def _execute(argv: list[str], env: dict[str, str], injector: FaultInjector | None) -> tuple[int, float]:
    """Run the script to its end, with faults when ``injector`` is given: its exit status and seconds."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, *argv], env=env)
    try:
        if injector is not None:
            injector.start(started)
        status = process.wait()
    finally:
        if injector is not None:
            injector.stop()
        if process.poll() is None:  # certify interrupted: the script goes too
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
    return status, time.perf_counter() - started


def run_script(plan: Plan, faulted: bool) -> tuple[dict[str, Any], FaultInjector | None]:
    """One run of the script on a fresh cluster: its summary (:func:`run_summary`) and, faulted, the
    injector (its faults, when the script connected)."""
    with tempfile.TemporaryDirectory(prefix="dlscale-certify-") as directory:
        path = os.path.join(directory, "record.jsonl")
        with local_cluster(plan) as cluster:
            address = cluster.scheduler_address
            injector = FaultInjector(address, plan) if faulted else None
            logger.info("%s run of %s on %s", "faulted" if faulted else "unfaulted", plan.label, address)
            status, seconds = _execute(plan.argv, _environment(address, path, plan.workers), injector)
        records = record.read(path)
    summary = run_summary(status, seconds, records)
    logger.info("%s run: exit status %d after %.1f s", "faulted" if faulted else "unfaulted", status, seconds)
    return summary, injector


def certify(plan: Plan) -> dict[str, Any]:
    """Run the script unfaulted, then (when that succeeded) under faults, and return the certificate."""
    unfaulted, _ = run_script(plan, faulted=False)
    if unfaulted["exit_status"] != 0:
        logger.warning("the unfaulted run failed (exit status %d): no faulted run", unfaulted["exit_status"])
        return certificate(plan, unfaulted, None, [])
    faulted, injector = run_script(plan, faulted=True)
    return certificate(plan, unfaulted, faulted, injector.faults, connected=injector.connected)


# -- the certificate -----------------------------------------------------------------------
def fit_summary(fit: dict[str, Any]) -> dict[str, Any]:
    """A fit record with its tally (:data:`TALLY`) summed over its epochs."""
    epochs = [{"epoch": e.get("epoch"), **{k: int(e.get(k, 0)) for k in TALLY}} for e in fit.get("epochs") or []]
    return {
        "approach": fit.get("approach"),
        "seconds": None if fit.get("seconds") is None else round(fit["seconds"], 3),
        "workers_lost": list(fit.get("workers_lost") or []),
        "score": fit.get("score"),
        "tally": {k: sum(e[k] for e in epochs) for k in TALLY},
        "epochs": epochs,
    }


def final_metrics(records: list[dict[str, Any]], fits: list[dict[str, Any]]) -> tuple[dict[str, float], str | None]:
    """A run's final metrics and where they come from: the last ``dlscale.report``, else the last
    fit's score as ``loss``, else none."""
    reported = [r["metrics"] for r in records if r.get("kind") == "metrics" and isinstance(r.get("metrics"), dict)]
    if reported:
        return {k: float(v) for k, v in reported[-1].items()}, "dlscale.report"
    if fits and fits[-1]["score"] is not None:
        return {"loss": float(fits[-1]["score"])}, "score of the last fit"
    return {}, None


def run_summary(exit_status: int, seconds: float, records: list[dict[str, Any]]) -> dict[str, Any]:
    """What the certificate keeps of one run: exit status, wall seconds, fits, final metrics."""
    fits = [fit_summary(r) for r in records if r.get("kind") == "fit"]
    metrics, source = final_metrics(records, fits)
    return {
        "exit_status": exit_status,
        "seconds": round(seconds, 3),
        "fits": fits,
        "metrics": metrics,
        "metrics_from": source,
    }


def _fit_seconds(run: dict[str, Any] | None) -> float | None:
    """The seconds of a run's fits together; ``None`` without fits."""
    return None if run is None or not run["fits"] else sum(f["seconds"] or 0.0 for f in run["fits"])


def _ratio(faulted: float | None, unfaulted: float | None) -> float | None:
    return None if faulted is None or not unfaulted else round(faulted / unfaulted, 4)


def certificate(
    plan: Plan,
    unfaulted: dict[str, Any],
    faulted: dict[str, Any] | None,
    faults: list[Fault],
    connected: float | None = None,
) -> dict[str, Any]:
    """The certificate of two runs (``faulted`` is ``None`` when it did not run) with its verdict;
    ``connected``: seconds from the faulted run's start to its ``SparkContext``'s connection."""
    counts = {"kill": 0, "stop": 0}
    for f in faults:
        counts[f.kind] += 1
    fit_seconds = [_fit_seconds(r) for r in (faulted, unfaulted)]
    cert = {
        "command": plan.command_line,
        "script": plan.label,
        "workers": plan.workers,
        "threads_per_worker": plan.threads_per_worker,
        "faults": {
            "kill_every": plan.kill_every,
            "stop_every": plan.stop_every,
            "stop_for": plan.stop_for,
            "script_connected": connected,
            "counts": counts,
            "injected": [vars(f) for f in faults],
        },
        "runs": {"unfaulted": unfaulted, "faulted": faulted},
        "time_ratio": _ratio(faulted and faulted["seconds"], unfaulted["seconds"]),
        "fit_time_ratio": _ratio(*fit_seconds),
    }
    checks = verdict(cert, plan.max_time_ratio, plan.max_metric_drop)
    cert["verdict"] = {"passed": all(c["passed"] for c in checks), "checks": checks}
    return cert


# -- the verdict ---------------------------------------------------------------------------
def _check(bound: str, passed: bool, measured: Any, limit: Any, message: str) -> dict[str, Any]:
    return {"bound": bound, "passed": passed, "measured": measured, "limit": limit, "message": message}


def lower_is_better(metric: str) -> bool:
    """Whether ``metric`` improves as it falls (a loss, an error), by its name: :data:`LOWER_IS_BETTER`."""
    name = metric.lower()
    return any(word in name for word in LOWER_IS_BETTER)


def metric_drop(metric: str, unfaulted: float, faulted: float) -> float:
    """How much worse ``metric`` is under faults: unfaulted - faulted, or the reverse for a loss or error."""
    return faulted - unfaulted if lower_is_better(metric) else unfaulted - faulted


def _exit_check(unfaulted: dict[str, Any], faulted: dict[str, Any] | None) -> dict[str, Any]:
    measured = {"unfaulted": unfaulted["exit_status"], "faulted": faulted and faulted["exit_status"]}
    if unfaulted["exit_status"] != 0:
        message = f"the unfaulted run exited with status {unfaulted['exit_status']} (no faulted run)"
    elif faulted["exit_status"] != 0:
        message = f"the faulted run exited with status {faulted['exit_status']}"
    else:
        return _check("exit status", True, measured, 0, "both runs exited with status 0")
    return _check("exit status", False, measured, 0, message)


def _faults_check(cert: dict[str, Any]) -> dict[str, Any]:
    injected = len(cert["faults"]["injected"])
    if injected:
        return _check("faults injected", True, injected, 1, f"{_count(injected, 'fault')} injected")
    seconds = cert["runs"]["faulted"]["seconds"]
    message = f"no fault injected: the script ended after {seconds:.1f} s, before the first (give a shorter period)"
    return _check("faults injected", False, 0, 1, message)


def _lost_check(faulted: dict[str, Any]) -> dict[str, Any]:
    fits = faulted["fits"]
    lost = [(i, f["tally"]["lost"], f["tally"]["planned"]) for i, f in enumerate(fits, 1) if f["tally"]["lost"]]
    total = sum(n for _, n, _ in lost)
    if lost:
        where = ", ".join(f"{n} of {planned} in fit {i}" for i, n, planned in lost)
        return _check("lost minibatches", False, total, 0, f"minibatches lost under faults: {where} (limit 0)")
    message = f"no minibatch lost in the faulted run's {_count(len(fits), 'fit')}" if fits else "no fit recorded"
    return _check("lost minibatches", True, 0, 0, message)


def _fits_check(unfaulted: dict[str, Any], faulted: dict[str, Any]) -> dict[str, Any]:
    counts = {"unfaulted": len(unfaulted["fits"]), "faulted": len(faulted["fits"])}
    if counts["unfaulted"] == counts["faulted"]:
        return _check("fits", True, counts, counts["unfaulted"], f"{_count(counts['faulted'], 'fit')} in each run")
    message = f"{_count(counts['faulted'], 'fit')} in the faulted run, {counts['unfaulted']} unfaulted"
    return _check("fits", False, counts, counts["unfaulted"], message)


def _time_check(ratio: float | None, limit: float) -> dict[str, Any]:
    if ratio is None:
        return _check("--max-time-ratio", False, None, limit, "time ratio not measured")
    holds = ratio <= limit
    message = f"time ratio {ratio:.2f} {'<=' if holds else '>'} --max-time-ratio {limit:g}"
    return _check("--max-time-ratio", holds, ratio, limit, message)


def _metric_checks(unfaulted: dict[str, float], faulted: dict[str, float], limit: float) -> list[dict[str, Any]]:
    if not unfaulted:
        message = "no metrics to compare (a script reports them with dlscale.report)"
        return [_check("--max-metric-drop", False, None, limit, message)]
    checks = []
    for name in sorted(unfaulted):
        if name not in faulted:
            checks.append(_check("--max-metric-drop", False, None, limit, f"{name} not reported by the faulted run"))
            continue
        drop = metric_drop(name, unfaulted[name], faulted[name])
        holds = drop <= limit
        message = (
            f"{name} drop {drop:.4g} {'<=' if holds else '>'} --max-metric-drop {limit:g} "
            f"({unfaulted[name]:.4g} unfaulted, {faulted[name]:.4g} faulted)"
        )
        checks.append(_check("--max-metric-drop", holds, {"metric": name, "drop": drop}, limit, message))
    return checks


def verdict(cert: dict[str, Any], max_time_ratio: float | None, max_metric_drop: float | None) -> list[dict[str, Any]]:
    """The bounds checked on a certificate, each with whether it holds, what was measured, its limit
    and a message naming them: both runs exit 0, nothing lost under faults, as many fits in both
    runs, at least one fault injected, and the time ratio and each metric's drop when their bounds
    are given."""
    unfaulted, faulted = cert["runs"]["unfaulted"], cert["runs"]["faulted"]
    checks = [_exit_check(unfaulted, faulted)]
    if faulted is None:
        return checks
    checks += [_faults_check(cert), _lost_check(faulted), _fits_check(unfaulted, faulted)]
    if max_time_ratio is not None:
        checks.append(_time_check(cert["time_ratio"], max_time_ratio))
    if max_metric_drop is not None:
        checks += _metric_checks(unfaulted["metrics"], faulted["metrics"], max_metric_drop)
    return checks


# -- printing ------------------------------------------------------------------------------
WIDTH = 80
SHOWN_FAULTS = 10  # faults listed in the printed certificate; the JSON has them all


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "    ")


def _faults_lines(cert: dict[str, Any]) -> list[str]:
    faults = cert["faults"]
    counts = faults["counts"]
    text = f"faults: {_count(counts['kill'], 'kill')} (one every {faults['kill_every']:g} s)"
    if faults["stop_every"]:
        text += f", {_count(counts['stop'], 'stop')} of {faults['stop_for']:g} s (one every {faults['stop_every']:g} s)"
    if faults["script_connected"] is not None:
        text += f", from {faults['script_connected']:.1f} s, when the script connected"
    lines = _wrap(text)
    for f in faults["injected"][:SHOWN_FAULTS]:
        lines.append(f"  {f['time']:8.1f} s  {f['kind']:4s}  {f['worker']}  pid {f['pid']}")
    if len(faults["injected"]) > SHOWN_FAULTS:
        lines.append(f"  ... {len(faults['injected']) - SHOWN_FAULTS} more")
    return lines


def _runs_lines(cert: dict[str, Any]) -> list[str]:
    lines = [f"{'run':12s}{'exit':>5s}{'seconds':>9s}{'fits':>6s}" + "".join(f"{k:>9s}" for k in TALLY)]
    for name, run in cert["runs"].items():
        if run is None:
            lines.append(f"{name:12s}  not run")
            continue
        tally = {k: sum(f["tally"][k] for f in run["fits"]) for k in TALLY}
        row = f"{name:12s}{run['exit_status']:5d}{run['seconds']:9.1f}{len(run['fits']):6d}"
        lines.append(row + "".join(f"{tally[k]:9d}" for k in TALLY))
        if len(run["fits"]) > 1:
            for i, f in enumerate(run["fits"], 1):
                row = f"{'  fit ' + str(i):12s}{'':5s}{f['seconds'] or 0:9.1f}{'':6s}"
                lines.append(row + "".join(f"{f['tally'][k]:9d}" for k in TALLY))
    faulted = cert["runs"]["faulted"]
    if faulted is not None and faulted["fits"]:
        lost = sorted({w for f in faulted["fits"] for w in f["workers_lost"]})
        lines += _wrap(f"workers lost during the faulted run's fits: {len(lost)}")
    if cert["time_ratio"] is not None:
        text = f"time ratio faulted/unfaulted: {cert['time_ratio']:.2f}"
        if cert["fit_time_ratio"] is not None:
            text += f" (the fits alone: {cert['fit_time_ratio']:.2f})"
        lines.append(text)
    return lines


def _metrics_lines(cert: dict[str, Any]) -> list[str]:
    unfaulted, faulted = cert["runs"]["unfaulted"], cert["runs"]["faulted"] or {"metrics": {}}
    names = list(dict.fromkeys([*unfaulted["metrics"], *faulted["metrics"]]))
    if not names:
        return ["metrics: none reported"]
    lines = [f"{'metric':20s}{'unfaulted':>12s}{'faulted':>12s}{'drop':>12s}"]
    for name in names:
        a, b = unfaulted["metrics"].get(name), faulted["metrics"].get(name)
        drop = metric_drop(name, a, b) if a is not None and b is not None else None
        cells = ["-" if v is None else f"{v:.4g}" for v in (a, b, drop)]
        lines.append(f"{name[:19]:20s}" + "".join(f"{c:>12s}" for c in cells))
    source = unfaulted["metrics_from"] or faulted.get("metrics_from")
    lines.append(f"(metrics from {source})")
    return lines


def render(cert: dict[str, Any]) -> str:
    """The certificate as plain text within :data:`WIDTH` columns, its verdict last."""
    lines = _wrap(f"dlscale certify: {cert['script']} on {cert['workers']} workers")
    lines += _faults_lines(cert) + [""] + _runs_lines(cert) + [""] + _metrics_lines(cert) + [""]
    checks = cert["verdict"]["checks"]
    failed = [c for c in checks if not c["passed"]]
    if failed:
        lines.append(f"verdict: FAILED, {len(failed)} of {len(checks)} bounds do not hold")
    else:
        lines.append(f"verdict: PASSED, all {len(checks)} bounds hold")
    for c in checks:
        lines += _wrap(f"{'ok' if c['passed'] else 'FAILED'}: {c['message']}", "  ")
    return "\n".join(lines)
