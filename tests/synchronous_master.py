"""A third master on the session base, as its tests use it: synchronous data parallelism that averages
every step's gradients (weighted by examples, as one process's step on the merged minibatches), the
scheduler's plugin reducing them: what varies from the two masters, and nothing else."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import Any, ClassVar

import numpy as np
import torch
from distributed import Future, get_worker
from distributed.utils import sync

from dlscale.data.loaders import keep_loaded
from dlscale.training import _worker
from dlscale.training._errors import SessionAbortedError, SessionClosedError
from dlscale.training._messages import OK, refusal, unwrap
from dlscale.training._plugins import SessionSchedulerPlugin, SessionWorkerPlugin, extension
from dlscale.training._session import SessionRun, run_trainer
from dlscale.training.master import TrainingMaster


class _Steps:
    """A session's bookkeeping on the scheduler: step ``k`` trains ``steps[k]``, one item a trainer."""

    def __init__(self, name: str, worker_of: dict[str, str], order: list[int], client: str | None) -> None:
        self.name, self.worker_of, self.client = name, dict(worker_of), client
        self.members = sorted(worker_of)
        self.alive, self.newcomers, self.failed = set(self.members), [], None
        self.steps = [list(order[i : i + len(self.members)]) for i in range(0, len(order), len(self.members))]
        self.pushed: dict[int, list[tuple[np.ndarray, int, float]]] = collections.defaultdict(list)
        self.means: dict[int, bytes] = {}  # the last two steps' (a trainer may still be reading the one before)
        self.settled = 0
        self.done: dict[int, asyncio.Event] = collections.defaultdict(asyncio.Event)  # steps not yet settled
        self.reports: list[tuple[list[int], int, float]] = []

    def training(self) -> bool:
        return self.failed is None and self.settled < len(self.steps)

    def remove_worker(self, worker: str) -> list[str]:
        gone = [t for t in self.alive if self.worker_of[t] == worker]
        if gone:  # a step needs every trainer: the skeleton stops rather than re-plans
            self.fail(gone[0], f"worker {worker} was lost")
        return gone

    def fail(self, who: str, error: str) -> None:
        self.failed = f"{who}: {error}"
        for event in self.done.values():
            event.set()

    def progress(self) -> dict[str, Any]:
        reports, self.reports = self.reports, []
        return {"reports": reports, "abandoned": [], "lost": [], "failed": self.failed}  # no trainer is ever lost

    def push(self, k: int, gradient: bytes, examples: int, loss: float) -> None:
        self.pushed[k].append((np.frombuffer(gradient, np.float32), examples, loss))
        if len(self.pushed[k]) == len(self.members):
            parts = self.pushed.pop(k)
            total = sum(n for _, n, _ in parts)
            self.means[k] = (sum(g * (n / total) for g, n, _ in parts)).astype(np.float32).tobytes()
            self.means.pop(k - 2, None)
            self.reports.append((self.steps[k], total, sum(s * n for _, n, s in parts) / total))
            self.settled += 1
            self.done.pop(k).set()


class SynchronousSchedulerPlugin(SessionSchedulerPlugin[_Steps]):
    name = "dlscale-synchronous"
    prefix = "synchronous"
    approach = "synchronous SGD"
    ops = ("join", "step")
    logger = logging.getLogger("tests.synchronous")

    def open_session(self, session: str, worker_of: dict[str, str], order: list[int], **kwargs: Any) -> None:
        self.sessions[session] = _Steps(session, worker_of, order, kwargs.get("client"))

    def close_session(self, session: str) -> None:
        self.sessions.pop(session, None)

    def join(self, session: str, trainer: str) -> dict[str, Any]:
        """A trainer's item of every step (``None`` where the last step has fewer items than trainers)."""
        return self._reply(
            session,
            lambda s: {"items": [(step + [None] * len(s.members))[s.members.index(trainer)] for step in s.steps]},
        )

    async def step(self, session: str, trainer: str, k: int, gradient: bytes, examples: int, loss: float) -> Any:
        s = self.sessions.get(session)
        if s is None:
            return refusal(SessionClosedError(f"session {session} is not open"))
        if s.failed is None:  # a step needs every trainer's part: each waits for the last
            done = s.done[k]
            s.push(k, gradient, examples, loss)
            await done.wait()
        if s.failed is not None:
            return refusal(SessionAbortedError(s.failed))
        return {"status": OK, "mean": s.means[k]}


class SynchronousWorkerPlugin(SessionWorkerPlugin):
    name, prefix, approach = SynchronousSchedulerPlugin.name, "synchronous", "synchronous SGD"

    def is_open(self, session: str) -> bool:
        return False  # nothing travels on the workers' own connections: the steps go through the scheduler


SYNCHRONOUS = extension(SynchronousSchedulerPlugin, SynchronousWorkerPlugin)


def _trainer(session: str, trainer: str, key: str, blob: Future, refs: list[Any], loader: Any, keep: float) -> Any:
    worker = get_worker()
    plugin = SynchronousWorkerPlugin.on(worker)

    def call(op: str, **kwargs: Any) -> dict[str, Any]:
        handler = getattr(worker.scheduler, f"dlscale_synchronous_{op}")
        return unwrap(sync(worker.loop, handler, session=session, trainer=trainer, **kwargs))

    def allreduce(network: Any, k: int, examples: int, loss: float) -> None:
        """The step's gradients replaced by the mean of every trainer's, before the optimizer steps."""
        gradient = network.gradients().numpy() if examples else np.zeros(network.num_params(), np.float32)
        reply = call("step", k=k, gradient=gradient.tobytes(), examples=examples, loss=loss)
        mean = torch.from_numpy(np.frombuffer(reply["mean"], np.float32).copy())
        params = list(network.module.parameters())
        for p, g in zip(params, mean.split([p.numel() for p in params])):
            p.grad = g.view_as(p)

    def train(joined: dict[str, Any], loaded: Any) -> dict[str, Any]:
        network = _worker.training_replica(key, blob)
        plugin.busy.add(session)
        try:
            for k, item in enumerate(joined["items"]):
                if item is None:  # the last step has fewer minibatches than trainers: this one adds none
                    allreduce(network, k, 0, 0.0)
                    network.optimizer.step()
                    continue
                batch = loaded(refs[item % len(refs)])  # work item e * n + i: minibatch i in epoch e
                hook = network.optimizer.register_step_pre_hook(
                    lambda *_, k=k, batch=batch: allreduce(
                        network, k, batch.num_examples(), float(network.score(batch))
                    )
                )
                try:
                    network.step(batch)
                finally:
                    hook.remove()
            return _worker.state_of(network, with_optimizer=True)
        finally:
            plugin.busy.discard(session)
            _worker.release_replica(network)

    def fail(error: str) -> None:
        sync(worker.loop, worker.scheduler.dlscale_synchronous_fail, session=session, trainer=trainer, error=error)

    return run_trainer(worker, plugin, session, trainer, lambda: call("join"), fail, loader, keep, train, "synchronous")


@dataclasses.dataclass
class SynchronousTrainingMaster(TrainingMaster):
    """Every step, each worker's trainer fits one minibatch and the step's gradients are averaged."""

    approach: ClassVar[str] = "synchronous SGD"

    def _train(self, run: Any, batches: Any, *, partitions: int | None = None, probe: bool = False) -> None:
        _SynchronousRun(self, run, batches).train(probe)


class _SynchronousRun(SessionRun):
    prefix = "synchronous"
    extension = SYNCHRONOUS

    def begin(self, probe: bool, left: Any) -> None:
        if probe:
            self.run.probe()

    def opened(self, order: list[int]) -> dict[str, Any]:
        return {"order": order}

    def submit(self, trainer: str, worker: str, local: int, k: int) -> Future:
        b, run = self.batches, self.run
        blob = run.blob  # sent when first asked for: then its replica's key is known
        args = (self.session, trainer, run.replicas[0], blob, b.refs, b.loader, keep_loaded())
        return self.client.submit(_trainer, *args, workers=[worker], pure=False, key=f"{self.session}-trainer-{k}")

    def progressed(self, progress: dict[str, Any], pending: bool) -> list[Any]:
        for items, examples, score in progress["reports"]:
            self.reported(items, score)
            self.run.step(items[0] // self.n, len(items), examples, score, iterations=1)
        return []

    def conclude(self, futures: dict[str, Future], closed: Any, seconds: float) -> list[int]:
        _worker.apply_state(self.run.network, next(iter(futures.values())).result(), copy=False)
        return []
