"""Training listeners (DL4J's ``ScoreIterationListener`` and ``PerformanceListener``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("dlscale")


class TrainingListener:
    """Called after every minibatch a network fits."""

    def iteration_done(self, network: Any, iteration: int, epoch: int, score: float, examples: int) -> None:
        """``score`` is the minibatch's loss; ``examples`` its number of examples."""


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
