"""Trainers parked between fits: what a fit leaves on its workers for the next fit of the same network.

DL4J's examples train one ``fit`` per epoch. A fit whose trainers all end with the driver's state
leaves them *parked* on their workers (their replicas, and what else they train with); the next fit
takes them back instead of sending the network again, if nothing changed in between: the same
network object, its state unchanged (:func:`fingerprint`), the master's same settings and the same
trainers on the same workers (:class:`Warm`). Otherwise the parked trainers are forgotten and the
network is sent as for a first fit. ``dlscale.training.keep-trainers`` turns parking off.

The driver's copy of the state a fit ends with is an :class:`Arrival`: fetched from a trainer's result
in the background as the fit returns and taken by the network when it is first read
(``Network.arriving``), so that neither the fit's end nor the next fit's start waits for it; a network
not read since is the one its parked trainers hold, with no digest to compare.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import cloudpickle
import crc32c
import torch
from distributed import Client, Future, get_worker, wait

from dlscale.runtime.cluster import cluster_workers
from dlscale.runtime.replicas import EVERY_WORKER, set_replication
from dlscale.training import _worker


class Arrival:
    """A fit's trained state on its way to the driver's network (``network.arriving(arrival)``): fetched
    at once, in a thread of its own, from the first of ``futures`` (trainers' results on their
    workers, each holding the whole state), and set on the network when it is first read; its
    :attr:`fingerprint` is kept then. ``what`` names the fit in the error of a state lost with every
    worker that held it."""

    def __init__(self, futures: list[Future], what: str, parked: tuple[str, str, list[str]] | None = None) -> None:
        self.fingerprint: tuple[int, str] | None = None  # the network's, once it took the state
        self._futures, self._what = futures, what
        self._parked = parked  # where replicas equal to the state are parked: plugin, session, workers
        self._state: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._fetched = threading.Event()
        threading.Thread(target=self._fetch, name="dlscale-arrival", daemon=True).start()

    def _fetch(self) -> None:
        errors = []
        for future in self._futures:
            try:
                result = future.result()
            except Exception as e:  # its worker was lost: another trainer's result holds the same state
                errors.append(e)
                continue
            self._state = {k: result[k] for k in ("params", "buffers", "optimizer")}
            break
        else:
            self._error = RuntimeError(
                f"the state {self._what} trained was lost with every worker that held it before the driver "
                f"took it ({'; '.join(map(str, errors))}); the network keeps the state it had before that fit"
            )
        self._futures = []  # the workers' copies released
        self._fetched.set()

    def ship(self, client: Client) -> Future | None:
        """The network with this state, without its optimizer, pickled on a worker from a replica
        parked with it (``parked``) and held on every worker: copied from worker to worker, so that an
        evaluation or inference between fits neither takes the state to the driver nor sends it back.
        ``None`` where no replica is parked with it any longer (a fit took it back, or its worker was
        lost or forgot it)."""
        if self._parked is None:
            return None
        name, session, nodes = self._parked
        alive = set(cluster_workers(client))
        for worker in [w for w in nodes if w in alive]:
            blob = client.submit(_parked_blob, name, session, workers=[worker], allow_other_workers=True, pure=False)
            wait([blob])
            if blob.status == "finished":
                set_replication(client, [blob], EVERY_WORKER)
                return blob
        return None

    def __call__(self, network: Any) -> None:
        self._fetched.wait()
        if self._error is not None:
            raise self._error
        state, self._state = self._state, None
        _worker.apply_state(network, state, copy=False)
        self.fingerprint = fingerprint(network)


def _parked_blob(name: str, session: str) -> bytes:
    """The replica that ``session``'s trainer parked on this worker, pickled without its optimizer (see
    ``SessionWorkerPlugin.serialised``); an error where none is."""
    return get_worker().plugins[name].serialised(session)


@dataclasses.dataclass(frozen=True)
class Warm:
    """A fit's trainers, parked on their workers under its last ``session``, and what the next fit must
    match to take them back: the same ``network`` (a weak reference), unchanged since (not read since
    its ``arrival``, or with the same ``fingerprint`` as it had then), the master's same ``settings``
    and the same ``trainers`` (where each is); and the first minibatch that fit trained on (``first``:
    its reference and its loader, pickled), if it trained on every one (:meth:`trained_on`)."""

    session: str
    network: weakref.ref[Any]
    fingerprint: tuple[int, str] | None
    arrival: Arrival | None
    settings: str
    trainers: tuple[Any, ...]
    first: tuple[Any, bytes] | None = None

    @classmethod
    def left(
        cls, session: str, network: Any, settings: str, trainers: tuple[Any, ...], first: tuple[Any, Any] | None
    ) -> Warm:
        """What the trainers of ``session``, parked as a fit of ``network`` with ``settings`` ends, leave;
        ``first``: the reference and loader of the fit's first minibatch when it trained on every one
        (it began at its first epoch's start), else ``None``."""
        loaded = None if first is None else (first[0], cloudpickle.dumps(first[1]))
        arrival = network.pending()
        if isinstance(arrival, Arrival):  # the state the trainers hold, not yet on the driver
            return cls(session, weakref.ref(network), None, arrival, settings, trainers, loaded)
        return cls(session, weakref.ref(network), fingerprint(network), None, settings, trainers, loaded)

    def trained_on(self, ref: Any, loader: Any) -> bool:
        """Whether the fit that left these trainers trained on minibatch ``ref`` read by ``loader`` (equal
        references, loaders that pickle alike): a fit going on with them need not probe it, since the
        network, unchanged since, took a step on it."""
        return self.first is not None and self.first[0] == ref and self.first[1] == cloudpickle.dumps(loader)

    def same(self, network: Any, settings: str) -> bool:
        """Whether ``network``, trained with ``settings``, is the one these trainers left, unchanged."""
        if self.network() is not network or self.settings != settings:
            return False
        if self.arrival is not None and network.pending() is self.arrival:  # not read since
            return True
        printed = self.fingerprint if self.arrival is None else self.arrival.fingerprint
        return printed is not None and printed == fingerprint(network)


def fingerprint(network: Any) -> tuple[int, str]:
    """A digest of ``network``'s state: the CRC-32C of its parameters, buffers and optimizer state
    tensors, with the rest of the optimizer's state (its settings, such as the learning rate) as text.
    A fit's trainers go on in the next fit only if the network has not changed in between."""
    crc, rest = 0, []

    def visit(value: Any) -> None:
        nonlocal crc
        if isinstance(value, torch.Tensor):
            data = value.detach().reshape(-1).contiguous().cpu()
            crc = crc32c.crc32c(data.view(torch.uint8).numpy() if data.numel() else b"", crc)
            rest.append(f"{data.dtype}{tuple(value.shape)}")
        elif isinstance(value, dict):
            for k in sorted(value, key=repr):
                rest.append(repr(k))
                visit(value[k])
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        else:
            rest.append(repr(value))

    visit([network.params(), dict(network.module.named_buffers()), network.optimizer_state()])
    return crc, "|".join(rest)
