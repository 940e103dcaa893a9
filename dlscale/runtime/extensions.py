"""The one installer of dlscale's Dask extensions.

Each feature that adds to a cluster (the training panel's scheduler plugin, the DISK_ONLY block
server on the workers, the memory manager's replica policy, gradient sharing's plugins) declares an
:class:`Extension` and calls :func:`install` before it relies on it. The first call through a client
asks the scheduler once what is missing and registers only that; later calls cost nothing, so a
feature installs on every use instead of tracking what each cluster already has.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dlscale import config, registry

if TYPE_CHECKING:
    from distributed import Client
    from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
    from distributed.scheduler import Scheduler


logger = logging.getLogger("dlscale")


@dataclass(frozen=True)
class Extension:
    """What one feature adds to a Dask cluster.

    ``scheduler_plugin`` and ``worker_plugin`` make the feature's plugins; each is registered under
    its own ``name`` attribute, the name the feature looks it up by, so the two names may differ.
    ``scheduler_setup`` runs in the scheduler each time :func:`install` asks it about the extension
    (once per client), so it must be idempotent. ``name`` identifies the extension to :func:`install`.
    """

    name: str
    scheduler_plugin: Callable[[], SchedulerPlugin] | None = None
    worker_plugin: Callable[[], WorkerPlugin] | None = None
    scheduler_setup: Callable[[Scheduler], None] | None = None


@dataclass
class _Installed:
    """The extensions installed through one client on the scheduler it was connected to."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    scheduler: str | None = None
    names: set[str] = field(default_factory=set)


_installed: weakref.WeakKeyDictionary[Client, _Installed] = weakref.WeakKeyDictionary()
_installed_lock = threading.Lock()


def install(client: Client, *extensions: Extension) -> None:
    """Install ``extensions`` on the cluster of ``client`` (a synchronous client).

    One call to the scheduler runs their scheduler setups and reports which of their plugins it
    lacks; only those are registered (a worker plugin also reaches workers that join later). What is
    installed is remembered per client and scheduler, so installing again makes no call at all, and
    threads sharing a client install each extension once.
    """
    with _installed_lock:
        state = _installed.setdefault(client, _Installed())
    with state.lock:
        # the client's copy of the scheduler's identity, renewed when it (re)connects;
        # scheduler_info() would ask the scheduler
        scheduler = client._scheduler_identity.get("id")
        if state.scheduler != scheduler:
            state.scheduler, state.names = scheduler, set()
        todo = [e for e in extensions if e.name not in state.names]
        if not todo:
            return
        plugins: dict[tuple[str, str], SchedulerPlugin | WorkerPlugin] = {}
        for e in todo:
            for kind, make in (("scheduler", e.scheduler_plugin), ("worker", e.worker_plugin)):
                if make is not None:
                    plugin = make()
                    plugins[kind, _name(plugin)] = plugin
        wanted = list(plugins)
        setups = [e.scheduler_setup for e in todo if e.scheduler_setup is not None]
        for i in client.run_on_scheduler(_prepare, wanted, setups):
            client.register_plugin(plugins[wanted[i]], name=wanted[i][1])
        state.names.update(e.name for e in todo)


def install_dashboard_pages(client: Client) -> None:
    """Install the registered dashboard pages (registry kind ``dashboard_page``: dlscale's training
    page, and any a plug-in adds) on the cluster of ``client``, as a context does when it starts, so
    that they are served before the first fit; nothing where ``dlscale.panel`` is off. A scheduler
    that cannot take them (one without dlscale, say) is warned about, not refused: the context works
    without its pages."""
    if not config.get("panel"):
        return
    pages = registry.get("dashboard_page")
    try:
        install(client, *(pages.lookup(name) for name in pages.names()))
    except Exception as e:
        logger.warning(
            "the dashboard of %s has no dlscale pages: %s: %s", client.scheduler.address, type(e).__name__, e
        )


def _name(plugin: SchedulerPlugin | WorkerPlugin) -> str:
    name = getattr(plugin, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"{type(plugin).__name__} needs a name attribute: extensions are installed and found by name")
    return name


def _prepare(
    wanted: list[tuple[str, str]], setups: list[Callable[[Scheduler], None]], dask_scheduler: Scheduler
) -> list[int]:
    """In the scheduler: run ``setups``; the indices in ``wanted`` of the ``(kind, name)`` plugins it lacks."""
    for setup in setups:
        setup(dask_scheduler)
    registered = {"scheduler": dask_scheduler.plugins, "worker": dask_scheduler.worker_plugins}
    return [i for i, (kind, name) in enumerate(wanted) if name not in registered[kind]]
