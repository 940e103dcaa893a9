"""The kernels of value messages and of top-k selection, each a fixed number of ops on the flat
vectors whatever the number of tensors in the layout.

Top-k works from a :class:`Plan`, made once per layout and density: which tensors are sent whole
(``ranges``), and for each of the others (a *row*) its ``k`` and where a sample of its residual is
read. :func:`cuts` finds every row's cut (the magnitude of its ``k``-th largest element) in one
gather and one top-k over a rows x width matrix: a tensor below the plan's ``exact_below`` lies
whole in its row, so its cut is exact; a larger one is sampled in runs of :data:`RUN` elements at
random places (one cache line each). Then the elements are chosen in one of two ways:

- on the host (:func:`scan`, numpy's kernels): every element not below its tensor's cut, in one
  pass over the flat residual in blocks that each lie within one tensor and stay in the core's
  cache (the count is then close to ``k``; exactly ``k`` for an exact row without ties);
- on a device (:func:`select`, torch's): the ``sum(k)`` elements of largest magnitude over their
  tensor's cut, one top-k over the flat vector: a count known on the host, so nothing is read
  back and nothing waits.

Every element that is not finite is among those chosen either way (NaN ranks above everything, and
is not below any cut), so checking the values sent (:func:`check_sent`) checks the whole residual.
Messages are added to parameters by :func:`add` with one ``index_add_`` per target, a batch of
messages at once, and :func:`waited` finds the picks the last message did not send from a map of
what it sent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dlscale.encoding.contract import Layout, check_target
from dlscale.encoding.wire import ValueUpdate, finite_bits
from dlscale.errors import NonFiniteUpdateError

RUN = 16  # elements a sample reads side by side: one 64-byte cache line of float32
BLOCK = 1 << 18  # elements a host scan works on at once: its scratch stays in the core's cache (1 MiB a buffer)


@dataclass(frozen=True, eq=False)
class Plan:
    """How top-k treats a layout at one density (see the module's docstring); its tensors live on
    the layout's device."""

    length: int
    ranges: tuple[tuple[int, int], ...]  # tensors sent whole, adjacent ones merged
    rows: tuple[tuple[int, int, int], ...]  # (offset, elements, k) of each tensor chosen from
    top: int  # the largest rank of a cut in its row
    static: torch.Tensor  # rows x width positions of the exact rows' elements (padded)
    pad: torch.Tensor  # rows x width: columns past an exact row's elements
    sampled: torch.Tensor  # rows x 1: rows read from a sample
    spans: torch.Tensor  # rows x 1: where a sampled row's runs may start, from its offset
    starts: torch.Tensor  # rows x 1: each row's offset
    ranks: torch.Tensor  # rows x 1: the rank of each row's cut in its sample, from 0
    run: torch.Tensor  # 0 .. RUN - 1
    dense: torch.Tensor  # the positions of the elements sent whole
    segment_rows: torch.Tensor  # each tensor's row, in order; the tensors sent whole: one past the last row
    segment_sizes: torch.Tensor  # each tensor's elements, in order
    blocks: tuple[tuple[int, int, int], ...]  # (start, stop, row) of the host scan

    @property
    def count(self) -> int:
        """Elements a device selection picks: every row's ``k``."""
        return sum(k for _, _, k in self.rows)

    @property
    def width(self) -> int:
        return self.static.shape[1]


def plan(layout: Layout, density: float, min_elements: int, exact_below: int, sample: int) -> Plan:
    """The :class:`Plan` of ``layout`` at ``density``: a tensor of one dimension, or one whose ``k``
    (``density`` of its elements, at least ``min_elements``) is a third of it or more, is sent whole
    (a third sent with indices costs what the whole does without); the others are rows, read whole
    below ``exact_below`` elements and from about ``sample`` elements above."""
    ranges: list[tuple[int, int]] = []
    rows: list[tuple[int, int, int]] = []
    segments: list[tuple[int, int, int]] = []
    for offset, n, shape in zip(layout.offsets, layout.numels, layout.shapes, strict=True):
        if not n:
            continue
        k = min(n, max(min_elements, math.ceil(density * n)))
        if len(shape) <= 1 or 3 * k >= n:
            ranges.append((offset, offset + n))
            segments.append((offset, offset + n, -1))
        else:
            segments.append((offset, offset + n, len(rows)))
            rows.append((offset, n, k))
    exact = [n < exact_below or n < RUN for _, n, _ in rows]
    width = max([n for (_, n, _), e in zip(rows, exact, strict=True) if e] + [sample if not all(exact) else 1])
    width = -(-width // RUN) * RUN
    static = np.zeros((len(rows), width), np.int64)
    pad = np.zeros((len(rows), width), np.bool_)
    ranks = []
    for i, ((offset, n, k), e) in enumerate(zip(rows, exact, strict=True)):
        if e:
            static[i, :n] = offset + np.arange(n)
            static[i, n:] = offset
            pad[i, n:] = True
        ranks.append(k - 1 if e else max(1, math.ceil(k * width / n)) - 1)
    device = layout.device
    blocks = [(a, min(a + BLOCK, b), row) for a, b, row in segments if row >= 0 for a in range(a, b, BLOCK)]
    dense = np.concatenate([np.arange(a, b) for a, b in _merge(ranges)] or [np.zeros(0, np.int64)])

    def put(array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.as_tensor(array, dtype=dtype).to(device)

    return Plan(
        length=layout.length,
        ranges=tuple(_merge(ranges)),
        rows=tuple(rows),
        top=max(ranks, default=-1) + 1,
        static=put(static),
        pad=put(pad, torch.bool),
        sampled=put(np.array([[not e] for e in exact], np.bool_).reshape(-1, 1), torch.bool),
        spans=put(np.array([[n - RUN + 1] for _, n, _ in rows]).reshape(-1, 1), torch.float32),
        starts=put(np.array([[o] for o, _, _ in rows]).reshape(-1, 1)),
        ranks=put(np.array(ranks).reshape(-1, 1)),
        run=put(np.arange(RUN)),
        dense=put(dense),
        segment_rows=put(np.array([row if row >= 0 else len(rows) for _, _, row in segments], np.int64)),
        segment_sizes=put(np.array([b - a for a, b, _ in segments], np.int64)),
        blocks=tuple(blocks),
    )


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent ranges joined."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def cuts(p: Plan, a: torch.Tensor, b: torch.Tensor | None, generator: torch.Generator) -> torch.Tensor:
    """Each row's cut in the residual ``a - b`` (``a`` when ``b`` is ``None``): the magnitude of its
    ``k``-th largest element, exact for a row read whole, estimated from a sample of random runs
    (drawn from ``generator``, on the host) for the others."""
    draws = torch.rand((len(p.rows), p.width // RUN), generator=generator).to(a.device)
    runs = ((draws * p.spans).long() + p.starts).unsqueeze(2) + p.run
    where = torch.where(p.sampled, runs.view(len(p.rows), p.width), p.static).view(-1)
    magnitude = (a.index_select(0, where) if b is None else a.index_select(0, where) - b.index_select(0, where)).abs()
    magnitude = magnitude.view(len(p.rows), p.width).masked_fill_(p.pad, -1.0)
    return torch.topk(magnitude, p.top, dim=1).values.gather(1, p.ranks).view(-1)


def select(p: Plan, d: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """The increasing positions of the ``p.count`` elements of ``d`` (the residual, flat) of largest
    magnitude over their row's ``cut``, elements sent whole excluded: one top-k of the flat vector,
    whose size the host knows without reading anything."""
    scale = torch.nn.functional.pad(cut.reciprocal(), (0, 1))  # a whole tensor's elements: scaled to 0...
    scale = scale.index_select(0, p.segment_rows).repeat_interleave(p.segment_sizes, output_size=p.length)
    score = d.abs().mul_(scale).index_fill_(0, p.dense, -1.0)  # ...then below every other, NaN included
    return torch.topk(score, p.count, sorted=False).indices.sort().values


def scan(
    p: Plan, a: torch.Tensor, b: torch.Tensor | None, cut: list[float]
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The increasing positions (int64) and float32 values of the elements of the residual ``a - b``
    (``a`` when ``b`` is ``None``; flat float32 CPU tensors) not below their row's ``cut`` (those at
    least the cut, and every one that is not finite), with how many each row found. Block by block,
    by numpy's kernels (on one thread faster than torch's): the residual is read once from memory and
    never written, its values taken from the block in the cache."""
    x = a.detach().numpy()
    y = None if b is None else b.detach().numpy()
    size = min(BLOCK, p.length) if p.length else 0
    scratch, magnitude, low = np.empty(size, np.float32), np.empty(size, np.float32), np.empty(size, np.bool_)
    limits = np.asarray(cut, np.float32)
    positions, values, found_in = [], [], [0] * len(p.rows)
    for start, stop, row in p.blocks:
        m = stop - start
        if y is None:
            d = x[start:stop]
        else:
            d = scratch[:m]
            np.subtract(x[start:stop], y[start:stop], out=d)
        np.abs(d, out=magnitude[:m])
        np.less(magnitude[:m], limits[row], out=low[:m])
        np.logical_not(low[:m], out=low[:m])  # NaN is not below the cut
        found = np.flatnonzero(low[:m])
        if len(found):
            positions.append(found + start)
            values.append(d[found])
            found_in[row] += len(found)
    if not positions:
        return np.zeros(0, np.int64), np.zeros(0, np.float32), found_in
    return np.concatenate(positions), np.concatenate(values), found_in


def add(messages: Sequence[ValueUpdate], targets: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Add ``scale`` times every one of ``messages`` to every flat vector of ``targets``: a message of
    every element (the ``"dense"`` compressor's) whole, one ``add_`` per target; the others' positions
    and values joined, then one ``index_add_`` per target."""
    for target in targets:
        for message in messages:
            check_target(target, message.length)
    whole = [m for m in messages if not m.index.numel() and m.ranges == ((0, m.length),)]
    for message in whole:
        for target in targets:
            target.add_(message.values.to(target.device, target.dtype), alpha=scale)
    parts = [m for m in messages if all(m is not w for w in whole)]
    if not parts or not targets:
        return
    device = targets[0].device
    at = torch.cat([m.positions().to(device) for m in parts]) if len(parts) > 1 else parts[0].positions()
    amounts = torch.cat([m.values.to(device) for m in parts]) if len(parts) > 1 else parts[0].values
    amounts = amounts.to(device, torch.float32)
    if scale != 1:
        amounts = amounts * scale
    for target in targets:
        target.index_add_(0, at.to(target.device), amounts.to(target.device, target.dtype))


def check_sent(ranges: tuple[tuple[int, int], ...], index: np.ndarray, bits: np.ndarray, dtype: torch.dtype) -> None:
    """Raise :class:`NonFiniteUpdateError` naming the first element of a message (its ``ranges``, its
    ``index`` and the ``bits`` of its values of type ``dtype``, on the host) that is not finite."""
    finite = finite_bits(bits, dtype)
    if finite.all():
        return
    i = int(np.argmin(finite))
    positions = np.concatenate([*(np.arange(a, b) for a, b in ranges), index])
    value = float(torch.from_numpy(bits[i : i + 1].copy()).view(dtype)[0])
    raise NonFiniteUpdateError(f"residual element {int(positions[i])} is {value}: the update is not finite")
