"""What the scheduler knows of the cluster now, and what the driver tells of it while it waits."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dask.utils import format_bytes
from distributed import wait

if TYPE_CHECKING:
    from distributed import Client, Future

logger = logging.getLogger("dlscale")

PAUSE_CHECK = 5.0
"""Seconds between a waiting driver's looks at the workers Dask has paused (one scheduler call each)."""


def cluster_workers(client: Client) -> dict[str, dict[str, Any]]:
    """The cluster's workers now, by address, with what the scheduler knows of each (``nthreads``…).

    Asked of the scheduler itself: ``Client.scheduler_info(n_workers=-1)`` returns the client's cached
    copy, which the client's periodic update (which asks for no workers) can overwrite while the call
    waits, so that it sometimes reports a cluster without workers."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


class PauseWatch:
    """Tells, while a driver waits on its workers, of the workers Dask has paused.

    A worker whose process memory passes ``distributed.worker.memory.pause`` starts no task until it
    falls again, and Dask's scatter waits for it: a fit then waits on it (its network sent there, a
    trainer to start) for as long
    as the worker holds that memory, and Dask says so only in the worker's own log. The driver warns
    once a pause, naming the worker and its memory, and says when it runs again. :meth:`check` looks at
    most every :data:`PAUSE_CHECK` seconds, so a loop may call it at every turn. ``waiting`` names what
    waits, in the warning."""

    def __init__(self, client: Client, waiting: str = "the fit") -> None:
        self.client, self.waiting = client, waiting
        self.paused: set[str] = set()
        self.due = time.monotonic() + PAUSE_CHECK

    def check(self) -> None:
        """:meth:`look`, if the last look was :data:`PAUSE_CHECK` seconds ago or more."""
        if time.monotonic() >= self.due:
            self.look()

    def look(self) -> None:
        """Warn of workers paused since the last look; tell of those running again (now, a scheduler call)."""
        self.due = time.monotonic() + PAUSE_CHECK
        workers = cluster_workers(self.client)
        paused = {address for address, info in workers.items() if info.get("status") == "paused"}
        for address in sorted(paused - self.paused):
            info = workers[address]
            memory, limit = info.get("metrics", {}).get("memory"), info.get("memory_limit")
            held = "" if memory is None else f": its process holds {format_bytes(memory)}"
            of = f" of its {format_bytes(limit)} memory limit" if memory is not None and limit else ""
            logger.warning(
                "worker %s is paused%s%s, past Dask's pause threshold (distributed.worker.memory.pause): "
                "it starts no task until its memory falls, and %s waits for any of its tasks to run "
                "there. Give the workers more memory, persist less, or restart the worker",
                address,
                held,
                of,
                self.waiting,
            )
        for address in sorted(self.paused - paused):
            logger.info("worker %s runs tasks again", address)
        self.paused = paused

    def result(self, future: Future) -> Any:
        """``future``'s result, looking at paused workers while it is not done (and once more when it
        is, after a pause was told of: the task ran, so its worker may run again)."""
        while not future.done():
            try:
                wait(future, timeout=PAUSE_CHECK)
            except TimeoutError:
                self.check()
        self.ended()
        return future.result()

    def ended(self) -> None:
        """The wait ended: its task ran, so a worker told of as paused may run again; look once more."""
        if self.paused:
            self.look()


@contextlib.contextmanager
def watching_pauses(client: Client, waiting: str) -> Iterator[None]:
    """Tell of paused workers (as :class:`PauseWatch` does) while the block waits on the cluster in a
    call that cannot look itself (``Client.gather``): a thread beside it looks every
    :data:`PAUSE_CHECK` seconds, the first time after that long, so a short block costs a thread's start."""
    done = threading.Event()

    def watch() -> None:
        pauses = PauseWatch(client, waiting)
        with contextlib.suppress(Exception):  # a look that fails (the cluster closing) tells nothing
            while not done.wait(PAUSE_CHECK):
                pauses.look()
            pauses.ended()

    thread = threading.Thread(target=watch, name="dlscale-pause-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(PAUSE_CHECK)
