"""A round's averaging among its trainers, peer to peer: an allreduce of each trainer's state as one flat
vector (``_flat``) in two phases (a direct reduce-scatter, then an all-gather).

With ``m`` members, member ``c`` owns the ``c``-th of ``m`` chunks: every member sends each other owner
its chunk with its weight (the examples it fitted), each owner averages its chunk, weighted, and sends
the average to every other member. Each member sends and receives about twice the vector's bytes times
``(m - 1) / m`` whatever ``m``, in two hops. Two members send each other their whole vectors instead and
both average all of it: the same bytes, in one hop (a round trip less a round, which counts where
rounds are short). What a step keeps aside (step counts, integer buffers) is taken from the first
member that fitted examples, as one process's averaging of states takes it from the first state. The
chunks travel in ``dtype`` (float32, float16/bfloat16 to halve the bytes, or int8 to quarter them:
blocks of 1,024 values scaled by their largest magnitude, as INTELLECT-1's int8 all-reduce); an owner
rounds its own average the same way, so every replica holds the same values (two members round their
own vectors as they send them, and sum alike).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}
BLOCK = 1024  # int8: values quantized together, with one float32 scale (their largest magnitude / 127)


def quantize(values: torch.Tensor) -> torch.Tensor:
    """``values`` in 8 bits, a block of :data:`BLOCK` at a time: the blocks' scales (float32), then the
    values rounded to a multiple of their block's scale (int8), as one array of bytes."""
    n = values.numel()
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=values.device)
    padded[:n] = values
    padded = padded.view(blocks, BLOCK)
    scale = padded.abs().amax(1) / 127
    scale[scale == 0] = 1.0
    q = torch.round(padded / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return torch.cat([scale.view(torch.uint8), q.view(torch.uint8).reshape(-1)[:n]])


def dequantize(packed: torch.Tensor) -> torch.Tensor:
    """The float32 values of :func:`quantize`'s bytes."""
    blocks = -(-packed.numel() // (BLOCK + 4))
    n = packed.numel() - 4 * blocks
    scale = packed[: 4 * blocks].view(torch.float32)
    q = torch.zeros(blocks * BLOCK, dtype=torch.int8, device=packed.device)
    q[:n] = packed[4 * blocks :].view(torch.int8)
    return (q.view(blocks, BLOCK).float() * scale[:, None]).reshape(-1)[:n]


def bounds(length: int, parts: int) -> list[int]:
    """Where each of ``parts`` chunks of a vector of ``length`` starts, and the end."""
    return [length * c // parts for c in range(parts + 1)]


# -- the allreduce ---------------------------------------------------------------------------------------
class Mailbox:
    """The parts a trainer has received, by ``(round, attempt, phase)`` and sender; filled on the
    worker's event loop, read from the trainer's thread."""

    def __init__(self) -> None:
        self._parts: dict[tuple[int, int, int], dict[str, tuple[dict[str, Any], Any]]] = {}
        self._transit: dict[tuple[int, int, int], float] = {}  # each key's longest part in flight (s)
        self._changed = threading.Condition()

    def put(self, key: tuple[int, int, int], sender: str, header: dict[str, Any], payload: Any) -> None:
        with self._changed:
            self._parts.setdefault(key, {})[sender] = (header, payload)
            flight = time.time() - header.get("sent", time.time())
            self._transit[key] = max(self._transit.get(key, 0.0), flight)
            self._changed.notify_all()

    def transit(self, key: tuple[int, int, int]) -> float:
        """The longest time a part of ``key`` was in flight, from its sending (the sender's clock) to
        its coming here, in seconds."""
        with self._changed:
            return self._transit.get(key, 0.0)

    def wait(
        self, key: tuple[int, int, int], senders: set[str], timeout: float
    ) -> dict[str, tuple[dict[str, Any], Any]] | None:
        """The parts of ``key`` from every one of ``senders``, or ``None`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                got = self._parts.get(key, {})
                if senders <= set(got):
                    return {s: got[s] for s in senders}
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)

    def forget(self, before: int) -> None:
        """Drop the parts of rounds before ``before``."""
        with self._changed:
            for key in [k for k in self._parts if k[0] < before]:
                del self._parts[key]
                self._transit.pop(key, None)


@dataclass
class Contribution:
    """What a member brings to a round's averaging: its vector (and layout, values set aside), its
    weight (examples fitted) and what it reports of its share."""

    vector: torch.Tensor
    layout: list[list[Any]]
    kept: dict[str, Any]
    weight: int
    report: dict[str, Any]
    average: Callable[[int], torch.Tensor] | None = None  # a buffer for the average, given its length


class Exchange:
    """One attempt of one round's allreduce for member ``me`` among ``members``; :meth:`run` advances it
    as far as the parts received allow within a time limit, and can be called again."""

    def __init__(
        self,
        me: str,
        k: int,
        attempt: int,
        members: list[str],
        mine: Contribution,
        mailbox: Mailbox,
        send: Callable[[str, tuple[int, int, int], dict[str, Any], Any], None],
        dtype: torch.dtype,
    ) -> None:
        self.me, self.k, self.attempt, self.members = me, k, attempt, list(members)
        self.mine, self.mailbox, self.send, self.dtype = mine, mailbox, send, dtype
        self.rank = self.members.index(me)
        self.others = set(self.members) - {me}
        self.phase = 0
        self.result: tuple[torch.Tensor, list[list[Any]], dict[str, Any]] | None = None
        self.reports: list[dict[str, Any]] = []
        self.transit = 0.0  # seconds its parts were in flight, the longest of each phase
        self._header = {"weight": mine.weight, "length": mine.vector.numel(), "report": mine.report}
        self.direct = len(self.members) == 2  # one hop: each sends the other its whole vector
        if self.direct:
            self._header.update(layout=mine.layout, kept=mine.kept)
        # set as the chunk this member owns is averaged (phase 2): the average, the first member
        # that fitted examples, and what this member's averaged chunk travels with
        self._out: torch.Tensor | None = None
        self._leader = ""
        self._average_header: dict[str, Any] = {}

    def _wire(self, chunk: torch.Tensor) -> np.ndarray:
        """A chunk as it travels: a CPU array in the exchange's dtype (bfloat16 as its 16 bits, int8 as
        :func:`quantize`'s bytes)."""
        if self.dtype == torch.int8:
            return quantize(chunk.detach()).cpu().numpy()
        t = chunk.detach().to(self.dtype).cpu()
        if self.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy()
        return t.numpy()

    def _unwire(self, array: Any, device: torch.device) -> torch.Tensor:
        t = torch.from_numpy(np.asarray(array))
        if self.dtype == torch.int8:
            return dequantize(t.to(device))
        if self.dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t.to(device=device, dtype=torch.float32)

    def _rounded(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` as they arrive after travelling in the exchange's dtype."""
        if self.dtype == torch.int8:
            return dequantize(quantize(values))
        return values.to(self.dtype).float()

    def _emit(self, peer: str, phase: int, header: dict[str, Any], chunk: torch.Tensor | None) -> None:
        payload = None if chunk is None else self._wire(chunk)
        self.send(peer, (self.k, self.attempt, phase), header, payload)

    def run(self, timeout: float) -> bool:
        """Go on until the average is here (``True``, :attr:`result` set) or ``timeout`` seconds pass."""
        if self.phase == 0:
            self._scatter()
        if self.phase == 1:
            got = self.mailbox.wait((self.k, self.attempt, 1), self.others, timeout)
            if got is None:
                return False
            self._reduce(got)
            self.transit = self.mailbox.transit((self.k, self.attempt, 1))
        if self.phase == 2:
            got = self.mailbox.wait((self.k, self.attempt, 2), self.others, timeout)
            if got is None:
                return False
            self._gather(got)
            self.transit += self.mailbox.transit((self.k, self.attempt, 2))
        return True

    def _scatter(self) -> None:
        """Phase 1: send each other owner its chunk of this member's vector (two members: all of it),
        with its weight."""
        v, m = self.mine.vector, len(self.members)
        edges = bounds(v.numel(), m)
        self._header["sent"] = time.time()
        for c, peer in enumerate(self.members):
            if peer != self.me:
                chunk = v if self.direct else v[edges[c] : edges[c + 1]]
                self._emit(peer, 1, self._header, chunk if self.mine.weight else None)
        self.phase = 1

    def _reduce(self, got: dict[str, tuple[dict[str, Any], Any]]) -> None:
        """Average the chunk this member owns from every member's part, weighted, and send the average
        to every other member (phase 2); the first member that fitted examples adds its layout and the
        values set aside."""
        mine, members, v = self.mine, self.members, self.mine.vector
        parts = {self.me: (self._header, None), **got}
        self.reports = [parts[t][0]["report"] for t in members]
        weights = {t: parts[t][0]["weight"] for t in members}
        total = sum(weights.values())
        lengths = {parts[t][0]["length"] for t in members if weights[t]}
        if len(lengths) > 1:
            raise RuntimeError(
                f"round {self.k}: the trainers' states differ in size ({sorted(lengths)} values): "
                "their networks or optimizers are not alike"
            )
        length = lengths.pop() if lengths else v.numel()
        edges = bounds(length, len(members))
        lo, hi = (0, length) if self.direct else (edges[self.rank], edges[self.rank + 1])
        self._out = mine.average(length) if mine.average is not None else torch.empty(length, device=v.device)
        # two members average all of it, in place; an owner its chunk, apart, to send it
        own = self._out if self.direct else torch.empty(hi - lo, dtype=torch.float32, device=v.device)
        own.zero_()
        if total:
            for t in members:  # in the members' order: every owner sums alike
                if not weights[t]:
                    continue
                chunk = v[lo:hi] if t == self.me else self._unwire(parts[t][1], v.device)
                if t == self.me and self.dtype != torch.float32:
                    chunk = self._rounded(chunk)
                own.add_(chunk, alpha=weights[t] / total)
        else:  # nobody fitted anything: the state stays
            own.copy_(v[lo:hi])
        if self.dtype != torch.float32 and not self.direct:
            own = self._rounded(own)  # as the others receive it
        self._leader = next((t for t in members if weights[t]), members[0])
        if self.direct:  # every member summed all of it alike; the leader's layout came with its vector
            head = parts[self._leader][0]
            self.result = (self._out, head["layout"], head["kept"])
            self.phase = 3
            return
        self._average_header = {"length": length}
        if self._leader == self.me:
            self._average_header.update(layout=mine.layout, kept=mine.kept)
        self._out[lo:hi] = own
        self._average_header["sent"] = time.time()
        for peer in members:
            if peer != self.me:
                self._emit(peer, 2, self._average_header, own)
        self.phase = 2

    def _gather(self, got: dict[str, tuple[dict[str, Any], Any]]) -> None:
        """Assemble the average from the other owners' averaged chunks."""
        out = self._out
        edges = bounds(out.numel(), len(self.members))
        for c, t in enumerate(self.members):
            if t != self.me:
                out[edges[c] : edges[c + 1]] = self._unwire(got[t][1], out.device)
        head = self._average_header if self._leader == self.me else got[self._leader][0]
        self.result = (out, head["layout"], head["kept"])
        self.phase = 3
