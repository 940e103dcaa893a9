"""A bound on bytes in flight, after ``distributed.shuffle``'s ``ResourceLimiter``, for threads that
may wait and an event loop that must not.

Gradient sharing holds a worker's encoded updates against ``dlscale.training.sharing.send-buffer`` from the
moment a trainer hands one over until every peer it goes to has it (or is dropped). Trainers, in
their own threads, wait for room before they hand over an update; the event loop holds the bytes it
queues for relaying without waiting and releases what it has sent.
"""

from __future__ import annotations

import collections
import threading
import time

from dlscale.errors import DlscaleError


class LimiterError(DlscaleError, ValueError):
    """A limiter given a limit or a size that is not a count of bytes, or asked to release more bytes
    than it holds (its accounting is broken)."""


class ResourceLimiter:
    """Bytes held against ``limit``: :meth:`acquire` waits while the bytes held reach the limit, and
    waiters go in the order they came. One update may take the total past the limit (an update larger
    than the limit still goes), so the bound is ``limit`` plus the largest update."""

    def __init__(self, limit: int) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise LimiterError(f"a limiter's limit must be an integer >= 1, got {limit!r}")
        self.limit = limit
        self._acquired = 0
        self._closed = False
        self._waiters: collections.deque[object] = collections.deque()
        self._condition = threading.Condition()

    def __repr__(self) -> str:
        return f"<ResourceLimiter limit: {self.limit} available: {self.available}>"

    @property
    def acquired(self) -> int:
        """The bytes held."""
        return self._acquired

    @property
    def available(self) -> int:
        """How many more bytes may be held before :meth:`acquire` waits."""
        return max(0, self.limit - self._acquired)

    @property
    def full(self) -> bool:
        return self._acquired >= self.limit

    @property
    def empty(self) -> bool:
        return self._acquired == 0

    @property
    def waiters(self) -> int:
        """Threads waiting in :meth:`acquire`."""
        return len(self._waiters)

    def acquire(self, n: int) -> float:
        """Wait until there is room and every earlier waiter has gone, then hold ``n`` bytes; returns the
        seconds waited. For threads that may block, never the event loop."""
        _check_size(n)
        with self._condition:
            if not self._waiters and not self._blocked():
                self._acquired += n
                return 0.0
            ticket = object()
            self._waiters.append(ticket)
            start = time.perf_counter()
            try:
                self._condition.wait_for(lambda: self._waiters[0] is ticket and not self._blocked())
            finally:
                self._waiters.remove(ticket)
                self._condition.notify_all()  # the next waiter may have room too
            self._acquired += n
            return time.perf_counter() - start

    def acquire_nowait(self, n: int) -> None:
        """Hold ``n`` bytes at once, whatever is held already (the event loop relaying an update)."""
        _check_size(n)
        with self._condition:
            self._acquired += n

    def release(self, n: int) -> None:
        """Give back ``n`` bytes and wake the waiters; more than is held is refused."""
        _check_size(n)
        with self._condition:
            if n > self._acquired:
                raise LimiterError(f"cannot release {n} bytes: the limiter holds {self._acquired}")
            self._acquired -= n
            self._condition.notify_all()

    def close(self) -> None:
        """Stop waiting: the waiters go on at once, and later calls to :meth:`acquire` do not wait."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()

    def _blocked(self) -> bool:
        return self.full and not self._closed


def _check_size(n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise LimiterError(f"a number of bytes must be an integer >= 0, got {n!r}")
