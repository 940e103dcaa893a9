"""Parameter averaging's protocol without a cluster: the scheduler's bookkeeping of rounds (``_rounds``)
under losses and late commits, and the allreduce (``_exchange``) among trainers in threads, against
the example-weighted mean of states that one process computes (``_worker.average``)."""

from __future__ import annotations

import collections
import functools
import random
import threading
from collections import Counter
from typing import Any

import pytest
import torch

from dlscale.nn import Network
from dlscale.training import _worker
from dlscale.training.averaging._exchange import (
    Contribution,
    Exchange,
    Mailbox,
    bounds,
    dequantize,
    quantize,
)
from dlscale.training.averaging._flat import FlatState
from dlscale.training.averaging._rounds import Rounds, TrainerLostError, plan_rounds
from dlscale.training.averaging._trainer import _Outer

T = ["a", "b", "c"]


def test_plans_rounds_of_consecutive_items_per_epoch_split_evenly() -> None:
    items = [3, 0, 4, 1, 2, 5 + 2, 5 + 0, 5 + 1, 5 + 4, 5 + 3]  # two epochs of 5
    plan = plan_rounds(items, ["a", "b"], 2, 5)
    assert plan == [
        {"a": [3, 0], "b": [4, 1]},
        {"a": [2], "b": []},
        {"a": [7, 5], "b": [6, 9]},
        {"a": [8], "b": []},
    ]
    owned = plan_rounds(list(range(6)), ["a", "b"], 2, 6, owner={0: "b", 1: "b", 2: "b", 3: "a", 4: "b", 5: "a"})
    assert owned == [{"a": [3, 5], "b": [0, 1]}, {"a": [], "b": [2, 4]}]


def _report(t: str, items: list[int]) -> dict[str, Any]:
    return {"trainer": t, "items": items, "examples": 8 * len(items)}


def _fitted(rounds: Rounds) -> Counter[int]:
    return Counter(i for r in rounds.reports for m in r["members"] for i in m["items"])


def _run_round(s: Rounds, k: int, attempt: int = 0) -> None:
    members = s.sync(s.rounds[k].members[attempt][0], k)["members"]
    report = [_report(t, s.rounds[k].shares.get(t, [])) for t in members]
    for t in members:
        s.commit(t, k, attempt, report)


def test_a_round_settles_when_every_live_trainer_holds_its_average() -> None:
    s = Rounds("s", plan_rounds(list(range(12)), T, 2, 12), T)
    assert s.begin("a", 0) == {
        "end": False,
        "round": 0,
        "items": [0, 1],
        "attempt": 0,
        "members": T,
        "committed": None,
        "holders": [],
    }
    report = [_report(t, s.rounds[0].shares[t]) for t in T]
    s.commit("a", 0, 0, report)
    assert s.rounds[0].committed == 0 and not s.reports  # b and c do not hold it yet
    s.commit("b", 0, 0, report)
    assert s.commit("c", 0, 0, report)["items"] == [10, 11]
    assert [r["round"] for r in s.reports] == [0]
    _run_round(s, 1)
    assert s.begin("a", 2)["end"] and s.settled() and _fitted(s) == Counter(range(12))


def test_a_commit_before_the_last_round_s_commit_is_refused() -> None:
    """Commits come in order (a trainer reads one's reply before it sends the next): one out of order
    would settle a round before the one before it, so it is refused, naming the trainer and rounds."""
    s = Rounds("s", plan_rounds(list(range(8)), ["a", "b"], 2, 8), ["a", "b"])
    report = [_report(t, s.rounds[0].shares[t]) for t in ("a", "b")]
    s.commit("b", 0, 0, report)
    with pytest.raises(RuntimeError, match="trainer a of session s committed round 1 before round 0"):
        s.commit("a", 1, 0, report)
    assert s.rounds[1].committed is None and not s.reports
    s.commit("a", 0, 0, report)
    s.commit("a", 1, 0, report)  # in order, it is taken
    assert s.rounds[1].committed == 0


def test_a_lost_trainer_s_share_goes_to_the_others_and_every_item_is_fitted_once() -> None:
    s = Rounds("s", plan_rounds(list(range(18)), T, 2, 18), T)
    _run_round(s, 0)
    assert s.lose("c")
    # c's share of the open round goes to a round inserted after it, its later shares to the others
    assert s.rounds[1].members[s.rounds[1].attempt] == ("a", "b")
    assert s.rounds[2].shares == {"a": [10], "b": [11]}
    assert all("c" not in r.shares and "c" not in r.members[r.attempt] for r in s.rounds[1:])  # the last too
    for k in range(1, len(s.rounds)):
        _run_round(s, k, s.rounds[k].attempt)
    assert s.settled() and _fitted(s) == Counter(range(18))
    assert s.abandoned == [10, 11]  # c was given them and its work on them is not in the result: redone
    with pytest.raises(TrainerLostError):
        s.begin("c", 1)


def test_an_attempt_a_lost_trainer_took_part_in_commits_with_its_items() -> None:
    """c's state reached a's average before c was lost: the round takes that attempt, c's moved items
    are taken back, and b, which did not complete it, adopts it."""
    s = Rounds("s", plan_rounds(list(range(6)), T, 2, 6), T)
    report = [_report(t, s.rounds[0].shares[t]) for t in T]
    s.lose("c")
    assert s.rounds[0].attempt == 1 and len(s.rounds) == 2  # c's share moved to an inserted round
    s.commit("a", 0, 0, report)  # a completed attempt 0, with c in it
    assert s.commit("b", 0, 1, report) == {"adopt": ["a"]}
    s.commit("b", 0, 0, [])
    assert len(s.rounds) == 1 and s.settled() and _fitted(s) == Counter(range(6))
    assert s.abandoned == []  # c's items are in the result once, nothing redone


def test_a_committed_round_nobody_alive_holds_opens_again() -> None:
    s = Rounds("s", plan_rounds(list(range(6)), T, 2, 6), T)
    report = [_report(t, s.rounds[0].shares[t]) for t in T]
    s.begin("c", 0)
    s.commit("c", 0, 0, report)
    s.lose("c")  # the only holder: a and b never got the average
    r = s.rounds[0]
    assert r.committed is None and r.members[r.attempt] == ("a", "b")
    _run_round(s, 0, r.attempt)
    _run_round(s, 1)
    assert s.settled() and _fitted(s) == Counter(range(6))
    assert s.abandoned == [4, 5]  # c fitted them, but the average it alone held went with it: redone


def test_losing_every_trainer_leaves_a_session_that_fits_nothing_more() -> None:
    """The last trainer lost (its shares of later rounds have nobody to go to): the bookkeeping takes it
    in, and the driver, with no trainer left, fails the fit with its network unchanged."""
    s = Rounds("s", plan_rounds(list(range(12)), ["a", "b"], 2, 12), ["a", "b"])
    _run_round(s, 0)
    assert s.lose("a") and s.lose("b")
    assert not s.alive and not s.settled() and [r["round"] for r in s.reports] == [0]


def test_a_retiring_trainer_leaves_between_settled_rounds_unless_it_is_the_last() -> None:
    s = Rounds("s", plan_rounds(list(range(8)), ["a", "b"], 2, 8), ["a", "b"])
    assert s.leave("b", 0) == "left"
    assert s.rounds[0].shares == {"a": [0, 1]} and s.rounds[1].shares["a"] == [2, 3]
    assert s.leave("a", 0) == "stay"


def test_the_last_round_of_an_epoch_a_checkpoint_wants_is_handed_out_to_be_kept() -> None:
    """Rounds of 2 epochs of 8 items, 2 rounds each: only a round that ends an epoch in
    ``snapshot_epochs`` says so as it is handed out."""
    s = Rounds("s", plan_rounds(list(range(16)), ["a", "b"], 2, 8), ["a", "b"])
    s.snapshot_epochs, s.per_epoch = {0}, 8
    assert [bool(s.begin("a", k).get("snapshot")) for k in range(4)] == [False, True, False, False]
    s.snapshot_epochs = {0, 1}
    assert [bool(s.begin("b", k).get("snapshot")) for k in range(4)] == [False, True, False, True]


def test_a_streaming_trainer_is_handed_the_next_round_with_each_commit() -> None:
    s = Rounds("s", plan_rounds(list(range(12)), ["a", "b"], 2, 12), ["a", "b"])
    first = s.begin("a", 0, ahead=1)
    assert (first["items"], first["next"]["items"]) == ([0, 1], [4, 5])
    s.begin("b", 0, ahead=1)
    assert s.frontier() == 1 and s.first_stoppable() == 2
    report = [_report(t, s.rounds[0].shares[t]) for t in ("a", "b")]
    reply = s.commit("a", 0, 0, report, ahead=1)
    assert reply["items"] == [8, 9] and reply["current"] == s.sync("a", 1)
    assert s.frontier() == 2 and s.first_stoppable() == 3
    assert s.commit("b", 0, 0, report, ahead=1)["items"] == [10, 11]
    assert s.commit("a", 1, 0, report, ahead=1)["end"]


def _simulate(seed: int, trainers: int, items: int, per: int, losses: int, ahead: int) -> None:
    """Trainers, streaming their rounds with ``ahead=1`` (each fits round k + 1 while round k's averaging
    is in flight), stepped in a random order, with ``losses`` trainers lost at random moments and each
    part of an averaging delivered to each peer at a random moment (a lost trainer's parts may never
    arrive): every item is reported fitted once, by the trainer it was handed to, in a round of its
    epoch (of 20 items), no share changes once handed out, and a trainer that has every part of its
    attempt has its commit taken (so a trainer may go on before the scheduler's reply comes)."""
    rng = random.Random(seed)
    names = [f"t{i}" for i in range(trainers)]
    s = Rounds("s", plan_rounds(list(range(items)), names, per, 20), names)
    handed: dict[tuple[int, str], list[int]] = {}  # (round, trainer): its share as handed out
    got: dict[tuple[int, int, str], set[str]] = collections.defaultdict(set)  # (round, attempt, to): from whom
    flying: list[tuple[int, int, str, str]] = []  # parts sent, not yet delivered: (round, attempt, from, to)
    state = {t: {"k": 0, "phase": "start", "attempt": None} for t in names}

    def take(t: str, reply: dict[str, Any]) -> None:
        while reply is not None and not reply["end"]:
            assert (reply["round"], t) not in handed
            handed[reply["round"], t] = reply["items"]
            reply = reply.get("next")

    def send(t: str, k: int, status: dict[str, Any]) -> None:
        state[t].update(attempt=status["attempt"], members=status["members"])
        got[k, status["attempt"], t].add(t)
        flying.extend((k, status["attempt"], t, m) for m in status["members"] if m != t)

    def deliver() -> None:
        k, attempt, sender, to = flying.pop(rng.randrange(len(flying)))
        if sender in s.alive or rng.random() < 0.5:
            got[k, attempt, to].add(sender)

    def step(t: str) -> None:
        st = state[t]
        k = st["k"]
        if st["phase"] == "start":
            reply = s.begin(t, 0, ahead=ahead)
            take(t, reply)
            if reply["end"]:
                st["phase"] = "done"
                return
            send(t, 0, reply)  # round 0 fitted, its parts sent (streaming: round 1 being fitted)
            st["phase"] = "averaging"
            return
        if st["phase"] != "averaging":
            return
        if set(st["members"]) <= got[k, st["attempt"], t]:  # every part of its attempt: it commits
            members = st["members"]
            report = [_report(m, handed.get((k, m), [])) for m in members]
            reply = s.commit(t, k, st["attempt"], report, ahead=ahead)
            assert "adopt" not in reply, (t, k, st["attempt"], s)
        else:
            status = s.sync(t, k)
            committed = status["committed"]
            if committed is not None:
                reply = s.commit(t, k, committed, [], ahead=ahead)  # adopts a holder's average
                assert "adopt" not in reply
            elif status["attempt"] != st["attempt"]:
                send(t, k, status)  # a member was lost: the round's averaging again, without it
                return
            else:
                return
        take(t, reply)
        st["k"] = k + 1
        if (k + 1, t) not in handed:  # nothing to fit: the session ends for this trainer
            st["phase"] = "done"
            return
        send(t, k + 1, reply["current"])

    lost = 0
    for _ in range(20_000):
        alive = sorted(s.alive)
        active = [t for t in alive if state[t]["phase"] != "done"]
        if not active:
            break
        if lost < losses and len(alive) > 1 and rng.random() < 0.05:
            s.lose(rng.choice(alive))
            lost += 1
        elif flying and rng.random() < 0.5:
            deliver()
        else:
            step(rng.choice(active))
    assert s.settled(), s
    assert _fitted(s) == Counter(range(items))
    for r in s.reports:
        for m in r["members"]:
            assert m["items"] == handed[r["round"], m["trainer"]]
        assert len({i // 20 for m in r["members"] for i in m["items"]}) <= 1, r
    # redone: exactly the items handed to a lost trainer that the result has from another (an item
    # dropped by two lost trainers in turn is named twice; the driver counts it once)
    by = {i: m["trainer"] for r in s.reports for m in r["members"] for i in m["items"]}
    dropped = {i for (_, t), share in handed.items() if t in s.gone for i in share if by[i] != t}
    assert set(s.abandoned) == dropped, (s.abandoned, dropped)


@pytest.mark.parametrize("ahead", [0, 1])
def test_rounds_fit_every_item_once_under_losses_streaming_or_not(ahead: int) -> None:
    for seed in range(300):
        _simulate(seed, trainers=2 + seed % 4, items=40 + seed % 23, per=1 + seed % 4, losses=seed % 4, ahead=ahead)


# -- the allreduce -----------------------------------------------------------------------------------
def _net(seed: int, norm: bool = True) -> Network:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(5, 7)] + ([torch.nn.BatchNorm1d(7)] if norm else []) + [torch.nn.Linear(7, 2)]
    return Network(
        torch.nn.Sequential(*layers), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    )


def _step(net: Network, seed: int, n: int) -> int:
    from dlscale.data import DataSet

    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(8, 5, generator=g)
        net.fit_batch(DataSet(x, (x[:, 0] > 0).long()))
    return 8 * n


def _states(nets: list[Network], weights: list[int]) -> list[dict[str, Any]]:
    """The states of ``nets`` as one process averages them (``_worker.average``), weighted by ``weights``."""
    return [
        {**_worker.state_of(n, True), "examples": w, "batches": 1, "score": 0.0, "shares": []}
        for n, w in zip(nets, weights, strict=True)
    ]


def _allreduce(nets: list[Network], weights: list[int], flats: list[FlatState], dtype=torch.float32):
    for flat, (average, layout, kept) in zip(flats, _exchanged(weights, flats, dtype), strict=True):
        flat.apply(average, layout, kept)


def _exchanged(weights: list[int], flats: list[FlatState], dtype=torch.float32) -> list[Any]:
    """Every member's average (and layout, values set aside) from an allreduce of ``flats`` in threads."""
    names = [f"t{i}" for i in range(len(flats))]
    boxes = {t: Mailbox() for t in names}

    def run(i: int) -> None:
        v, layout, kept = flats[i].vector()
        mine = Contribution(v, layout, kept, weights[i], {"trainer": names[i]})

        def send(peer: str, key: tuple[int, int, int], header: dict[str, Any], payload: Any) -> None:
            boxes[peer].put(key, names[i], header, payload)

        ex = Exchange(names[i], 0, 0, names, mine, boxes[names[i]], send, dtype)
        assert ex.run(10.0)
        results[i] = ex.result

    results: list[Any] = [None] * len(flats)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(flats))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("members", [2, 3, 4])
def test_the_allreduce_is_the_example_weighted_mean_of_the_states(members: int) -> None:
    nets = [_net(0) for _ in range(members)]
    flats = [FlatState(n, True) for n in nets]
    weights = [_step(n, seed=10 + i, n=1 + i % 2) for i, n in enumerate(nets)]
    states = _states(nets, weights)
    expected = _worker.average(*states)
    _allreduce(nets, weights, flats)
    for n in nets:  # every replica holds the same state: the weighted mean
        torch.testing.assert_close(n.params(), expected["params"], rtol=0, atol=1e-6)
        bn = n.module[1]
        torch.testing.assert_close(bn.running_mean, expected["buffers"]["1.running_mean"], rtol=0, atol=1e-6)
        momentum = n.optimizer_state()["state"][0]["momentum_buffer"]
        torch.testing.assert_close(momentum, expected["optimizer"]["state"][0]["momentum_buffer"], rtol=0, atol=1e-6)
        # what is not averaged comes from the first state, as one process takes it
        assert int(bn.num_batches_tracked) == int(expected["buffers"]["1.num_batches_tracked"])
    assert all(torch.equal(nets[0].params(), n.params()) for n in nets[1:])


def test_a_member_without_examples_takes_the_others_state_and_its_optimizer_layout() -> None:
    nets = [_net(0), _net(0)]
    flats = [FlatState(n, True) for n in nets]
    w = _step(nets[0], seed=1, n=2)  # the second never stepped: no momentum buffers
    expected = _worker.state_of(nets[0], True)
    _allreduce(nets, [w, 0], flats)
    torch.testing.assert_close(nets[1].params(), expected["params"], rtol=0, atol=1e-6)
    assert nets[1].optimizer_state()["state"][4]["momentum_buffer"].shape == (2, 7)


@pytest.mark.parametrize("members", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_exchange_leaves_every_replica_alike_and_near_the_mean(dtype: torch.dtype, members: int) -> None:
    nets = [_net(0, norm=False) for _ in range(members)]
    flats = [FlatState(n, True) for n in nets]
    weights = [_step(n, seed=20 + i, n=2) for i, n in enumerate(nets)]
    states = _states(nets, weights)
    expected = _worker.average(*states)
    _allreduce(nets, weights, flats, dtype)
    assert all(torch.equal(nets[0].params(), n.params()) for n in nets[1:])
    # the change since the round began travels in 16 bits: its rounding, not the parameters'
    change = (expected["params"] - flats[0].anchor).abs().max()
    tolerance = float(change) * (2**-8 if dtype == torch.bfloat16 else 2**-11) * 2
    torch.testing.assert_close(nets[0].params(), expected["params"], rtol=0, atol=tolerance)


def test_a_streaming_trainer_takes_the_average_keeping_what_it_fitted_since_it_sent() -> None:
    """``FlatState.settle``: the state becomes the round's average plus the change since ``mark``
    (parameters, batch-norm statistics, momentum); without a step since, exactly the average, as
    ``apply`` sets it; the anchor becomes the averaged parameters on every member alike."""
    nets = [_net(0) for _ in range(3)]
    flats = [FlatState(n, True) for n in nets]
    weights = [_step(n, seed=30 + i, n=2) for i, n in enumerate(nets[:2])]
    _worker.apply_state(nets[2], _worker.state_of(nets[1], True))  # a copy of the second, to apply plainly
    for f in flats[:2]:
        f.vector()
        f.mark()
    results = _exchanged(weights, flats[:2])
    sent = _worker.state_of(nets[0], True)
    _step(nets[0], seed=40, n=3)  # the first fits on while the average comes; the second does not
    now = _worker.state_of(nets[0], True)
    for f, (average, layout, kept) in zip(flats[:2], results, strict=True):
        f.settle(average, layout, kept)
    flats[2].apply(*results[1])
    plain = _worker.state_of(nets[2], True)
    settled = _worker.state_of(nets[1], True)
    assert torch.equal(settled["params"], plain["params"])
    assert all(torch.equal(settled["buffers"][k], v) for k, v in plain["buffers"].items())
    assert torch.equal(flats[0].anchor, flats[1].anchor) and torch.equal(flats[1].anchor, plain["params"])
    carried = _worker.state_of(nets[0], True)
    torch.testing.assert_close(carried["params"], plain["params"] + now["params"] - sent["params"], rtol=0, atol=1e-6)
    mean = "1.running_mean"
    expected = plain["buffers"][mean] + now["buffers"][mean] - sent["buffers"][mean]
    torch.testing.assert_close(carried["buffers"][mean], expected, rtol=0, atol=1e-6)
    momentum = [s["optimizer"]["state"][0]["momentum_buffer"] for s in (carried, plain, now, sent)]
    torch.testing.assert_close(momentum[0], momentum[1] + momentum[2] - momentum[3], rtol=0, atol=1e-6)


def test_a_streaming_trainer_s_outer_step_takes_the_average_as_it_comes() -> None:
    """``settle`` with an outer optimizer: its step moves the anchor by the averaged change (an outer
    SGD of lr 1 as plain averaging does) and the progress since the state was sent is kept on top."""
    results, states = [], []
    for outer_lr in (None, 1.0, 0.5):
        nets = [_net(0) for _ in range(2)]
        flats = [FlatState(n, True) for n in nets]
        weights = [_step(n, seed=50 + i, n=2) for i, n in enumerate(nets)]
        for f in flats:
            f.vector()
            f.mark()
        anchor = flats[0].anchor.clone()
        averages = _exchanged(weights, flats)
        _step(nets[0], seed=60, n=2)
        progress = nets[0].params() - flats[0]._sent
        if outer_lr is None:
            flats[0].settle(*averages[0])
        else:
            outer = _Outer(functools.partial(torch.optim.SGD, lr=outer_lr), flats[0])
            flats[0].settle(*averages[0], outer.step)
        results.append(nets[0].params().clone())
        states.append((anchor, averages[0][0][: anchor.numel()], progress))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-6)
    anchor, change, progress = states[2]
    torch.testing.assert_close(results[2], anchor + 0.5 * change + progress, rtol=0, atol=1e-6)


@pytest.mark.parametrize("members", [2, 3])
def test_8_bit_exchange_leaves_every_replica_alike_and_near_the_mean(members: int) -> None:
    """int8 blocks: each value travels rounded to a 127th of its block's largest magnitude (here one
    block holds every parameter's change and momentum), and an owner's average once more."""
    nets = [_net(0, norm=False) for _ in range(members)]
    flats = [FlatState(n, True) for n in nets]
    weights = [_step(n, seed=20 + i, n=2) for i, n in enumerate(nets)]
    states = _states(nets, weights)
    largest = max(float(f.vector()[0].abs().max()) for f in flats)
    expected = _worker.average(*states)
    _allreduce(nets, weights, flats, torch.int8)
    assert all(torch.equal(nets[0].params(), n.params()) for n in nets[1:])
    error = float((nets[0].params() - expected["params"]).abs().max())
    assert 0 < error <= largest / 127, (error, largest)


def test_8_bit_blocks_round_each_value_to_its_block_s_scale() -> None:
    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.randn(1500, generator=g), 1000 * torch.randn(700, generator=g)])
    packed = quantize(values)
    assert packed.dtype == torch.uint8 and packed.numel() == 2200 + 4 * 3  # three blocks and their scales
    back = dequantize(packed)
    for lo, hi in ((0, 1024), (1024, 2048), (2048, 2200)):  # the second block mixes both magnitudes
        scale = float(values[lo:hi].abs().max()) / 127
        assert float((back[lo:hi] - values[lo:hi]).abs().max()) <= scale / 2 * (1 + 1e-6)
    assert torch.equal(dequantize(quantize(torch.zeros(5))), torch.zeros(5))


def test_chunk_bounds_cover_the_vector() -> None:
    assert bounds(10, 3) == [0, 3, 6, 10]
    assert bounds(2, 4) == [0, 0, 1, 1, 2]
