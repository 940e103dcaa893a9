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

from distributed.active_memory_manager import (
    ReduceReplicas,
    Suggestion,
    SuggestionGenerator,
)

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

    def run(self) -> SuggestionGenerator:
        tasks = self.manager.scheduler.tasks
        workers = len(self.manager.scheduler.running)
        for key, n in list(self.desired.items()):
            ts = tasks.get(key)
            if ts is None:
                del self.desired[key]
                continue
            if ts.state != "memory" or n == KEEP:
                continue
            for _ in range(min(n, workers) - len(ts.who_has)):
                yield Suggestion("replicate", ts)
            for _ in range(len(ts.who_has) - n):
                yield Suggestion("drop", ts)
        for suggestion in super().run():
            if suggestion.ts.key not in self.desired:
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
        for k in keys:
            if n > 1 or n == KEEP:
                policy.desired[_key(k)] = n
            else:
                policy.desired.pop(_key(k), None)


def set_replication(client: Client, futures: list, n: int) -> None:
    """Hold ``n`` replicas of each of ``futures`` (1 returns them to Dask's default; :data:`KEEP` holds the
    copies there are while the caller places more itself, so that the memory manager neither drops them
    nor sends its own copies to workers that are receiving the caller's)."""
    install(client, REPLICAS)
    client.run_on_scheduler(_set_desired, [f.key for f in futures], n)
    if n > 1:
        client.replicate(futures, n=None if n == EVERY_WORKER else n)
