"""A trainer's state as one flat vector, for a round's averaging (``_exchange``).

The vector holds the change of the parameters since the round began (the same starting point on every
trainer) and the values of the floating buffers (batch-norm statistics) and, with ``save_updater``,
of the optimizer's floating state (momentum), laid out by name and shape after the parameters. What a
step keeps aside (step counts, integer buffers) travels apart, in plain form. An average sets the state
back: the parameters move by the averaged change, the rest takes the averaged values. A trainer that
streams its rounds takes a round's average during the next round, keeping its progress made since it
sent its state (:meth:`FlatState.mark`, :meth:`FlatState.settle`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from dlscale.nn.network import Network, cpu_copy


def _plain(value: Any) -> Any:
    """A value set aside (a step count, an integer buffer) in plain form for the comms."""
    if isinstance(value, torch.Tensor):
        return {"tensor": value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    return value


def _unplain(value: Any, device: torch.device) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]), device=device)
    return value


class FlatState:
    """``network``'s state as one vector laid out as the module docstring says, read at a round's start
    (:meth:`begin`) and at its end (:meth:`vector`), and set from an average (:meth:`apply`)."""

    def __init__(self, network: Network, with_optimizer: bool) -> None:
        self.network, self.with_optimizer = network, with_optimizer
        self.params = network.params()
        self.anchor = self.params.detach().clone()  # the parameters when the round began
        self._buffer = torch.empty(0, dtype=torch.float32, device=self.params.device)
        # where rounds' averages are assembled, in turn: the last round's stays whole for peers that
        # missed part of it while the next is assembled
        self._averages = [torch.empty(0, dtype=torch.float32, device=self.params.device) for _ in range(2)]
        self._turn = 0
        self._layout: list[list[Any]] = []  # the layout of the last vector
        self._sent = torch.empty(0, dtype=torch.float32, device=self.params.device)  # streaming: see mark

    def begin(self) -> None:
        """The round begins from the parameters as they are now."""
        self.anchor.copy_(self.params)
        self._turn ^= 1

    def renew(self) -> None:
        """Take a new buffer for the next vector: sends still in flight read the last one."""
        self._buffer = torch.empty(0, dtype=torch.float32, device=self.params.device)

    # -- streaming rounds: the average taken during the next round ---------------------------------
    def mark(self) -> None:
        """The state was just sent (:meth:`vector`): what is fitted from here on is this trainer's own
        progress, which :meth:`settle` carries over the round's average."""
        if self._sent.shape != self.params.shape:
            self._sent = torch.empty_like(self.params)
        self._sent.copy_(self.params)

    def settle(
        self,
        average: torch.Tensor,
        layout: list[list[Any]],
        kept: dict[str, Any],
        outer: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Take the average of the round sent at :meth:`mark` keeping the progress made since:
        :meth:`apply` with ``carry``, the anchor becoming the averaged parameters."""
        self.apply(average, layout, kept, outer, carry=True)
        self._turn ^= 1

    def keep_own(self) -> None:
        """A lone trainer's round: its state as sent is the round's average (nothing to apply)."""
        self.anchor.copy_(self._sent)
        self._turn ^= 1

    def _sent_parts(self) -> dict[str, torch.Tensor]:
        """The tensors after the parameters as the last vector holds them, by name."""
        return dict(self._laid_out(self._buffer, self._layout))

    def _laid_out(self, vector: torch.Tensor, layout: list[list[Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor after the parameters in ``vector`` laid out by ``layout``: its name and a view."""
        offset = self.params.numel()
        for name, shape in layout:
            size = int(np.prod(shape)) if shape else 1
            yield name, vector[offset : offset + size].view(shape)
            offset += size

    def _parts(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """The floating tensors after the parameters, by name, and the values set aside."""
        tensors, kept = [], {}
        for name, b in self.network.module.named_buffers():
            if b.is_floating_point() and b.dim() > 0:
                tensors.append((f"buffer/{name}", b))
            else:
                kept[f"buffer/{name}"] = _plain(b)
        if self.with_optimizer:
            optimizer = self.network.optimizer
            params = [p for g in optimizer.param_groups for p in g["params"]]
            for i, p in enumerate(params):
                for key, v in sorted(optimizer.state.get(p, {}).items()):
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                        tensors.append((f"optimizer/{i}/{key}", v))
                    else:
                        kept[f"optimizer/{i}/{key}"] = _plain(v)
        return tensors, kept

    def vector(self) -> tuple[torch.Tensor, list[list[Any]], dict[str, Any]]:
        """The vector now (a buffer reused from round to round), its layout (name and shape of each
        tensor after the parameters) and the values set aside."""
        tensors, kept = self._parts()
        n = self.params.numel()
        total = n + sum(t.numel() for _, t in tensors)
        if self._buffer.numel() != total:
            self._buffer = torch.empty(total, dtype=torch.float32, device=self.params.device)
        v = self._buffer
        torch.sub(self.params.detach(), self.anchor, out=v[:n])
        offset = n
        for _, t in tensors:
            v[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
            offset += t.numel()
        self._layout = [[name, list(t.shape)] for name, t in tensors]
        return v, self._layout, kept

    def average_buffer(self, length: int) -> torch.Tensor:
        """A buffer of ``length`` for this round's average (the same for every attempt; reused every
        other round)."""
        if self._averages[self._turn].numel() != length:
            self._averages[self._turn] = torch.empty(length, dtype=torch.float32, device=self.params.device)
        return self._averages[self._turn]

    def averaged(self, average: torch.Tensor, layout: list[list[Any]], carried: bool) -> dict[str, Any]:
        """A CPU copy of the state that a round's ``average`` (laid out by ``layout``), just taken, stands
        for, as ``state_of`` gives a network's: the averaged parameters (the anchor once the average was
        carried over, :meth:`settle`; else the parameters), the buffers and optimizer state as averaged
        (a streaming trainer's own hold its progress since), and the values set aside as taken."""
        buffers = {name: cpu_copy(b) for name, b in self.network.module.named_buffers()}
        optimizer = cpu_copy(self.network.optimizer_state()) if self.with_optimizer else None
        for name, value in self._laid_out(average, layout):
            kind, _, rest = name.partition("/")
            if kind == "buffer":
                buffers[rest] = cpu_copy(value)
            elif optimizer is not None:
                index, _, key = rest.partition("/")
                optimizer["state"][int(index)][key] = cpu_copy(value)
        return {"params": cpu_copy(self.anchor if carried else self.params), "buffers": buffers, "optimizer": optimizer}

    def apply(
        self,
        average: torch.Tensor,
        layout: list[list[Any]],
        kept: dict[str, Any],
        outer: Callable[[torch.Tensor], None] | None = None,
        carry: bool = False,
    ) -> None:
        """Set the state from ``average`` (laid out by ``layout``, with ``kept`` set aside): the
        parameters move by the averaged change (or as ``outer``, given the parameters' averaged change,
        moves them), the rest takes the averaged values. With ``carry`` (streaming) every tensor then
        adds its own change since :meth:`mark` (one that was not sent keeps its own value) and the
        anchor becomes the averaged parameters: with no step since, the state is the average exactly."""
        n = self.params.numel()
        with torch.no_grad():
            if not carry:
                if outer is None:
                    torch.add(self.anchor, average[:n], out=self.params)
                else:
                    outer(average[:n])
            elif outer is None:  # in place: the progress since it was sent, on the averaged parameters
                self.params.sub_(self._sent)
                self.anchor.add_(average[:n])
                self.params.add_(self.anchor)
            else:
                progress = self.params - self._sent
                outer(average[:n])  # the anchor and the parameters take the outer step
                self.params.add_(progress)
            sent = self._sent_parts() if carry else {}
            named = dict(self.network.module.named_buffers())
            optimizer = self.network.optimizer
            params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
            for name, value in self._laid_out(average, layout):
                kind, _, rest = name.partition("/")
                if kind == "buffer":
                    target = named[rest]
                else:
                    index, _, key = rest.partition("/")
                    state = optimizer.state[params[int(index)]]
                    target = state.get(key)
                    if not (isinstance(target, torch.Tensor) and target.shape == value.shape):
                        state[key] = value.clone()
                        continue
                if not carry:
                    target.copy_(value)
                elif name in sent:  # its own change since it was sent, on the average
                    target.sub_(sent[name]).add_(value)
            for name, value in kept.items():
                kind, _, rest = name.partition("/")
                value = _unplain(value, self.params.device)
                if kind == "buffer":
                    named[rest].copy_(value)
                else:
                    index, _, key = rest.partition("/")
                    optimizer.state[params[int(index)]][key] = value
