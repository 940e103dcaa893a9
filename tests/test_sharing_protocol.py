"""Gradient sharing's protocol, role by role: the send-buffer limiter, the records and their plain
form, the session errors and the settings."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import dask.config
import pytest
from distributed.protocol import dumps, loads

from dlscale.errors import DlscaleError
from dlscale.training.sharing._config import SharingConfig
from dlscale.training.sharing._exceptions import (
    STOPPED,
    LimiterError,
    MalformedMessageError,
    SessionAbortedError,
    SessionClosedError,
    SessionStoppedError,
    SharingConfigError,
    TrainerLostError,
)
from dlscale.training.sharing._limiter import ResourceLimiter
from dlscale.training.sharing._messages import Ack, Handout, Update, View, ok, refusal, unwrap


def wait_until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# -- the limiter ----------------------------------------------------------------------------------


def test_limiter_holds_bytes_against_its_bound() -> None:
    limiter = ResourceLimiter(100)
    assert limiter.empty and not limiter.full and limiter.available == 100
    assert limiter.acquire(60) == 0.0
    assert limiter.acquire(39) == 0.0  # 99 held: still below the limit, no wait
    assert limiter.acquired == 99 and limiter.available == 1
    assert limiter.acquire(50) == 0.0  # one update may take the total past the limit
    assert limiter.full and limiter.available == 0 and limiter.acquired == 149
    limiter.acquire_nowait(1000)  # the event loop relaying never waits
    assert limiter.acquired == 1149
    limiter.release(1149)
    assert limiter.empty
    assert "limit: 100" in repr(limiter)


def test_limiter_refuses_releasing_more_than_it_holds() -> None:
    limiter = ResourceLimiter(10)
    limiter.acquire(4)
    with pytest.raises(LimiterError, match="cannot release 5 bytes: the limiter holds 4") as info:
        limiter.release(5)
    assert isinstance(info.value, DlscaleError) and isinstance(info.value, ValueError)
    assert limiter.acquired == 4  # unchanged
    for bad in (-1, 1.5, True):
        with pytest.raises(LimiterError, match="number of bytes"):
            limiter.acquire(bad)
    for bad in (0, -5, 2.0):
        with pytest.raises(LimiterError, match="limit"):
            ResourceLimiter(bad)


def test_a_waiting_thread_is_woken_by_a_release() -> None:
    limiter = ResourceLimiter(10)
    limiter.acquire(10)
    waited: list[float] = []
    thread = threading.Thread(target=lambda: waited.append(limiter.acquire(3)))
    thread.start()
    wait_until(lambda: limiter.waiters == 1)
    time.sleep(0.05)
    assert not waited  # still blocked: the limit is reached
    limiter.release(1)
    thread.join(5)
    assert waited and waited[0] >= 0.05
    assert limiter.acquired == 12 and limiter.waiters == 0


def test_waiters_go_in_the_order_they_came() -> None:
    limiter = ResourceLimiter(10)
    limiter.acquire(10)
    order: list[str] = []
    threads = []
    for n, name in enumerate("abc", 1):
        thread = threading.Thread(target=lambda name=name: (limiter.acquire(10), order.append(name)))
        thread.start()
        threads.append(thread)
        wait_until(lambda n=n: limiter.waiters == n)
    for expected in (["a"], ["a", "b"], ["a", "b", "c"]):
        limiter.release(10)  # room for one: the first waiter takes it and fills the buffer again
        wait_until(lambda expected=expected: order == expected)
        time.sleep(0.02)
        assert order == expected
    for thread in threads:
        thread.join(5)


def test_closing_a_limiter_lets_its_waiters_go() -> None:
    limiter = ResourceLimiter(1)
    limiter.acquire(1)
    threads = [threading.Thread(target=limiter.acquire, args=(1,)) for _ in range(3)]
    for thread in threads:
        thread.start()
    wait_until(lambda: limiter.waiters == 3)
    limiter.close()
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()
    assert limiter.acquire(5) == 0.0  # no more waiting


def test_limiter_between_trainer_threads_and_the_event_loop() -> None:
    """As a node uses it: threads acquire before they hand an update to the loop, the loop releases
    it when sent; the bytes held never pass the limit by more than one update."""
    limit, size, per_thread = 50, 7, 200
    limiter = ResourceLimiter(limit)
    held: list[int] = []
    sent: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def sent_later(n: int) -> None:
            async def release() -> None:
                await asyncio.sleep(0.0005)
                sent.append(n)
                limiter.release(n)

            asyncio.ensure_future(release())

        def trainer() -> None:
            for _ in range(per_thread):
                limiter.acquire(size)
                held.append(limiter.acquired)
                loop.call_soon_threadsafe(sent_later, size)

        await asyncio.gather(*(asyncio.to_thread(trainer) for _ in range(4)))
        while len(sent) < 4 * per_thread:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert len(sent) == 4 * per_thread and limiter.empty
    assert max(held) <= limit - 1 + size
    assert max(held) > limit // 2  # the bound was reached: the trainers waited for the loop


# -- records ----------------------------------------------------------------------------------------

VIEW = View(done=False, version=2, nodes=("tcp://a", "tcp://b"), alive=("tcp://a#0", "tcp://b#0"), finished={})
RECORDS = [
    Update("tcp://a#0", 7, b"\x00\x01payload"),
    Ack(item=12, examples=16, score=0.25, threshold=1e-3, sparsity=0.01, bytes_sent=420),
    VIEW,
    dataclasses.replace(VIEW, done=True, finished={"tcp://a#0": 30}),
    Handout(items=(3, 4), view=VIEW),
    Handout(items=(), view=VIEW),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_records_round_trip_through_their_plain_form_on_the_comm(record: Any) -> None:
    plain = record.to_plain()
    assert type(record).from_plain(plain) == record
    assert type(record).from_plain(loads(dumps(plain))) == record  # as msgpack carries it


def test_a_plain_ack_with_an_integer_score_reads_as_a_float() -> None:
    ack = Ack.from_plain({"item": 1, "examples": 2, "score": 3, "threshold": 0, "sparsity": 0, "bytes_sent": 0})
    assert ack.score == 3.0 and isinstance(ack.score, float)


@pytest.mark.parametrize(
    "cls, plain, match",
    [
        (Update, ["tcp://a#0", 1, b"x"], r"update: expected a mapping of fields, got list"),
        (Update, {"origin": "o", "seq": 1}, r"update: missing fields \['payload'\], unexpected fields \[\]"),
        (Update, {"origin": "o", "seq": 1, "payload": b"", "x": 0}, r"unexpected fields \['x'\]"),
        (Update, {"origin": "o", "seq": "1", "payload": b""}, r"update\.seq: expected an integer, got str"),
        (Update, {"origin": "o", "seq": True, "payload": b""}, r"update\.seq: expected an integer"),
        (Update, {"origin": "o", "seq": 1, "payload": "text"}, r"update\.payload: expected bytes, got str"),
        (
            Ack,
            {"item": 1, "examples": 2, "score": "low", "threshold": 0.1, "sparsity": 0.1, "bytes_sent": 3},
            r"acknowledgement\.score: expected a number",
        ),
        (
            View,
            {"done": False, "version": 0, "nodes": "tcp://a", "alive": [], "finished": {}},
            r"session view\.nodes: expected a list",
        ),
        (
            View,
            {"done": False, "version": 0, "nodes": [], "alive": [], "finished": {"t": "3"}},
            r"session view\.finished\['t'\]: expected an integer",
        ),
        (
            Handout,
            {"items": [1], "view": {"done": 0, "version": 0, "nodes": [], "alive": [], "finished": {}}},
            r"session view\.done: expected a boolean, got int",
        ),
        (Handout, {"items": [1, None], "view": VIEW.to_plain()}, r"handout\.items\[1\]: expected"),
    ],
)
def test_a_malformed_record_is_refused_naming_the_field(cls: Any, plain: Any, match: str) -> None:
    with pytest.raises(MalformedMessageError, match=match) as info:
        cls.from_plain(plain)
    assert isinstance(info.value, DlscaleError) and isinstance(info.value, ValueError)


def test_replies_carry_a_status_and_refusals_become_typed_errors() -> None:
    reply = ok(VIEW)
    assert reply["status"] == "OK"
    assert View.from_plain(unwrap(loads(dumps(reply)))) == VIEW
    for cls in (SessionClosedError, TrainerLostError, SessionAbortedError):
        plain = loads(dumps(refusal(cls("session s: something named"))))
        assert plain == {"status": cls.reason, "message": "session s: something named"}
        with pytest.raises(cls, match="session s: something named"):
            unwrap(plain)
    with pytest.raises(MalformedMessageError, match="unknown status 'weird'"):
        unwrap({"status": "weird"})
    with pytest.raises(MalformedMessageError, match="without a status"):
        unwrap({"items": []})


# -- the session errors and the settings -----------------------------------------------------------


def test_session_errors_are_dlscale_runtime_errors_with_distinct_reasons() -> None:
    classes = [SessionClosedError, TrainerLostError, SessionAbortedError]
    assert sorted(STOPPED) == sorted(c.reason for c in classes) and len(STOPPED) == 3
    for cls in classes:
        assert STOPPED[cls.reason] is cls
        assert issubclass(cls, SessionStoppedError) and issubclass(cls, DlscaleError) and issubclass(cls, RuntimeError)
    assert issubclass(MalformedMessageError, ValueError) and issubclass(SharingConfigError, ValueError)


def test_settings_are_read_in_one_record() -> None:
    config = SharingConfig.from_dask()
    assert config == SharingConfig(
        send_buffer=64 * 2**20,
        coalesce=4 * 2**20,
        mesh_fanout=8,
        poll_interval=0.02,
        end_timeout=60,
        send_retries=3,
        send_retry_delay=0.1,
    )
    with dask.config.set({"dlscale.sharing.send-buffer": "1KiB", "dlscale.sharing.send-retry-delay": "2s"}):
        changed = SharingConfig.from_dask()
    assert changed.send_buffer == 1024 and changed.send_retry_delay == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.send_retries = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("send-retries", -1, r"dlscale\.sharing\.send-retries must be an integer >= 0, got -1"),
        ("mesh-fanout", 0, r"dlscale\.sharing\.mesh-fanout must be an integer >= 1"),
        ("send-buffer", "lots", r"dlscale\.sharing\.send-buffer: "),
        ("send-buffer", 0, r"dlscale\.sharing\.send-buffer must be an integer >= 1"),
        ("poll-interval", "soon", r"dlscale\.sharing\.poll-interval: "),
        ("send-retry-delay", "later", r"dlscale\.sharing\.send-retry-delay: "),
    ],
)
def test_a_setting_out_of_range_is_refused_naming_it(key: str, value: Any, match: str) -> None:
    with dask.config.set({f"dlscale.sharing.{key}": value}), pytest.raises(SharingConfigError, match=match):
        SharingConfig.from_dask()
    with pytest.raises(SharingConfigError, match=r"dlscale\.sharing\.send-retry-delay must be a duration >= 0"):
        dataclasses.replace(SharingConfig.from_dask(), send_retry_delay=-0.5)
