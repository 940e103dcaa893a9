"""Trainers parked between fits: what a fit leaves on its workers for the next fit of the same network.

DL4J's examples train one ``fit`` per epoch. A fit whose trainers all end with the driver's state
leaves them *parked* on their workers (their replicas, and what else they train with); the next fit
takes them back instead of sending the network again, if nothing changed in between: the same
network object, its state unchanged (:func:`fingerprint`), the master's same settings and the same
trainers on the same workers (:class:`Warm`). Otherwise the parked trainers are forgotten and the
network is sent as for a first fit. ``dlscale.training.keep-trainers`` turns parking off.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import cloudpickle
import crc32c
import torch


@dataclasses.dataclass(frozen=True)
class Warm:
    """A fit's trainers, parked on their workers under its last ``session``, and what the next fit must
    match to take them back: the same ``network`` (a weak reference), unchanged since (its
    ``fingerprint``), the master's same ``settings`` and the same ``trainers`` (where each is); and
    the first minibatch that fit trained on (``first``: its reference and its loader, pickled), if it
    trained on every one (:meth:`trained_on`)."""

    session: str
    network: weakref.ref[Any]
    fingerprint: tuple[int, str]
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
        return cls(session, weakref.ref(network), fingerprint(network), settings, trainers, loaded)

    def trained_on(self, ref: Any, loader: Any) -> bool:
        """Whether the fit that left these trainers trained on minibatch ``ref`` read by ``loader`` (equal
        references, loaders that pickle alike): a fit going on with them need not probe it, since the
        network, unchanged since, took a step on it."""
        return self.first is not None and self.first[0] == ref and self.first[1] == cloudpickle.dumps(loader)

    def same(self, network: Any, settings: str) -> bool:
        """Whether ``network``, trained with ``settings``, is the one these trainers left, unchanged."""
        return self.network() is network and self.settings == settings and self.fingerprint == fingerprint(network)


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
