"""The ways a gradient-sharing trainer keeps its update, one class each, chosen once per fit from the
session's compressor and aggregation (:func:`keeping`).

Every way fits a minibatch (:meth:`Keeping.fit`), turns the step into the message it sends
(:meth:`Keeping.encode`) and adds its peers' messages where they belong (:meth:`Keeping.receive`);
at the end it says what the shared parameters are (:meth:`Keeping.shared`) and what it has not sent
(:meth:`Keeping.residual`). A parked trainer parks its way of keeping, which the next fit takes back.

- :class:`SharedCopy` (a lossless compressor, updates summed): the shared parameters kept beside the
  replica, which keeps its whole update; the residual is the replica less them and is read where it
  lies (a :class:`~dlscale.encoding.Difference`). Invariant: replica = shared + residual.
- :class:`Weighed` (a lossless compressor, updates averaged): the replica keeps its update weighed by
  ``1 / live trainers``, as every replica applies it; the residual is the compressor's own.
  Invariant: replica = shared + residual, the shared parameters being the replica less the residual.
- :class:`TakenOut` (a compressor that is not lossless, DL4J's way): the update is taken out of the
  replica and the message put back, so every replica holds the shared parameters.
  Invariant: replica = shared.

A lossless trainer without a live peer sends nothing and trains as one process does (its updates
stay in its replica, and so in its residual). Nothing here reads a value on the host: losses,
thresholds and messages stay where the network computes until the trainer reads them.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch

from dlscale.encoding import Compressor, CompressorState, Difference, MomentumMask
from dlscale.nn.network import Network

MOMENTUM = "momentum_buffer"  # the optimizer state that momentum factor masking zeroes (SGD's, RMSprop's)


class Keeping(abc.ABC):
    """One trainer's way of keeping its update: its ``network``'s replica, the session's ``compressor``
    and the trainer's compressor ``state``; with ``momentum_masking``, the momentum of what a message
    sends after waiting is zeroed (Lin et al., "Deep Gradient Compression", ICLR 2018)."""

    def __init__(
        self, network: Network, compressor: Compressor, state: CompressorState, momentum_masking: bool
    ) -> None:
        self.network, self.compressor, self.state = network, compressor, state
        self.params = network.params()
        self.momentum_masking = momentum_masking
        self.targets: list[torch.Tensor] = [self.params]  # what a peer's message is added to

    def fit(self, batch: Any, alive: int) -> torch.Tensor:
        """One optimizer step on ``batch`` with ``alive`` live trainers; its loss, unread."""
        return self.network.step(batch)

    def encode(self, alive: int) -> Any | None:
        """The message of the step just fitted (``None``: nothing to send), its update kept as this way
        keeps it, and momentum masked."""
        if alive <= 1 and self.compressor.lossless:
            return None
        message = self._encode(alive)
        if message is not None and self.momentum_masking:
            mask = self.compressor.momentum_mask(self.state, message)
            if mask is not None:
                mask_momentum(self.network, mask)
        return message

    @abc.abstractmethod
    def _encode(self, alive: int) -> Any | None: ...

    def receive(self, messages: Sequence[tuple[Compressor, Any]]) -> None:
        """Add peers' messages, each with the compressor that reads it, to every target: a batch per
        compressor."""
        for codec in {id(c): c for c, _ in messages}.values():
            codec.apply_all([m for c, m in messages if c is codec], self.targets)

    @abc.abstractmethod
    def residual(self) -> torch.Tensor:
        """What this trainer has computed and not sent, as the compressor state's ``residual``."""

    @abc.abstractmethod
    def shared(self) -> torch.Tensor:
        """The shared parameters: the replica less what it has not sent."""


class SharedCopy(Keeping):
    """A lossless compressor, updates summed: the shared parameters beside the replica, a copy of its
    parameters at first."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.shared_params = self.params.detach().clone()
        self.targets.append(self.shared_params)  # peers' messages change the shared parameters too

    def _encode(self, alive: int) -> Any | None:
        message = self.compressor.compress(self.state, Difference(self.params, self.shared_params))
        if message is not None:  # what is sent leaves the residual by joining the shared parameters
            self.compressor.apply(message, self.shared_params)
        return message

    def residual(self) -> torch.Tensor:
        return Difference(self.params, self.shared_params).into(self.state.residual)

    def shared(self) -> torch.Tensor:
        return self.shared_params


class _Update(Keeping):
    """A way that takes the optimizer's update as the parameters' change over the step, weighed by
    ``1 / live trainers`` when the updates are averaged (``mean``)."""

    def __init__(self, *args: Any, mean: bool) -> None:
        super().__init__(*args)
        self.mean = mean
        self.before, self.update = torch.empty_like(self.params), torch.empty_like(self.params)

    def fit(self, batch: Any, alive: int) -> torch.Tensor:
        if alive > 1 or not self.compressor.lossless:
            self.before.copy_(self.params)
        return self.network.step(batch)

    def _take(self, alive: int) -> torch.Tensor:
        """The step's update, weighed by ``1 / alive`` when averaging with a live peer."""
        update = torch.sub(self.params, self.before, out=self.update)
        if self.mean and alive > 1:
            update.mul_(1 / alive)  # the sender weighs its update: every replica applies the same
        return update


class Weighed(_Update):
    """A lossless compressor, updates averaged: the replica keeps the weighed update."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args, mean=True)

    def _encode(self, alive: int) -> Any | None:
        update = self._take(alive)  # encoded only with a live peer: weighed
        self.params.sub_(update, alpha=alive - 1)
        return self.compressor.compress(self.state, update)

    def residual(self) -> torch.Tensor:
        return self.state.residual

    def shared(self) -> torch.Tensor:
        return self.params - self.state.residual


class TakenOut(_Update):
    """A compressor that is not lossless: the update goes to the compressor, and the replica takes the
    message instead, as every peer does."""

    def _encode(self, alive: int) -> Any | None:
        message = self.compressor.compress(self.state, self._take(alive))
        self.params.copy_(self.before)
        if message is not None:
            self.compressor.apply(message, self.params)
        return message

    def residual(self) -> torch.Tensor:
        return self.state.residual

    def shared(self) -> torch.Tensor:
        return self.params


def mask_momentum(network: Network, mask: MomentumMask) -> None:
    """Zero the momentum ``mask`` says (momentum factor masking, Lin et al., "Deep Gradient
    Compression", ICLR 2018): a sent element's momentum would otherwise go on pushing it the same way
    while its update is still on its way to the peers, whose own momentum pushes it too. In the
    optimizer's momentum laid out flat (:meth:`~dlscale.nn.Network.flat_optimizer_state`), one op
    whatever the number of tensors; optimizers that keep no ``momentum_buffer`` (Adam, whose updates
    are normalised per element) are left alone, and get no state."""
    momentum = network.flat_optimizer_state(MOMENTUM)
    if momentum is None:
        return
    at = mask.positions.to(momentum.device)
    if mask.keep is None:
        momentum.index_fill_(0, at, 0)
    else:  # a fixed number of ops, whatever how many are kept
        momentum.index_copy_(0, at, momentum.index_select(0, at).mul_(mask.keep))


def keeping(
    network: Network, compressor: Compressor, state: CompressorState, aggregation: str, momentum_masking: bool
) -> Keeping:
    """The way to keep updates for ``compressor`` and ``aggregation`` (``"sum"`` or ``"mean"``)."""
    args = (network, compressor, state, momentum_masking)
    if not compressor.lossless:
        return TakenOut(*args, mean=aggregation == "mean")
    return SharedCopy(*args) if aggregation == "sum" else Weighed(*args)
