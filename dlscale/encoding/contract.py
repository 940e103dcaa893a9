"""The contract of compressors: how a trainer's updates become the messages that gradient sharing exchanges.

A :class:`Compressor` is stateless and shared; each trainer holds its own
:class:`CompressorState` (made by :meth:`Compressor.state` from the parameters' :class:`Layout`),
whose *residual* is what the trainer computed and has not sent yet. At each step the trainer hands
the optimizer's update to :meth:`Compressor.compress`, which adds it to the residual, picks what to
send and takes exactly that out of the residual (error feedback: what is not sent now is sent later,
never lost unless the compressor says it discards something). Every replica, the sender's own
included, adds the message to its parameters with :meth:`Compressor.apply`.

:func:`check_update` and :func:`check_target` are the argument checks the built-in compressors share.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from dlscale.encoding.wire import MAX_LENGTH


@dataclass(frozen=True)
class Layout:
    """The parameters a compressor works on: each tensor's shape, in the order of the flat vector
    that holds them all, and the device they live on."""

    shapes: tuple[tuple[int, ...], ...]
    device: torch.device = torch.device("cpu")

    def __post_init__(self) -> None:
        shapes = tuple(tuple(int(d) for d in s) for s in self.shapes)
        if any(d < 0 for s in shapes for d in s):
            raise ValueError(f"parameter shapes must have non-negative sizes, got {self.shapes!r}")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "device", torch.device(self.device))
        if self.length > MAX_LENGTH:
            raise ValueError(f"a layout of {self.length} elements is longer than a message holds ({MAX_LENGTH})")

    @classmethod
    def of(cls, parameters: Iterable[torch.Tensor]) -> Layout:
        """The layout of ``parameters`` (a module's ``parameters()``, in the order they are flattened)."""
        tensors = list(parameters)
        device = tensors[0].device if tensors else torch.device("cpu")
        return cls(tuple(tuple(t.shape) for t in tensors), device)

    @functools.cached_property
    def numels(self) -> tuple[int, ...]:
        """Elements of each tensor."""
        return tuple(math.prod(s) for s in self.shapes)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each tensor starts in the flat vector."""
        return tuple(int(o) for o in np.cumsum((0, *self.numels))[:-1])

    @property
    def length(self) -> int:
        """Elements of the flat vector."""
        return sum(self.numels)


@dataclass
class CompressorState:
    """One trainer's state: the ``residual`` (a flat float32 vector of what it has computed and not
    sent yet), its ``step`` s in its network's training so far (a trainer starts at its network's
    minibatches over the trainers, so that a fit that goes on with a trained network does not warm
    up again), and what the last one sent: its ``threshold``
    (the smallest magnitude it would send; 0 when it sends everything; a 0-d tensor, unread, where
    the compressor works on a device) and ``density`` (elements sent over elements)."""

    layout: Layout
    residual: torch.Tensor
    step: int = 0
    threshold: float | torch.Tensor = 0.0
    density: float = 0.0


class MomentumMask(NamedTuple):
    """The optimizer momentum a message's sending masks (momentum factor masking): the flat
    ``positions`` (int64) it looks at and, for each, whether its momentum is kept (``keep``, bool);
    with ``keep`` ``None``, the momentum of every one of them is zeroed."""

    positions: torch.Tensor
    keep: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class Difference:
    """A residual that lies in two flat vectors: ``params - shared``, a lossless trainer's replica less
    the shared parameters beside it. Given to :meth:`Compressor.compress` in place of an update, it
    lets the compressor read the residual where it lies, in its own pass over the two, where
    subtracting first would write the whole residual and read it back at every step."""

    params: torch.Tensor
    shared: torch.Tensor

    def into(self, out: torch.Tensor) -> torch.Tensor:
        """``params - shared``, written to ``out``."""
        return torch.sub(self.params.detach(), self.shared, out=out)


class Compressor(abc.ABC):
    """Turns updates into messages and back: one instance serves every trainer, each with its own
    :class:`CompressorState`. Register a subclass with
    ``dlscale.registry.register("compressor", name, cls)`` to make ``SharedTrainingMaster(...,
    compressor=name)`` use it."""

    lossless: bool = False
    """Whether what :meth:`compress` takes in and does not send stays in the residual exactly, to be
    sent later (error feedback that loses nothing). A trainer then keeps its whole update in its own
    replica, whose parameters are the shared ones plus its residual, so that its next gradient is
    taken where it would be without compression; it applies only its peers' messages (and, summing
    them, hands :meth:`compress` a :class:`Difference`, which a lossless compressor must take).
    Otherwise a trainer applies its own message to its replica, as DL4J does, and every replica
    holds the shared parameters."""

    def state(self, layout: Layout) -> CompressorState:
        """A trainer's fresh state: an all-zero residual on the parameters' device."""
        return CompressorState(layout, torch.zeros(layout.length, dtype=torch.float32, device=layout.device))

    @abc.abstractmethod
    def compress(self, state: CompressorState, update: torch.Tensor | Difference) -> Any | None:
        """Add ``update`` (the flat float32 update, on the parameters' device; not kept) to the
        residual, take out what is sent, and return the message (``None`` when nothing is sent).
        A :class:`Difference` (which only a :attr:`lossless` compressor takes) *is* the residual:
        the caller adds the message to its ``shared``, which takes out what is sent, and the state's
        own ``residual`` is neither read nor kept (``difference.into(state.residual)`` sets it when
        it is wanted). A non-finite update raises :class:`~dlscale.encoding.NonFiniteUpdateError`."""

    @abc.abstractmethod
    def apply(self, message: Any, params: torch.Tensor, scale: float = 1.0) -> None:
        """Add ``scale`` times ``message`` to the flat vector ``params`` in place, on its device."""

    def apply_all(self, messages: Sequence[Any], targets: Sequence[torch.Tensor]) -> None:
        """Add every one of ``messages`` to every flat vector of ``targets`` (a trainer's peers'
        messages of a step, to its replica and shared parameters); a scheme whose messages can be
        added as one overrides this with a fixed number of ops, here one :meth:`apply` each."""
        for message in messages:
            for target in targets:
                self.apply(message, target)

    def stage(self, message: Any) -> Any:
        """``message``, its copy off the parameters' device started (:meth:`to_bytes` then waits for
        it), so that the next step's kernels are queued meanwhile; as it is when the parameters live
        on the host."""
        return message

    @abc.abstractmethod
    def to_bytes(self, message: Any) -> bytes:
        """The message on the wire: versioned, with a magic and a CRC-32C."""

    @abc.abstractmethod
    def from_bytes(self, data: bytes | bytearray | memoryview) -> Any:
        """The message :meth:`to_bytes` wrote; damaged or inconsistent bytes raise
        :class:`~dlscale.errors.CorruptDataError`."""

    @abc.abstractmethod
    def momentum_mask(self, state: CompressorState, message: Any) -> MomentumMask | None:
        """The optimizer momentum zeroed after ``message``, the message :meth:`compress` just returned
        for ``state``, is sent (momentum factor masking): that of elements that waited in the
        residual; ``None`` for none."""

    def describe(self, state: CompressorState, message: Any) -> dict[str, float | int | str]:
        """What encoding debug mode logs about one step: the message and the residual it left."""
        r = state.residual.detach()
        magnitude = r.abs()
        size = len(self.to_bytes(message)) if message is not None else 0
        cut = float(state.threshold)
        return {
            "form": type(message).__name__ if message is not None else "no",
            "threshold": cut,
            "length": state.layout.length,
            "sparsity": state.density,
            "message_bytes": size,
            "dense_bytes": 4 * state.layout.length,
            "residual_l2": float(torch.linalg.vector_norm(r, dtype=torch.float64)),
            "residual_max_abs": float(magnitude.max()) if r.numel() else 0.0,
            "residual_above_threshold": int(torch.count_nonzero(magnitude >= cut)) if cut > 0 else 0,
        }


def check_target(params: torch.Tensor, length: int) -> None:
    if not isinstance(params, torch.Tensor) or params.dim() != 1:
        raise ValueError(f"params must be a 1-D tensor, got {params!r:.80}")
    if params.numel() != length:
        raise ValueError(f"params has {params.numel()} elements, the message describes {length}")


def check_update(compressor: Compressor, state: CompressorState, update: torch.Tensor | Difference) -> None:
    if isinstance(update, Difference):
        if not compressor.lossless:
            raise TypeError(f"{compressor!r} is not lossless: give it the update, not a Difference")
        tensors = (update.params, update.shared)
    else:
        tensors = (update,)
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != state.layout.length:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"update must be a flat tensor of {state.layout.length} elements, got {got}")
