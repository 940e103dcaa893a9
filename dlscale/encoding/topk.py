"""``"topk"``, the default compressor: per-tensor top-k selection with values, biases and norm
weights dense, sparsity warm-up (Deep Gradient Compression, Lin et al. 2018).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch

from dlscale.encoding import kernels
from dlscale.encoding.contract import CompressorState, Difference, Layout, check_update
from dlscale.encoding.dense import ValueCompressor
from dlscale.encoding.threshold import check_finite
from dlscale.encoding.wire import VALUE_DTYPES, ValueUpdate


@dataclass
class TopKState(CompressorState):
    """A :class:`CompressorState` that also knows what the last message sent (``last``: its ranges and
    index, no values) and which of this step's picks were not among it (``waited``), with the random
    numbers of its samples (``generator``: its own, so that compressing neither draws from nor
    depends on the program's random state)."""

    last: ValueUpdate | None = None
    waited: torch.Tensor | None = None
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
    On the CPU, tensors of more than ``exact_below`` elements pick their cut from a random sample of
    about ``sample`` elements (in runs of 16 side by side: one cache line each) instead of an exact
    top-k (the sent count is then close to, not exactly, k); on a GPU every tensor's
    top-k is exact and the step stays on the device, with one round trip to the host (the finiteness
    check and the statistics) besides the message's own bytes.
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
        self.exact_below, self.sample = exact_below, sample

    def state(self, layout: Layout) -> TopKState:
        base = super().state(layout)
        return TopKState(layout, base.residual, generator=torch.Generator().manual_seed(0))

    def density_at(self, step: int) -> float:
        """The density of step ``step`` (from 0): 1 at first, ``density`` from ``warmup_steps`` on."""
        if step >= self.warmup_steps:
            return self.density
        return self.density ** (step / self.warmup_steps)

    def compress(self, state: TopKState, update: torch.Tensor | Difference) -> ValueUpdate:
        check_update(self, state, update)
        r = state.residual
        on_host = r.device.type == "cpu"
        implied = isinstance(update, Difference)
        if implied and on_host:  # read where it lies: no residual written and read back
            minuend, subtrahend = update.params.detach(), update.shared.detach()
        else:
            if implied:
                update.into(r)
            else:
                r.add_(update.detach())
            minuend, subtrahend = r, None
        layout, dtype = state.layout, VALUE_DTYPES[self.values]
        density = self.density_at(state.step)
        ranges: list[tuple[int, int]] = []
        picks: list[torch.Tensor] = []
        picked: list[torch.Tensor] = []
        for offset, n, shape in zip(layout.offsets, layout.numels, layout.shapes, strict=True):
            if not n:
                continue
            k = min(n, max(self.min_elements, math.ceil(density * n)))
            if len(shape) <= 1 or 3 * k >= n:  # a third sent with indices costs what the whole does without
                ranges.append((offset, offset + n))
                continue
            a = minuend[offset : offset + n]
            b = None if subtrahend is None else subtrahend[offset : offset + n]
            if on_host:
                index, values = self._select(a, b, k, state.generator)
            else:
                index = kernels.top(a, k)
                values = a.index_select(0, index)
            picks.append(index + offset)
            picked.append(values)
        ranges = kernels.merge(ranges)
        dense = [minuend[a:b] if subtrahend is None else minuend[a:b] - subtrahend[a:b] for a, b in ranges]
        exact = torch.cat([*dense, *picked]).to(torch.float32) if dense or picked else r.new_zeros(0)
        index = torch.cat(picks) if picks else torch.zeros(0, dtype=torch.int64, device=r.device)
        message = ValueUpdate(layout.length, tuple(ranges), index, exact.to(dtype))
        sparse = exact[exact.numel() - index.numel() :].abs()
        smallest = sparse.min() if sparse.numel() else exact.new_zeros(())
        if on_host:  # every element not finite is among those sent: see _select
            kernels.check_sent(message, exact)
            cut = float(smallest)
        else:  # one round trip to the host a step: the finiteness check and the smallest value sent
            total, cut = torch.stack([r.sum(), smallest]).tolist()
            if not math.isfinite(total):
                check_finite(r)
        if not implied:  # what rounding lost stays; a Difference's caller adds the message to its shared
            kernels.apply_values(message, r, -1.0)
        state.waited = kernels.waited(index, state.last)
        state.last = dataclasses.replace(message, values=message.values[:0])
        state.step += 1
        state.threshold = cut
        state.density = message.count / layout.length if layout.length else 0.0
        return message

    def _select(
        self, a: torch.Tensor, b: torch.Tensor | None, k: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The increasing positions of about ``k`` elements of largest magnitude in the residual
        ``a - b`` (``a`` when ``b`` is ``None``; on the CPU), and their values. Every element that is
        not finite is among them (``topk`` ranks NaN above all, the scan keeps what is not below the
        cut), so that checking the values sent checks the whole residual."""
        n = a.numel()
        if n < self.exact_below:
            r = a if b is None else a - b
            index = kernels.top(r, k)
            return index, r.index_select(0, index)
        sample = kernels.sample(a, b, self.sample, generator).abs()
        cut = float(torch.topk(sample, max(1, math.ceil(k * sample.numel() / n))).values[-1])
        index, values = kernels.scan(a, b, cut)
        if index.numel() > 2 * k:  # a sample's cut that fell too low: the k largest of those found
            top = torch.sort(torch.topk(values.abs(), k, sorted=False).indices).values
            index, values = index.index_select(0, top), values.index_select(0, top)
        return index, values

    def momentum_mask(self, state: TopKState, message: ValueUpdate) -> torch.Tensor:
        """The picks that waited: elements the message before this one did not send. An element
        sent at every step waits for nothing and keeps its momentum, as in one process (masking
        it too would take momentum SGD's momentum away from every element a dense phase sends,
        such as the warm-up's)."""
        return state.waited

    def __repr__(self) -> str:
        return (
            f"TopKCompressor(density={self.density!r}, values={self.values!r}, warmup_steps={self.warmup_steps!r}, "
            f"min_elements={self.min_elements!r}, "
            f"exact_below={self.exact_below!r}, sample={self.sample!r})"
        )
