"""One parameter-averaging trainer: a long-lived task that fits its share of each round and then averages
its state with the other trainers', peer to peer, until the session's rounds are done.

A round: the trainer asks the scheduler for its share (with the commit of the round before: one call a
round), fits it, reading ahead (``prefetch``), and takes part in the round's allreduce
(``_exchange``) with the members the scheduler names. When the allreduce has every part, the trainer
commits the round on the scheduler and takes the average: the parameters move by the averaged change,
or as the outer optimizer (DiLoCo) moves them given it; the buffers and the optimizer's state take the
averaged values. A trainer alone fits as one process does, its state untouched. While parts are
missing the trainer asks the scheduler every ``poll`` seconds how the round stands: a member lost
means a new attempt without it; a round committed with another attempt (or a part lost in flight)
means taking the average from a trainer that holds it. A trainer whose worker retires leaves between
rounds. At the end each trainer returns its state (every trainer holds the same), the driver takes
one.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from distributed import get_client, get_worker, secede
from distributed.utils import sync

from dlscale.data.loaders import prefetch
from dlscale.runtime.retirement import LEAVING
from dlscale.runtime.tasks import match_threads
from dlscale.training._heap import training_heap
from dlscale.training._worker import check_finite, release_replica, state_of, training_replica
from dlscale.training.averaging._exchange import DTYPES, Contribution, Exchange, FlatState
from dlscale.training.averaging._worker_plugin import plugin
from dlscale.training.sharing._exceptions import SessionAbortedError, SessionClosedError, SessionStoppedError
from dlscale.training.sharing._messages import unwrap
from dlscale.training.sharing._trainer import HeldMinibatch

logger = logging.getLogger("dlscale.training.averaging")


@dataclass(frozen=True)
class TrainerSpec:
    """What every trainer of a session is told."""

    save_updater: bool
    prefetch: int
    outer_optimizer: Callable[..., torch.optim.Optimizer] | None
    dtype: str
    poll: float  # seconds between a waiting trainer's calls to the scheduler
    timeout: float  # seconds a trainer waits for a round's average to be taken from a peer
    keep: bool  # whether a trainer that ends with the session's state parks its replica for the next fit
    warm: str | None = None  # the session whose parked replicas this one's trainers go on with


class _Control:
    """Calls to the scheduler's ``dlscale_averaging_*`` handlers from the trainer's thread."""

    def __init__(self, worker: Any, session: str, trainer: str) -> None:
        self.worker, self.session, self.trainer = worker, session, trainer

    def __call__(self, op: str, **kwargs: Any) -> dict[str, Any]:
        method = getattr(self.worker.scheduler, f"dlscale_averaging_{op}")
        return unwrap(sync(self.worker.loop, method, session=self.session, trainer=self.trainer, **kwargs))


def run(
    session: str,
    trainer: str,
    key: str,
    blob: Any,
    refs: list[Any],
    names: list[str],
    loader: Callable[[Any], Any],
    spec: TrainerSpec,
) -> dict[str, Any]:
    """The task of one trainer; returns its state and statistics, or ``{"lost": True}`` for a trainer
    whose worker was lost (the task then runs again elsewhere and stops at once), ``{"aborted": True}``
    for one stopped by another's failure, ``{"retired": True}`` for one that left as its worker retired."""
    worker = get_worker()
    control = _Control(worker, session, trainer)
    try:
        control("join")
    except SessionStoppedError as e:
        return _stopped(trainer, e)
    if isinstance(loader, HeldMinibatch):
        loader = loader.bind(get_client())
    secede()  # a trainer runs for the whole fit: it does not hold one of the worker's task slots
    try:
        with training_heap():
            return _Trainer(worker, control, key, blob, refs, names, loader, spec).train()
    except SessionStoppedError as e:
        return _stopped(trainer, e)
    except BaseException as e:
        with contextlib.suppress(Exception):  # the original error matters, not this one
            control("fail", error=f"{type(e).__name__}: {e}")
        e.add_note(f"in parameter-averaging trainer {trainer} on worker {worker.address}")
        raise


def _stopped(trainer: str, error: SessionStoppedError) -> dict[str, Any]:
    aborted = isinstance(error, SessionAbortedError)
    return {"trainer": trainer, "lost": not aborted and not isinstance(error, SessionClosedError), "aborted": aborted}


class _Trainer:
    def __init__(
        self,
        worker: Any,
        control: _Control,
        key: str,
        blob: Any,
        refs: list[Any],
        names: list[str],
        loader: Callable[[Any], Any],
        spec: TrainerSpec,
    ) -> None:
        self.worker, self.control, self.spec = worker, control, spec
        self.name, self.session = control.trainer, control.session
        self.plugin = plugin(worker)
        self.mailbox = self.plugin.mailboxes[self.session]  # opened by the driver before any trainer started
        if spec.warm is None:
            self.network = training_replica(key, blob)
        else:  # the last fit's replica goes on
            self.network = self.plugin.unpark(spec.warm)
            if self.network is None:
                raise RuntimeError(
                    f"the replica of the last fit, to go on here, is no longer on worker {worker.address} "
                    "(the worker was restarted): fit again to send the network anew"
                )
        self.refs, self.names, self.loader = refs, names, loader
        self.dtype = DTYPES[spec.dtype]

    def _send(self, peer: str, key: tuple[int, int, int], header: dict[str, Any], payload: Any) -> None:
        self.plugin.send(self.session, peer, key, header, payload)

    def train(self) -> dict[str, Any]:
        self.plugin.busy.add(self.session)
        try:
            return self._train()
        finally:
            self.plugin.busy.discard(self.session)
            release_replica(self.network)

    def _train(self) -> dict[str, Any]:
        match_threads()
        net, spec = self.network, self.spec
        flat = FlatState(net, spec.save_updater)
        outer = _Outer(spec.outer_optimizer, flat) if spec.outer_optimizer is not None else None
        reply, k = self.control("begin", round=0), 0
        staying, last_exchange = False, float("nan")
        while not reply["end"]:
            if not staying and self.worker.status in LEAVING:
                outcome = self._leave(k)
                if outcome == "left":
                    return {"trainer": self.name, "retired": True}
                staying = outcome == "stay"
            if not spec.save_updater:
                net.optimizer.state.clear()  # DL4J without save_updater: the updater starts afresh each round
            flat.begin()
            report = self._fit(k, reply["items"])
            fitted = time.perf_counter()
            report["last_exchange_seconds"] = last_exchange  # the averaging that ended its previous round
            reply = self._average(k, flat, outer, report, reply)
            last_exchange = time.perf_counter() - fitted
            self.mailbox.forget(k)
            k += 1
        state = state_of(net, with_optimizer=spec.save_updater)
        # the replica goes on in the next fit, if the driver's network is then this state
        self.plugin.park(self.session, net if spec.keep else None)
        return {**state, "trainer": self.name}

    def _leave(self, k: int) -> str:
        """Leave the session before round ``k`` as this trainer's worker retires: ``"left"``; ``"stay"``
        for the last live trainer (for good), ``"later"`` while a peer may still need round ``k - 1``'s
        average from it."""
        outcome = self.control("leave", round=k)["outcome"]
        if outcome == "left":
            logger.info(
                "trainer %s left its session: worker %s is %s", self.name, self.worker.address, self.worker.status
            )
        elif outcome == "stay":
            logger.warning(
                "trainer %s stays while worker %s retires: no other trainer would train the rest",
                self.name,
                self.worker.address,
            )
        return outcome

    def _fit(self, k: int, items: list[int]) -> dict[str, Any]:
        """Fit round ``k``'s share ``items``, reading ahead; returns what this trainer reports of it."""
        net, n = self.network, len(self.refs)
        start, t0 = time.time(), time.perf_counter()
        examples, score, waited = 0, float("nan"), 0.0
        losses = []  # where the network computes, unread until the round's steps are queued
        batches = prefetch([self.refs[i % n] for i in items], self.loader, self.spec.prefetch)
        try:
            for item in items:
                w = time.perf_counter()
                batch = next(batches)
                waited += time.perf_counter() - w
                try:
                    losses.append(net.step(batch))
                except Exception as e:
                    e.add_note(f"while fitting minibatch {self.names[item % n]}")
                    raise
                examples += batch.num_examples()
            if items:  # the round's losses in one read; a non-finite one names its minibatch
                scores = torch.stack(losses).tolist()
                for item, value in zip(items, scores, strict=True):
                    if not math.isfinite(value):
                        check_finite(net, value, self.names[item % n])  # raises
                score = scores[-1]
                # a step that left a parameter non-finite with a finite loss: seen once a round
                check_finite(net, score, " or ".join(self.names[i % n] for i in items))
        except Exception as e:
            e.add_note(f"while training round {k} of the session (epoch {items[0] // n if items else '?'} of the fit)")
            raise
        finally:
            batches.close()
        return {
            "trainer": self.name,
            "worker": self.worker.address,
            "items": list(items),
            "examples": examples,
            "score": score,
            "fit_seconds": time.perf_counter() - t0,
            "wait_seconds": waited,
            "start": start,
            "end": time.time(),
        }

    def _average(
        self, k: int, flat: FlatState, outer: _Outer | None, report: dict[str, Any], status: dict[str, Any]
    ) -> dict[str, Any]:
        """Round ``k``'s averaging, among the members that ``status`` (the scheduler's reply as the round
        began) names unless that changed since; returns the scheduler's reply to its commit (the next
        round's share)."""
        exchange: Exchange | None = None
        contribution: Contribution | None = None
        while True:
            committed = status["committed"]
            if committed is not None:  # a peer committed: this trainer's own attempt may be about to end too
                if exchange is not None and exchange.attempt == committed and exchange.run(self.spec.poll):
                    return self._commit(k, committed, exchange.reports, flat, outer, exchange.result)
                return self._adopt(k, committed, status["holders"], flat, outer)
            members = list(status["members"])  # a tuple after Dask's comms
            if members == [self.name]:  # alone: its state is the round's
                return self._commit(k, status["attempt"], [report], flat, outer, None)
            if exchange is None or exchange.attempt != status["attempt"]:
                if contribution is None:
                    vector, layout, kept = flat.vector()
                    contribution = Contribution(vector, layout, kept, report["examples"], report, flat.average_buffer)
                exchange = Exchange(
                    self.name, k, status["attempt"], members, contribution, self.mailbox, self._send, self.dtype
                )
            if exchange.run(self.spec.poll):
                return self._commit(k, exchange.attempt, exchange.reports, flat, outer, exchange.result)
            status = self.control("sync", round=k)

    def _commit(
        self,
        k: int,
        attempt: int,
        reports: list[dict[str, Any]],
        flat: FlatState,
        outer: _Outer | None,
        result: tuple[torch.Tensor, list[list[Any]], dict[str, Any]] | None,
    ) -> dict[str, Any]:
        reply = self.control("commit", round=k, attempt=attempt, report=reports)
        if "adopt" in reply:  # the round took another attempt's average
            status = self.control("sync", round=k)
            return self._adopt(k, status["committed"], status["holders"], flat, outer)
        if result is not None:
            average, layout, kept = result
            flat.apply(average, layout, kept, None if outer is None else outer.step)
            self.plugin.keep(self.session, k, attempt, {"layout": layout, "kept": kept}, average.cpu().numpy())
        return reply

    def _adopt(self, k: int, attempt: int, holders: list[str], flat: FlatState, outer: _Outer | None) -> dict[str, Any]:
        """Take round ``k``'s average (of ``attempt``) from one of ``holders``, and commit it."""
        deadline = time.monotonic() + self.spec.timeout
        while True:
            for holder in holders:
                with contextlib.suppress(Exception):
                    got = sync(
                        self.worker.loop,
                        self.worker.rpc(holder).dlscale_averaging_result,
                        session=self.session,
                        round=k,
                        callback_timeout=self.spec.timeout,
                    )
                    if got is not None and got["attempt"] == attempt:
                        average = torch.from_numpy(np.asarray(got["payload"]).copy()).to(flat.params.device)
                        header = got["header"]
                        reply = self.control("commit", round=k, attempt=attempt, report=[])
                        flat.apply(average, header["layout"], header["kept"], None if outer is None else outer.step)
                        self.plugin.keep(self.session, k, attempt, header, average.cpu().numpy())
                        logger.info("trainer %s took round %d's average from %s", self.name, k, holder)
                        return reply
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"trainer {self.name} could not take round {k}'s average from any of {holders} "
                    f"within {self.spec.timeout:g} s (dlscale.sharing.end-timeout)"
                )
            time.sleep(self.spec.poll)
            status = self.control("sync", round=k)
            attempt, holders = status["committed"], status["holders"]


class _Outer:
    """DiLoCo's outer step: the optimizer made by ``factory`` over the parameters at the round's start,
    stepped with the averaged change, negated, as their gradient (a pseudo-gradient)."""

    def __init__(self, factory: Callable[..., torch.optim.Optimizer], flat: FlatState) -> None:
        self.flat = flat
        self.optimizer = factory([flat.anchor])

    def step(self, change: torch.Tensor) -> None:
        anchor = self.flat.anchor
        anchor.grad = -change
        self.optimizer.step()
        anchor.grad = None
        self.flat.params.copy_(anchor)
