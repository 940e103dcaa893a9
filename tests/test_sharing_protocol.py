"""Gradient sharing's protocol, role by role: the send-buffer limiter, the records and their plain
form, the session errors, the settings, the scheduler's session logic (alone and over the comm), the
data plane's sends and retries on in-process clusters, through Dask's comms and over the workers' own
connections, and the mesh on 64 comm servers."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
import warnings
from typing import Any

import dask.config
import numpy as np
import pytest
import torch
from distributed import get_client
from distributed.comm.core import CommClosedError
from distributed.core import ConnectionPool, Server
from distributed.protocol import dumps, loads
from distributed.utils_test import captured_logger, gen_cluster
from tornado.ioloop import IOLoop

from dlscale.data import DataSet
from dlscale.errors import DlscaleError
from dlscale.training._config import DEPRECATED, SessionConfig, setting
from dlscale.training._errors import (
    STOPPED,
    MalformedMessageError,
    SessionAbortedError,
    SessionClosedError,
    SessionStoppedError,
    TrainerLostError,
    TrainingConfigError,
)
from dlscale.training._messages import ok, refusal, unwrap
from dlscale.training._sources import _PATIENCE, HeldMinibatch
from dlscale.training.sharing._leases import Session
from dlscale.training.sharing._limiter import LimiterError, ResourceLimiter
from dlscale.training.sharing._messages import Ack, Handout, Update, View, framed
from dlscale.training.sharing._node import Node
from dlscale.training.sharing._scheduler_plugin import SharingSchedulerPlugin
from dlscale.training.sharing._trainer import _Control
from dlscale.training.sharing._worker_plugin import NAME, SharingWorkerPlugin


def wait_until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


async def async_wait_until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


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
        (Update, {"origin": "o", "seq": 1, "residual": False}, r"update: missing fields \['payload'\], unexpected"),
        (Update, {"origin": "o", "seq": 1, "payload": b"", "residual": False, "x": 0}, r"unexpected fields \['x'\]"),
        (
            Update,
            {"origin": "o", "seq": "1", "payload": b"", "residual": False},
            r"update\.seq: expected an integer, got str",
        ),
        (Update, {"origin": "o", "seq": True, "payload": b"", "residual": False}, r"update\.seq: expected an integer"),
        (
            Update,
            {"origin": "o", "seq": 1, "payload": "text", "residual": False},
            r"update\.payload: expected bytes, got str",
        ),
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
    assert issubclass(MalformedMessageError, ValueError) and issubclass(TrainingConfigError, ValueError)


def test_settings_are_read_in_one_record() -> None:
    config = SessionConfig.from_dask()
    assert config == SessionConfig(
        send_buffer=64 * 2**20,
        coalesce=4 * 2**20,
        mesh_fanout=8,
        poll_interval=0.02,
        lease=2,
        end_timeout=60,
        send_retries=3,
        send_retry_delay=0.1,
    )
    with dask.config.set(
        {"dlscale.training.sharing.send-buffer": "1KiB", "dlscale.training.sharing.send-retry-delay": "2s"}
    ):
        changed = SessionConfig.from_dask()
    assert changed.send_buffer == 1024 and changed.send_retry_delay == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.send_retries = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("sharing.send-retries", -1, r"dlscale\.training\.sharing\.send-retries must be an integer >= 0, got -1"),
        ("sharing.mesh-fanout", 0, r"dlscale\.training\.sharing\.mesh-fanout must be an integer >= 1"),
        ("sharing.lease", 0, r"dlscale\.training\.sharing\.lease must be an integer >= 1, got 0"),
        ("sharing.send-buffer", "lots", r"dlscale\.training\.sharing\.send-buffer: "),
        ("sharing.send-buffer", 0, r"dlscale\.training\.sharing\.send-buffer must be an integer >= 1"),
        ("poll-interval", "soon", r"dlscale\.training\.poll-interval: "),
        ("sharing.send-retry-delay", "later", r"dlscale\.training\.sharing\.send-retry-delay: "),
        ("keep-trainers", "yes", r"dlscale\.training\.keep-trainers must be true or false, got 'yes'"),
    ],
)
def test_a_setting_out_of_range_is_refused_naming_it(key: str, value: Any, match: str) -> None:
    with dask.config.set({f"dlscale.training.{key}": value}), pytest.raises(TrainingConfigError, match=match):
        SessionConfig.from_dask()
    with pytest.raises(
        TrainingConfigError, match=r"dlscale\.training\.sharing\.send-retry-delay must be a duration >= 0"
    ):
        dataclasses.replace(SessionConfig.from_dask(), send_retry_delay=-0.5)


@pytest.mark.parametrize(
    "old, field, value, read",
    [
        ("sharing.lease", "lease", 7, 7),
        ("sharing.end-timeout", "end_timeout", "3s", 3.0),
        ("sharing.keep-trainers", "keep_trainers", False, False),
    ],
)
def test_an_old_key_is_still_read_with_a_warning_naming_the_new_one(
    old: str, field: str, value: Any, read: Any
) -> None:
    new = DEPRECATED[old]
    with (
        dask.config.set({f"dlscale.{old}": value}),
        pytest.warns(FutureWarning, match=f"dlscale.{old} is now dlscale.{new}"),
    ):
        assert getattr(SessionConfig.from_dask(), field) == read
    with (
        dask.config.set({"dlscale.averaging.transport": "dask"}),
        pytest.warns(FutureWarning, match="training.transport"),
    ):
        assert setting("training.transport") == "dask"


# -- the scheduler's session logic, alone ----------------------------------------------------------


def ack(item: int, examples: int = 16, score: float = 1.0) -> Ack:
    return Ack(item, examples, score, threshold=1e-3, sparsity=0.01, bytes_sent=100)


def session() -> Session:
    worker_of = {"a#0": "tcp://a", "a#1": "tcp://a", "b#0": "tcp://b", "c#0": "tcp://c"}
    return Session.open("s", worker_of, list(range(10)), workers={"tcp://a", "tcp://b"})


def test_trainers_on_unknown_workers_are_lost_from_the_start() -> None:
    s = session()
    assert s.alive == {"a#0", "a#1", "b#0"} and s.lost == ["c#0"]
    assert s.nodes() == ["tcp://a", "tcp://b"]
    with pytest.raises(TrainerLostError, match="trainer c#0 is not a member of session s"):
        s.join("c#0")


def test_a_trainer_joins_once() -> None:
    s = session()
    view = s.join("a#0")
    assert view == View(False, 0, ("tcp://a", "tcp://b"), ("a#0", "a#1", "b#0"), {})
    with pytest.raises(TrainerLostError, match="trainer a#0 of session s started a second time"):
        s.join("a#0")


def test_a_drained_session_ends_with_the_items_its_trainers_hold() -> None:
    s = session()
    s.hand_out("a#0", 3)
    assert s.drain() == [3, 4, 5, 6, 7, 8, 9]  # for the next segment, in order
    assert s.hand_out("b#0", 2).items == () and s.work_left()
    s.acknowledge("a#0", [ack(0), ack(1), ack(2)])
    assert not s.work_left() and s.view().done


def test_workers_that_join_are_reported_to_the_driver() -> None:
    plugin = SharingSchedulerPlugin()
    plugin.sessions = {"s": session()}
    plugin.add_worker(None, "tcp://d")  # type: ignore[arg-type]
    plugin.add_worker(None, "tcp://a")  # type: ignore[arg-type]  # one of the session's: not new
    plugin.add_worker(None, "tcp://d")  # type: ignore[arg-type]
    assert plugin.sessions["s"].progress()["newcomers"] == ["tcp://d"]


def test_a_driver_that_disconnects_ends_its_sessions() -> None:
    plugin = SharingSchedulerPlugin()
    plugin.sessions = {"mine": session(), "other": session()}
    plugin.sessions["mine"].client = "client-1"
    plugin.sessions["other"].client = "client-2"
    plugin.remove_client(None, "client-1")  # type: ignore[arg-type]
    assert list(plugin.sessions) == ["other"]
    reply = plugin.next("mine", "a#0", [], 1)
    assert reply["status"] != "OK"  # its trainers are told at their next call, and stop


def test_items_are_handed_out_in_order_and_acknowledged_once() -> None:
    s = session()
    assert s.hand_out("a#0", 3).items == (0, 1, 2)
    assert s.hand_out("b#0", 2).items == (3, 4)
    before = time.time()
    assert s.acknowledge("a#0", [ack(0, 16, 0.5), ack(2, 8, 0.25), ack(3)]) == [ack(0, 16, 0.5), ack(2, 8, 0.25)]
    assert s.acknowledge("a#0", [ack(0)]) == []  # already acknowledged
    progress = s.progress()
    # with what the step sent, and when the scheduler heard of it
    assert [r[:6] for r in progress["reports"]] == [(0, 16, 0.5, 1e-3, 0.01, 100), (2, 8, 0.25, 1e-3, 0.01, 100)]
    assert before <= progress["reports"][0][6] == progress["reports"][1][6] <= time.time()
    assert {k: v for k, v in progress.items() if k != "reports"} == {
        "abandoned": [],
        "lost": ["c#0"],
        "failed": None,
        "failed_by": None,
        "state": "run",
        "version": 0,
        "nodes": ["tcp://a", "tcp://b"],
        "alive": ["a#0", "a#1", "b#0"],
        "finished": {},
        "newcomers": [],
        "retired": [],
    }
    assert s.progress()["reports"] == []  # each acknowledgement is reported once


def test_a_lost_workers_unacknowledged_items_go_back_to_the_front() -> None:
    s = session()
    s.hand_out("a#0", 2)  # 0, 1
    s.hand_out("a#1", 1)  # 2
    s.hand_out("b#0", 2)  # 3, 4
    s.acknowledge("a#0", [ack(0)])
    assert s.remove_worker("tcp://a") == ["a#0", "a#1"]
    assert s.remove_worker("tcp://a") == [] and s.version == 1
    assert list(s.pending)[:3] == [1, 2, 5]
    assert s.lost == ["c#0", "a#0", "a#1"] and s.nodes() == ["tcp://b"]
    assert s.progress()["abandoned"] == [1, 2]  # to be fitted again: the driver counts them redone
    assert s.progress()["abandoned"] == []  # reported once
    with pytest.raises(TrainerLostError):
        s.hand_out("a#0", 1)
    assert s.hand_out("b#0", 2) == Handout((1, 2), View(False, 1, ("tcp://b",), ("b#0",), {}))


def test_a_retiring_trainer_hands_its_items_back_and_its_peers_wait_for_its_updates() -> None:
    s = session()
    s.hand_out("a#0", 2)  # 0, 1
    s.hand_out("b#0", 1)  # 2
    fresh, view = s.leave("a#0", [ack(0)], sent=7, stats={"minibatches": 1}, running={"tcp://b"})
    assert [a.item for a in fresh] == [0] and view.version == 1
    assert "a#0" not in view.alive and view.finished == {"a#0": 7}  # its peers wait for its 7 updates
    assert list(s.pending)[:2] == [1, 3] and s.lost == ["c#0"]  # handed back, not lost
    progress = s.progress()
    assert progress["retired"] == [{"minibatches": 1}] and progress["lost"] == ["c#0"]
    assert s.progress()["retired"] == []  # reported once
    with pytest.raises(TrainerLostError):
        s.hand_out("a#0", 1)
    assert s.remove_worker("tcp://a") == ["a#1"]  # the worker's other trainer had not left: it is lost
    # the last live trainer on a running worker stays to train the rest, its items back in the queue
    fresh, view = s.leave("b#0", [], sent=3, stats={}, running=set())
    assert "b#0" in view.alive and view.version == 2 and s.pending[0] == 2 and s.assigned["b#0"] == set()
    assert s.hand_out("b#0", 1).items == (2,)
    assert s.progress()["abandoned"] == []  # a trainer that leaves hands back items it never fitted


def test_the_session_is_done_when_every_item_is_acknowledged() -> None:
    s = Session.open("s", {"a#0": "tcp://a", "b#0": "tcp://b"}, [0, 1], workers={"tcp://a", "tcp://b"})
    s.hand_out("a#0", 2)
    assert not s.finish("b#0", 0).done and s.training()
    s.acknowledge("a#0", [ack(0), ack(1)])
    assert s.hand_out("a#0", 1) == Handout((), View(True, 0, ("tcp://a", "tcp://b"), ("a#0", "b#0"), {"b#0": 0}))
    assert s.finish("a#0", 5).finished == {"a#0": 5, "b#0": 0}
    assert not s.training() and s.progress()["state"] == "end"
    s.remove_worker("tcp://b")
    assert s.status("a#0").finished == {"a#0": 5}  # only live trainers count


def test_a_failure_stops_every_trainer_at_its_next_call() -> None:
    s = session()
    s.hand_out("a#0", 2)
    s.fail("b#0", "ValueError: bad minibatch")
    s.fail("driver", "stopped by the driver")  # the first failure is the one reported
    assert s.acknowledge("a#0", [ack(0)]) == [ack(0)]  # what was fitted is still reported
    for call in (lambda: s.hand_out("a#0", 1), lambda: s.finish("a#0", 1), lambda: s.status("a#1")):
        with pytest.raises(SessionAbortedError, match="session s stopped: b#0: ValueError: bad minibatch"):
            call()
    progress = s.progress()
    assert progress["state"] == "abort" and progress["failed"] == "b#0: ValueError: bad minibatch"
    assert progress["failed_by"] == "b#0"
    assert [r[:3] for r in progress["reports"]] == [(0, 16, 1.0)] and not s.training()


# -- the scheduler plugin over the comm ------------------------------------------------------------


@pytest.mark.gen_cluster
@gen_cluster(client=True)
async def test_the_control_plane_over_the_comm(c: Any, s: Any, a: Any, b: Any) -> None:
    await c.register_plugin(SharingSchedulerPlugin())
    ta, tb = f"{a.address}#0", f"{b.address}#0"
    worker_of = {ta: a.address, tb: b.address}
    await c.scheduler.dlscale_sharing_open(session="s", worker_of=worker_of, order=[0, 1, 2])
    joined = await a.scheduler.dlscale_sharing_join(session="s", trainer=ta)
    assert joined["status"] == "OK" and View.from_plain(unwrap(joined)).nodes == tuple(sorted([a.address, b.address]))

    # the trainer's end: records in a trainer's thread, plain data on the comm
    control = _Control(a, "s", ta)
    handout = await asyncio.to_thread(control.next, [], 2)
    assert handout.items == (0, 1) and not handout.view.done
    handout = await asyncio.to_thread(control.next, [ack(0, 16, 0.5)], 1)
    assert handout.items == (2,)
    malformed = {**ack(1).to_plain(), "item": "1"}
    with pytest.raises(MalformedMessageError, match=r"acknowledgement\.item"):
        await a.scheduler.dlscale_sharing_next(session="s", trainer=ta, acks=[malformed], want=1)
    progress = await c.scheduler.dlscale_sharing_progress(session="s")
    assert [tuple(r[:6]) for r in progress["reports"]] == [(0, 16, 0.5, 1e-3, 0.01, 100)]
    assert set(progress) == {
        "reports",
        "abandoned",
        "lost",
        "failed",
        "failed_by",
        "state",
        "version",
        "nodes",
        "alive",
        "finished",
        "newcomers",
        "retired",
    }

    # adaptive scaling may not retire a worker whose trainers are at work
    assert s.plugins[NAME].valid_workers_downscaling(s, list(s.workers.values())) == []

    # a lost worker: its trainer is refused, the others see a new version
    await b.close()
    await async_wait_until(lambda: len(s.workers) == 1)
    refused = await c.scheduler.dlscale_sharing_status(session="s", trainer=tb)
    assert refused == {"status": "lost", "message": f"trainer {tb} is not a member of session s"}
    assert (await asyncio.to_thread(control.status)).version == 1
    assert list((await c.scheduler.dlscale_sharing_progress(session="s"))["lost"]) == [tb]

    await c.scheduler.dlscale_sharing_fail(session="s", trainer="driver", error="stopped by the driver")
    with pytest.raises(SessionAbortedError, match="stopped by the driver"):
        await asyncio.to_thread(control.finish, 3)
    await c.scheduler.dlscale_sharing_close(session="s")
    with pytest.raises(SessionClosedError, match="session s is not open"):
        await asyncio.to_thread(control.status)


# -- the data plane: sends, retries, the bound ------------------------------------------------------

DASK_COMMS = {"dlscale.training.transport": "dask"}  # the handlers below stand in for a peer's
FAST_RETRIES = {"dlscale.training.sharing.send-retries": 2, "dlscale.training.sharing.send-retry-delay": "10ms"}


async def open_nodes(c: Any, *workers: Any) -> list[Node]:
    await c.register_plugin(SharingWorkerPlugin())
    nodes = [w.plugins[NAME].open("s", 1, "plain", SessionConfig.from_dask()) for w in workers]
    for node in nodes:
        node.set_nodes(0, sorted(w.address for w in workers))
    await asyncio.sleep(0.01)  # the loop adopts the membership
    return nodes


def flaky_handler(worker: Any, failures: int, deliver_first: bool = False) -> list[int]:
    """Make ``worker``'s ``dlscale_update`` drop its connection on its first ``failures`` calls (after
    delivering, when ``deliver_first``: the reply is what is lost); returns the count of calls."""
    calls = [0]
    update = worker.handlers["dlscale_update"]

    def handler(session: str, sender: str, messages: list[Any]) -> None:
        calls[0] += 1
        if calls[0] <= failures:
            if deliver_first:
                update(session=session, sender=sender, messages=messages)
            raise CommClosedError("connection dropped")
        update(session=session, sender=sender, messages=messages)

    worker.handlers["dlscale_update"] = handler
    return calls


def dropped(node: Node, peer: str) -> bool:
    link = node.comms.links.get(peer)
    return link is not None and link.dead


def updates(n: int, origin: str = "a#0") -> list[Update]:
    return [Update(origin, i, f"update {i}".encode()) for i in range(n)]


@pytest.mark.parametrize("deliver_first", [False, True])
@pytest.mark.gen_cluster
@gen_cluster(client=True, config=FAST_RETRIES | DASK_COMMS)
async def test_a_failure_that_clears_within_the_retries_loses_nothing(
    c: Any, s: Any, a: Any, b: Any, deliver_first: bool
) -> None:
    node_a, node_b = await open_nodes(c, a, b)
    calls = flaky_handler(b, failures=2, deliver_first=deliver_first)
    sent = updates(20)
    for u in sent:
        node_a.send(u, 0)
    await async_wait_until(lambda: len(node_b.inboxes[0]) >= 20)
    await asyncio.sleep(0.05)  # a duplicate would be in by now
    assert list(node_b.inboxes[0]) == sent  # each once, in order
    assert calls[0] >= 3 and not dropped(node_a, b.address)
    await async_wait_until(lambda: node_a.limiter.empty)


@pytest.mark.gen_cluster
@gen_cluster(client=True, config=FAST_RETRIES | DASK_COMMS)
async def test_a_peer_unreachable_beyond_the_retries_is_dropped(c: Any, s: Any, a: Any, b: Any) -> None:
    node_a, node_b = await open_nodes(c, a, b)
    calls = flaky_handler(b, failures=100)
    for u in updates(5):
        node_a.send(u, 0)
    await async_wait_until(lambda: dropped(node_a, b.address))
    await async_wait_until(lambda: node_a.limiter.empty)
    assert calls[0] == 3  # the first try and two retries
    node_a.send(Update("a#0", 5, b"later"), 0)
    await asyncio.sleep(0.05)
    assert calls[0] == 3 and not node_b.inboxes[0] and node_a.limiter.empty


@pytest.mark.gen_cluster
@gen_cluster(client=True, config=FAST_RETRIES | DASK_COMMS)
async def test_a_call_hanging_on_a_peer_dropped_from_the_membership_ends_at_once(
    c: Any, s: Any, a: Any, b: Any
) -> None:
    """A lost peer's call may hang (a connection attempt waits for Dask's connect timeout): dropping the peer,
    as a new membership does, cancels it and frees its bytes at once."""
    node_a, node_b = await open_nodes(c, a, b)
    entered, release = asyncio.Event(), asyncio.Event()

    async def hanging(session: str, sender: str, messages: list[Any]) -> None:
        entered.set()
        await release.wait()

    b.handlers["dlscale_update"] = hanging
    node_a.send(Update("a#0", 0, b"x" * 1000), 0)
    await asyncio.wait_for(entered.wait(), 5)
    assert not node_a.limiter.empty
    node_a.set_nodes(1, [a.address])  # b left the membership
    await async_wait_until(lambda: dropped(node_a, b.address) and node_a.limiter.empty, timeout=2)
    assert not node_a.comms.links[b.address].running
    release.set()
    assert not node_b.inboxes[0]


@pytest.mark.gen_cluster
@gen_cluster(client=True, config=FAST_RETRIES | DASK_COMMS)
async def test_a_peers_own_error_is_not_retried(c: Any, s: Any, a: Any, b: Any) -> None:
    node_a, _ = await open_nodes(c, a, b)
    calls = [0]

    def broken(session: str, sender: str, messages: list[Any]) -> None:
        calls[0] += 1
        raise ValueError("cannot take updates")

    b.handlers["dlscale_update"] = broken
    node_a.send(Update("a#0", 0, b"x"), 0)
    await async_wait_until(lambda: dropped(node_a, b.address))
    assert calls[0] == 1 and node_a.limiter.empty


@pytest.mark.gen_cluster
@gen_cluster(client=True, config=DASK_COMMS)
async def test_a_malformed_update_is_refused(c: Any, s: Any, a: Any, b: Any) -> None:
    _, node_b = await open_nodes(c, a, b)
    with pytest.raises(MalformedMessageError, match=r"update: missing fields \['payload', 'residual', 'seq'\]"):
        await a.rpc(b.address).dlscale_update(session="s", sender=a.address, messages=[{"origin": "a#0"}])
    assert not node_b.inboxes[0]


@pytest.mark.gen_cluster
@gen_cluster(client=True, config={"dlscale.training.sharing.send-buffer": 2500} | DASK_COMMS)
async def test_a_trainer_waits_for_the_network_when_the_send_buffer_is_full(c: Any, s: Any, a: Any, b: Any) -> None:
    node_a, node_b = await open_nodes(c, a, b)
    update = b.handlers["dlscale_update"]
    held: list[int] = []

    async def slow(session: str, sender: str, messages: list[Any]) -> None:
        held.append(node_a.limiter.acquired)
        await asyncio.sleep(0.02)
        update(session=session, sender=sender, messages=messages)

    b.handlers["dlscale_update"] = slow
    sent = [Update("a#0", i, bytes([i]) * 1000) for i in range(20)]
    waited = await asyncio.to_thread(lambda: sum(node_a.send(u, 0) for u in sent))  # a trainer's thread
    await async_wait_until(lambda: len(node_b.inboxes[0]) == 20)
    assert list(node_b.inboxes[0]) == sent
    assert waited > 0 and max(held) <= 2500 - 1 + 1000
    await async_wait_until(lambda: node_a.limiter.empty)  # the last reply is in


# -- over the workers' own connections (the default) ----------------------------------------------


def counted_handler(worker: Any) -> list[int]:
    """Count ``worker``'s calls of ``dlscale_update`` (Dask's comms), delivering them."""
    calls = [0]
    update = worker.handlers["dlscale_update"]

    def handler(session: str, sender: str, messages: list[Any]) -> None:
        calls[0] += 1
        update(session=session, sender=sender, messages=messages)

    worker.handlers["dlscale_update"] = handler
    return calls


@pytest.mark.gen_cluster
@gen_cluster(client=True, config=FAST_RETRIES)
async def test_updates_go_over_the_workers_own_connections_each_once_in_order(c: Any, s: Any, a: Any, b: Any) -> None:
    node_a, node_b = await open_nodes(c, a, b)
    calls = counted_handler(b)
    sent = [Update("a#0", i, bytes([i]) * (i * 1000)) for i in range(30)] + [Update("a#0", 30, b"", residual=True)]
    for u in sent:
        node_a.send(u, 0)
    await async_wait_until(lambda: len(node_b.inboxes[0]) >= len(sent))
    await asyncio.sleep(0.05)  # a duplicate would be in by now
    assert list(node_b.inboxes[0]) == sent and calls[0] == 0
    assert a.plugins[NAME].sockets.peers == [b.address]
    await async_wait_until(lambda: node_a.limiter.empty)


@pytest.mark.gen_cluster
@gen_cluster(client=True, config=FAST_RETRIES)
async def test_a_peer_whose_connection_cannot_be_made_beyond_the_retries_is_dropped(
    c: Any, s: Any, a: Any, b: Any
) -> None:
    node_a, node_b = await open_nodes(c, a, b)
    asked = [0]

    def gone() -> None:
        asked[0] += 1
        raise CommClosedError("connection dropped")

    b.handlers["dlscale_sharing_port"] = gone
    node_a.send(Update("a#0", 0, b"x" * 1000), 0)
    await async_wait_until(lambda: dropped(node_a, b.address) and node_a.limiter.empty)
    assert asked[0] == 3 and not node_b.inboxes[0]  # the first try and two retries


@pytest.mark.gen_cluster
@gen_cluster(client=True)
async def test_a_peer_without_a_listener_gets_its_updates_through_dask_s_comms(c: Any, s: Any, a: Any, b: Any) -> None:
    node_a, node_b = await open_nodes(c, a, b)
    calls = counted_handler(b)
    b.handlers["dlscale_sharing_port"] = lambda: None  # as a worker with transport "dask" answers
    sent = updates(5)
    for u in sent:
        node_a.send(u, 0)
    await async_wait_until(lambda: len(node_b.inboxes[0]) >= 5)
    assert list(node_b.inboxes[0]) == sent and calls[0] >= 1
    await async_wait_until(lambda: node_a.limiter.empty)


@pytest.mark.gen_cluster
@gen_cluster(client=True)
async def test_a_malformed_message_on_a_worker_s_own_connection_is_refused(c: Any, s: Any, a: Any, b: Any) -> None:
    _, node_b = await open_nodes(c, a, b)
    sockets = a.plugins[NAME].sockets
    with captured_logger("dlscale.training.sharing", level=logging.WARNING) as log:
        for head in ({"updates": [["a#0", 0, False, 5]]}, {"updates": [["a#0", "zero", False, 3]]}, {"other": 1}):
            sockets.send("s", b.address, head, np.frombuffer(b"abc", np.uint8), lambda error: None)
        good = Update("a#0", 1, b"abc")
        sockets.send("s", b.address, *framed([good]), lambda error: None)
        await async_wait_until(lambda: len(node_b.inboxes[0]) == 1)
    assert list(node_b.inboxes[0]) == [good]
    refused = [line for line in log.getvalue().splitlines() if "refused" in line]
    assert len(refused) == 3
    assert "do not add up to the 3 bytes" in refused[0] and "update.seq: expected an integer" in refused[1]


@pytest.mark.gen_cluster
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_a_mesh_relays_what_it_reads_off_its_own_connections(c: Any, s: Any, a: Any, b: Any, w: Any) -> None:
    """A chain (fan-out 1): the middle node passes each end's updates on to the other end."""
    workers = sorted([a, b, w], key=lambda x: x.address)
    await c.register_plugin(SharingWorkerPlugin())
    config = dataclasses.replace(SessionConfig.from_dask(), mesh_fanout=1)
    nodes = [x.plugins[NAME].open("s", 1, "mesh", config) for x in workers]
    for node in nodes:
        node.set_nodes(0, [x.address for x in workers])
    await asyncio.sleep(0.01)
    first, last = nodes[0], nodes[2]
    sent = [Update(f"{workers[0].address}#0", i, bytes([i]) * 100) for i in range(10)]
    for u in sent:
        first.send(u, 0)
    await async_wait_until(lambda: len(last.inboxes[0]) >= 10)
    assert list(last.inboxes[0]) == sent and list(nodes[1].inboxes[0]) == sent
    assert workers[0].plugins[NAME].sockets.peers == [workers[1].address]  # not to the far end


# -- the mesh on 64 lightweight peers: real comm servers in one process ------------------------


async def _mesh_round(nodes: dict[str, Node], version: int, seq: int) -> None:
    for node in nodes.values():
        node.set_nodes(version, sorted(nodes))
    await asyncio.sleep(0.05)
    for address, node in nodes.items():
        node.send(Update(f"{address}#0", seq, f"{address}/{seq}".encode()), 0)
    for _ in range(200):
        if all(len(n.inboxes[0]) == len(nodes) - 1 for n in nodes.values()):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)  # a duplicate would arrive by now
    for address, node in nodes.items():
        got = sorted(u.payload.decode() for u in node.inboxes[0])
        assert got == sorted(f"{a}/{seq}" for a in nodes if a != address)
        node.inboxes[0].clear()


@pytest.mark.parametrize("mode, fanout", [("mesh", 4), pytest.param("plain", 4, marks=pytest.mark.slow)])
def test_every_update_reaches_every_peer_once_on_64_nodes(mode: str, fanout: int) -> None:
    config = dataclasses.replace(SessionConfig.from_dask(), mesh_fanout=fanout)

    async def main() -> None:
        pool = await ConnectionPool(limit=1024)
        servers, nodes = [], {}
        loop = IOLoop.current()
        for _ in range(64):
            server = Server({})
            await server.listen("tcp://127.0.0.1:0")
            node = Node("s", server.address, pool, loop, 1, mode, config)
            server.handlers["dlscale_update"] = lambda session, sender, messages, node=node: node.receive(
                sender, [Update.from_plain(m) for m in messages]
            )
            servers.append(server)
            nodes[server.address] = node
        try:
            await _mesh_round(nodes, 0, 0)
            links = [len(n.comms.links) for n in nodes.values()]
            assert max(links) <= (fanout + 1 if mode == "mesh" else 63)
            # the root of the tree dies: the survivors rebuild it and go on
            root = min(nodes)
            await servers[[s.address for s in servers].index(root)].close()
            nodes.pop(root).close()
            await _mesh_round(nodes, 1, 1)
        finally:
            for node in nodes.values():
                node.close()
            for server in servers:
                await server.close()
            await pool.close()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        asyncio.run(main())


# -- minibatches held in worker memory ----------------------------------------------------------------
def _slow_minibatch(seconds: float) -> DataSet:
    time.sleep(seconds)
    return DataSet(torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 0]))


def _held(dataset: str, name: str) -> tuple[list[list[float]], list[int], list[str]]:
    """Load ``name`` of ``dataset`` as a trainer does, with what the loader logged on the way."""
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("dlscale.training")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        batch = HeldMinibatch(dataset, 30.0).bind(get_client())(name)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return batch.features.tolist(), batch.labels.tolist(), said


def test_a_held_minibatch_slower_to_come_than_the_loaders_patience_is_asked_for_again_and_arrives(sc) -> None:
    """A fetch of a held minibatch that outlasts the loader's patience (one that would be connecting to
    a worker already dead) is cancelled and asked again, not given up: a minibatch computed for
    longer than the patience arrives whole, after the loader said it asked again."""
    client = sc.client
    dataset = f"test-held-{uuid.uuid4().hex[:8]}"
    slow = client.submit(_slow_minibatch, _PATIENCE + 1.5, pure=False)
    client.publish_dataset(**{dataset: {"mb": slow}})
    try:
        features, labels, said = client.submit(_held, dataset, "mb", pure=False).result(timeout=60)
    finally:
        client.unpublish_dataset(dataset)
    assert features == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]] and labels == [0, 1, 0]
    assert [m for m in said if "asking again" in m] == [
        f"minibatch mb, held in worker memory, not here after {_PATIENCE:.3g} s: asking again"
    ]
