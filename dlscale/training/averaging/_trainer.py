"""One parameter-averaging trainer: a long-lived task that fits its share of each round and then averages
its state with the other trainers', peer to peer, until the session's rounds are done.

A round: the trainer is handed its share by the scheduler one round ahead (with the commit of the round
before: one call a round), fits it, reading ahead (``prefetch``), and takes part in the round's
allreduce (``_exchange``) with the members the scheduler names. When the allreduce has every part, the
trainer commits the round on the scheduler and takes the average: the parameters move by the averaged
change, or as the outer optimizer (DiLoCo) moves them given it; the buffers and the optimizer's state
take the averaged values. It does not wait for the scheduler's reply to the commit: it fits the next
round, handed out already, and reads the reply when it needs it (the round after's share, and
before its next commit: commits reach the scheduler one at a time, in order). Nor does
it wait for the reply to learn how the next round's averaging stands: until the reply comes, it
averages with the members the round was handed out with, which is how the round stays unless a
member is lost (then the parts it waits for do not come, and it asks the scheduler: see below). A
commit of an attempt whose every part a trainer holds is always taken (a different attempt can only
complete with a part from this trainer, which sends parts for one attempt at a time and commits the
last), so going on before the reply loses nothing; a reply refusing it would be a broken protocol,
and fails the fit. A trainer alone fits as one process does, its state untouched.

Streaming (``TrainerSpec.streaming``), a trainer sends round ``k``'s state and fits round ``k + 1``
(handed out with round ``k``) while the allreduce is in flight, advancing it between steps; it takes
round ``k``'s average as soon as it is whole, keeping the progress made since it sent its state
(``FlatState.settle``), and waits for it after half of round ``k + 1``'s steps at the latest (an
average taken later costs accuracy): a round's communication and the wait for a slower trainer hide
behind the next round's steps. While parts are
missing the trainer asks the scheduler every ``poll`` seconds how the round stands: a member lost
means a new attempt without it; a round committed with another attempt (or a part lost in flight)
means taking the average from a trainer that holds it. A trainer whose worker retires leaves between
rounds. At the end each trainer returns its state (every trainer holds the same), the driver takes
one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from distributed import get_worker
from distributed.utils import sync

from dlscale.data.loaders import prefetch
from dlscale.runtime.retirement import LEAVING
from dlscale.runtime.tasks import match_threads
from dlscale.training._messages import packed, unwrap
from dlscale.training._session import run_trainer
from dlscale.training._worker import check_finite, release_replica, state_of, training_replica
from dlscale.training.averaging._exchange import DTYPES, Contribution, Exchange
from dlscale.training.averaging._flat import FlatState
from dlscale.training.averaging._worker_plugin import plugin

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
    keep_loaded: float  # the fraction of its worker's memory a trainer may keep loaded minibatches in
    streaming: bool = False  # whether a round's averaging overlaps the next round's steps
    warm: str | None = None  # the session whose parked replicas this one's trainers go on with


class _Control:
    """Calls to the scheduler's ``dlscale_averaging_*`` handlers from the trainer's thread."""

    def __init__(self, worker: Any, session: str, trainer: str) -> None:
        self.worker, self.session, self.trainer = worker, session, trainer

    def __call__(self, op: str, **kwargs: Any) -> dict[str, Any]:
        return unwrap(self.send(op, **kwargs).result())

    def send(self, op: str, **kwargs: Any) -> Future:
        """The call, without waiting: the future of its reply, unread (:func:`unwrap` it)."""
        method = getattr(self.worker.scheduler, f"dlscale_averaging_{op}")
        call = method(session=self.session, trainer=self.trainer, **kwargs)
        return asyncio.run_coroutine_threadsafe(call, self.worker.loop.asyncio_loop)


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

    def train(joined: dict[str, Any], loader: Callable[[Any], Any]) -> dict[str, Any]:
        return _Trainer(worker, control, key, blob, refs, names, loader, spec).train()

    return run_trainer(
        worker,
        plugin(worker),
        session,
        trainer,
        lambda: control("join"),
        lambda error: control("fail", error=error),
        loader,
        spec.keep_loaded,
        train,
        "parameter-averaging",
    )


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
        self.last_exchange = float("nan")  # seconds the last round's averaging took to end
        self.flat: FlatState
        self.outer: _Outer | None = None
        self.shares: dict[int, list[int]] = {}  # this trainer's shares handed out and not yet fitted, by round
        # how each round's averaging stood when last heard: as the round was handed out, then as the
        # reply to the commit of the round before said
        self.statuses: dict[int, dict[str, Any]] = {}
        self.reply: tuple[int, Future | dict[str, Any]] | None = None  # the last commit's round and reply, unread
        # peers this trainer saw dropped from a round's averaging (their worker lost): a later round whose
        # status, heard before the loss, still names one is asked of the scheduler at once rather than
        # after waiting ``poll`` seconds for a part that cannot come
        self.gone: set[str] = set()
        self.snapshots: set[int] = set()  # rounds handed out whose average is kept aside for a checkpoint

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
        self.flat = FlatState(net, spec.save_updater)
        self.outer = _Outer(spec.outer_optimizer, self.flat) if spec.outer_optimizer is not None else None
        self._handed(self.control("begin", round=0, ahead=self.ahead))
        k, staying = 0, False
        pending: _RoundAverage | None = None  # streaming: the last round's averaging, in flight
        while True:
            if k not in self.shares:
                self._hear()  # the reply that hands it out, if still unread
            if pending is not None and k not in self.shares:  # nothing to fit (or a round inserted since)
                self._finish(pending)
                pending = None
            if k not in self.shares:
                self._hear()
            if k not in self.shares:
                break
            if not spec.save_updater:
                net.optimizer.state.clear()  # DL4J without save_updater: the updater starts afresh each round
            if not spec.streaming:
                self.flat.begin()
            report = self._fit(k, self.shares.pop(k), pending)  # ends the pending averaging
            if not staying and self.worker.status in LEAVING:
                outcome = self._leave(k)
                if outcome == "left":
                    return {"trainer": self.name, "retired": True}
                staying = outcome == "stay"
            report["last_exchange_seconds"] = self.last_exchange  # the averaging that ended before it
            if self.plugin.sending(self.session):
                self.flat.renew()  # the last vector is still being sent
            self._hear(wait=False)  # how this round's averaging stands, if the scheduler said already
            pending = _RoundAverage(self, k, report, self._status(k))
            if not spec.streaming:
                self._finish(pending)
                pending = None
            k += 1
        state = state_of(net, with_optimizer=spec.save_updater)
        # the replica goes on in the next fit, if the driver's network is then this state
        self.plugin.park(self.session, net if spec.keep else None)
        return {**state, "trainer": self.name}

    ahead = 1  # a trainer is handed the round after the one it fits: it goes on as it commits one

    def _finish(self, pending: _RoundAverage) -> float:
        """End ``pending``: take its average and commit it; the reply (read by :meth:`_hear`) hands out
        this trainer's next shares and says how the next round's averaging stands. Returns the seconds
        it took."""
        t0 = time.perf_counter()
        self.reply = (pending.k, pending.finish())
        self.mailbox.forget(pending.k)
        end = time.perf_counter()
        self.last_exchange = end - t0
        if self.spec.streaming and pending.exchange is not None and pending.exchange.result is not None:
            # as long as it would have held the trainers without streaming: its parts' time in flight
            self.last_exchange = max(self.last_exchange, pending.exchange.transit)
        return end - t0

    def _status(self, k: int) -> dict[str, Any] | None:
        """How round ``k``'s averaging stood when last heard (``None``: never), forgetting it and what is
        known of the rounds before it."""
        for j in [j for j in self.statuses if j < k]:
            del self.statuses[j]
        return self.statuses.pop(k, None)

    def _hear(self, wait: bool = True) -> None:
        """Read the reply to the last commit, waiting for it if it has not come yet (``wait``), else
        leaving it for later."""
        if self.reply is None:
            return
        k, reply = self.reply
        if isinstance(reply, Future):
            if not wait and not reply.done():
                return
            reply = unwrap(reply.result())
        self.reply = None
        if "adopt" in reply:
            raise RuntimeError(
                f"trainer {self.name}: the scheduler took another attempt's average of a round whose every "
                "part this trainer held; the parameter-averaging protocol is broken"
            )
        self._handed(reply)
        if "current" in reply:
            self.statuses[k + 1] = reply["current"]

    def _handed(self, reply: dict[str, Any]) -> None:
        """Take in the shares a ``begin`` or ``commit`` reply hands out, how each round's averaging stood
        as it was handed out (each round's part of the reply carries it), and the rounds whose average
        is to be kept aside for a checkpoint."""
        while reply is not None and not reply["end"]:
            k = reply["round"]
            self.shares[k], self.statuses[k] = reply["items"], reply
            if reply.get("snapshot"):
                self.snapshots.add(k)
            reply = reply.get("next")

    def _snapshot(self, k: int, average: torch.Tensor, layout: list[list[Any]]) -> None:
        """Round ``k``'s average, just taken, kept aside on the worker if the driver is to write a
        checkpoint from it (the round ends an epoch one wants): the trainer goes on."""
        if k in self.snapshots:
            state = self.flat.averaged(average, layout, carried=self.spec.streaming)
            self.plugin.snapshot(self.session, k, state)
        self.snapshots = {j for j in self.snapshots if j > k}

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

    def _fit(self, k: int, items: list[int], pending: _RoundAverage | None) -> dict[str, Any]:
        """Fit round ``k``'s share ``items``, reading ahead; returns what this trainer reports of it.
        Streaming, the last round's averaging (``pending``) is advanced between the steps and its average
        taken as soon as it is whole, after half the steps at the latest (then waited for), or at the end."""
        net, n = self.network, len(self.refs)
        start, t0 = time.time(), time.perf_counter()
        examples, score, waited = 0, float("nan"), 0.0
        late, latest, averaging = 0, (len(items) + 1) // 2, 0.0
        late_seconds = 0.0  # the steps taken with the last round's averaging in flight
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
                if pending is not None:
                    late += 1
                    if pending.poll() or late >= latest:
                        late_seconds = time.perf_counter() - t0 - waited
                        averaging = self._finish(pending)
                        pending = None
            if pending is not None:  # an empty share
                averaging = self._finish(pending)
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
            "late_steps": late,
            "late_seconds": late_seconds,
            "averaging_seconds": averaging,
        }

    def _take(self, average: torch.Tensor, layout: list[list[Any]], kept: dict[str, Any]) -> None:
        """Take a round's average: at once, or streaming, carrying the progress made since (``settle``)."""
        outer = None if self.outer is None else self.outer.step
        if self.spec.streaming:
            self.flat.settle(average, layout, kept, outer)
        else:
            self.flat.apply(average, layout, kept, outer)

    def _commit(
        self,
        k: int,
        attempt: int,
        reports: list[dict[str, Any]],
        result: tuple[torch.Tensor, list[list[Any]], dict[str, Any]] | None,
    ) -> Future:
        """Commit round ``k``'s ``attempt``, whose every part this trainer holds, and take its average
        (``result``; ``None``: this trainer was alone, its state is the round's); returns the future of
        the scheduler's reply (see the module's docstring)."""
        self._hear()  # the last commit's reply first: commits reach the scheduler in order, one at a time
        reply = self.control.send("commit", round=k, attempt=attempt, report=packed(reports), ahead=self.ahead)
        if result is None:
            if self.spec.streaming:
                self.flat.keep_own()
            return reply
        average, layout, kept = result
        self._take(average, layout, kept)
        self._snapshot(k, average, layout)
        self.plugin.keep(self.session, k, attempt, {"layout": layout, "kept": kept}, average.cpu().numpy())
        return reply

    def _adopt(self, k: int, attempt: int, holders: list[str]) -> dict[str, Any]:
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
                        average = torch.from_numpy(np.asarray(got["payload"]).copy()).to(self.flat.params.device)
                        header = got["header"]
                        self._hear()  # as _commit: the last commit's reply first
                        reply = self.control("commit", round=k, attempt=attempt, report=packed([]), ahead=self.ahead)
                        self._take(average, header["layout"], header["kept"])
                        self._snapshot(k, average, header["layout"])
                        self.plugin.keep(self.session, k, attempt, header, average.cpu().numpy())
                        logger.info("trainer %s took round %d's average from %s", self.name, k, holder)
                        return reply
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"trainer {self.name} could not take round {k}'s average from any of {holders} "
                    f"within {self.spec.timeout:g} s (dlscale.training.end-timeout)"
                )
            time.sleep(self.spec.poll)
            status = self.control("sync", round=k)
            attempt, holders = status["committed"], status["holders"]


class _RoundAverage:
    """Round ``k``'s averaging as ``trainer`` takes part in it, among the members that ``status`` (how the
    round stood when this trainer last heard) names unless that changed since: begun as the round's
    share is fitted (the state sent), advanced without waiting (:meth:`poll`, between the next round's
    steps when streaming), ended by :meth:`finish` with the commit."""

    def __init__(self, trainer: _Trainer, k: int, report: dict[str, Any], status: dict[str, Any] | None) -> None:
        self.trainer, self.k, self.report = trainer, k, report
        if status is None or trainer.gone.intersection(status["members"]):
            status = trainer.control("sync", round=k)
        self.status = status
        self.exchange: Exchange | None = None
        self.contribution: Contribution | None = None
        if trainer.spec.streaming:
            trainer.flat.mark()  # the state as sent: what is fitted from now on is carried over the average
            if self._members() != [trainer.name]:
                self._contribute()
                self.poll()

    def _members(self) -> list[str]:
        return list(self.status["members"])  # a tuple after Dask's comms

    def _contribute(self) -> Contribution:
        if self.contribution is None:
            flat = self.trainer.flat
            vector, layout, kept = flat.vector()
            self.report["state_values"] = vector.numel()  # what a round's averaging moves, for the driver's choice
            self.contribution = Contribution(
                vector, layout, kept, self.report["examples"], self.report, flat.average_buffer
            )
        return self.contribution

    def _exchange(self) -> Exchange:
        """The exchange of the round's current attempt (a new one when the attempt changed)."""
        t, attempt = self.trainer, self.status["attempt"]
        if self.exchange is None or self.exchange.attempt != attempt:
            self.exchange = Exchange(
                t.name, self.k, attempt, self._members(), self._contribute(), t.mailbox, t._send, t.dtype
            )
        return self.exchange

    def poll(self) -> bool:
        """Send this trainer's parts, or average what has come, without waiting; returns whether the
        average can be taken now (it is whole, or this trainer is alone)."""
        if self.status["committed"] is not None:
            return False  # a peer committed: ask the scheduler (finish)
        if self._members() == [self.trainer.name]:
            return True
        return self._exchange().run(0)

    def finish(self) -> Future | dict[str, Any]:
        """Wait for the average (asking the scheduler how the round stands while parts are missing),
        commit it and take it; returns the scheduler's reply to the commit (this trainer's next shares),
        or its future."""
        t, k = self.trainer, self.k
        while True:
            committed = self.status["committed"]
            exchange = self.exchange
            if committed is not None:  # a peer committed: this trainer's own attempt may be about to end too
                if exchange is not None and exchange.attempt == committed and exchange.run(t.spec.poll):
                    return t._commit(k, committed, exchange.reports, exchange.result)
                return t._adopt(k, committed, self.status["holders"])
            if self._members() == [t.name]:  # alone: its state is the round's
                return t._commit(k, self.status["attempt"], [self.report], None)
            exchange = self._exchange()
            if exchange.run(t.spec.poll):
                return t._commit(k, exchange.attempt, exchange.reports, exchange.result)
            before = set(self._members())
            self.status = t.control("sync", round=k)
            t.gone.update(before - set(self._members()))


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
