"""How a parameter-averaging fit that is not told its averaging frequency chooses it, and the receipt it
shows: the choice, what it was measured from, the predicted speedup and the measured one.

A round of ``H`` minibatches a trainer costs its steps, ``H * step`` (a step as long as it takes with
no averaging in flight), what the round costs beyond its steps and its averaging (handing out shares,
committing, taking the average: ``overhead``, measured), and the part of the averaging the trainers
wait for: all of it without streaming, and with streaming what is left of it after half of the next
round's steps (a trainer takes round ``k``'s average after half of round ``k + 1`` at the latest) and
the CPU the averaging in flight takes from the steps it overlaps (``contention``: on cores shared by
the trainers and their workers' comms, those steps are slower; a cost a round, however long). ``W``
trainers then fit ``W * H`` minibatches in that time, against ``H`` for one trainer stepping alone at
the undisturbed pace: the speedup over one trainer.

Streaming pays where the contention and what is left of the averaging cost less than the averaging
itself (:func:`streams`): a fit streams the rounds its bounds allow it to, and the next fit of its
master streams only where the first one's measures say so (a fit that did not stream keeps the
contention measured when one last did, so that the choice does not swing between fits).

Where the last fit's measures predict the fit's trainers slower than one trainer (a large state on a
slow link, steps too short to hide it), the fit trains on one worker alone: a second cannot pay. It
keeps those measures (it averages nothing to measure anew), so the master's later fits do the same.

In that model a longer round is never slower (its costs beyond the steps are paid once a round, and
less of its averaging is waited for), so the fit trains the longest rounds the quality guard allows:
the bounds' high end, at most a trainer's minibatches of an epoch, split into rounds of about even
length (:func:`choose`). Taking instead the smallest frequency whose predicted speed came within 5% of
the fastest put the rounds where the averaging only just fits in half a round, where the model's
error costs most: at 1 Gbit/s a fit that chose 25 waited 2.5 s for averages where rounds of 50 waited
0.34 s, and trained at 0.88 of their speed (``benchmarks.compare`` on 7421e17). The model predicts the
fit's speedup for its receipt, and is what a choice among methods would compare.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dask.utils import format_bytes


@dataclasses.dataclass(frozen=True)
class Measures:
    """What averaged rounds measured: ``trainers`` of them, a ``step`` (seconds a minibatch with no
    averaging in flight, fitting and reading), an ``averaging`` (seconds a round's allreduce of
    ``state_bytes`` took, parts in flight included), a round's ``overhead`` beyond its steps and the
    averaging waited for, what a fit costs before its first round (``start``: the trainers started)
    and after its last (``end``: the state taken back), measured over a fit, or estimated from the
    averaging before one ended, and the seconds a streaming round's steps lose to the averaging in
    flight beside them (``contention``)."""

    trainers: int
    step: float
    averaging: float
    state_bytes: int
    overhead: float
    start: float
    end: float
    contention: float = 0.0

    @classmethod
    def of_round(
        cls,
        trainers: int,
        step: float,
        averaging: float,
        state_bytes: int,
        frequency: int,
        streaming: bool,
        seconds: float,
        contention: float = 0.0,
    ) -> Measures:
        """From one round of ``frequency`` minibatches a trainer that took ``seconds``; a fit's end
        estimated as the last averaging, taken whole, and the state sent back once at the rate the
        averaging moved it (its start is not known yet: it has passed)."""
        m = cls(trainers, step, averaging, state_bytes, 0.0, 0.0, 0.0, contention)
        overhead = max(0.0, seconds - m.round_at(frequency, streaming))  # m's overhead is 0: what is left
        end = averaging * (1 + trainers / (2 * max(1, trainers - 1)))
        return dataclasses.replace(m, overhead=overhead, end=end)

    def exposed(self, frequency: int, streaming: bool) -> float:
        """Seconds of a round's averaging the trainers wait for at ``frequency``."""
        return max(0.0, self.averaging - frequency * self.step / 2) if streaming else self.averaging

    def round_at(self, frequency: int, streaming: bool) -> float:
        """The predicted seconds of a round of ``frequency`` minibatches a trainer (streaming's averaging
        alone overlaps the steps: its contention)."""
        taken = self.contention if streaming else 0.0
        return frequency * self.step + self.overhead + taken + self.exposed(frequency, streaming)

    def speedup(self, frequency: int, streaming: bool) -> float:
        """Rounds of ``frequency`` against one trainer stepping alone at the measured step."""
        return self.trainers * frequency * self.step / self.round_at(frequency, streaming)

    def rate(self) -> float:
        """Bytes a second between the trainers, as the averaging moved them (each sends and receives
        about twice ``(W - 1) / W`` of its state in an allreduce)."""
        moved = 2 * (self.trainers - 1) / self.trainers * self.state_bytes
        return moved / self.averaging if self.averaging > 0 else math.inf


@dataclasses.dataclass
class Choice:
    """The receipt of a chosen frequency: ``frequency`` and ``streaming``, the :class:`Measures` it was
    chosen from (``source``: "this fit" or "the last fit"), the fit's ``predicted`` speedup over one
    trainer when chosen, and the ``measured`` one when the fit ended (``None`` until then). ``alone``:
    the speedup predicted for the fit's trainers where it was under 1, so that one trainer trains
    (predicted at 1.0: one trainer at its step)."""

    frequency: int
    streaming: bool
    measures: Measures
    source: str
    predicted: float
    bounds: tuple[int, int]
    measured: float | None = None
    alone: float | None = None

    def why(self) -> str:
        """The measures behind the choice, in a few words."""
        m = self.measures
        rate = m.rate()
        link = f"{format_bytes(rate)}/s" if math.isfinite(rate) else "no averaging"
        beside = f" (+{_seconds(m.contention)} a round beside an averaging)" if m.contention else ""
        return (
            f"a step {_seconds(m.step)}{beside}, an averaging {_seconds(m.averaging)} of "
            f"{format_bytes(m.state_bytes)} ({link}), {m.trainers} trainers, measured in {self.source}"
        )

    def line(self) -> str:
        """The choice, why, and the speedups: what the fit's closing line says."""
        how = "streaming rounds" if self.streaming else "rounds"
        rounds = f"averaging every {self.frequency} minibatches in {how}"
        if self.alone is not None:
            trainers = f"{self.measures.trainers} trainers {rounds} were predicted {self.alone:.2f}x"
            said = f"one trainer, since {trainers} ({self.why()}): predicted {self.predicted:.2f}x"
        else:
            said = f"{rounds} ({self.why()}): predicted {self.predicted:.2f}x"
        if self.measured is not None:
            said += f", measured {self.measured:.2f}x"
        return said + " one trainer"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "line": self.line()}


def choose(share: int, bounds: tuple[int, int]) -> int:
    """The frequency for a trainer's ``share`` of minibatches an epoch within ``bounds``: as few rounds an
    epoch as keep each within the high end (or the share), about even in length; the high end itself
    where even rounds would fall below the low end (a share of 51 in bounds of ``[40, 50]``: 50, then 1)."""
    low, high = bounds
    high = max(1, min(high, share))
    even = math.ceil(share / math.ceil(share / high))
    return even if even >= min(low, high) else high


def streams(measures: Measures, frequency: int) -> bool:
    """Whether rounds of ``frequency`` should stream, as ``measures`` (a fit's, with its streaming
    rounds' contention) predict: where what streaming costs a round (the contention, and the part of
    the averaging still waited for) is at most the averaging that plain rounds wait for. A state
    averaged in a few milliseconds (a small network on a fast link) can cost its steps more beside
    them than it takes alone."""
    return measures.round_at(frequency, True) <= measures.round_at(frequency, False)


def pace(stepped: float, steps: int, late_seconds: float, late_steps: int) -> tuple[float, float]:
    """Seconds a step with no averaging in flight, and what the ``late_steps`` taken with one in flight
    (streaming) took beyond that pace (the CPU the averaging took from them), from ``stepped`` seconds
    of ``steps`` steps, of which ``late_seconds`` went to the late ones."""
    free = (stepped - late_seconds) / (steps - late_steps) if steps > late_steps else stepped / max(1, steps)
    return max(0.0, free), max(0.0, late_seconds - late_steps * free)


def alone_faster(measures: Measures, frequency: int, streaming: bool, items: int) -> bool:
    """Whether one trainer at the measured step would fit ``items`` sooner than ``measures.trainers``
    in rounds of ``frequency``: both pay the fit's start, the trainers their rounds and its end."""
    rounds = items / (measures.trainers * frequency)
    return rounds * measures.round_at(frequency, streaming) + measures.end > items * measures.step


def fit_speedup(
    measures: Measures, frequency: int, streaming: bool, items: int, remaining: int, elapsed: float
) -> float:
    """The fit's predicted speedup over one trainer: its ``items`` at the measured step, against the
    ``elapsed`` seconds in which the items fitted so far were (up to the end of the round reported
    last: the rounds after it are the ``remaining`` items, not the time since; from its start, the
    fit's measured start), the rounds of ``frequency`` left for ``remaining`` items, and the fit's end."""
    rounds = remaining / (measures.trainers * frequency)
    before = elapsed if remaining < items else measures.start
    seconds = before + rounds * measures.round_at(frequency, streaming) + measures.end
    return items * measures.step / seconds if seconds > 0 else math.nan


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"
