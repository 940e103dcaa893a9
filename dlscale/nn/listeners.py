"""Training listeners (DL4J's ``ScoreIterationListener`` and ``PerformanceListener``) and what a
distributed fit reports to them after every step."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("dlscale")


@dataclass(frozen=True)
class SentUpdate:
    """A gradient-sharing step's update as its compressor sent it: the message's ``bytes`` (0 when the
    step sent nothing), the compressor's ``threshold`` and the ``sparsity`` (fraction of the parameters
    sent)."""

    bytes: int
    threshold: float
    sparsity: float


@dataclass(frozen=True)
class StepReport:
    """One step of a distributed fit as the driver learns of it: the network's ``iteration`` after it
    (the step moved it on by ``iterations``: one minibatch with gradient sharing, a round's minibatches
    per worker with parameter averaging), the ``epoch``, the mean loss ``score`` over ``examples`` examples,
    ``time`` (Unix) the step was reported (by the scheduler's receipt of a trainer's acknowledgement,
    or the driver's of a round), and for gradient sharing the ``update`` it sent."""

    iteration: int
    iterations: int
    epoch: int
    score: float
    examples: int
    time: float
    update: SentUpdate | None = None


class TrainingListener:
    """Called after every minibatch a network fits (every step of a distributed fit)."""

    def iteration_done(self, network: Any, iteration: int, epoch: int, score: float, examples: int) -> None:
        """``score`` is the minibatch's loss; ``examples`` its number of examples."""

    def step_done(self, network: Any, step: StepReport) -> None:
        """A distributed fit's step with all the driver knows of it; calls :meth:`iteration_done` unless
        overridden, so a listener that needs more than the loss overrides this instead."""
        self.iteration_done(network, step.iteration, step.epoch, step.score, step.examples)

    def fit_done(self, network: Any) -> None:
        """A distributed fit has ended, whether it succeeded or failed (a listener flushes here)."""


@dataclass
class ScoreIterationListener(TrainingListener):
    """Logs the score every ``frequency`` iterations and keeps ``(iteration, score)`` in ``history``."""

    frequency: int = 10
    history: list[tuple[int, float]] = field(default_factory=list)

    def iteration_done(self, network: Any, iteration: int, epoch: int, score: float, examples: int) -> None:
        if iteration % self.frequency == 0:
            self.history.append((iteration, score))
            log.info("Score at iteration %d is %.6g", iteration, score)


@dataclass
class PerformanceListener(TrainingListener):
    """Logs examples/s and batches/s every ``frequency`` iterations; the figures go to ``history``."""

    frequency: int = 10
    history: list[dict[str, float]] = field(default_factory=list)
    _since: float | None = None
    _examples: int = 0
    _batches: int = 0

    def iteration_done(self, network: Any, iteration: int, epoch: int, score: float, examples: int) -> None:
        now = time.perf_counter()
        if self._since is None:
            self._since = now
            return
        self._examples += examples
        self._batches += 1
        if self._batches >= self.frequency:
            seconds = now - self._since
            entry = {
                "iteration": iteration,
                "examples/s": self._examples / seconds,
                "batches/s": self._batches / seconds,
                "score": score,
            }
            self.history.append(entry)
            log.info(
                "iteration %d: %.1f examples/s, %.2f batches/s, score %.6g",
                iteration,
                entry["examples/s"],
                entry["batches/s"],
                score,
            )
            self._since, self._examples, self._batches = now, 0, 0
