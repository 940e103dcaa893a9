"""Training progress on the driver: one tqdm bar per fit, or a line per epoch in logs.

Shown according to ``dlscale.progress``: ``auto`` (a bar when the driver's standard error is a
terminal, else nothing), ``true`` (a bar on a terminal and a widget in a notebook, through
``tqdm.auto``; elsewhere a line per epoch through the ``dlscale`` logger, as in logs) or ``false``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque

import tqdm.auto
import tqdm.autonotebook
import tqdm.std

from dlscale import config

logger = logging.getLogger("dlscale")

RATE_WINDOW = 10.0  # seconds over which the bar's rates, and so its ETA, are measured
BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}"


def mode() -> str | None:
    """How progress is shown: ``"bar"``, ``"lines"`` or ``None``, by ``dlscale.progress`` and where
    standard error goes."""
    setting = config.get("progress")
    if setting not in ("auto", True, False):
        raise TypeError(f"dlscale.progress must be true, false or 'auto', got {setting!r}")
    terminal = bool(getattr(sys.stderr, "isatty", lambda: False)())
    if setting == "auto":
        return "bar" if terminal else None
    if not setting:
        return None
    notebook = tqdm.autonotebook.tqdm is not tqdm.std.tqdm
    return "bar" if terminal or notebook else "lines"


class _Bar(tqdm.auto.tqdm):
    """tqdm whose rate, and so its ETA, is the one measured over :data:`RATE_WINDOW` (gradient
    sharing's acknowledgements arrive in bursts: the gaps between updates say nothing)."""

    window_rate: float | None = None

    @property
    def format_dict(self) -> dict:
        return {**super().format_dict, "rate": self.window_rate}


class Progress:
    """Progress of one fit: ``per_epoch`` minibatches in each of ``epochs`` epochs, reported through
    :meth:`advance` with the epoch they belong to (gradient sharing acknowledges minibatches of two
    epochs at once where they meet). Call :meth:`close` at the end, also after an error."""

    def __init__(self, label: str, per_epoch: int, epochs: int, first_epoch: int = 0) -> None:
        self.label, self.per_epoch, self.epochs, self.first_epoch = label, per_epoch, epochs, first_epoch
        self.mode = mode()
        # per epoch of the fit: minibatches, examples, sum of losses weighted by examples
        self.tally = [[0, 0, 0.0] for _ in range(epochs)]
        self.first_report: list[float | None] = [None] * epochs
        self.finished = 0  # epochs done, in order
        self.epoch_end = time.time()  # of the latest finished epoch; the fit's start at first
        self.loss: float | None = None  # the latest finished epoch's
        self.done = self.examples = 0
        # (time, minibatches, examples) at the reports of the last RATE_WINDOW seconds and the one before
        # them; not the fit's start, whose first minibatch waits for the network to reach the workers
        self.window: deque[tuple[float, int, int]] = deque()
        self.bar = (
            _Bar(
                total=per_epoch * epochs,
                desc=self._desc(),
                bar_format=BAR_FORMAT,
                dynamic_ncols=True,
                file=sys.stderr,
            )
            if self.mode == "bar"
            else None
        )

    def advance(self, epoch: int, minibatches: int, examples: int, mean_loss: float, at: float | None = None) -> None:
        """``minibatches`` more of the fit's ``epoch``-th epoch (from 0) were fitted, on ``examples``
        examples with mean loss ``mean_loss``, reported at ``at`` (``time.time()``; default now):
        rates come from when the work was done, not from when the driver read it (gradient
        sharing's reports reach the driver in bursts)."""
        if self.mode is None:
            return
        now = time.time() if at is None else min(at, time.time())
        if self.window:
            now = max(now, self.window[-1][0])  # reports of several trainers may cross
        if self.first_report[epoch] is None:
            self.first_report[epoch] = now
        tally = self.tally[epoch]
        tally[0] += minibatches
        tally[1] += examples
        tally[2] += mean_loss * examples
        self.done += minibatches
        self.examples += examples
        self.window.append((now, self.done, self.examples))
        while len(self.window) > 2 and self.window[1][0] <= now - RATE_WINDOW:
            self.window.popleft()  # the oldest point left is the window's start
        while self.finished < self.epochs and self.tally[self.finished][0] >= self.per_epoch:
            self._epoch_done(now)
        if self.bar is not None:
            self._draw(minibatches)

    def close(self) -> None:
        """End the bar, leaving its last state on its own line."""
        if self.bar is not None:
            self.bar.close()

    def _epoch_done(self, now: float) -> None:
        """The earliest unfinished epoch is complete: it ran from the end of the one before (the
        fit's start for the first) or its own first report, whichever came first, to now (with
        gradient sharing, trainers take the next epoch's minibatches before this one's last are in)."""
        _, examples, losses = self.tally[self.finished]
        self.loss = losses / examples if examples else float("nan")
        seconds = now - min(self.epoch_end, self.first_report[self.finished] or now)
        self.epoch_end = now
        self.finished += 1
        if self.mode == "lines":
            logger.info(
                "%s: epoch %d/%d, loss %.3g, %s examples/s, %.1f s",
                self.label,
                self.first_epoch + self.finished,
                self.first_epoch + self.epochs,
                self.loss,
                f"{examples / max(seconds, 1e-9):,.0f}",
                seconds,
            )

    def _desc(self) -> str:
        epoch = min(self.finished + 1, self.epochs)
        return f"{self.label}: epoch {self.first_epoch + epoch}/{self.first_epoch + self.epochs}"

    def _draw(self, minibatches: int) -> None:
        bar = self.bar
        (t0, n0, e0), (t1, n1, e1) = self.window[0], self.window[-1]
        span = t1 - t0
        bar.window_rate = (n1 - n0) / span if span > 0 else None
        current = self.tally[min(self.finished, self.epochs - 1)]
        loss = current[2] / current[1] if current[1] and self.finished < self.epochs else self.loss
        parts = [] if loss is None else [f"loss {loss:.3g}"]
        if span > 0:
            parts.append(f"{tqdm.std.tqdm.format_sizeof((e1 - e0) / span)} ex/s")
        bar.set_description_str(self._desc(), refresh=False)
        bar.set_postfix_str(", ".join(parts), refresh=False)
        bar.update(minibatches)
