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
come from the scheduler a lease (``dlscale.sharing.lease``) at a time. Peers' updates are
applied between steps, as they arrive: there is no barrier per step. At the end each trainer waits
until it has applied every update its live peers sent, returns the shared parameters (its own
less its residual) with the residual, and parks its replica, shared parameters and compressor state
on its worker, where the driver's next fit of the same network, unchanged, takes them back
(``TrainerSpec.warm``) instead of sending the network again. A trainer whose worker is retiring or
closing (its status says so) leaves instead, between two steps: it hands the minibatches it holds
back to the scheduler, sends its whole residual to its peers and returns once that is on its way
(the last live trainer stays).
The trainer knows nothing of any compression scheme: it asks the compressor
(``dlscale.encoding.compressors``).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from distributed import Future, get_client, get_worker, secede
from distributed.utils import sync

from dlscale.data.loaders import prefetch
from dlscale.encoding import Compressor, CompressorState, Difference, Layout
from dlscale.encoding.dense import DenseCompressor
from dlscale.errors import NonFiniteUpdateError
from dlscale.runtime.retirement import LEAVING, retire_timeout
from dlscale.training._heap import training_heap
from dlscale.training._worker import check_finite, decode, replica, state_of
from dlscale.training.sharing._exceptions import SessionAbortedError, SessionClosedError, SessionStoppedError
from dlscale.training.sharing._messages import Ack, Handout, Update, View, unwrap
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
    iteration: int = 0  # the network's iteration count when the fit began
    warm: str | None = None  # the session whose trainers, parked on the workers, go on in this one


_PATIENCE = 2.0  # seconds a fetch of a held minibatch may take before it is asked again (doubling)


@dataclass(frozen=True)
class HeldMinibatch:
    """The loader of minibatches held in workers' memory ("direct" training), by name. The driver
    publishes their futures as the Dask dataset ``dataset``; a trainer takes them from there once
    (:meth:`bind`), which makes its client want them as the driver's does: a minibatch lost with its
    worker is recomputed from its RDD's lineage, and the trainer waiting for it is told when it is
    back. ``timeout`` (seconds) bounds that wait.

    A fetch can be connecting to a worker that died after the scheduler named it as the holder, and
    Dask retries a refused connection until its connect timeout (``distributed.comm.timeouts.connect``,
    30 s). So a fetch that takes longer than :data:`_PATIENCE` seconds is cancelled and asked again,
    which asks the scheduler again and finds the copy recomputed elsewhere, with the patience doubled
    each time so that a long transfer still ends."""

    dataset: str
    timeout: float
    futures: dict[str, Future] | None = None

    def bind(self, client: Any) -> HeldMinibatch:
        return HeldMinibatch(self.dataset, self.timeout, client.get_dataset(self.dataset))

    def __call__(self, name: str) -> Any:
        future, patience = self.futures[name], _PATIENCE
        deadline = time.monotonic() + self.timeout
        while True:
            wait = min(patience, deadline - time.monotonic())
            try:
                return decode(future.result(timeout=max(wait, 0.0)))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"minibatch {name}, held in worker memory, was not available within {self.timeout:g} s "
                        "(dlscale.sharing.end-timeout): it was lost with its worker and not recomputed"
                    ) from None
                logger.info("minibatch %s, held in worker memory, not here after %.3g s: asking again", name, wait)
                patience *= 2


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
    try:
        joined = control.join()
    except SessionStoppedError as e:
        return _stopped(trainer, e)
    if isinstance(loader, HeldMinibatch):
        loader = loader.bind(get_client())
    secede()  # a trainer runs for the whole fit: it should not hold one of the worker's task slots
    try:
        with training_heap():
            return _Trainer(worker, control, local, key, blob, refs, loader, spec, joined).train()
    except SessionClosedError as e:  # the session ended under it: its driver is gone
        plugin(worker).close(session)
        return _stopped(trainer, e)
    except SessionStoppedError as e:
        return _stopped(trainer, e)
    except BaseException as e:
        with contextlib.suppress(Exception):  # the original error matters, not this one
            control.fail(f"{type(e).__name__}: {e}")
        e.add_note(f"in gradient-sharing trainer {trainer} on worker {worker.address}")
        raise


def _stopped(trainer: str, error: SessionStoppedError) -> dict[str, Any]:
    """The result of a trainer whose session stopped under it: it was lost (or its session is gone),
    or another trainer failed."""
    aborted = isinstance(error, SessionAbortedError)
    return {"trainer": trainer, "lost": not aborted, "aborted": aborted}


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
        self.parked: _Parked | None = None
        if spec.warm is not None:
            self.parked = plugin(worker).unpark(spec.warm, local)
            if self.parked is None:
                raise RuntimeError(
                    f"the trainer of the last fit, to go on here, is no longer on worker {worker.address} "
                    "(the worker was restarted): fit again to send the network anew"
                )
            self.network = self.parked.network
        else:
            self.network, _ = replica(f"{key}/{local}", blob, local, spec.workers_per_node)
        self.params = self.network.params()
        self.targets = [self.params]  # what a peer's message is added to
        self.compressor = spec.compressor
        self.alive = len(joined.alive)
        self.refs, self.loader = refs, loader
        self.inbox = self.node.inboxes[local]
        self.applied: collections.Counter[str] = collections.Counter()
        self.acks: list[Ack] = []
        self.acks_lock = threading.Lock()
        self.handed: collections.deque[int] = collections.deque()
        self.stopping = threading.Event()
        self.staying = False  # the last live trainer, told to stay while its worker retires
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

    def _apply_inbox(self) -> None:
        """Apply the updates received so far."""
        while self.inbox:
            update = self.inbox.popleft()
            codec = _WHOLE if update.residual else self.compressor
            try:
                message = codec.from_bytes(update.payload)
            except Exception as e:
                e.add_note(f"in an update from trainer {update.origin}")
                raise
            for target in self.targets:
                codec.apply(message, target)
            self.applied[update.origin] += 1
            self.stats["messages_received"] += 1
            self.stats["bytes_received"] += len(update.payload)

    def _items(self) -> Iterator[Any]:
        """The refs of the minibatches this trainer is handed, pulled from the scheduler a lease
        (``dlscale.sharing.lease`` of them) at a time, the acknowledgements of those fitted since
        going with each call (the prefetching thread runs this); ends when the session has no work
        left, and raises :class:`SessionStoppedError` when the session stops under it."""
        n = len(self.refs)
        while not self.stopping.is_set():
            with self.acks_lock:
                acks, self.acks = self.acks, []
            handout = self.control.next(acks, want=self.config.lease)
            self.node.set_nodes(handout.view.version, handout.view.nodes)
            self.alive = len(handout.view.alive)
            if handout.items:
                for item in handout.items:
                    self.handed.append(item)
                    yield self.refs[item % n]
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

    def _train(self) -> dict[str, Any]:
        net, spec = self.network, self.spec
        threads = max(1, self.worker.state.nthreads // spec.workers_per_node)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        params, compressor = self.params, self.compressor
        lossless = compressor.lossless
        # A lossless trainer that sums updates keeps the shared parameters beside its replica; its
        # residual is then its replica less them, one subtraction a step. Otherwise it keeps the
        # parameters from before each step to take the update out.
        if self.parked is not None:  # the last fit's trainer goes on
            shared, own = self.parked.shared, self.parked.state
        else:
            shared = params.clone() if lossless and spec.aggregation == "sum" else None
            own = compressor.state(Layout.of(net.module.parameters()))
        own.step = spec.iteration // max(1, self.alive)  # a fit goes on with its network's training: one warm-up
        before, delta = (None, None) if shared is not None else (torch.empty_like(params), torch.empty_like(params))
        if shared is not None:
            self.targets.append(shared)  # peers' messages change the shared parameters too
        seq = step = 0
        last_gc = time.monotonic()
        batches = prefetch(self._items(), self.loader, spec.prefetch)
        left = False
        try:
            t = time.perf_counter()
            while True:
                if not self.staying and self.worker.status in LEAVING:
                    batches.close()  # its thread stops, and with it the calls for more minibatches
                    if shared is not None:
                        Difference(params, shared).into(own.residual)
                    if self._leave(own, seq):
                        left = True
                        break
                    batches = prefetch(self._items(), self.loader, spec.prefetch)  # the last trainer stays
                batch = next(batches, None)
                t = self._phase("wait", t)
                if batch is None:
                    break
                item = self.handed.popleft()
                self._apply_inbox()
                t = self._phase("apply", t)
                # a lossless trainer without a live peer sends nothing: it trains as one process does,
                # its updates kept in its replica (to the residual); only a check that they are finite
                alone = lossless and self.alive <= 1
                if shared is None and not alone:
                    before.copy_(params)
                try:
                    score = net.fit_batch(batch)
                except Exception as e:
                    e.add_note(f"while fitting minibatch {self.refs[item % len(self.refs)]}")
                    raise
                message = update = None
                if alone:
                    check_finite(net, score, str(self.refs[item % len(self.refs)]))
                elif shared is not None:
                    update = Difference(params, shared)  # the residual, as it lies: nothing to add
                else:
                    update = torch.sub(params, before, out=delta)  # the optimizer's update
                    if spec.aggregation == "mean" and self.alive > 1:
                        update.mul_(1 / self.alive)  # the sender weighs its update: every replica applies the same
                        if lossless:  # the replica keeps the weighed update
                            params.sub_(update, alpha=self.alive - 1)
                t = self._phase("fit", t)
                if update is not None:
                    try:
                        message = compressor.compress(own, update)
                    except NonFiniteUpdateError as e:
                        e.add_note(f"after fitting minibatch {self.refs[item % len(self.refs)]}")
                        raise
                    if shared is not None and message is not None:
                        compressor.apply(message, shared)
                    if not lossless:  # the update goes to the compressor instead of the parameters
                        params.copy_(before)
                        if message is not None:
                            compressor.apply(message, params)
                    if message is not None and spec.momentum_masking:
                        mask = compressor.momentum_mask(own, message)
                        if mask is not None and mask.numel():
                            _mask_momentum(net, mask)
                if spec.debug:
                    if shared is not None:
                        Difference(params, shared).into(own.residual)
                    self._debug(step, compressor.describe(own, message))
                t = self._phase("encode", t)
                size = 0
                if message is not None:
                    payload = compressor.to_bytes(message)
                    size = len(payload)
                    self.node.send(Update(self.name, seq, payload), self.local)
                    seq += 1
                    self.stats["messages_sent"] += 1
                    self.stats["bytes_sent"] += size
                t = self._phase("send", t)
                if spec.collect_stats:
                    self.stats["steps"].append((time.time(), own.threshold, own.density, size))
                examples = batch.num_examples()
                with self.acks_lock:
                    self.acks.append(Ack(item, examples, float(score), float(own.threshold), float(own.density), size))
                self.stats["minibatches"] += 1
                self.stats["examples"] += examples
                self.stats["score"] = float(score)
                step += 1
                if spec.gc_seconds is not None and time.monotonic() - last_gc >= spec.gc_seconds:
                    gc.collect()
                    last_gc = time.monotonic()
                    t = time.perf_counter()
        finally:
            self.stopping.set()
            batches.close()
        if left:
            return {"trainer": self.name, "retired": True}
        self._finish(seq)
        if shared is not None:
            Difference(params, shared).into(own.residual)
            out = shared
        elif lossless:  # the shared parameters: this replica's less what it has not sent
            out = params - own.residual.to(params.device)
        else:
            out = params
        state = state_of(net, with_optimizer=True, params=out)
        if self.config.keep_trainers:  # the replica goes on in the next fit, if the driver's network is then this one
            plugin(self.worker).park(self.control.session, self.local, _Parked(net, shared, own))
        return {
            **state,
            "trainer": self.name,
            "residual": own.residual.cpu(),
            "examples": self.stats["examples"],
            "batches": self.stats["minibatches"],
            "score": float("nan"),
            "shares": [],
            "stats": self.stats,
        }

    def _leave(self, own: Any, sent: int) -> bool:
        """Leave the session as this trainer's worker retires: acknowledge what is fitted, hand back the
        rest, send the whole residual to the peers and wait (at most ``dlscale.worker.retire-timeout``)
        until it is on its way. Returns ``False``, with nothing handed back lost (the items go back to
        the queue, for this trainer too), when the session keeps it as the last live trainer."""
        with self.acks_lock:
            acks, self.acks = self.acks, []
        payload, stats = None, self.stats
        if torch.count_nonzero(own.residual):  # the residual as one dense message; the residual itself is kept
            payload = _WHOLE.to_bytes(_WHOLE.compress(CompressorState(own.layout, own.residual), own.residual))
            stats = dict(stats, messages_sent=stats["messages_sent"] + 1, bytes_sent=stats["bytes_sent"] + len(payload))
        view = self.control.leave(acks, sent + (payload is not None), stats)
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
            self.node.send(Update(self.name, sent, payload, residual=True), self.local)
        if not self.node.drained(retire_timeout()):
            logger.warning("trainer %s left with updates still unsent to its peers", self.name)
        logger.info("trainer %s left its session: worker %s is %s", self.name, self.worker.address, self.worker.status)
        return True

    def _finish(self, sent: int) -> None:
        """Report the end of this trainer's work (every minibatch of the session is fitted by now) and
        apply updates until every live peer's last one is in."""
        t = time.perf_counter()
        view = self.control.finish(sent)
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

    def _debug(self, step: int, description: dict[str, Any]) -> None:
        info = {"trainer": self.name, "step": step, **description}
        logger.info(DEBUG_FORMAT, info)
        self.worker.log_event(DEBUG_TOPIC, info)


@dataclass(frozen=True)
class _Parked:
    """What a trainer trains with, kept on its worker between two fits: its replica of the network, the
    shared parameters (of a lossless trainer summing updates) and its compressor's state."""

    network: Any
    shared: torch.Tensor | None
    state: CompressorState


def _mask_momentum(network: Any, sent: torch.Tensor) -> None:
    """Zero the momentum at the increasing flat positions ``sent`` (momentum factor masking, Lin et al.,
    "Deep Gradient Compression", ICLR 2018): a sent element's momentum would otherwise go on pushing
    it the same way while its update is still on its way to the peers, whose own momentum pushes it
    too. Applies to optimizers that keep a ``momentum_buffer`` (SGD, RMSprop), not to Adam's moments,
    whose updates are normalised per element."""
    state = network.optimizer.state  # a defaultdict: looking a parameter up would add an empty state for it,
    # and trainers whose states differ in their keys cannot be averaged
    buffers = [
        (p.numel(), state[p].get("momentum_buffer") if p in state else None) for p in network.module.parameters()
    ]
    if all(b is None for _, b in buffers):
        return
    sent = sent.to(next(b for _, b in buffers if b is not None).device)
    # where each tensor's positions start and end in ``sent``: one round trip from a GPU for them all
    offsets = np.cumsum([0] + [n for n, _ in buffers]).tolist()
    bounds = torch.searchsorted(sent, torch.tensor(offsets, device=sent.device)).tolist()
    for (_, buffer), offset, lo, hi in zip(buffers, offsets, bounds, bounds[1:]):
        if buffer is not None and hi > lo:
            buffer.view(-1).index_fill_(0, sent[lo:hi] - offset, 0)
