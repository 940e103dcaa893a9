"""The embedded cluster of ``local[N]``: scripts without a main guard run, workers are restarted by
their nannies, and no process outlives the script, whether it ends, crashes or is interrupted."""

from __future__ import annotations

import http.client
import os
import platform
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import dask.config
import psutil
import pytest

from dlscale import SparkConf, SparkContext
from dlscale.runtime import allocator
from tests.conftest import WORKER_IMPORTS

ROOT = Path(__file__).resolve().parent.parent


def _marked(mark: str) -> list[psutil.Process]:
    """The running processes whose environment carries ``mark`` (every descendant of a script inherits it)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("DLSCALE_TEST_MARK") == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _left_behind(mark: str, within: float) -> list[psutil.Process]:
    deadline = time.monotonic() + within
    while (left := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _script_env(storage_root: Path, mark: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DASK_DLSCALE__STORAGE__ROOT": str(storage_root),
        "DLSCALE_TEST_MARK": mark,
    }


def test_readme_example_runs_as_a_script_without_a_main_guard(tmp_path: Path) -> None:
    example = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert "__main__" not in example and 'SparkContext("local[2]")' in example
    (tmp_path / "wordcount.py").write_text(example)
    (tmp_path / "root" / "demo" / "text").mkdir(parents=True)  # beside the file the example writes itself
    (tmp_path / "root" / "demo" / "text" / "part-0.txt").write_text("a b a c\nb a d a\n")
    (tmp_path / "root" / "demo" / "text" / "part-1.txt").write_text("c a b\ne a c b\n")
    mark = uuid.uuid4().hex
    done = subprocess.run(
        [sys.executable, "wordcount.py"],
        cwd=tmp_path,
        env=_script_env(tmp_path / "root", mark),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    # with the example's own text ("to be or not to be ..."): a 6, b 4, c 3, be 2, to 2
    assert done.stdout == "[('a', 6), ('b', 4), ('c', 3), ('to', 2), ('be', 2)]\n"
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    assert _left_behind(mark, within=5) == []


SLEEPER = """
import sys, time
from dlscale import SparkConf, SparkContext

with SparkContext("local[2]") as sc:
    print(sc.parallelize(range(4), 2).map(lambda x: x * x).sum(), flush=True)
    sc.parallelize(range(2), 2).foreach(lambda _: time.sleep(600))
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["crash", "ctrl-c"])
def test_no_process_outlives_an_interrupted_script(tmp_path: Path, sig: signal.Signals) -> None:
    """A crashed script (``SIGKILL``: no cleanup at all) and a Ctrl-C (``SIGINT`` to the terminal's
    process group) leave no nanny or worker running; a Ctrl-C ends the script with its own traceback."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "sleeper.py"],
        cwd=tmp_path,
        env=_script_env(tmp_path, mark),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives a foreground job
    )
    try:
        assert proc.stdout.readline() == "14\n"
        assert len(_marked(mark)) >= 5  # the script, 2 nanny processes and their 2 workers
        time.sleep(1)  # the workers are in their tasks
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert _left_behind(mark, within=30) == []
    if sig == signal.SIGINT:
        assert err.rstrip().endswith("KeyboardInterrupt") and "sleeper.py" in err, err


def _worker_pids(ctx: SparkContext) -> list[int]:
    try:
        return list(ctx.client.run(os.getpid).values())
    except OSError:  # a worker left between the scheduler's answer and the call
        return []


def _nanny_status(dask_worker: Any) -> str:
    return dask_worker.status.name


def test_a_killed_worker_is_restarted_by_its_nanny() -> None:
    with dask.config.set({"dlscale.worker.imports": WORKER_IMPORTS}), SparkContext("local[1]") as ctx:
        # a worker registers before its nanny has finished starting, and a worker that dies before
        # then fails its nanny's start (Dask's behaviour): kill it once the nanny runs
        deadline = time.monotonic() + 30
        while set(ctx.client.run(_nanny_status, nanny=True).values()) != {"running"}:
            assert time.monotonic() < deadline, "the nanny did not finish starting"
            time.sleep(0.05)
        (before,) = _worker_pids(ctx)
        os.kill(before, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (pids := _worker_pids(ctx)) in ([], [before]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(pids) == 1 and pids != [before]
        assert list(ctx.client.run(_imported).values()) == [True]  # its successor too, before any task
        assert ctx.parallelize(range(10), 2).sum() == 45


def _restarted(ctx: SparkContext, before: int, seconds: float) -> int:
    """The pid of the worker that replaced the one of pid ``before``, once its nanny runs again."""
    deadline = time.monotonic() + seconds
    while (pids := _worker_pids(ctx)) in ([], [before]) or set(ctx.client.run(_nanny_status, nanny=True).values()) != {
        "running"
    }:
        assert time.monotonic() < deadline, f"no worker back within {seconds} s"
        time.sleep(0.05)
    (pid,) = pids
    return pid


@pytest.mark.slow
def test_a_worker_killed_again_keeps_its_nanny_when_the_first_loss_timeout_ends() -> None:
    """Dask closes a lost worker's nanny when no worker of its name is back
    ``distributed.deploy.lost-worker-timeout`` after the loss. Killed, replaced, and killed again just
    before that timeout ends, the worker is being replaced when the first loss's time is up: its
    nanny goes on and the replacement joins (Dask's own timer would close the nanny, for good)."""
    timeout = 8.0
    settings = {"dlscale.worker.imports": WORKER_IMPORTS, "distributed.deploy.lost-worker-timeout": f"{timeout}s"}
    with dask.config.set(settings), SparkContext("local[1]") as ctx:
        first = _restarted(ctx, -1, 30)
        lost = time.monotonic()
        os.kill(first, signal.SIGKILL)
        second = _restarted(ctx, first, timeout - 1)
        time.sleep(max(0.0, lost + timeout - 0.3 - time.monotonic()))  # a fresh worker takes longer to join
        os.kill(second, signal.SIGKILL)
        third = _restarted(ctx, second, 60)
        time.sleep(max(0.0, lost + timeout + 0.5 - time.monotonic()))
        assert len(ctx.client.cluster.workers) == 1 and _worker_pids(ctx) == [third]
        assert ctx.parallelize(range(10), 2).sum() == 45


def _imported() -> bool:
    return {"torch._dynamo", "dlscale.training._worker"} <= set(sys.modules)


def _parent() -> str:
    return " ".join(psutil.Process(os.getppid()).cmdline())


def test_a_killed_worker_is_forked_again_from_a_server_that_imported_torch() -> None:
    """A worker process is a fork of its nanny's fork server, which imported what a worker imports: a
    killed one is back within a fraction of a second (0.16-0.23 s measured), where a spawned one
    imports torch afresh (4-7 s here on a quiet machine, 6-13 s on a busy one). With
    ``dlscale.worker.forkserver: false`` the nanny spawns it."""
    with dask.config.set({"dlscale.worker.imports": WORKER_IMPORTS}), SparkContext("local[1]") as ctx:
        first = _restarted(ctx, -1, 30)
        assert "multiprocessing.forkserver" in next(iter(ctx.client.run(_parent).values()))
        os.kill(first, signal.SIGKILL)
        _restarted(ctx, first, 3)
        assert list(ctx.client.run(_imported).values()) == [True]
    with dask.config.set({"dlscale.worker.forkserver": False, "dlscale.worker.imports": []}), SparkContext() as ctx:
        assert all("multiprocessing.forkserver" not in parent for parent in ctx.client.run(_parent).values())


def test_workers_import_what_training_needs_as_they_start_unless_told_not_to() -> None:
    """The first fit of a context does not wait for torch (and torch._dynamo, which its optimizers import
    on first use): the workers imported them before joining; ``dlscale.worker.imports: []`` leaves them out."""
    with dask.config.set({"dlscale.worker.imports": WORKER_IMPORTS}), SparkContext("local[1]") as ctx:
        assert list(ctx.client.run(_imported).values()) == [True]
    with dask.config.set({"dlscale.worker.imports": []}), SparkContext("local[1]") as ctx:
        assert list(ctx.client.run(lambda: "torch" in sys.modules).values()) == [False]


def _faults_of_a_reused_buffer(_: Any) -> int:
    """Page faults of this thread while it allocates, fills and frees 8 MiB with C's malloc a second time:
    none where the first one's memory stayed with the process, 2,048 where it went back to the system."""
    import ctypes
    import resource

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    faults = []
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        buffer = libc.malloc(8 * 2**20)
        ctypes.memset(buffer, 1, 8 * 2**20)
        libc.free(buffer)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    return faults[1]


def _huge_pages_always() -> bool:
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator settings")
def test_workers_keep_freed_tensor_memory_for_the_next_step_unless_told_not_to() -> None:
    """Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_=65536``: memory a task frees goes back to the system
    and the next step's tensors fault it in again, page by page. The workers' preload sets glibc's
    thresholds from ``dlscale.worker.malloc-*``; ``null`` leaves Dask's setting."""
    with SparkContext("local[1]") as ctx:
        assert ctx.parallelize([0], 1).map(_faults_of_a_reused_buffer).collect()[0] < 256
    if _huge_pages_always():  # 2 MiB pages: a handful of faults either way
        return
    unset = {f"dlscale.worker.malloc-{name}": None for name in allocator.PARAMETERS}
    with dask.config.set(unset), SparkContext("local[1]") as ctx:
        assert ctx.parallelize([0], 1).map(_faults_of_a_reused_buffer).collect()[0] >= 1024


def _keep_freed_memory(_: Any) -> tuple[int, float]:
    """Allocate, touch and free 8 MiB blocks with C's malloc until this worker's process is 128 MiB above
    the lowest of its memory thresholds, each followed by a small block left allocated, as a task's small
    objects are (so that freeing the large ones gives nothing back by itself); returns the process's
    memory when it stopped and that threshold."""
    import ctypes

    from distributed import get_worker

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    manager = get_worker().memory_manager
    threshold = manager.memory_limit * min(manager.memory_target_fraction, manager.memory_spill_fraction)
    process = psutil.Process()
    blocks = []
    while process.memory_info().rss < threshold + 128 * 2**20:
        blocks.append(libc.malloc(8 * 2**20))
        ctypes.memset(blocks[-1], 1, 8 * 2**20)
        libc.malloc(4096)
    peak = process.memory_info().rss
    for block in blocks:
        libc.free(block)
    return peak, threshold


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator settings")
def test_a_worker_gives_back_what_its_allocator_keeps_when_its_memory_is_high() -> None:
    """Freed memory the allocator keeps for training is invisible to Dask's memory manager (nothing to
    spill): above Dask's target the worker gives it back within a memory-monitor interval or so, and
    once its memory is low again the settings for training are back."""
    conf = SparkConf().setMaster("local[1]").set("spark.executor.memory", str(1536 * 2**20))
    with SparkContext(conf=conf) as ctx:
        peak, threshold = ctx.parallelize([0], 1).map(_keep_freed_memory).collect()[0]
        assert peak > threshold
        deadline = time.monotonic() + 5
        while (rss := next(iter(ctx.client.run(lambda: psutil.Process().memory_info().rss).values()))) > threshold:
            assert time.monotonic() < deadline, f"the worker kept {rss / 2**20:.0f} MiB, above {threshold / 2**20:.0f}"
            time.sleep(0.1)
        if not _huge_pages_always():  # 2 MiB pages: a handful of faults either way
            assert ctx.parallelize([0], 1).map(_faults_of_a_reused_buffer).collect()[0] < 256
        logs = [msg for _, msg in next(iter(ctx.client.get_worker_logs().values()))]
        assert not [msg for msg in logs if "Unmanaged memory" in msg or "Pausing" in msg]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator settings")
def test_an_mmap_threshold_glibc_refuses_is_named(monkeypatch) -> None:
    monkeypatch.setattr(allocator, "_done", False)
    with dask.config.set({"dlscale.worker.malloc-mmap-threshold": "64MiB"}):
        with pytest.raises(ValueError, match="dlscale.worker.malloc-mmap-threshold is 67108864 bytes"):
            allocator.tune()


def test_a_module_on_the_driver_path_imports_on_the_workers(tmp_path: Path, monkeypatch) -> None:
    """As a module next to the script: functions of an importable module are sent by reference."""
    (tmp_path / "next_to_the_script.py").write_text("def triple(x):\n    return 3 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import next_to_the_script

    with SparkContext("local[1]") as ctx:
        assert ctx.parallelize([1, 2], 2).map(next_to_the_script.triple).collect() == [3, 6]


def test_data_goes_straight_between_driver_and_workers_unless_dask_says_otherwise() -> None:
    """Scattered and gathered data of an embedded cluster skip the scheduler (which carries each
    transfer twice); Dask's own setting, where set, decides."""
    with SparkContext("local[1]", "direct") as sc:
        assert sc.client.direct_to_workers is True
    with dask.config.set({"distributed.client.direct-to-workers": False}), SparkContext("local[1]", "via") as sc:
        assert sc.client.direct_to_workers is False


def test_stopping_closes_the_dashboards_open_connections() -> None:
    """A browser keeps its connections to the dashboard open between requests; once the context stops,
    they are closed, so that a request to the next context's dashboard on the same port opens a new
    one instead of waiting on a connection that nothing answers any more."""
    with SparkContext("local[1]") as ctx:
        address = urllib.parse.urlsplit(ctx.uiWebUrl)
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
        connection.request("GET", address.path)
        response = connection.getresponse()
        assert response.status == 200 and not response.will_close
        response.read()
    assert connection.sock.recv(1) == b""  # closed by the server, not a timeout
    connection.close()


def _ticks(sc: SparkContext) -> set[float]:
    """The tick interval (ms) of every process of ``sc``'s cluster: scheduler, nannies and workers."""

    def tick(dask_worker: Any = None, dask_scheduler: Any = None) -> float:
        server = dask_worker if dask_worker is not None else dask_scheduler
        return server.periodic_callbacks["tick"].callback_time

    return {
        sc.client.run_on_scheduler(tick),
        *sc.client.run(tick).values(),
        *sc.client.run(tick, nanny=True).values(),
    }


def test_an_embedded_cluster_s_processes_tick_at_dlscale_s_interval() -> None:
    """Every process of the embedded cluster wakes its event loop to time it every
    dlscale.local.tick-interval (500 ms), not Dask's 20 ms (fifty wake-ups a second in each process,
    which slowed a fit by 8%: benchmarks.ticks); null leaves Dask's setting, and this process's own
    configuration is as it was; a value that is no duration is refused before any process starts."""
    dask_s = dask.config.get("distributed.admin.tick.interval")
    with SparkContext("local[2]", "ticks") as sc:
        assert _ticks(sc) == {500.0}
        assert dask.config.get("distributed.admin.tick.interval") == dask_s
    with dask.config.set({"dlscale.local.tick-interval": None}), SparkContext("local[1]", "dask-ticks") as sc:
        assert _ticks(sc) == {1000 * dask.utils.parse_timedelta(dask_s)}
    for bad in ("often", 0):
        with dask.config.set({"dlscale.local.tick-interval": bad}), pytest.raises(ValueError, match="tick-interval"):
            SparkContext("local[1]", "bad-ticks")
