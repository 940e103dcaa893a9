"""``"topk"``, the default compressor: per-tensor top-k selection with values, biases and norm
weights dense, sparsity warm-up (Deep Gradient Compression, Lin et al. 2018).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

from dlscale.encoding import kernels
from dlscale.encoding.contract import CompressorState, Difference, Layout, MomentumMask, check_update
from dlscale.encoding.dense import ValueCompressor
from dlscale.encoding.wire import VALUE_DTYPES, ValueUpdate, host_bits

KERNELS = ("auto", "host", "device")
"""Where top-k's selection runs: ``"host"``, numpy's blocked scan (parameters on the CPU);
``"device"``, torch's ops with nothing read back (any device: what an accelerator runs, countable
on the CPU); ``"auto"``, the host's on the CPU and the device's elsewhere."""


@dataclass
class TopKState(CompressorState):
    """A :class:`CompressorState` that also keeps the :class:`~dlscale.encoding.kernels.Plan` of its
    density (``plan``), a flag per element of what the last message sent (``sent``, at the positions
    ``last``) and the mask of the momentum of this step's picks (``mask``), with the random numbers
    of its samples (``generator``: its own, so that compressing neither draws from nor depends on
    the program's random state)."""

    plan: kernels.Plan | None = None
    plan_density: float = -1.0
    sent: torch.Tensor | np.ndarray | None = None
    last: torch.Tensor | None = None
    mask: MomentumMask | None = None
    generator: torch.Generator | None = None


class TopKCompressor(ValueCompressor):
    """Per-tensor top-k with values (Deep Gradient Compression, Lin et al., ICLR 2018).

    Each tensor of two or more dimensions sends the ``density`` fraction of its residual's elements
    of largest magnitude, and at least ``min_elements`` of them (small tensors such as convolution
    kernels would otherwise wait many steps for each of their few elements), as values of type
    ``values`` (``"bf16"``, ``"fp16"`` or ``"fp32"``); what rounding to that type leaves stays in the
    residual, so nothing is lost. 1-D tensors (biases, norm weights) are sent whole at every step.
    Selection is per tensor, so a layer of small updates is sent as often as a layer of large ones.
    The density warms up: it starts at 1 (everything sent) and falls geometrically to ``density``
    over the first ``warmup_steps`` steps of the network's training (not of each fit).
    Each tensor's cut (the magnitude of its k-th largest element) is exact below ``exact_below``
    elements and taken from a random sample of about ``sample`` (in runs of 16 side by side: one
    cache line each) above, for every tensor at once (:mod:`dlscale.encoding.kernels`: a fixed
    number of ops whatever the number of tensors). ``kernels`` says how the elements are then chosen:
    on the host, every element not below its tensor's cut (close to k of them; exactly k for an
    exact cut without ties); on a device, the sum of the k of largest magnitude over their tensor's
    cut, a count the host knows, so the step never waits for the device (the message's values are
    checked to be finite as its bytes are made, on the host).
    The residual loses nothing (:attr:`~Compressor.lossless`).
    """

    lossless = True

    def __init__(
        self,
        density: float = 0.004,
        values: str = "bf16",
        warmup_steps: int = 20,
        min_elements: int = 32,
        exact_below: int = 1 << 16,
        sample: int = 1 << 14,
        kernels: str = "auto",
    ) -> None:
        if isinstance(density, bool) or not isinstance(density, numbers.Real) or not 0 < density <= 1:
            raise ValueError(f"density must be a number in (0, 1], got {density!r}")
        if values not in VALUE_DTYPES:
            raise ValueError(f"values must be one of {sorted(VALUE_DTYPES)}, got {values!r}")
        for name, value, low in (
            ("warmup_steps", warmup_steps, 0),
            ("min_elements", min_elements, 1),
            ("exact_below", exact_below, 1),
            ("sample", sample, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.density, self.values = float(density), values
        self.warmup_steps, self.min_elements = warmup_steps, min_elements
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        self.exact_below, self.sample, self.kernels = exact_below, sample, kernels

    def state(self, layout: Layout) -> TopKState:
        if self.kernels == "host" and layout.device.type != "cpu":
            raise ValueError(f"the host's kernels work on parameters on the CPU, not on {layout.device}")
        base = super().state(layout)
        return TopKState(layout, base.residual, generator=torch.Generator().manual_seed(0))

    def _on_host(self, state: TopKState) -> bool:
        return self.kernels == "host" or (self.kernels == "auto" and state.layout.device.type == "cpu")

    def _plan(self, state: TopKState) -> kernels.Plan:
        density = self.density_at(state.step)
        if state.plan is None or state.plan_density != density:
            state.plan = kernels.plan(state.layout, density, self.min_elements, self.exact_below, self.sample)
            state.plan_density = density
        return state.plan

    def density_at(self, step: int) -> float:
        """The density of step ``step`` (from 0): 1 at first, ``density`` from ``warmup_steps`` on."""
        if step >= self.warmup_steps:
            return self.density
        return self.density ** (step / self.warmup_steps)

    def compress(self, state: TopKState, update: torch.Tensor | Difference) -> ValueUpdate:
        check_update(self, state, update)
        r, host = state.residual, self._on_host(state)
        implied = isinstance(update, Difference)
        if implied and host:  # read where it lies: no residual written and read back
            a, b = update.params.detach(), update.shared.detach()
        else:
            if implied:
                update.into(r)
            else:
                r.add_(update.detach())
            a, b = r, None
        p = self._plan(state)
        cut = kernels.cuts(p, a, b, state.generator) if p.rows else None
        if host:
            limits = cut.tolist() if cut is not None else []
            index, picked = self._scan(p, a, b, limits)
            dense = a.index_select(0, p.dense)
            exact = torch.cat([dense if b is None else dense - b.index_select(0, p.dense), torch.from_numpy(picked)])
            index = torch.from_numpy(index)
            places = torch.cat([p.dense, index])
            state.threshold = min(limits, default=0.0)
        else:  # a count known on the host: nothing is read, nothing waits
            index = kernels.select(p, a, cut) if p.rows else p.dense[:0]
            places = torch.cat([p.dense, index])
            exact = a.index_select(0, places)
            state.threshold = cut.min() if cut is not None else 0.0
        message = ValueUpdate(p.length, p.ranges, index, exact.to(VALUE_DTYPES[self.values]), places, host)
        if host:  # every element not finite is among those sent; on a device, checked as its bytes are made
            kernels.check_sent(p.ranges, index.numpy(), host_bits(message.values), message.values.dtype)
        if not implied:  # what rounding lost stays; a Difference's caller adds the message to its shared
            kernels.add([message], [r], -1.0)
        state.mask = self._mask(state, index, places, host)
        state.step += 1
        state.density = message.count / p.length if p.length else 0.0
        return message

    def _scan(
        self, p: kernels.Plan, a: torch.Tensor, b: torch.Tensor | None, cut: list[float]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The host's picks: every element not below its row's cut, and of a row whose sample's cut fell
        so low that it found more than twice its ``k``, the ``k`` largest of those found."""
        if not cut:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        index, values, found = kernels.scan(p, a, b, cut)
        over = [i for i, (n, (_, _, k)) in enumerate(zip(found, p.rows, strict=True)) if n > 2 * k]
        if not over:
            return index, values
        bounds = np.cumsum([0, *found])
        keep = np.ones(len(index), np.bool_)
        for i in over:
            start, n, k = bounds[i], found[i], p.rows[i][2]
            keep[start + np.argpartition(np.abs(values[start : start + n]), n - k)[: n - k]] = False  # NaN last
        return index[keep], values[keep]

    def _mask(self, state: TopKState, index: torch.Tensor, places: torch.Tensor, host: bool) -> MomentumMask:
        """The momentum mask of this step's picks: each kept when the last message sent it (an element
        sent at every step waits for nothing and keeps its momentum, as in one process: masking it too
        would take momentum SGD's momentum away from every element a dense phase sends, such as the
        warm-up's); the flags of what was sent moved on to this message."""
        if state.sent is None:
            n = state.layout.length
            state.sent = np.zeros(n, np.bool_) if host else torch.zeros(n, dtype=torch.bool, device=index.device)
        if host:
            i = index.numpy()
            fresh = ~state.sent[i]
            if state.last is not None:
                state.sent[state.last.numpy()] = False
            state.sent[places.numpy()] = True
            mask = MomentumMask(torch.from_numpy(i[fresh]))
        else:
            mask = MomentumMask(index, state.sent.index_select(0, index))
            if state.last is not None:
                state.sent.index_fill_(0, state.last, False)
            state.sent.index_fill_(0, places, True)
        state.last = places
        return mask

    def momentum_mask(self, state: TopKState, message: ValueUpdate) -> MomentumMask:
        """The picks that waited: elements the message before this one did not send."""
        return state.mask

    def __repr__(self) -> str:
        return (
            f"TopKCompressor(density={self.density!r}, values={self.values!r}, warmup_steps={self.warmup_steps!r}, "
            f"min_elements={self.min_elements!r}, "
            f"exact_below={self.exact_below!r}, sample={self.sample!r}, kernels={self.kernels!r})"
        )
