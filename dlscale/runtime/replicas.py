"""Keeps replicated storage levels and broadcast variables replicated.

Dask's Active Memory Manager drops every replica beyond the one that waiting tasks need
(``ReduceReplicas``), which would undo ``MEMORY_ONLY_2`` within seconds. This policy takes its
place (:data:`REPLICAS`, installed by :func:`set_replication`): keys of persisted partitions and
broadcasts keep their requested replica count; every other key is treated exactly as
``ReduceReplicas`` treats it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from distributed import Future, wait
from distributed.active_memory_manager import (
    ReduceReplicas,
    Suggestion,
    SuggestionGenerator,
)
from distributed.core import Status

from dlscale.runtime.extensions import Extension, install

if TYPE_CHECKING:
    from distributed import Client
    from distributed.scheduler import Scheduler

EVERY_WORKER = 2**31  # a replica count meaning "on every worker", those that join later included
KEEP = 0  # a replica count meaning "the copies there are": none dropped, none added (while a caller places them)


class PersistedReplicas(ReduceReplicas):
    """``ReduceReplicas`` that honours a desired replica count per persisted key."""

    def __init__(self) -> None:
        super().__init__()
        self.desired: dict[Any, int] = {}
        # keys of ``desired`` that the scheduler did not know yet when their count was set (a KEEP for
        # keys a caller is about to place): their count waits for them instead of going as a released key's
        # (one that never comes is kept until its count is set back to 1)
        self.unseen: set[Any] = set()
        self.kept: dict[Any, int] = {}  # keys whose replicas are not dropped below a count, none added

    def run(self) -> SuggestionGenerator:
        tasks = self.manager.scheduler.tasks
        workers = len(self.manager.scheduler.running)
        for key, n in list(self.desired.items()):
            ts = tasks.get(key)
            if ts is None:
                if key not in self.unseen:  # released: its count goes with it
                    del self.desired[key]
                continue
            self.unseen.discard(key)
            if ts.state != "memory" or n == KEEP:
                continue
            for _ in range(min(n, workers) - len(ts.who_has)):
                yield Suggestion("replicate", ts)
            for _ in range(len(ts.who_has) - n):
                yield Suggestion("drop", ts)
        for key in [k for k in self.kept if k not in tasks]:
            del self.kept[key]
        drops: dict[Any, int] = {}  # how many more replicas of a kept key may go
        for suggestion in super().run():
            key = suggestion.ts.key
            if key in self.kept:
                drops.setdefault(key, len(suggestion.ts.who_has) - self.kept[key])
                drops[key] -= 1
                if drops[key] < 0:
                    continue
            if key not in self.desired:
                yield suggestion


def _key(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def _replace_reduce_replicas(scheduler: Scheduler) -> None:
    """Put :class:`PersistedReplicas` in place of ``ReduceReplicas`` in the scheduler's memory manager."""
    amm = scheduler.extensions.get("amm")
    if amm is None or any(isinstance(p, PersistedReplicas) for p in amm.policies):
        return
    for p in [p for p in amm.policies if type(p) is ReduceReplicas]:
        amm.policies.discard(p)
    amm.add_policy(PersistedReplicas())


REPLICAS = Extension("dlscale-replicas", scheduler_setup=_replace_reduce_replicas)


def _policy(scheduler: Scheduler) -> PersistedReplicas | None:
    """The policy :data:`REPLICAS` installed, if the scheduler has a memory manager."""
    amm = scheduler.extensions.get("amm")
    policies = amm.policies if amm is not None else ()
    return next((p for p in policies if isinstance(p, PersistedReplicas)), None)


def _set_desired(keys: Iterable[Any], n: int, dask_scheduler: Any = None) -> None:
    policy = _policy(dask_scheduler)
    if policy is not None:
        for k in map(_key, keys):
            if n > 1 or n == KEEP:
                policy.desired[k] = n
                if k in dask_scheduler.tasks:
                    policy.unseen.discard(k)
                else:
                    policy.unseen.add(k)
            else:
                policy.desired.pop(k, None)
                policy.unseen.discard(k)


def set_replication(client: Client, futures: list, n: int) -> None:
    """Hold ``n`` replicas of each of ``futures`` (1 returns them to Dask's default; :data:`KEEP` holds the
    copies there are while the caller places more itself, so that the memory manager neither drops them
    nor sends its own copies to workers that are receiving the caller's: with :data:`KEEP`, ``futures``
    may be the keys the caller is about to place).

    With ``n`` > 1, the futures are waited for first. The graph that :meth:`Client.persist` sent goes on
    the client's batched stream, and the scheduler adds its tasks only once it has unpacked the graph in
    a thread, whereas the count is set by a call of its own that can overtake both the graph and the
    release of an earlier future of the same key: set before the tasks exist, the count was taken for a
    released key's and removed at the memory manager's next cycle, which then dropped the copies that
    :meth:`Client.replicate` made. Set once the scheduler holds the results, it is these tasks' count."""
    install(client, REPLICAS)
    if n > 1 and (pending := [f for f in futures if isinstance(f, Future)]):
        wait(pending)
    client.run_on_scheduler(_set_desired, [getattr(f, "key", f) for f in futures], n)
    if n > 1:
        client.replicate(futures, n=None if n == EVERY_WORKER else n)


_STAYING = frozenset({Status.running, Status.paused})


def _keep_newest(generations: list[list[Any]], n: int, dask_scheduler: Any = None) -> int:
    policy = _policy(dask_scheduler)
    if policy is None:  # nothing drops replicas: only the newest generation is worth holding
        return len(generations) - 1
    # a copy on a worker on its way out (closing, being retired) does not count: it will go with its worker
    staying = sum(ws.status in _STAYING for ws in dask_scheduler.workers.values())
    enough = min(n, staying)
    newest = 0
    for i, keys in enumerate(generations):
        found = [dask_scheduler.tasks.get(_key(k)) for k in keys]
        if all(ts is not None and sum(ws.status in _STAYING for ws in ts.who_has or ()) >= enough for ts in found):
            newest = i
    for i, keys in enumerate(generations):
        for k in keys:
            if i < newest:
                policy.kept.pop(_key(k), None)
            else:
                policy.kept[_key(k)] = n
    return newest


def keep_newest_copied(client: Client, generations: list[list[Future]], n: int) -> int:
    """Keep up to ``n`` replicas of the futures of each of ``generations`` (oldest first) where tasks
    have copied them, adding none; returns the index of the newest generation whose futures all have
    ``n`` (0 while none has), and stops keeping those before it. Holding that generation and the
    newer ones, a caller always holds one that a single lost worker cannot take.

    No copies are made on purpose: a copy made by the memory manager while its key is being released
    can crash the receiving worker (distributed 2026.8, ``assert not ts.done`` in the worker's
    ``flight -> released`` transition)."""
    install(client, REPLICAS)
    return client.run_on_scheduler(_keep_newest, [[f.key for f in g] for g in generations], n)
