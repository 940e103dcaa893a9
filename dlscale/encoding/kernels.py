"""The kernels of value messages and of top-k selection: adding a
:class:`~dlscale.encoding.wire.ValueUpdate` to parameters (:func:`apply_values`), picking the
elements of largest magnitude (exactly, :func:`top`, or from a sample's cut, :func:`sample` and
:func:`scan`), checking that what is sent is finite (:func:`check_sent`) and finding the picks that
waited (:func:`waited`).
"""

from __future__ import annotations

import numpy as np
import torch

from dlscale.encoding.contract import check_target
from dlscale.encoding.wire import ValueUpdate
from dlscale.errors import NonFiniteUpdateError


def apply_values(message: ValueUpdate, params: torch.Tensor, scale: float) -> None:
    check_target(params, message.length)
    values = message.values.to(params.device, params.dtype)
    if scale != 1:
        values = values * scale
    at = 0
    for a, b in message.ranges:
        params[a:b] += values[at : at + b - a]
        at += b - a
    if message.index.numel():
        params.index_add_(0, message.index.to(params.device), values[at:])


def top(part: torch.Tensor, k: int) -> torch.Tensor:
    """The increasing positions of the ``k`` elements of largest magnitude in ``part``."""
    return torch.sort(torch.topk(part.abs(), k, sorted=False).indices).values


_RUN = 16  # elements a sample reads side by side: one 64-byte cache line of float32


def sample(a: torch.Tensor, b: torch.Tensor | None, size: int, generator: torch.Generator) -> torch.Tensor:
    """About ``size`` elements of the residual ``a - b`` (``a`` when ``b`` is ``None``), in runs of
    :data:`_RUN` at random places (with replacement): one cache line read per run, where as many
    single elements would each miss the cache; the whole residual when it is no larger."""
    n = a.numel()
    if n <= size or n < _RUN:
        return a if b is None else a - b
    starts = torch.randint(0, n - _RUN + 1, (max(1, size // _RUN),), generator=generator)
    at = (starts[:, None] + torch.arange(_RUN)).reshape(-1)
    values = a.index_select(0, at)
    return values if b is None else values - b.index_select(0, at)


_BLOCK = 1 << 16  # elements a scan works on at once: its scratch stays in the core's cache


def scan(a: torch.Tensor, b: torch.Tensor | None, cut: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The increasing positions (int64) and values of the elements of the residual ``a - b`` (``a``
    when ``b`` is ``None``; 1-D float32 CPU tensors) whose magnitude is not below ``cut``: those at
    least ``cut``, and every one that is not finite. Block by block, by numpy's kernels (on one
    thread faster than torch's): the residual is read once from memory and never written, its
    values taken from the block in the cache."""
    x = a.numpy()
    y = None if b is None else b.numpy()
    n = len(x)
    size = min(n, _BLOCK)
    scratch, magnitude, low = np.empty(size, np.float32), np.empty(size, np.float32), np.empty(size, np.bool_)
    c = np.float32(cut)
    positions, values = [], []
    for at in range(0, n, _BLOCK):
        m = min(_BLOCK, n - at)
        if y is None:
            d = x[at : at + m]
        else:
            d = scratch[:m]
            np.subtract(x[at : at + m], y[at : at + m], out=d)
        np.abs(d, out=magnitude[:m])
        np.less(magnitude[:m], c, out=low[:m])
        np.logical_not(low[:m], out=low[:m])  # NaN is not below the cut
        found = np.flatnonzero(low[:m])
        if len(found):
            positions.append(found + at)
            values.append(d[found])
    if not positions:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32)
    return torch.from_numpy(np.concatenate(positions)), torch.from_numpy(np.concatenate(values))


def check_sent(message: ValueUpdate, exact: torch.Tensor) -> None:
    """Raise :class:`NonFiniteUpdateError` naming the first element of ``message``, whose float32
    values are ``exact``, that is not finite."""
    bad = ~torch.isfinite(exact)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        element = int(message.positions()[i])
        raise NonFiniteUpdateError(f"residual element {element} is {float(exact[i])}: the update is not finite")


def waited(index: torch.Tensor, last: ValueUpdate | None) -> torch.Tensor:
    """The positions of ``index`` (increasing) that the ``last`` message did not send, found by
    searching its sorted positions (numpy's search on the CPU, several times faster than torch's)
    rather than flags over every element."""
    if last is None:
        return index
    bounds = [p for r in last.ranges for p in r]
    if index.device.type == "cpu":
        i, sent = index.numpy(), last.index.numpy()
        fresh = np.ones(len(i), np.bool_)
        if len(sent):
            fresh &= sent[np.minimum(np.searchsorted(sent, i), len(sent) - 1)] != i
        if bounds:
            fresh &= np.searchsorted(np.asarray(bounds, np.int64), i, side="right") % 2 == 0
        return torch.from_numpy(i[fresh])
    fresh = torch.ones_like(index, dtype=torch.bool)
    if last.index.numel():
        at = torch.searchsorted(last.index, index).clamp_(max=last.index.numel() - 1)
        fresh &= last.index.index_select(0, at) != index
    if bounds:
        fresh &= torch.searchsorted(torch.tensor(bounds, device=index.device), index, right=True) % 2 == 0
    return index.masked_select(fresh)


def merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent ranges joined."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
