"""The one installer of dlscale's Dask extensions, on its own 2-process LocalCluster: the tests add a
worker and replace the memory manager's policies, which the session's cluster must not see."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import distributed
import pytest
from distributed.active_memory_manager import ReduceReplicas
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

from dlscale.facade.persist import BLOCKS, BlockServer
from dlscale.monitor import panel
from dlscale.runtime.extensions import Extension, install
from dlscale.runtime.replicas import REPLICAS, PersistedReplicas
from dlscale.training.sharing._extension import SHARING
from dlscale.training.sharing._scheduler_plugin import SharingSchedulerPlugin
from dlscale.training.sharing._worker_plugin import SharingWorkerPlugin

STARTS: Counter[str] = Counter()  # scheduler plugin starts by name, in the scheduler's process


class Counting(SchedulerPlugin):
    """Counts its starts; not idempotent, so registering it again would start it again."""

    def __init__(self, name: str) -> None:
        self.name = name

    def start(self, scheduler: Any) -> None:
        STARTS[self.name] += 1


class Marking(WorkerPlugin):
    def __init__(self, name: str) -> None:
        self.name = name


class Nameless(WorkerPlugin):
    pass


def extension(name: str) -> Extension:
    return Extension(name, scheduler_plugin=partial(Counting, name), worker_plugin=partial(Marking, name + "-w"))


def starts(name: str) -> int:
    return STARTS[name]


def registered(dask_scheduler: Any) -> tuple[set[str], set[str]]:
    return set(dask_scheduler.plugins), set(dask_scheduler.worker_plugins)


def worker_plugins(dask_worker: Any) -> set[str]:
    return set(dask_worker.plugins)


def worker_handlers(dask_worker: Any) -> set[str]:
    return set(dask_worker.handlers)


def policies(dask_scheduler: Any) -> list[str]:
    return sorted(type(p).__name__ for p in dask_scheduler.extensions["amm"].policies)


@pytest.fixture(scope="module")
def cluster() -> Iterator[distributed.LocalCluster]:
    with distributed.LocalCluster(
        processes=True, n_workers=2, threads_per_worker=1, dashboard_address=None
    ) as local_cluster:
        yield local_cluster


@pytest.fixture
def client(cluster: distributed.LocalCluster) -> Iterator[distributed.Client]:
    """A fresh client, so that nothing installed through another one is remembered."""
    with distributed.Client(cluster, set_as_default=False) as c:
        yield c


def count_calls(monkeypatch: pytest.MonkeyPatch, client: distributed.Client, method: str, delay: float = 0) -> list:
    """Record each call of ``client.<method>``, delayed by ``delay`` seconds, and pass it on."""
    calls: list = []
    original: Callable = getattr(client, method)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        time.sleep(delay)
        return original(*args, **kwargs)

    monkeypatch.setattr(client, method, counted)
    return calls


def refuse(monkeypatch: pytest.MonkeyPatch, client: distributed.Client) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("install called the scheduler")

    for method in ("run_on_scheduler", "register_plugin", "scheduler_info"):
        monkeypatch.setattr(client, method, fail)


def test_install_registers_once_and_then_asks_nothing(client: distributed.Client, monkeypatch) -> None:
    asked = count_calls(monkeypatch, client, "run_on_scheduler")
    registrations = count_calls(monkeypatch, client, "register_plugin")
    install(client, extension("once"))
    assert (len(asked), len(registrations)) == (1, 2)
    assert client.run_on_scheduler(starts, "once") == 1
    on_scheduler, on_workers = client.run_on_scheduler(registered)
    assert "once" in on_scheduler and "once-w" in on_workers
    assert all("once-w" in names for names in client.run(worker_plugins).values())

    refuse(monkeypatch, client)
    install(client, extension("once"))
    monkeypatch.undo()
    assert client.run_on_scheduler(starts, "once") == 1


def test_another_client_asks_once_and_registers_nothing(cluster, client: distributed.Client, monkeypatch) -> None:
    install(client, extension("shared"))
    with distributed.Client(cluster, set_as_default=False) as other:
        asked = count_calls(monkeypatch, other, "run_on_scheduler")
        registrations = count_calls(monkeypatch, other, "register_plugin")
        install(other, extension("shared"))
        install(other, extension("shared"))
        assert (len(asked), len(registrations)) == (1, 0)
    assert client.run_on_scheduler(starts, "shared") == 1


def test_only_extensions_not_yet_installed_are_asked_about(client: distributed.Client, monkeypatch) -> None:
    install(client, extension("first"))
    asked = count_calls(monkeypatch, client, "run_on_scheduler")
    install(client, extension("first"), extension("second"))
    install(client, extension("second"))
    (_prepare, wanted, _setups), *more = asked
    assert not more and sorted(wanted) == [("scheduler", "second"), ("worker", "second-w")]


def test_threads_sharing_a_client_install_once(client: distributed.Client, monkeypatch) -> None:
    asked = count_calls(monkeypatch, client, "run_on_scheduler", delay=0.2)
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def run() -> None:
        barrier.wait()
        try:
            install(client, extension("threads"))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(asked) == 1
    assert client.run_on_scheduler(starts, "threads") == 1


def test_a_new_scheduler_is_asked_again(client: distributed.Client, monkeypatch) -> None:
    install(client, extension("moved"))
    asked = count_calls(monkeypatch, client, "run_on_scheduler")
    registrations = count_calls(monkeypatch, client, "register_plugin")
    monkeypatch.setitem(client._scheduler_identity, "id", "another-scheduler")
    install(client, extension("moved"))
    assert (len(asked), len(registrations)) == (1, 0)


def test_worker_joining_later_gets_the_worker_plugin(cluster, client: distributed.Client) -> None:
    install(client, extension("later"))
    cluster.scale(3)
    try:
        client.wait_for_workers(3, timeout=60)
        found = client.run(worker_plugins)
        assert len(found) == 3 and all("later-w" in names for names in found.values())
    finally:
        cluster.scale(2)


def test_scheduler_and_worker_plugins_keep_their_own_names(client: distributed.Client) -> None:
    install(client, Extension("two-names", partial(Counting, "on-scheduler"), partial(Marking, "on-workers")))
    on_scheduler, on_workers = client.run_on_scheduler(registered)
    assert "on-scheduler" in on_scheduler and "on-scheduler" not in on_workers
    assert "on-workers" in on_workers and "on-workers" not in on_scheduler


def test_a_plugin_without_a_name_is_refused_and_not_remembered(client: distributed.Client) -> None:
    nameless = Extension("nameless", worker_plugin=Nameless)
    with pytest.raises(TypeError, match="Nameless needs a name"):
        install(client, nameless)
    with pytest.raises(TypeError, match="Nameless needs a name"):
        install(client, nameless)


def test_replicas_setup_replaces_reduce_replicas_once(cluster, client: distributed.Client) -> None:
    assert client.run_on_scheduler(policies) == [ReduceReplicas.__name__]
    install(client, REPLICAS)
    assert client.run_on_scheduler(policies) == [PersistedReplicas.__name__]
    with distributed.Client(cluster, set_as_default=False) as other:
        install(other, REPLICAS)
    assert client.run_on_scheduler(policies) == [PersistedReplicas.__name__]


def test_features_install_under_the_names_they_look_up(client: distributed.Client, monkeypatch) -> None:
    asked = count_calls(monkeypatch, client, "run_on_scheduler")
    install(client, panel.PANEL, BLOCKS, SHARING)
    assert len(asked) == 1
    on_scheduler, on_workers = client.run_on_scheduler(registered)
    assert {panel.NAME, SharingSchedulerPlugin.name} <= on_scheduler
    assert {BlockServer.name, SharingWorkerPlugin.name} <= on_workers
    assert client.run_on_scheduler(lambda dask_scheduler: panel.in_scheduler(dask_scheduler) is not None)
    for handlers in client.run(worker_handlers).values():
        assert {"dlscale_read_block", "dlscale_update"} <= handlers
