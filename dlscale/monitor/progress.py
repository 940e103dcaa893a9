"""Training progress on the driver: one tqdm bar per fit on a terminal, or lines in logs.

Shown according to ``dlscale.progress``: ``auto`` (a bar when the driver's standard error is a
terminal, else lines), ``true`` (the same, and tqdm's widget in a notebook) or ``false``. Lines go
through the ``dlscale`` logger at ``INFO``: one per epoch, and for a long epoch at most one per
``dlscale.progress-interval`` in between, with the time left.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque

import tqdm.auto
import tqdm.autonotebook
import tqdm.std
from dask.utils import parse_timedelta

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
    if setting is False:
        return None
    terminal = bool(getattr(sys.stderr, "isatty", lambda: False)())
    notebook = setting is True and tqdm.autonotebook.tqdm is not tqdm.std.tqdm
    return "bar" if terminal or notebook else "lines"


def interval() -> float | None:
    """Seconds at least between two lines within an epoch, ``dlscale.progress-interval``; ``None``
    (setting ``null``, ``false`` or 0) for none."""
    setting = config.get("progress-interval")
    seconds = parse_timedelta(setting) if setting not in (None, False) else None
    return seconds if seconds else None


def _duration(seconds: float) -> str:
    """``12.3 s``, ``4m 05s`` or ``2h 07m``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m {int(seconds % 60):02d}s"
    return f"{minutes // 60}h {minutes % 60:02d}m"


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
        self.start = self.epoch_end = time.time()  # epoch_end: of the latest finished epoch; the fit's start at first
        self.interval = interval() if self.mode == "lines" else None
        self.loss: float | None = None  # the latest finished epoch's
        self.done = self.examples = 0
        self.losses = 0.0  # the fit's sum of losses weighted by examples
        # (time, minibatches, examples, losses) of the fit at its latest line; its start at first
        self.logged = (self.start, 0, 0, 0.0)
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
        self.losses += mean_loss * examples
        self.window.append((now, self.done, self.examples))
        while len(self.window) > 2 and self.window[1][0] <= now - RATE_WINDOW:
            self.window.popleft()  # the oldest point left is the window's start
        finished = self.finished
        while self.finished < self.epochs and self.tally[self.finished][0] >= self.per_epoch:
            self._epoch_done(now)
        if self.bar is not None:
            self._draw(minibatches)
        elif (
            self.interval is not None
            and self.finished == finished < self.epochs
            and now - self.logged[0] >= self.interval
        ):
            self._log_interval(now)

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
            self.logged = (now, self.done, self.examples, self.losses)
            logger.info(
                "%s: epoch %d/%d, %s examples in %s, %s examples/s, loss %.3g, elapsed %s",
                self.label,
                self.first_epoch + self.finished,
                self.first_epoch + self.epochs,
                f"{examples:,}",
                _duration(seconds),
                f"{examples / seconds:,.0f}" if seconds > 0 else "-",  # an epoch done in the same instant
                self.loss,
                _duration(now - self.start),
            )

    def _log_interval(self, now: float) -> None:
        """A line within the earliest unfinished epoch, as the bar shows it: the share of the fit done,
        its examples so far, and the rate and mean loss since the line before, by which rate the time
        left is estimated."""
        t0, done0, examples0, losses0 = self.logged
        seconds, examples = max(now - t0, 1e-9), self.examples - examples0
        rate = (self.done - done0) / seconds  # minibatches a second
        total = self.per_epoch * self.epochs
        self.logged = (now, self.done, self.examples, self.losses)
        logger.info(
            "%s: epoch %d/%d, fit %d%% (%s examples), %s examples/s, loss %.3g, elapsed %s, ETA %s",
            self.label,
            self.first_epoch + self.finished + 1,
            self.first_epoch + self.epochs,
            100 * self.done // total,
            f"{self.examples:,}",
            f"{examples / seconds:,.0f}",
            (self.losses - losses0) / examples if examples else float("nan"),
            _duration(now - self.start),
            _duration((total - self.done) / rate) if rate > 0 else "unknown",
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
