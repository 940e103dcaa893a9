"""Training progress on the driver: a bar per epoch (on a terminal) and a line as each epoch ends.

Shown according to ``dlscale.progress``: ``auto`` (on when the driver's standard error is a
terminal), ``true`` (always: on a terminal a live bar, elsewhere one line per epoch, as in logs)
or ``false``.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from dlscale import config

WIDTH = 24
REDRAW_SECONDS = 0.2


def enabled(stream: TextIO | None = None) -> bool:
    """Whether progress is shown, by ``dlscale.progress``."""
    setting = config.get("progress")
    if setting == "auto":
        stream = stream or sys.stderr
        return bool(getattr(stream, "isatty", lambda: False)())
    if not isinstance(setting, bool):
        raise TypeError(f"dlscale.progress must be true, false or 'auto', got {setting!r}")
    return setting


class Progress:
    """Progress of one fit: ``per_epoch`` minibatches in each of ``epochs`` epochs, counted as
    :meth:`advance` reports them (in any order across epochs, as gradient sharing acknowledges them)."""

    def __init__(
        self,
        label: str,
        per_epoch: int,
        epochs: int,
        first_epoch: int = 0,
        stream: TextIO | None = None,
        panel_url: str | None = None,
    ) -> None:
        self.label, self.per_epoch, self.epochs, self.first_epoch = label, per_epoch, epochs, first_epoch
        self.stream = stream or sys.stderr
        self.show = enabled(self.stream)
        self.live = self.show and bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = self.examples = 0
        self.loss = 0.0
        self.epoch_examples = 0
        self.start = self.epoch_start = self.drawn = time.perf_counter()
        if self.show and panel_url:
            self.stream.write(f"{label}: live panel at {panel_url}\n")
            self.stream.flush()

    def advance(self, minibatches: int, examples: int, mean_loss: float) -> None:
        """``minibatches`` more were fitted, on ``examples`` examples with mean loss ``mean_loss``."""
        if not self.show:
            return
        before = self.done // self.per_epoch
        self.done += minibatches
        self.examples += examples
        self.epoch_examples += examples
        self.loss += mean_loss * examples
        if self.done // self.per_epoch > before and self.done <= self.per_epoch * self.epochs:
            self._epoch_line(self.done // self.per_epoch)
        elif self.live and time.perf_counter() - self.drawn >= REDRAW_SECONDS:
            self._bar()

    def _rate(self, examples: int, since: float) -> float:
        return examples / max(time.perf_counter() - since, 1e-9)

    def _epoch_line(self, finished: int) -> None:
        loss = self.loss / self.epoch_examples if self.epoch_examples else float("nan")
        start, pad = ("\r", " " * 10) if self.live else ("", "")
        self.stream.write(
            f"{start}{self.label}: epoch {self.first_epoch + finished}/"
            f"{self.first_epoch + self.epochs} done, loss {loss:.4f}, "
            f"{self._rate(self.epoch_examples, self.epoch_start):,.0f} examples/s{pad}\n"
        )
        self.stream.flush()
        self.loss, self.epoch_examples, self.epoch_start = 0.0, 0, time.perf_counter()

    def _bar(self) -> None:
        within = self.done % self.per_epoch
        filled = WIDTH * within // self.per_epoch
        epoch = self.first_epoch + min(self.done // self.per_epoch + 1, self.epochs)
        self.stream.write(
            f"\r{self.label}: epoch {epoch}/{self.first_epoch + self.epochs} "
            f"[{'#' * filled}{'.' * (WIDTH - filled)}] {within}/{self.per_epoch} minibatches, "
            f"{self._rate(self.examples, self.start):,.0f} examples/s"
        )
        self.stream.flush()
        self.drawn = time.perf_counter()
