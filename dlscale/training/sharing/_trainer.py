"""One gradient-sharing trainer: a long-lived task that fits minibatches and exchanges compressed
updates with its peers until the session's minibatches are done.

Each step fits one minibatch; the optimizer's update (the change it makes to the parameters),
scaled by the aggregation's weight, goes to the session's compressor, which keeps what it does not
send in the trainer's residual; its message is sent to every peer, which applies it. With a
lossless compressor (``Compressor.lossless``: "topk", "dense") the trainer's own replica keeps its
whole update, so that its parameters are the shared ones plus its residual and its next gradient is
taken where one process's would be (summing updates, it keeps the shared parameters beside its
replica, to which its own messages and its peers' are added, and its residual is its replica less
them, which the compressor reads where it lies: a ``Difference``); alone, with no live peer, it
sends nothing and trains as one process does. With another ("dl4j") the update is taken back out
and the message applied instead, so that every replica holds the shared parameters. Minibatches
come from the scheduler a lease (``dlscale.training.sharing.lease``) at a time. Peers' updates are
applied between steps, as they arrive: there is no barrier per step. At the end each trainer waits
until it has applied every update its live peers sent, returns the shared parameters (its own
less its residual) with the residual, and parks its replica, shared parameters and compressor state
on its worker, where the driver's next fit of the same network, unchanged, takes them back
(``TrainerSpec.warm``) instead of sending the network again. A trainer whose worker is retiring or
closing (its status says so) leaves instead, between two steps: it hands the minibatches it holds
back to the scheduler, sends its whole residual to its peers and returns once that is on its way
(the last live trainer stays).
The trainer knows nothing of any compression scheme: it asks the compressor (``dlscale.encoding``),
and keeps its update the way ``_keeping`` chooses for the compressor and the aggregation. Losses and
the compressor's figures stay where the network computes until the acknowledgements of a lease
read them, in one go, off the training thread; on an accelerator a step's message is copied off the
device while the next step's kernels are queued.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from distributed import get_worker
from distributed.utils import sync

from dlscale.data.loaders import prefetch
from dlscale.encoding import Compressor, CompressorState, Layout
from dlscale.encoding.dense import DenseCompressor
from dlscale.errors import NonFiniteUpdateError
from dlscale.runtime.retirement import LEAVING, retire_timeout
from dlscale.training._messages import unwrap
from dlscale.training._session import run_trainer
from dlscale.training._worker import release_replica, state_of, training_replica
from dlscale.training.sharing._keeping import Keeping, keeping
from dlscale.training.sharing._messages import Ack, Handout, Update, View
from dlscale.training.sharing._worker_plugin import plugin

logger = logging.getLogger("dlscale.training.sharing")

_WHOLE = DenseCompressor()  # the codec of a leaving trainer's residual, whatever the session's compressor

DEBUG_TOPIC = "dlscale-encoding"
DEBUG_FORMAT = (
    "trainer %(trainer)s step %(step)d: threshold %(threshold).3g, sparsity %(sparsity).3g, %(form)s "
    "message of %(message_bytes)d bytes, residual L2 %(residual_l2).4g, max |r| %(residual_max_abs).3g, "
    "%(residual_above_threshold)d elements still above threshold"
)


@dataclass(frozen=True)
class TrainerSpec:
    """What every trainer of a session is told."""

    compressor: Compressor
    aggregation: str  # "mean": each update weighted 1 / (live trainers); "sum": weight 1
    workers_per_node: int
    prefetch: int
    debug: bool
    collect_stats: bool
    gc_seconds: float | None
    momentum_masking: bool
    keep_loaded: float  # the fraction of its worker's memory a trainer may keep loaded minibatches in
    iteration: int = 0  # the network's iteration count when the fit began
    warm: str | None = None  # the session whose trainers, parked on the workers, go on in this one


class _Control:
    """Calls to the scheduler's ``dlscale_sharing_*`` handlers from a trainer's threads: plain data on
    the comm, records here; a session that has stopped for this trainer raises a
    :class:`SessionStoppedError`."""

    def __init__(self, worker: Any, session: str, trainer: str) -> None:
        self.worker, self.session, self.trainer = worker, session, trainer

    def _call(self, op: str, **kwargs: Any) -> Any:
        method = getattr(self.worker.scheduler, f"dlscale_sharing_{op}")
        return sync(self.worker.loop, method, session=self.session, trainer=self.trainer, **kwargs)

    def join(self) -> View:
        return View.from_plain(unwrap(self._call("join")))

    def next(self, acks: list[Ack], want: int) -> Handout:
        """Acknowledge ``acks`` and ask for up to ``want`` more items."""
        return Handout.from_plain(unwrap(self._call("next", acks=[a.to_plain() for a in acks], want=want)))

    def finish(self, sent: int) -> View:
        return View.from_plain(unwrap(self._call("finish", sent=sent)))

    def status(self) -> View:
        return View.from_plain(unwrap(self._call("status")))

    def fail(self, error: str) -> None:
        self._call("fail", error=error)

    def leave(self, acks: list[Ack], sent: int, stats: dict[str, Any]) -> View:
        return View.from_plain(unwrap(self._call("leave", acks=[a.to_plain() for a in acks], sent=sent, stats=stats)))


def run(
    session: str,
    trainer: str,
    local: int,
    key: str | None,
    blob: bytes | None,
    refs: list[Any],
    loader: Callable[[Any], Any],
    spec: TrainerSpec,
) -> dict[str, Any]:
    """The task of one trainer; returns its final state, or ``{"lost": True}`` for a trainer whose
    worker was lost (this task then runs again elsewhere and stops at once), ``{"aborted": True}``
    for one stopped by another's failure and ``{"retired": True}`` for one that left its session as
    its worker retired (its statistics reach the driver through the scheduler)."""
    worker = get_worker()
    control = _Control(worker, session, trainer)

    def train(joined: View, loader: Callable[[Any], Any]) -> dict[str, Any]:
        return _Trainer(worker, control, local, key, blob, refs, loader, spec, joined).train()

    return run_trainer(
        worker,
        plugin(worker),
        session,
        trainer,
        control.join,
        control.fail,
        loader,
        spec.keep_loaded,
        train,
        "gradient-sharing",
    )


class _Trainer:
    def __init__(
        self,
        worker: Any,
        control: _Control,
        local: int,
        key: str | None,
        blob: bytes | None,
        refs: list[Any],
        loader: Callable[[Any], Any],
        spec: TrainerSpec,
        joined: View,
    ) -> None:
        self.worker, self.control, self.local, self.spec = worker, control, local, spec
        self.name = control.trainer
        self.node = plugin(worker).nodes[control.session]
        self.config = self.node.config
        self.node.set_nodes(joined.version, joined.nodes)
        self.start_version = joined.version
        self.alive = len(joined.alive)
        self.compressor = spec.compressor
        if spec.warm is not None:  # the last fit's trainer goes on
            parked: Keeping | None = plugin(worker).unpark(spec.warm, local)
            if parked is None:
                raise RuntimeError(
                    f"the trainer of the last fit, to go on here, is no longer on worker {worker.address} "
                    "(the worker was restarted): fit again to send the network anew"
                )
            self.keeping = parked
        else:
            network = training_replica(f"{key}/{local}", blob, local, spec.workers_per_node)
            state = self.compressor.state(Layout.of(network.module.parameters()))
            self.keeping = keeping(network, self.compressor, state, spec.aggregation, spec.momentum_masking)
        self.keeping.state.step = spec.iteration // max(1, self.alive)  # a fit goes on with its network's training
        self.refs, self.loader = refs, loader
        self.inbox = self.node.inboxes[local]
        self.applied: collections.Counter[str] = collections.Counter()
        self.steps: list[_Step] = []  # fitted and sent, not yet acknowledged: their figures still unread
        self.steps_lock = threading.Lock()
        self.handed: collections.deque[int] = collections.deque()
        self.stopping = threading.Event()
        self.staying = False  # the last live trainer, told to stay while its worker retires
        self.seq = 0  # messages sent
        self.stats = {
            "trainer": self.name,
            "worker": worker.address,
            "minibatches": 0,
            "examples": 0,
            "messages_sent": 0,
            "bytes_sent": 0,
            "messages_received": 0,
            "bytes_received": 0,
            "score": float("nan"),
            "phases": [],
            "steps": [],
        }
        self._wall0, self._perf0 = time.time(), time.perf_counter()

    # -- bookkeeping ------------------------------------------------------------------------
    def _phase(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        if self.spec.collect_stats:
            self.stats["phases"].append((phase, self._wall0 + (t0 - self._perf0), now - t0))
        return now

    def _received(self) -> list[tuple[Compressor, Any]]:
        """The updates received so far, read, each with the compressor that applies it."""
        messages = []
        while self.inbox:
            update = self.inbox.popleft()
            codec = _WHOLE if update.residual else self.compressor
            try:
                messages.append((codec, codec.from_bytes(update.payload)))
            except Exception as e:
                e.add_note(f"in an update from trainer {update.origin}")
                raise
            self.applied[update.origin] += 1
            self.stats["messages_received"] += 1
            self.stats["bytes_received"] += len(update.payload)
        return messages

    def _apply_inbox(self) -> None:
        self.keeping.receive(self._received())

    def _ref(self, item: int) -> Any:
        return self.refs[item % len(self.refs)]

    def _acks(self) -> list[Ack]:
        """The acknowledgements of the steps sent since the last call, their losses and thresholds read
        from where the network computes in one go (the figures of a lone trainer, which sends nothing,
        also tell that it has not diverged)."""
        with self.steps_lock:
            steps, self.steps = self.steps, []
        if not steps:
            return []
        unread = [s.loss for s in steps] + [s.threshold for s in steps if isinstance(s.threshold, torch.Tensor)]
        values = iter(torch.stack([v.reshape(()).float() for v in unread]).tolist())
        scores = [next(values) for _ in steps]
        acks = []
        for s, score in zip(steps, scores, strict=True):
            threshold = next(values) if isinstance(s.threshold, torch.Tensor) else s.threshold
            if not math.isfinite(score):
                error = NonFiniteUpdateError(
                    f"training diverged on minibatch {self._ref(s.item)}: the loss is {score} "
                    "(a NaN or infinite input, or too high a learning rate)"
                )
                error.add_note(f"after fitting minibatch {self._ref(s.item)}")
                raise error
            acks.append(Ack(s.item, s.examples, score, float(threshold), float(s.density), s.size))
            if self.spec.collect_stats:
                self.stats["steps"].append((s.sent, float(threshold), float(s.density), s.size))
        self.stats["score"] = scores[-1]
        return acks

    def _items(self) -> Iterator[Any]:
        """The refs of the minibatches this trainer is handed, pulled from the scheduler a lease
        (``dlscale.training.sharing.lease`` of them) at a time, the acknowledgements of those sent since going
        with each call (the prefetching thread runs this, so the figures are read off the training
        thread); ends when the session has no work left, and raises :class:`SessionStoppedError`
        when the session stops under it."""
        while not self.stopping.is_set():
            handout = self.control.next(self._acks(), want=self.config.lease)
            self.node.set_nodes(handout.view.version, handout.view.nodes)
            self.alive = len(handout.view.alive)
            if handout.items:
                for item in handout.items:
                    self.handed.append(item)
                    yield self._ref(item)
            elif handout.view.done:
                return
            else:
                time.sleep(self.config.poll_interval)

    # -- the fit ----------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        self.node.busy.add(self.local)
        try:
            return self._train()
        finally:
            self.node.busy.discard(self.local)
            release_replica(self.keeping.network)

    def _train(self) -> dict[str, Any]:
        """Step until the session's minibatches are done: apply what peers sent, fit, encode, send.
        Where the network computes on an accelerator, a step's message is copied off it while the
        next step's kernels are queued, and sent after them."""
        spec, keeping = self.spec, self.keeping
        threads = max(1, self.worker.state.nthreads // spec.workers_per_node)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        overlap = keeping.params.device.type != "cpu"
        batches = prefetch(self._items(), self.loader, spec.prefetch)
        last_gc, outgoing = time.monotonic(), None
        try:
            t = time.perf_counter()
            while True:
                if not self.staying and self.worker.status in LEAVING:
                    batches.close()  # its thread stops, and with it the calls for more minibatches
                    outgoing = self._send(outgoing)
                    if self._leave():
                        return {"trainer": self.name, "retired": True}
                    batches = prefetch(self._items(), self.loader, spec.prefetch)  # the last trainer stays
                if not self.handed:  # the next minibatch waits for a call that acknowledges the last step
                    outgoing = self._send(outgoing)
                batch = next(batches, None)
                t = self._phase("wait", t)
                if batch is None:
                    break
                item = self.handed.popleft()
                self._apply_inbox()
                t = self._phase("apply", t)
                alive = self.alive  # read once: the prefetching thread changes it
                with _about(f"while fitting minibatch {self._ref(item)}"):
                    loss = keeping.fit(batch, alive)
                t = self._phase("fit", t)
                outgoing = self._send(outgoing)  # the last step's, copied off the device meanwhile
                with _about(f"after fitting minibatch {self._ref(item)}"):
                    message = keeping.encode(alive)
                if spec.debug:
                    self._debug(message)
                state = keeping.state
                staged = None if message is None else self.compressor.stage(message)
                outgoing = _Step(item, batch.num_examples(), loss, state.threshold, state.density, staged)
                t = self._phase("encode", t)
                if not overlap:
                    outgoing = self._send(outgoing)
                    t = self._phase("send", t)
                if spec.gc_seconds is not None and time.monotonic() - last_gc >= spec.gc_seconds:
                    gc.collect()
                    last_gc, t = time.monotonic(), time.perf_counter()
            self._send(outgoing)
        finally:
            self.stopping.set()
            batches.close()
        return self._finish()

    def _send(self, step: _Step | None) -> None:
        """Send ``step``'s message, if any, to every peer and count the step as done (its
        acknowledgement goes with the next call to the scheduler); ``None``, what is then outgoing."""
        if step is None:
            return
        if step.message is not None:
            with _about(f"after fitting minibatch {self._ref(step.item)}"):
                payload = self.compressor.to_bytes(step.message)
            step.message, step.size = None, len(payload)
            self.node.send(Update(self.name, self.seq, payload), self.local)
            self.seq += 1
            self.stats["messages_sent"] += 1
            self.stats["bytes_sent"] += step.size
        step.sent = time.time()
        with self.steps_lock:
            self.steps.append(step)
        self.stats["minibatches"] += 1
        self.stats["examples"] += step.examples

    def _leave(self) -> bool:
        """Leave the session as this trainer's worker retires: acknowledge what is fitted, hand back the
        rest, send the whole residual to the peers and wait (at most ``dlscale.worker.retire-timeout``)
        until it is on its way. Returns ``False``, with nothing handed back lost (the items go back to
        the queue, for this trainer too), when the session keeps it as the last live trainer."""
        acks, residual = self._acks(), self.keeping.residual()
        payload, stats = None, self.stats
        if torch.count_nonzero(residual):  # the residual as one dense message; the residual itself is kept
            payload = _WHOLE.to_bytes(_WHOLE.compress(CompressorState(self.keeping.state.layout, residual), residual))
            stats = dict(stats, messages_sent=stats["messages_sent"] + 1, bytes_sent=stats["bytes_sent"] + len(payload))
        view = self.control.leave(acks, self.seq + (payload is not None), stats)
        self.handed.clear()
        if self.name in view.alive:
            logger.warning(
                "trainer %s stays while worker %s retires: no other trainer would train the rest",
                self.name,
                self.worker.address,
            )
            self.staying = True
            self.node.busy.discard(self.local)
            return False
        if payload is not None:
            self.node.send(Update(self.name, self.seq, payload, residual=True), self.local)
        if not self.node.drained(retire_timeout()):
            logger.warning("trainer %s left with updates still unsent to its peers", self.name)
        logger.info("trainer %s left its session: worker %s is %s", self.name, self.worker.address, self.worker.status)
        return True

    def _finish(self) -> dict[str, Any]:
        """Report the end of this trainer's work (every minibatch of the session is fitted and
        acknowledged by now), apply updates until every live peer's last one is in, and return the
        shared parameters with the residual; the trainer parks on its worker for the next fit."""
        t = time.perf_counter()
        view = self.control.finish(self.seq)
        deadline = time.monotonic() + self.config.end_timeout
        stalled_since, count = time.monotonic(), sum(self.applied.values())
        while True:
            self._apply_inbox()
            self.node.set_nodes(view.version, view.nodes)
            alive = [o for o in view.alive if o != self.name]
            if all(o in view.finished for o in alive):  # and the retired, whose counts are there too
                missing = {
                    o: n - self.applied[o] for o, n in view.finished.items() if o != self.name and self.applied[o] < n
                }
                if not missing:
                    break
                now, total = time.monotonic(), sum(self.applied.values())
                if total != count:
                    stalled_since, count = now, total
                # after a loss, updates relayed by the lost node may never come
                if view.version != self.start_version and now - stalled_since > 1.0:
                    logger.warning(
                        "trainer %s ends without %d updates lost with a peer", self.name, sum(missing.values())
                    )
                    break
                if now > deadline:
                    logger.warning(
                        "trainer %s gave up waiting for %d updates from %s",
                        self.name,
                        sum(missing.values()),
                        ", ".join(sorted(missing)),
                    )
                    break
            time.sleep(self.config.poll_interval / 4)
            view = self.control.status()
        self._apply_inbox()
        self._phase("wait", t)
        keeping = self.keeping
        state = state_of(keeping.network, with_optimizer=True, params=keeping.shared())
        residual = keeping.residual()
        if self.config.keep_trainers:  # the replica goes on in the next fit, if the driver's network is then this one
            plugin(self.worker).park(self.control.session, self.local, keeping)
        return {
            **state,
            "trainer": self.name,
            "residual": residual.cpu(),
            "examples": self.stats["examples"],
            "batches": self.stats["minibatches"],
            "score": float("nan"),
            "shares": [],
            "stats": self.stats,
        }

    def _debug(self, message: Any) -> None:
        keeping = self.keeping
        keeping.residual()
        info = {
            "trainer": self.name,
            "step": self.stats["minibatches"],
            **self.compressor.describe(keeping.state, message),
        }
        logger.info(DEBUG_FORMAT, info)
        self.worker.log_event(DEBUG_TOPIC, info)


@dataclass
class _Step:
    """A step fitted, its figures unread where the network computes: its minibatch (``item``), examples,
    loss, the compressor's threshold and density after it, and its message until sent (then its size
    in bytes, and when)."""

    item: int
    examples: int
    loss: torch.Tensor
    threshold: float | torch.Tensor
    density: float
    message: Any | None
    size: int = 0
    sent: float = 0.0  # when, in seconds since the epoch


@contextlib.contextmanager
def _about(note: str) -> Iterator[None]:
    """Add ``note`` to an exception raised in the block."""
    try:
        yield
    except Exception as e:
        e.add_note(note)
        raise
