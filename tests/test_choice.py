"""The cost model a parameter-averaging fit predicts its speedup with, against a round's time worked out
by hand; the frequency it chooses, the longest rounds the bounds allow, against trying every one."""

from __future__ import annotations

import itertools

import pytest

from dlscale.training.averaging._choice import Choice, Measures, alone_faster, choose, fit_speedup, pace, streams


def measures(
    step: float, averaging: float, overhead: float = 0.0, trainers: int = 2, contention: float = 0.0
) -> Measures:
    return Measures(trainers, step, averaging, 1 << 20, overhead, 0.0, 0.0, contention)


def test_streaming_hides_the_averaging_up_to_half_a_round() -> None:
    """A round of 20 steps of 10 ms and 2 ms beside: an averaging of 0.1 s is all waited for without
    streaming, hidden by streaming (half the round, 0.1 s, covers it); one of 0.16 s shows 0.06 s."""
    m = measures(0.01, 0.1, overhead=0.002)
    assert m.round_at(20, streaming=False) == pytest.approx(0.2 + 0.002 + 0.1)
    assert m.round_at(20, streaming=True) == pytest.approx(0.2 + 0.002)
    assert measures(0.01, 0.16, 0.002).round_at(20, streaming=True) == pytest.approx(0.2 + 0.002 + 0.06)
    assert m.speedup(20, streaming=True) == pytest.approx(2 * 0.2 / 0.202)


def test_the_averaging_in_flight_costs_a_streaming_round_what_it_took_from_its_steps() -> None:
    """A round of 20 steps of 10 ms, 8 of them beside the last round's averaging and 3 ms slower each:
    the pace is the undisturbed 10 ms and the 24 ms more a cost of every streaming round, however
    long; rounds without streaming take the averaging whole and nothing beside it."""
    step, contention = pace(20 * 0.01 + 8 * 0.003, 20, 8 * 0.013, 8)
    assert step == pytest.approx(0.01) and contention == pytest.approx(0.024)
    assert pace(0.2, 20, 0.0, 0) == pytest.approx((0.01, 0.0))  # nothing in flight: no contention
    m = measures(step, 0.1, overhead=0.002, contention=contention)
    for h in (20, 50):
        assert m.round_at(h, streaming=True) == pytest.approx(h * 0.01 + 0.002 + 0.024)
    assert m.round_at(20, streaming=False) == pytest.approx(0.2 + 0.002 + 0.1)
    assert m.speedup(50, True) / m.speedup(20, True) == pytest.approx(0.226 / 0.2 * 0.5 / 0.526)
    # its round measured gives back the overhead net of it
    assert Measures.of_round(2, 0.01, 0.1, 1 << 20, 20, True, 0.226, 0.024).overhead == pytest.approx(0.002)


@pytest.mark.parametrize(
    ("averaging", "contention", "expected"),
    [
        (0.1, 0.024, True),  # 0.1 s waited for without streaming, 0.024 s beside it
        (0.002, 0.003, False),  # a state averaged in 2 ms: its 3 ms beside the steps cost more
        (0.003, 0.003, True),  # as fast either way: streaming, as rounds that long do by default
        (0.5, 0.05, True),  # 0.05 s beside it and 0.4 s shown past half a round (0.1 s), against 0.5 s
        (0.3, 0.2, False),  # 0.2 s beside it and 0.2 s shown, against 0.3 s
    ],
)
def test_rounds_stream_where_the_model_predicts_them_faster(
    averaging: float, contention: float, expected: bool
) -> None:
    """Rounds of 20 steps of 10 ms stream where the contention and the averaging not hidden by half a
    round cost at most the averaging plain rounds wait for, as round_at predicts."""
    m = measures(0.01, averaging, overhead=0.002, contention=contention)
    assert streams(m, 20) is expected
    assert expected == (m.round_at(20, True) <= m.round_at(20, False))


def test_one_trainer_is_chosen_where_it_would_fit_sooner_than_the_trainers() -> None:
    """400 items of 10 ms steps: one trainer takes 4 s; 2 trainers in rounds of 20 take 10 rounds of
    0.2 s + 0.002 s + what of the averaging shows, and the fit's end (0.3 s): with an averaging of
    0.1 s hidden, 2.32 s; of 0.5 s, streaming, 10 x 0.602 + 0.3 = 6.32 s; both pay the fit's start."""
    m = Measures(2, 0.01, 0.1, 1 << 20, 0.002, start=5.0, end=0.3)
    assert not alone_faster(m, 20, True, 400)
    slow = Measures(2, 0.01, 0.5, 1 << 20, 0.002, start=5.0, end=0.3)
    assert alone_faster(slow, 20, True, 400)
    # just under one trainer's 4 s: 10 rounds of 0.372 s (0.17 s of the averaging shown) and an end of 0.25 s
    assert not alone_faster(Measures(2, 0.01, 0.27, 1 << 20, 0.002, start=5.0, end=0.25), 20, True, 400)
    assert alone_faster(Measures(2, 0.01, 0.27, 1 << 20, 0.002, start=5.0, end=0.31), 20, True, 400)


def test_a_round_measured_gives_back_its_overhead_and_the_next_fit_its_end() -> None:
    """``of_round``: a round of 30 steps of 4 ms and an averaging of 50 ms, all of it waited for without
    streaming and none of it streaming: the overhead is what the round took beyond them; the fit's
    end, the last averaging and the state sent back once at the rate the averaging moved it (2
    trainers: each moved its state once)."""
    for streaming, exposed in ((False, 0.05), (True, 0.0)):
        m = Measures.of_round(2, 0.004, 0.05, 1 << 20, 30, streaming, 0.12 + exposed + 0.007)
        assert m.overhead == pytest.approx(0.007)
        assert m.end == pytest.approx(0.05 + 0.05)
        assert m.rate() == pytest.approx((1 << 20) / 0.05)


@pytest.mark.parametrize(
    ("step", "averaging", "overhead"),
    list(itertools.product((0.0003, 0.004, 0.04), (0.001, 0.05, 0.4, 2.0), (0.0, 0.003, 0.08))),
)
def test_no_shorter_round_is_faster_so_the_longest_the_bounds_allow_is_chosen(
    step: float, averaging: float, overhead: float
) -> None:
    """Tried one by one, from the round's time as the module's docstring states it (a contention of a
    tenth of the averaging when streaming): the speed never falls as rounds grow, so the fastest in
    the bounds is at their high end (or a trainer's share of an epoch), which the choice takes."""
    contention = averaging / 10
    for streaming in (False, True):

        def speed(h: int, streaming: bool = streaming) -> float:
            exposed = max(0.0, averaging - h * step / 2) + contention if streaming else averaging
            return h / (h * step + overhead + exposed)

        m = measures(step, averaging, overhead, contention=contention)
        for h in range(1, 100):
            assert m.speedup(h, streaming) == pytest.approx(2 * step * speed(h))
            assert m.speedup(h + 1, streaming) >= m.speedup(h, streaming) * (1 - 1e-12)
    for share in (45, 100, 7):
        candidates = range(min(20, share), min(50, share) + 1)
        assert max(candidates, key=speed) == min(50, share) and choose(share, (20, 50)) <= min(50, share)


@pytest.mark.parametrize(
    ("share", "bounds", "expected"),
    [(80, (4, 30), 27), (40, (4, 30), 20), (100, (20, 50), 50), (38, (20, 50), 38), (7, (20, 50), 7)]
    + [(31, (20, 30), 30)],
)
def test_rounds_are_as_few_as_the_bounds_allow_and_about_even(
    share: int, bounds: tuple[int, int], expected: int
) -> None:
    """A trainer's share of an epoch in as few rounds as keep each within the high end, about even: 80
    in 3 rounds of 27 (not 30, 30 and 20), 40 in 2 of 20, 100 in 2 of 50, 38 and 7 once an epoch;
    where even rounds would fall below the low end (31 in 2 of 16, under 20), the high end itself."""
    assert choose(share, bounds) == expected


def test_a_fit_predicted_from_its_start_counts_its_edges_and_from_its_middle_what_has_elapsed() -> None:
    m = Measures(2, 0.01, 0.02, 1 << 20, 0.001, start=0.5, end=0.3)
    # 400 items, 2 trainers every 20: 10 rounds of 0.2 + 0.001 s (the averaging hidden)
    assert fit_speedup(m, 20, True, 400, 400, elapsed=0.0) == pytest.approx(400 * 0.01 / (0.5 + 10 * 0.201 + 0.3))
    assert fit_speedup(m, 20, True, 400, 200, elapsed=1.2) == pytest.approx(400 * 0.01 / (1.2 + 5 * 0.201 + 0.3))


def test_the_receipt_says_what_was_chosen_why_and_both_speedups() -> None:
    choice = Choice(40, True, measures(0.035, 0.21), "this fit", 1.8234, (20, 50))
    assert choice.line() == (
        "averaging every 40 minibatches in streaming rounds (a step 35 ms, an averaging 210 ms of 1.00 MiB "
        "(4.76 MiB/s), 2 trainers, measured in this fit): predicted 1.82x one trainer"
    )
    choice.measured = 1.7
    assert choice.line().endswith("predicted 1.82x, measured 1.70x one trainer")
    choice.measures = measures(0.035, 0.21, contention=0.066)
    assert "(a step 35 ms (+66 ms a round beside an averaging), an averaging 210 ms" in choice.line()
    assert choice.to_dict()["line"] == choice.line() and choice.to_dict()["measures"]["step"] == 0.035
    choice.alone, choice.predicted = 0.62, 1.0  # its trainers predicted slower than one: one trains
    assert choice.line().startswith(
        "one trainer, since 2 trainers averaging every 40 minibatches in streaming rounds were predicted 0.62x "
        "(a step 35 ms (+66 ms a round beside an averaging)"
    )
    assert choice.line().endswith("predicted 1.00x, measured 1.70x one trainer")
