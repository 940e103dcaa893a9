"""Training statistics: what every worker did in every round (parameter averaging) or every trainer
did over time (gradient sharing), and where the time went.

The counterpart of DL4J's ``SparkTrainingStats``: collected only when a training master is asked to
(``collect_training_stats=True``), kept on the driver, printable and savable as JSON.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from dlscale import storage


@dataclass
class WorkerRound:
    """One worker's share of one round: the minibatches it fitted and how long that took.

    ``fit_seconds`` is the whole task; ``wait_seconds`` the part spent waiting for minibatches to load
    (a high share means storage, not compute, is the bottleneck). ``start`` and ``end`` are Unix times.
    """

    worker: str
    batches: list[str]
    examples: int
    score: float
    fit_seconds: float
    wait_seconds: float
    start: float
    end: float


@dataclass
class RoundStats:
    """One round: ``seconds`` from the previous round's end to this one's, as seen by the driver."""

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
    """

    trainer: str
    worker: str
    minibatches: int = 0
    examples: int = 0
    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    phases: list[tuple[str, float, float]] = field(default_factory=list)
    steps: list[tuple[float, float, float, int]] = field(default_factory=list)

    def seconds(self, phase: str) -> float:
        """Total time spent in ``phase``."""
        return sum(s for p, _, s in self.phases if p == phase)


@dataclass
class TrainingStats:
    """Statistics of one ``fit`` call (appended to by later calls of the same ``SparkNet``)."""

    approach: str
    workers: int
    prepare_seconds: float = 0.0  # exporting or caching minibatches before the first round
    rounds: list[RoundStats] = field(default_factory=list)
    trainers: list[TrainerStats] = field(default_factory=list)

    def extend(self, later: TrainingStats) -> None:
        """Append the statistics of a later ``fit`` of the same network."""
        self.prepare_seconds += later.prepare_seconds
        self.rounds.extend(later.rounds)
        self.trainers.extend(later.trainers)

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
