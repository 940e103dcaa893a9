"""The workers' own connections for the trainers' messages (``dlscale.training._sockets``: averaging's
parts, sharing's updates), without a cluster: two workers' ends in one process, on 127.0.0.1, against
what was sent; and averaging's plugin handing a part its peer cannot take there to Dask's comms, on
in-process workers (sharing's: ``test_sharing_protocol``)."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from distributed.utils_test import gen_cluster

from dlscale.training import _sockets
from dlscale.training._messages import packed
from dlscale.training._sockets import MAX_HEAD, NoListener, Sockets
from dlscale.training.averaging._worker_plugin import NAME, AveragingWorkerPlugin

TIMEOUT = 10.0


class End:
    """One worker's end: what it delivered (session, sender, the head's key and header, payload)."""

    def __init__(
        self, name: str, ports: dict[str, tuple[str, int] | None], sessions: set[str], largest: int = 2**30
    ) -> None:
        self.name, self.sessions = name, sessions
        self.got: list[tuple[Any, ...]] = []
        self.delivered = threading.Condition()
        self.sockets = Sockets(
            "averaging",
            "127.0.0.1",
            name,
            lambda s: s in self.sessions,
            self._deliver,
            self._port_of,
            TIMEOUT,
            2.0,
            largest,
        )
        self.ports = ports
        ports[name] = self.sockets.address

    def _port_of(self, peer: str) -> tuple[str, int] | None:
        """As a peer's plugin answers through Dask's comms; a peer gone: the call fails."""
        if peer not in self.ports:
            raise OSError(f"{peer} is gone")
        return self.ports[peer]

    def _deliver(self, session: str, sender: str, head: Any, payload: Any) -> None:
        with self.delivered:
            self.got.append((session, sender, tuple(head["key"]), head["header"], payload))
            self.delivered.notify_all()

    def wait_for(self, n: int) -> list[tuple[Any, ...]]:
        with self.delivered:
            assert self.delivered.wait_for(lambda: len(self.got) >= n, TIMEOUT), self.got
            return list(self.got)


class Sent(threading.Event):
    """Set once a message is written or could not be; ``error`` says which."""

    error: BaseException | None = None

    def __call__(self, error: BaseException | None) -> None:
        self.error = error
        self.set()


def sent(end: End, session: str, peer: str, key: Any, header: Any, payload: Any) -> Sent:
    done = Sent()
    end.sockets.send(session, peer, {"key": list(key), "header": header}, payload, done)
    return done


@pytest.fixture
def ends() -> Iterator[tuple[End, End, dict[str, tuple[str, int] | None]]]:
    ports: dict[str, tuple[str, int] | None] = {}
    a, b = End("tcp://a", ports, {"s"}), End("tcp://b", ports, {"s"})
    yield a, b, ports
    a.sockets.close()
    b.sockets.close()


@pytest.mark.parametrize("dtype", ["float32", "float16", "int16", "uint8"])
def test_a_part_arrives_as_dask_s_comms_deliver_it(ends, dtype: str) -> None:
    a, b, _ = ends
    payload = (np.arange(50_000) % 251).astype(dtype)
    header = {"weight": 3, "report": {"items": [4, 1], "score": float("nan")}, "layout": [["w", [2, 3]]]}
    assert sent(a, "s", "tcp://b", (7, 1, 2), header, payload).wait(TIMEOUT)
    ((session, sender, key, got_header, got),) = b.wait_for(1)
    assert (session, sender, key) == ("s", "tcp://a", (7, 1, 2))
    assert got.dtype == payload.dtype and np.array_equal(got, payload)
    # lists as tuples, as msgpack reads them in Dask's comms
    assert got_header["weight"] == 3 and got_header["layout"] == (("w", (2, 3)),)
    assert got_header["report"]["items"] == (4, 1) and np.isnan(got_header["report"]["score"])


def test_parts_arrive_in_the_order_sent_both_ways_without_a_payload_too(ends) -> None:
    a, b, _ = ends
    for k in range(20):
        sent(a, "s", "tcp://b", (k, 0, 1), {"k": k}, None if k % 3 else np.full(1000, k, np.float32))
        sent(b, "s", "tcp://a", (k, 0, 1), {"k": k}, None)
    for end in (a, b):
        parts = end.wait_for(20)
        assert [p[2][0] for p in parts] == list(range(20)) and [p[3]["k"] for p in parts] == list(range(20))
    assert [p[4] is None for p in b.got] == [bool(k % 3) for k in range(20)]
    assert all(np.all(p[4] == k) for k, p in enumerate(b.got) if k % 3 == 0)


def test_a_part_of_a_session_not_open_is_dropped_and_the_next_arrives(ends) -> None:
    a, b, _ = ends
    assert sent(a, "closed", "tcp://b", (0, 0, 1), {}, np.ones(3 * 2**20, np.float32)).wait(TIMEOUT)
    assert sent(a, "s", "tcp://b", (1, 0, 1), {}, np.ones(5, np.float32)).wait(TIMEOUT)
    ((session, _, key, _, _),) = b.wait_for(1)
    assert (session, key) == ("s", (1, 0, 1))


def test_a_peer_without_a_listener_gets_its_parts_through_dask_s_comms(ends) -> None:
    a, _, ports = ends
    ports["tcp://c"] = None
    handed = sent(a, "s", "tcp://c", (0, 0, 1), {}, np.ones(5, np.float32))
    assert handed.wait(TIMEOUT) and isinstance(handed.error, NoListener)  # for its sender to send elsewise


def test_a_part_for_a_peer_gone_is_dropped_and_a_restarted_peer_is_reached_anew(ends) -> None:
    a, b, ports = ends
    first = sent(a, "s", "tcp://b", (0, 0, 1), {}, None)
    assert first.wait(TIMEOUT) and first.error is None
    b.wait_for(1)
    b.sockets.close()
    del ports["tcp://b"]  # gone: asking it for its port fails
    # the kept connection is found broken, the peer cannot be asked again: done is told why
    for k in range(1, 4):
        later = sent(a, "s", "tcp://b", (k, 0, 1), {}, np.ones(2**20, np.float32))
        assert later.wait(TIMEOUT)
    assert isinstance(later.error, OSError)  # not NoListener: not to be sent through Dask's comms
    restarted = End("tcp://b", ports, {"s"})
    try:
        assert sent(a, "s", "tcp://b", (9, 0, 1), {}, np.ones(5, np.float32)).wait(TIMEOUT)
        ((_, _, key, _, _),) = restarted.wait_for(1)
        assert key == (9, 0, 1)
    finally:
        restarted.sockets.close()


def test_a_peer_whose_listener_cannot_be_reached_gets_its_parts_through_dask_s_comms(ends, caplog) -> None:
    a, _, ports = ends
    with socket.create_server(("127.0.0.1", 0)) as closed:
        ports["tcp://c"] = closed.getsockname()[:2]  # answers, but nothing listens there: refused
    handed = [sent(a, "s", "tcp://c", (k, 0, 1), {}, None) for k in range(2)]
    assert all(h.wait(TIMEOUT) and isinstance(h.error, NoListener) for h in handed)
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "listener of worker tcp://c" in warning.getMessage()
    assert "dlscale.training.transport: dask" in warning.getMessage()
    assert "cannot connect to the averaging listener" in warning.getMessage()


def test_a_connection_that_sends_what_is_not_a_part_is_closed_before_anything_is_allocated(ends) -> None:
    _, b, _ = ends
    with socket.create_connection(b.sockets.address, timeout=TIMEOUT) as bad:
        bad.sendall(struct.pack("!IQ", MAX_HEAD + 1, 2**40))
        assert bad.recv(1) == b""  # closed by b
    with socket.create_connection(b.sockets.address, timeout=TIMEOUT) as peer:
        for sender, dtype in (("x", "object"), ("y", "float32")):  # a dtype no part travels as: dropped
            head = packed({"session": "s", "sender": sender, "dtype": dtype, "head": {"key": [0, 0, 1], "header": {}}})
            peer.sendall(struct.pack("!IQ", len(head), 8) + head + b"\0" * 8)
        ((_, sender, _, _, payload),) = b.wait_for(1)  # in the order sent: the first was not delivered
        assert sender == "y" and payload.tolist() == [0.0, 0.0]


def test_a_header_msgpack_cannot_carry_fails_the_sender_at_once(ends) -> None:
    a, _, _ = ends
    with pytest.raises(TypeError):
        a.sockets.send("s", "tcp://b", {"bad": object()}, None, lambda error: None)
    with pytest.raises(TypeError, match="travels as one of"):
        a.sockets.send("s", "tcp://b", {}, np.ones(3, np.float64), lambda error: None)


def test_a_peer_that_does_not_read_holds_up_its_own_parts_only(ends) -> None:
    a, b, ports = ends
    with socket.create_server(("127.0.0.1", 0)) as hung:  # connections are taken, never read
        ports["tcp://c"] = hung.getsockname()[:2]
        stuck = sent(a, "s", "tcp://c", (0, 0, 1), {}, np.ones(16 * 2**20, np.float32))  # beyond the buffers
        assert sent(a, "s", "tcp://b", (0, 0, 1), {}, None).wait(TIMEOUT)
        b.wait_for(1)
        assert not stuck.is_set()
    assert stuck.wait(TIMEOUT)  # its connection reset: dropped


def test_an_idle_peer_s_connection_is_closed_and_the_next_part_connects_anew(ends, monkeypatch) -> None:
    a, b, _ = ends
    monkeypatch.setattr(_sockets, "IDLE", 0.2)
    assert sent(a, "s", "tcp://b", (0, 0, 1), {}, None).wait(TIMEOUT)
    assert a.sockets.peers == ["tcp://b"]
    deadline = time.monotonic() + TIMEOUT
    while a.sockets.peers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.sockets.peers == []  # its writing thread ended, its connection closed
    assert sent(a, "s", "tcp://b", (1, 0, 1), {}, None).wait(TIMEOUT)
    assert [p[2] for p in b.wait_for(2)] == [(0, 0, 1), (1, 0, 1)]


def test_a_part_sent_once_the_worker_closes_is_dropped_at_once(ends) -> None:
    a, b, _ = ends
    a.sockets.close()
    assert sent(a, "s", "tcp://b", (0, 0, 1), {}, None).is_set()
    assert a.sockets.peers == []


def test_a_part_larger_than_the_worker_could_hold_is_refused_unread(caplog) -> None:
    ports: dict[str, tuple[str, int] | None] = {}
    a, small = End("tcp://a", ports, {"s"}), End("tcp://small", ports, {"s"}, largest=2**20)
    try:
        sent(a, "s", "tcp://small", (0, 0, 1), {}, np.ones(2**20, np.float32))  # 4 MiB
        assert sent(a, "s", "tcp://small", (1, 0, 1), {}, np.ones(4, np.float32)).wait(TIMEOUT)
        ((_, _, key, _, payload),) = small.wait_for(1)  # the big one never delivered
        assert key == (1, 0, 1) and payload.tolist() == [1.0] * 4
        assert any("refused a message of 4194304 bytes" in r.getMessage() for r in caplog.records)
    finally:
        a.sockets.close()
        small.sockets.close()


@pytest.mark.gen_cluster
@gen_cluster(client=True)
async def test_averaging_sends_a_part_its_peer_has_no_listener_for_through_dask_s_comms(
    c: Any, s: Any, a: Any, b: Any
) -> None:
    await c.register_plugin(AveragingWorkerPlugin())
    sender, receiver = a.plugins[NAME], b.plugins[NAME]
    assert sender.sockets is not None
    b.handlers["dlscale_averaging_port"] = lambda: None  # as a worker with transport "dask" answers
    box = receiver.open("s")
    part = np.arange(10, dtype=np.float32)
    sender.send("s", b.address, (3, 0, 1), {"weight": 2}, part)
    got = await asyncio.to_thread(box.wait, (3, 0, 1), {a.address}, TIMEOUT)
    assert got is not None
    header, payload = got[a.address]
    assert header == {"weight": 2} and np.array_equal(payload, part)
    deadline = time.monotonic() + TIMEOUT
    while sender.sending("s") and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not sender.sending("s") and sender.sockets.peers == []  # no connection made to b
