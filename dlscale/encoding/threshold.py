"""Threshold encoding of updates (Strom, Interspeech 2015), as in Deeplearning4j's gradient sharing.

A trainer adds each update to a float32 *residual*; :func:`encode` then sends every element with
``|r| >= t`` as ``sign(r) * t`` and subtracts what it sent from the residual, so that nothing is
lost: what is not sent now stays in the residual for a later step. Every replica, the sender's own
included, adds the message to its parameters with :func:`apply`. The messages and their bytes are
:class:`~dlscale.encoding.wire.EncodedUpdate`.

A residual or target on the CPU is encoded and updated by numpy's kernels; one on a GPU by torch's,
on the GPU, so that only the message itself crosses to the host (and back, at a peer).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dlscale.encoding.wire import BITMAP, FORMS, MAX_LENGTH, SHIFTS, SPARSE, EncodedUpdate, bitmap_bytes
from dlscale.errors import NonFiniteUpdateError

_BLOCK = 64  # elements per block of the coarse first scan
_GATHER = 8  # gather the blocks that hold something to send when they are at most 1 in _GATHER
_SAMPLE = 1009  # stride of the sample that picks the dense scan straight away...
_DENSE = 0.005  # ...when more than this fraction of it is to be sent (then a quarter of the blocks or more is)
_CHUNK = 1 << 18  # elements decoded at a time when adding a bitmap to a dense vector
# Multiplying four 2-bit codes, one per byte of a little-endian uint32, by this puts code k at
# bits 24 + 2k; every other product lands below bit 24 without overlapping, so nothing carries.
_PACK = np.uint32(1 << 24 | 1 << 18 | 1 << 12 | 1 << 6)


def encode(residual: torch.Tensor, threshold: float, *, form: str | None = None) -> EncodedUpdate:
    """Encode the elements of ``residual`` with ``|r| >= threshold`` and subtract what is sent from
    ``residual`` in place.

    ``threshold`` is rounded to float32, the precision of the message. ``form`` forces
    ``"sparse"`` or ``"bitmap"``; by default the smaller is used (sparse when nothing is sent).
    A residual holding NaN or infinity raises :class:`NonFiniteUpdateError` and is left unchanged.
    """
    t = _float32_threshold(threshold)
    n = _check_vector(residual, "residual")
    if form is not None and form not in FORMS:
        raise ValueError(f"form must be None, 'sparse' or 'bitmap', got {form!r}")
    r = residual.detach()
    if r.device.type != "cpu":
        return _encode_on_device(r, t, form)
    a = r.numpy()
    # The scans below count NaN as to be sent: non-finite elements are then always among those
    # looked at, and are refused before anything changes.
    index = None if _looks_dense(a, t) else _candidates(r, a, t)
    if index is not None:
        return _encode_at(a, t, index, form)
    pos = a < t
    np.logical_not(pos, out=pos)  # r >= t, +inf or NaN
    neg = a <= -t
    count = np.count_nonzero(pos) + np.count_nonzero(neg)
    if (form or _choose(count, n)) == SPARSE:
        return _encode_at(a, t, np.flatnonzero(pos | neg), SPARSE)
    check_finite(r)
    codes = neg.view(np.uint8)  # in place: each fresh full-length array costs page faults
    codes <<= 1
    codes |= pos.view(np.uint8)
    payload = _pack(codes)  # overwrites codes
    _add_bitmap(a, payload, -t)
    return EncodedUpdate(BITMAP, float(t), n, int(count), payload)


def decode(message: EncodedUpdate) -> torch.Tensor:
    """The update ``message`` describes, as a dense float32 vector."""
    t = np.float32(message.threshold)
    if message.form == BITMAP:
        return torch.from_numpy(_unpack(message.payload, t)[: message.length])
    out = np.zeros(message.length, np.float32)
    index, values = _sparse_entries(message.payload, t)
    out[index] = values
    return torch.from_numpy(out)


def sent_indices(message: EncodedUpdate) -> np.ndarray:
    """The positions of the elements ``message`` changes, in increasing order (int64): cheap for a
    sparse message, a full decode for a bitmap."""
    if message.form == BITMAP:
        return np.flatnonzero(_unpack(message.payload, np.float32(1))[: message.length])
    index = np.abs(message.payload.astype(np.int64))
    index -= 1
    if len(index) > 1 and not (index[1:] >= index[:-1]).all():  # encode() writes them in order
        index.sort()
    return index


def apply(message: EncodedUpdate, target: torch.Tensor, scale: float = 1.0) -> None:
    """Add ``scale`` times the update ``message`` describes to ``target`` in place (a sparse message
    touches only its elements)."""
    if not isinstance(message, EncodedUpdate):
        raise TypeError(f"message must be an EncodedUpdate, got {type(message).__name__}")
    n = _check_vector(target, "target")
    if n != message.length:
        raise ValueError(f"target has {n} elements, the message encodes {message.length}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
        raise TypeError(f"scale must be a number, got {type(scale).__name__}")
    with np.errstate(over="ignore", invalid="ignore"):
        value = np.float32(message.threshold * scale)
    if not np.isfinite(value):
        raise ValueError(f"scale must make a finite step, got scale={scale!r} with threshold {message.threshold}")
    if target.device.type != "cpu":
        _apply_on_device(message, target.detach(), value)
        return
    a = target.detach().numpy()
    if message.form == BITMAP:
        _add_bitmap(a, message.payload, value)
    else:
        index, values = _sparse_entries(message.payload, value)
        a[index] += values


def _float32_threshold(threshold: float) -> np.float32:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.floating)):
        raise TypeError(f"threshold must be a number, got {type(threshold).__name__}")
    with np.errstate(over="ignore"):
        t = np.float32(threshold)
    if not (np.isfinite(t) and t > 0):
        raise ValueError(f"threshold must be positive and finite in float32, got {threshold!r}")
    return t


def _check_vector(t: torch.Tensor, name: str) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor, got shape {tuple(t.shape)}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if t.numel() > MAX_LENGTH:
        raise ValueError(f"{name} has {t.numel()} elements; an encoded update holds at most {MAX_LENGTH}")
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor, which holds no values")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t.numel()


def _choose(count: int, length: int) -> str:
    return SPARSE if count == 0 or 4 * count < bitmap_bytes(length) else BITMAP


def _looks_dense(a: np.ndarray, t: np.float32) -> bool:
    """Whether a sample of every :data:`_SAMPLE`-th element says that so many blocks hold something
    to send that :func:`_candidates` would scan them for nothing. A guess: either answer encodes right."""
    sample = a[::_SAMPLE]
    return np.count_nonzero(np.abs(sample) >= t) > _DENSE * len(sample)


def _candidates(r: torch.Tensor, a: np.ndarray, t: np.float32) -> np.ndarray | None:
    """Increasing indices of the elements with ``|r| >= t`` or not finite, or None when too many
    blocks of :data:`_BLOCK` elements hold one for gathering those blocks to pay.

    Two reductions (the blocks' maxima and minima, which propagate NaN) find the blocks; only
    those are looked at element by element.
    """
    body = len(a) - len(a) % _BLOCK
    blocks = r[:body].view(-1, _BLOCK)
    high = torch.amax(blocks, 1).numpy()
    low = torch.amin(blocks, 1).numpy()
    quiet = high < t
    quiet &= low > -t
    hot = np.flatnonzero(~quiet)
    if len(hot) * _GATHER > len(high):
        return None
    rows = np.take(a[:body].reshape(-1, _BLOCK), hot, axis=0)
    found = np.flatnonzero(~(np.abs(rows) < t))
    tail = body + np.flatnonzero(~(np.abs(a[body:]) < t))
    return np.concatenate((hot[found // _BLOCK] * _BLOCK + found % _BLOCK, tail))


def check_finite(r: torch.Tensor) -> None:
    """Raise :class:`NonFiniteUpdateError` naming the first element of ``r`` that is not finite, if any.
    One sum decides for the common case (a NaN or infinity makes it non-finite); only a sum that is not
    finite, which finite values can also give by overflowing, is looked into element by element."""
    if bool(torch.isfinite(r.sum())):
        return
    bad = torch.nonzero(~torch.isfinite(r))
    if len(bad):
        i = int(bad[0])
        raise NonFiniteUpdateError(f"residual element {i} is {float(r[i])}: the update is not finite")


def _encode_at(a: np.ndarray, t: np.float32, index: np.ndarray, form: str | None) -> EncodedUpdate:
    """Encode the elements at ``index``: increasing, and every one with ``|r| >= t`` or not finite
    (then refused, before anything changes)."""
    n, count = len(a), len(index)
    values = a[index]
    finite = np.isfinite(values)
    if not finite.all():
        i = int(index[np.argmin(finite)])
        raise NonFiniteUpdateError(f"residual element {i} is {a[i]}: the update is not finite")
    neg = values < 0
    a[index] = values - np.where(neg, -t, t)
    if (form or _choose(count, n)) == SPARSE:
        payload = index.astype(np.int32) + 1
        np.negative(payload, out=payload, where=neg)
        return EncodedUpdate(SPARSE, float(t), n, count, payload)
    codes = np.zeros(n, np.uint8)
    codes[index] = np.where(neg, 2, 1)
    return EncodedUpdate(BITMAP, float(t), n, count, _pack(codes))


def _encode_on_device(r: torch.Tensor, t: np.float32, form: str | None) -> EncodedUpdate:
    """:func:`encode` of a residual on a GPU, by torch on the GPU: one round trip to the host for the
    count and the finiteness check, then the message's payload."""
    n, value = r.numel(), float(t)
    pos, neg = r >= value, r <= -value
    total, count = torch.stack([r.sum(dtype=torch.float64), (pos.sum() + neg.sum()).double()]).tolist()
    if not math.isfinite(total):
        check_finite(r)
    count = int(count)
    r.sub_(pos.float() - neg.float(), alpha=value)  # ±t exactly, one rounding: as the CPU's kernels do
    if (form or _choose(count, n)) == SPARSE:
        index = torch.nonzero(pos | neg).squeeze(1)
        payload = (index + 1).int()
        payload = torch.where(neg[index], -payload, payload)
        return EncodedUpdate(SPARSE, value, n, count, payload.cpu().numpy())
    codes = pos.to(torch.uint8) | (neg.to(torch.uint8) << 1)
    codes = torch.nn.functional.pad(codes, (0, -n % 4)).view(-1, 4)
    packed = codes[:, 0] | codes[:, 1] << 2 | codes[:, 2] << 4 | codes[:, 3] << 6
    return EncodedUpdate(BITMAP, value, n, count, packed.cpu().numpy())


def _apply_on_device(message: EncodedUpdate, target: torch.Tensor, value: np.float32) -> None:
    """:func:`apply` to a target on a GPU: the payload goes to the GPU, which decodes it there."""
    payload = torch.tensor(message.payload, device=target.device)
    if message.form == SPARSE:
        index = payload.abs().long() - 1
        target.index_add_(0, index, torch.where(payload > 0, float(value), -float(value)).to(target.dtype))
        return
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=target.device)
    codes = ((payload[:, None] >> shifts) & 3).view(-1)[: message.length]
    steps = torch.tensor([0, value, -value, 0], dtype=target.dtype, device=target.device)
    target.add_(steps[codes.long()])


def _pack(codes: np.ndarray) -> np.ndarray:
    """2-bit codes, one a byte, packed four to a byte (the last byte padded with zeros). The codes
    are used as scratch space and overwritten."""
    whole = len(codes) // 4
    out = np.empty(bitmap_bytes(len(codes)), np.uint8)
    if whole < len(out):
        out[-1] = sum(int(c) << 2 * k for k, c in enumerate(codes[4 * whole :]))
    words = codes[: 4 * whole].view("<u4")
    words *= _PACK
    words >>= 24
    out[:whole] = words
    return out


def _add_bitmap(a: np.ndarray, payload: np.ndarray, value: np.float32) -> None:
    """Add ``value`` where the bitmap ``payload`` says 1 and ``-value`` where it says 2, a chunk of
    :data:`_CHUNK` elements at a time, so that each chunk's decoded values are still in cache."""
    for start in range(0, len(a), _CHUNK):
        part = a[start : start + _CHUNK]
        part += _unpack(payload[start // 4 : (start + _CHUNK) // 4], value)[: len(part)]


def _unpack(payload: np.ndarray, value: np.float32) -> np.ndarray:
    """The float32 values (0, +value, -value) of a bitmap payload, four per byte, through a table
    of 256 rows of four floats (gathered as 16-byte complex128 carriers: one copy per byte)."""
    codes = (np.arange(256, dtype=np.uint8)[:, None] >> SHIFTS) & 3
    table = np.array([0, value, -value, 0], np.float32)[codes]
    return np.take(table.view(np.complex128).reshape(256), payload).view(np.float32)


def _sparse_entries(payload: np.ndarray, value: np.float32) -> tuple[np.ndarray, np.ndarray]:
    return np.abs(payload) - 1, np.where(payload > 0, value, -value)


def describe(message: EncodedUpdate, residual: torch.Tensor) -> dict[str, float | int | str]:
    """What DL4J's encoding debug mode reports about one step: ``message`` and the ``residual`` that
    encoding it left.

    ``residual_above_threshold`` counts the elements still at ``|r| >= threshold`` after encoding
    (they were at twice the threshold or more before): they will be sent again at the next step
    whatever the next update, a backlog that a low threshold or residual clipping clears. A
    separate function, so that encoding pays for none of it.
    """
    n = _check_vector(residual, "residual")
    if n != message.length:
        raise ValueError(f"residual has {n} elements, the message encodes {message.length}")
    magnitude = residual.detach().abs()
    return {
        "form": message.form,
        "threshold": message.threshold,
        "length": message.length,
        "count": message.count,
        "sparsity": message.sparsity,
        "message_bytes": message.nbytes,
        "dense_bytes": 4 * message.length,
        "residual_l2": float(torch.linalg.vector_norm(residual.detach(), dtype=torch.float64)),
        "residual_max_abs": float(magnitude.max()) if n else 0.0,
        "residual_above_threshold": int(torch.count_nonzero(magnitude >= message.threshold)),
    }
