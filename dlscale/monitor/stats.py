"""Training statistics: what every worker did in every round (parameter averaging) or every trainer
did over time (gradient sharing), and where the time went.

The counterpart of DL4J's ``SparkTrainingStats``: collected only when a training master is asked to
(``collect_training_stats=True``), kept on the driver, printable and savable as JSON.
"""

from __future__ import annotations

import html
import io
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dask.utils import format_bytes

from dlscale import storage


@dataclass
class WorkerRound:
    """One worker's share of one round: the minibatches it fitted and how long that took.

    ``fit_seconds`` is the whole task; ``wait_seconds`` the part spent waiting for minibatches to load
    (a high share means storage, not compute, is the bottleneck). ``start`` and ``end`` are Unix times.
    With streaming rounds, ``late_steps`` is how many of these minibatches the worker fitted before it
    took the previous round's average, and ``averaging_seconds`` the part of ``fit_seconds`` spent
    taking it (waiting for it, committing and applying it).
    """

    worker: str
    batches: list[str]
    examples: int
    score: float
    fit_seconds: float
    wait_seconds: float
    start: float
    end: float
    late_steps: int = 0
    averaging_seconds: float = 0.0


@dataclass
class RoundStats:
    """One round: ``seconds`` from the previous round's end to this one's (a round ends when its last
    member ends its share, by the members' clocks; the first from when the trainers were started)."""

    epoch: int
    round: int
    seconds: float
    examples: int
    score: float
    workers: list[WorkerRound]


PHASES = ("fit", "encode", "send", "apply", "wait")
"""The phases of a gradient-sharing trainer's timeline: fitting a minibatch (forward, backward and the
optimizer's update), encoding the residual, handing messages to the transport (time blocked on a
full send buffer), applying received messages, and waiting (for minibatches, for work, or for the
peers' last messages at the end)."""


@dataclass
class TrainerStats:
    """One gradient-sharing trainer over a whole ``fit``.

    ``phases`` is its timeline: ``(phase, start, seconds)`` with ``phase`` one of :data:`PHASES` and
    ``start`` a Unix time. ``steps`` is one ``(time, threshold, sparsity, message_bytes)`` per step.
    ``score`` is the loss of its last minibatch.
    """

    trainer: str
    worker: str
    minibatches: int = 0
    examples: int = 0
    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    score: float = math.nan
    phases: list[tuple[str, float, float]] = field(default_factory=list)
    steps: list[tuple[float, float, float, int]] = field(default_factory=list)

    def seconds(self, phase: str) -> float:
        """Total time spent in ``phase``."""
        return sum(s for p, _, s in self.phases if p == phase)


@dataclass
class EpochTally:
    """Exactly once, for one epoch of a fit, counted from what the trainers reported fitted (not from the
    plan): of its ``planned`` minibatches, ``once`` fitted by the trainer first given them, ``redone``
    fitted by another after a trainer that held them was lost (parameter averaging drops the lost
    trainer's work on them; gradient sharing keeps the updates it had sent), ``lost`` never fitted and
    ``duplicated`` reported fitted more than once (both 0 unless something is wrong)."""

    epoch: int
    planned: int
    once: int
    redone: int
    lost: int
    duplicated: int = 0


def tally_line(tallies: Sequence[EpochTally], workers_lost: int) -> str:
    """The exactly-once tally of a fit's epochs in a few words: "3 workers lost, 41 minibatches redone, 0
    lost (of 480, the rest fitted once)"."""
    planned = sum(t.planned for t in tallies)
    redone, lost = sum(t.redone for t in tallies), sum(t.lost for t in tallies)
    duplicated = sum(t.duplicated for t in tallies)
    parts = [f"{workers_lost} worker{'s' * (workers_lost != 1)} lost"] if workers_lost else []
    parts += [f"{redone} minibatches redone", f"{lost} lost"]
    if duplicated:
        parts.append(f"{duplicated} fitted twice")
    return f"{', '.join(parts)} (of {planned}, the rest fitted once)"


@dataclass
class TrainingStats:
    """Statistics of one ``fit`` call (appended to by later calls of the same ``SparkNet``).

    ``dense_bytes`` is the size of one update sent dense (the network's parameters), for gradient
    sharing; 0 where unknown."""

    approach: str
    workers: int
    prepare_seconds: float = 0.0  # exporting or caching minibatches before the first round
    rounds: list[RoundStats] = field(default_factory=list)
    trainers: list[TrainerStats] = field(default_factory=list)
    dense_bytes: int = 0
    averaging_frequency: int | None = None  # parameter averaging's, as the last fit chose it
    exactly_once: list[EpochTally] = field(default_factory=list)  # each epoch of each fit
    choice: dict[str, Any] | None = None  # the last chosen frequency's receipt: why, predicted and measured speedup

    def extend(self, later: TrainingStats) -> None:
        """Append the statistics of a later ``fit`` of the same network."""
        self.prepare_seconds += later.prepare_seconds
        self.rounds.extend(later.rounds)
        self.trainers.extend(later.trainers)
        self.dense_bytes = later.dense_bytes or self.dense_bytes
        self.averaging_frequency = later.averaging_frequency or self.averaging_frequency
        self.choice = later.choice or self.choice
        self.exactly_once.extend(later.exactly_once)

    def overview(self) -> dict[str, Any]:
        """The figures of the whole record, ``None`` where unknown: training ``seconds`` (rounds' times for
        parameter averaging; the time any trainer was at work for gradient sharing), ``examples`` and
        ``examples_per_second``, ``bytes_sent`` and ``dense_bytes`` (every step's update sent dense),
        ``phases`` (each phase's share of the workers' or trainers' time: for parameter averaging
        ``fit`` and ``wait``, waiting for data being part of a task) and the final ``score`` (the last
        round's, or the mean of the trainers' last minibatches')."""
        if self.trainers:
            spans = sorted(
                (min(s for _, s, _ in t.phases), max(s + d for _, s, d in t.phases)) for t in self.trainers if t.phases
            )
            seconds, end = 0.0, -math.inf
            for start, stop in spans:  # the union of the trainers' spans: no gap between fits counts
                seconds += max(0.0, stop - max(start, end))
                end = max(end, stop)
            examples = sum(t.examples for t in self.trainers)
            busy = {p: sum(t.seconds(p) for t in self.trainers) for p in PHASES}
            scores = [t.score for t in self.trainers if t.minibatches and math.isfinite(t.score)]
            score = sum(scores) / len(scores) if scores else None
            sent: int | None = sum(t.bytes_sent for t in self.trainers)
            dense = sum(t.minibatches for t in self.trainers) * self.dense_bytes or None
        else:
            seconds = sum(r.seconds for r in self.rounds)
            examples = sum(r.examples for r in self.rounds)
            tasks = [w for r in self.rounds for w in r.workers]
            wait = sum(w.wait_seconds for w in tasks)
            busy = {"fit": sum(w.fit_seconds for w in tasks) - wait, "wait": wait}
            score = self.rounds[-1].score if self.rounds else None
            sent = dense = None
        total = sum(busy.values())
        return {
            "approach": self.approach,
            "workers": self.workers,
            "seconds": seconds,
            "prepare_seconds": self.prepare_seconds,
            "examples": examples,
            "examples_per_second": examples / seconds if seconds > 0 else None,
            "bytes_sent": sent,
            "dense_bytes": dense,
            "phases": {p: b / total for p, b in busy.items()} if total > 0 else {},
            "score": score,
        }

    def _lines(self) -> list[tuple[str, str]]:
        """The overview as ``(label, text)`` pairs, for the text and HTML forms."""
        o = self.overview()
        units = f"{len(self.trainers)} trainers" if self.trainers else f"{len(self.rounds)} rounds"
        lines = [
            ("approach", o["approach"]),
            ("workers", f"{o['workers']}, {units}"),
            ("duration", f"{o['seconds']:.2f} s training, {o['prepare_seconds']:.2f} s preparing minibatches"),
            ("examples", f"{o['examples']:,}"),
        ]
        if o["examples_per_second"] is not None:
            lines.append(("examples/s", f"{o['examples_per_second']:,.1f}"))
        if o["bytes_sent"] is not None:
            dense = o["dense_bytes"]
            vs = f" of {format_bytes(dense)} dense ({o['bytes_sent'] / dense:.2%})" if dense else ""
            lines.append(("bytes sent", f"{format_bytes(o['bytes_sent'])}{vs}"))
        if o["phases"]:
            lines.append(("time by phase", ", ".join(f"{p} {share:.0%}" for p, share in o["phases"].items())))
        if o["score"] is not None:
            lines.append(("final loss", f"{o['score']:.6g}"))
        if self.exactly_once:
            lines.append(("exactly once", tally_line(self.exactly_once, 0)))
        if self.choice is not None:
            lines.append(("chosen", self.choice["line"]))
        return lines

    def __repr__(self) -> str:
        return "<TrainingStats " + "; ".join(f"{label}: {text}" for label, text in self._lines()) + ">"

    def _repr_html_(self) -> str:
        """A table of :meth:`overview`, as notebooks show it."""
        rows = "".join(
            f'<tr><th style="text-align: left;">{html.escape(label)}</th>'
            f'<td style="text-align: left;">{html.escape(text)}</td></tr>'
            for label, text in self._lines()
        )
        return f'<div><strong>TrainingStats</strong><table style="text-align: left;">{rows}</table></div>'

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        """Write the statistics as JSON to ``url`` (any fsspec URL, atomically)."""
        storage.write_string_to_file(url, self.to_json(), storage_options)

    def summary(self) -> str:
        """A few lines: rounds, throughput, and the shares of time spent fitting and waiting for data."""
        parts = f"{len(self.rounds)} rounds" if self.rounds or not self.trainers else f"{len(self.trainers)} trainers"
        head = f"{self.approach}: {self.workers} workers, {parts}, {self.prepare_seconds:.2f} s preparing minibatches"
        lines = [head]
        seconds = sum(r.seconds for r in self.rounds)
        examples = sum(r.examples for r in self.rounds)
        if self.rounds and seconds > 0:
            shares = [w for r in self.rounds for w in r.workers]
            fit = sum(w.fit_seconds for w in shares)
            wait = sum(w.wait_seconds for w in shares)
            lines.append(f"{examples} examples in {seconds:.2f} s: {examples / seconds:.1f} examples/s")
            lines.append(
                f"mean round {seconds / len(self.rounds):.3f} s; workers busy fitting "
                f"{fit / (seconds * self.workers):.0%} of it, of which {wait / max(fit, 1e-12):.0%} "
                "waiting for data"
            )
            lines.append(f"last score {self.rounds[-1].score:.6g}")
        for t in self.trainers:
            busy = sum(s for _, _, s in t.phases) or 1e-12
            shares = ", ".join(f"{p} {t.seconds(p) / busy:.0%}" for p in PHASES)
            lines.append(
                f"trainer {t.trainer}: {t.minibatches} minibatches, {t.messages_sent} updates sent "
                f"({t.bytes_sent / max(t.messages_sent, 1):.0f} bytes each), {t.messages_received} "
                f"received; {shares}"
            )
        return "\n".join(lines)

    def save_html(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        """Write a self-contained HTML report (tables, timeline, per-step charts) to ``url`` (any fsspec URL,
        atomically); see :func:`dlscale.monitor.timeline.to_html`."""
        from dlscale.monitor import timeline  # imports this module

        storage.write_string_to_file(url, timeline.to_html(self), storage_options)

    def save_png(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        """Write the timeline and per-step charts as a PNG to ``url`` (any fsspec URL, atomically); needs
        matplotlib (``pip install "dlscale[plot]"``). See :func:`dlscale.monitor.timeline.to_png`."""
        from dlscale.monitor import timeline  # imports this module

        image = io.BytesIO()
        timeline.to_png(self, image)  # drawn before anything is opened: a failure leaves no file
        storage.write_bytes(url, image.getbuffer(), storage_options=storage_options)
