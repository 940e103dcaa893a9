"""Messages between the trainers of a fit over TCP connections of the workers' own, beside Dask's
comms: a listener on the worker's interface, a thread per incoming connection that reads messages
and hands them on, and a thread per peer that writes the messages this worker's trainers send to
it, in the order sent, on one kept connection. Both masters' data planes use it: parameter
averaging's parts of a round's allreduce, gradient sharing's encoded updates.

Through Dask's comms (``worker.rpc``) a message costs each worker's event loop a message handled in
Python, in turns at the interpreter's lock with the trainers stepping beside it: a round trip of the
digits MLP's state (154 KB) between two workers' tasks took 1.4 ms with a model stepping on both
workers (0.64 ms without), against 0.28 ms (0.25 ms) over these sockets, written and read by threads
that wait in the kernel and do nothing else (``benchmarks.round_trip``).

A frame: the lengths of its head and its payload (``!IQ``), the head (msgpack, as Dask's comms carry
it: the session, the sender, the payload's dtype and the master's own fields), then the payload's
bytes. Nothing is unpickled; a head is at most :data:`MAX_HEAD` bytes and a payload at most half the
worker's memory limit (a state this worker trains could not be larger), and a payload is allocated
only for a session open here (any other is read through a small buffer and dropped). A peer's port
is asked once through Dask's comms and its connection kept. A message that cannot be written (its
peer gone) is reported to its sender, which drops it or tries again; one for a peer without a
listener, or whose listener cannot be reached (a firewall between the workers, with a warning), is
handed back with :class:`NoListener`, and its sender sends it through Dask's comms instead. Used
where workers listen on ``tcp://``; a cluster on ``tls://`` keeps its messages in Dask's comms,
encrypted.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import dask
import numpy as np
from dask.utils import parse_timedelta
from distributed.comm.addressing import get_address_host, parse_address
from distributed.system import MEMORY_LIMIT
from distributed.utils import sync

from dlscale.training._config import setting
from dlscale.training._messages import packed, unpacked

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger("dlscale.training")

_PREFIX = struct.Struct("!IQ")  # the head's and the payload's lengths in bytes
MAX_HEAD = 16 * 2**20
"""The largest head read (a part's header with its report and the state's layout, an update's
fields); a longer one closes the connection before anything is allocated for it."""
_SCRATCH = 2**20
IDLE = 300.0
"""Seconds without a message for a peer after which its writing thread closes the connection and ends
(a peer that left the cluster keeps no thread or socket here); the next message for it connects anew."""
DTYPES = frozenset({"float32", "float16", "int16", "uint8"})
"""What a payload travels as: averaging's parts (``averaging._exchange``), sharing's encoded bytes."""
TRANSPORTS = ("tcp", "dask")

Deliver = Callable[[str, str, dict[str, Any], Any], None]
"""Takes a message read: its session, sender (a worker's address), head and payload."""
Done = Callable[[BaseException | None], None]
"""Called once a message is written (``None``), or could not be (the error): from the writing thread."""


class NoListener(Exception):
    """What ``done`` is told of a message for a peer that has no listener of its own, or whose listener
    cannot be reached: not written, for its sender to send through Dask's comms."""


def transport() -> str:
    """``dlscale.training.transport``, checked: ``"tcp"`` (these sockets) or ``"dask"`` (Dask's comms)."""
    value = setting("training.transport")
    if value not in TRANSPORTS:
        raise ValueError(f"dlscale.training.transport must be one of {', '.join(TRANSPORTS)}, got {value!r}")
    return value


def open_sockets(worker: Worker, master: str, wanted: Callable[[str], bool], deliver: Deliver) -> Sockets | None:
    """``worker``'s :class:`Sockets` for ``master``'s messages, and the ``dlscale_<master>_port``
    handler through which its peers ask where they listen; ``None`` (the handler answers ``None``)
    where ``dlscale.training.transport`` is ``"dask"`` or the worker does not listen on ``tcp://``.
    A write waits ``dlscale.training.end-timeout`` at most for a peer, a connection Dask's connect
    timeout; a message may be half the worker's memory limit (of the machine's memory without one)."""
    handler = f"dlscale_{master}_port"
    sockets = None
    if transport() == "tcp" and parse_address(worker.address)[0] == "tcp":
        timeout = parse_timedelta(setting("training.end-timeout"))

        def port_of(peer: str) -> tuple[str, int] | None:  # from a writing thread
            got = sync(worker.loop, getattr(worker.rpc(peer), handler), callback_timeout=timeout)
            return None if got is None else (str(got[0]), int(got[1]))

        sockets = Sockets(
            master,
            get_address_host(worker.address),
            worker.address,
            wanted,
            deliver,
            port_of,
            timeout,
            parse_timedelta(dask.config.get("distributed.comm.timeouts.connect")),
            (worker.memory_manager.memory_limit or MEMORY_LIMIT) // 2,
        )
    worker.handlers[handler] = lambda: None if sockets is None else sockets.address
    return sockets


class Sockets:
    """The connections of one worker for ``master`` (``"averaging"`` or ``"sharing"``): :meth:`send`
    writes a message to a peer (a worker's address) without waiting; messages read from peers go to
    ``deliver`` if ``wanted(session)`` (else they are dropped). ``port_of(peer)`` asks a peer where its
    own listener is (``None``: it has none, and its messages are handed back with :class:`NoListener`,
    as they are for a peer whose listener cannot be reached within ``connect_timeout`` seconds: a
    firewall between the workers). A write waits for a peer at most ``timeout`` seconds; a message of
    more than ``largest`` bytes is refused unread (its connection closed)."""

    def __init__(
        self,
        master: str,
        host: str,
        me: str,
        wanted: Callable[[str], bool],
        deliver: Deliver,
        port_of: Callable[[str], tuple[str, int] | None],
        timeout: float,
        connect_timeout: float,
        largest: int,
    ) -> None:
        self.master, self.me, self.timeout, self.connect_timeout = master, me, timeout, connect_timeout
        self.largest = largest
        self._wanted, self._deliver, self._port_of = wanted, deliver, port_of
        self._listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._writers: dict[str, _Writer] = {}
        self._writing = threading.Lock()
        self._in: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name=f"dlscale-{master}-accept", daemon=True).start()

    def send(
        self,
        session: str,
        peer: str,
        head: dict[str, Any],
        payload: np.ndarray | None,
        done: Done,
    ) -> None:
        """Write a message (``head``, the master's own fields; ``payload``, read until written) to
        ``peer`` from that peer's writing thread; ``done`` is called once it is written or could not be.
        The head is encoded here, so that one msgpack cannot carry fails the caller."""
        dtype = None if payload is None else str(payload.dtype)
        if dtype is not None and dtype not in DTYPES:
            raise TypeError(f"a payload travels as one of {sorted(DTYPES)}, not {dtype}")
        frame = packed({"session": session, "sender": self.me, "dtype": dtype, "head": head})
        with self._writing:
            if self._closed:  # the worker is closing: nothing more goes out
                done(ConnectionAbortedError(f"worker {self.me} is closing"))
                return
            writer = self._writers.get(peer)
            if writer is None:
                writer = self._writers[peer] = _Writer(self, peer)
            writer.queue.put((session, payload, frame, done))

    @property
    def peers(self) -> list[str]:
        """The peers this worker holds a connection to, sorted."""
        with self._writing:
            return sorted(peer for peer, w in self._writers.items() if w.conn is not None)

    def close(self) -> None:
        with self._writing:
            self._closed = True
            for writer in self._writers.values():
                writer.queue.put(None)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (closing does not)
        with contextlib.suppress(OSError):
            self._listener.close()
        for conn in list(self._in):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _ended(self, writer: _Writer) -> bool:
        """Whether ``writer`` (its peer gone, or idle) may end: nothing is queued for it (else it goes on)."""
        with self._writing:
            if not writer.queue.empty():
                return False
            if self._writers.get(writer.peer) is writer:
                del self._writers[writer.peer]
            return True

    # -- reading -------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                # out of file descriptors, say: the peers' messages wait in the backlog until it passes
                logger.warning(
                    "worker %s cannot take a connection for %s messages (%s: %s)",
                    self.me,
                    self.master,
                    type(e).__name__,
                    e,
                )
                time.sleep(1.0)
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._in.add(conn)
            threading.Thread(target=self._read, args=(conn,), name=f"dlscale-{self.master}-read", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        scratch = bytearray(_SCRATCH)
        try:
            while (prefix := _read_exactly(conn, _PREFIX.size, at_frame=True)) is not None:
                n_head, n_data = _PREFIX.unpack(prefix)
                if n_head > MAX_HEAD or n_data > self.largest:
                    logger.warning(
                        "worker %s refused a message of %d bytes with a head of %d (at most %d and %d): its "
                        "connection is closed",
                        self.me,
                        n_data,
                        n_head,
                        self.largest,
                        MAX_HEAD,
                    )
                    return
                frame = unpacked(_read_exactly(conn, n_head))
                session, dtype = frame["session"], frame["dtype"]
                wanted = self._wanted(session)
                payload = None
                if n_data and wanted and dtype in DTYPES and n_data % np.dtype(dtype).itemsize == 0:
                    payload = np.empty(n_data // np.dtype(dtype).itemsize, dtype=dtype)
                    _read_into(conn, memoryview(payload).cast("B"))
                elif n_data:
                    wanted = False
                    while n_data:  # dropped without allocating it
                        n_data -= _read_into(conn, memoryview(scratch)[: min(n_data, _SCRATCH)])
                if wanted:
                    self._deliver(session, frame["sender"], frame["head"], payload)
        except Exception as e:  # noqa: BLE001 - a peer gone, or not a peer: its connection ends here
            if not self._closed:
                logger.debug("a connection of %s messages ended (%s: %s)", self.master, type(e).__name__, e)
        finally:
            self._in.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()


class _Writer:
    """The thread that writes the messages for one peer, in the order sent, on one kept connection: a
    peer that does not read (gone with its machine) holds up its own messages only. It ends once a write
    to its peer failed, or :data:`IDLE` seconds passed without a message, and nothing else is queued;
    the next message for that peer starts another."""

    def __init__(self, sockets: Sockets, peer: str) -> None:
        self.sockets, self.peer = sockets, peer
        self.queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self.conn: socket.socket | None = None
        self.listening = True  # whether the peer has a listener of its own (as far as known)
        threading.Thread(target=self._run, name=f"dlscale-{sockets.master}-write", daemon=True).start()

    def _run(self) -> None:
        s = self.sockets
        try:
            while True:
                try:
                    item = self.queue.get(timeout=IDLE)
                except queue.Empty:  # no message for this peer in a while (gone, or no longer training with)
                    if s._ended(self):
                        return
                    continue
                if item is None:
                    return
                session, payload, frame, done = item
                try:
                    if self._write(frame, payload):
                        done(None)
                    else:
                        done(NoListener(self.peer))
                    continue
                except Exception as e:  # noqa: BLE001 - a peer lost: its sender decides what follows
                    logger.debug(
                        "a %s message of session %s for %s was not delivered (%s: %s)",
                        s.master,
                        session,
                        self.peer,
                        type(e).__name__,
                        e,
                    )
                    done(e)
                if s._ended(self):
                    return
        finally:
            if self.conn is not None:
                with contextlib.suppress(OSError):
                    self.conn.close()

    def _write(self, frame: bytes, payload: np.ndarray | None) -> bool:
        """Write one message; ``False`` if the peer has no listener of its own."""
        data = memoryview(b"") if payload is None else memoryview(np.ascontiguousarray(payload)).cast("B")
        prefix = _PREFIX.pack(len(frame), data.nbytes) + frame
        for again in (False, True):  # a kept connection found broken (its peer restarted): once on a new one
            kept = self.conn is not None
            if not kept and not self._connect():
                return False
            conn = self.conn
            try:
                conn.sendall(prefix)
                if data.nbytes:
                    conn.sendall(data)
                return True
            except OSError:
                self.conn = None
                with contextlib.suppress(OSError):
                    conn.close()
                if again or not kept:
                    raise
        raise AssertionError("unreachable")

    def _connect(self) -> bool:
        address = self.sockets._port_of(self.peer) if self.listening else None
        if address is None:
            self.listening = False
            return False
        try:
            conn = socket.create_connection(tuple(address), timeout=self.sockets.connect_timeout)
        except OSError as e:  # the peer answered through Dask's comms, but its listener cannot be reached
            logger.warning(
                "worker %s cannot connect to the %s listener of worker %s at %s (%s: %s); their messages go "
                "through Dask's comms (dlscale.training.transport: dask skips the attempt)",
                self.sockets.me,
                self.sockets.master,
                self.peer,
                address,
                type(e).__name__,
                e,
            )
            self.listening = False
            return False
        conn.settimeout(self.sockets.timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = conn
        return True


def _read_into(conn: socket.socket, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            raise EOFError("the peer closed the connection within a frame")
        got += n
    return got


def _read_exactly(conn: socket.socket, n: int, at_frame: bool = False) -> bytearray | None:
    """``n`` bytes; ``None`` where the peer closed the connection between frames (``at_frame``)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = conn.recv_into(view) if n else 0
    if not n:
        return buf
    if not got and at_frame:
        return None
    if not got:
        raise EOFError("the peer closed the connection within a frame")
    if got < n:
        _read_into(conn, view[got:])
    return buf
