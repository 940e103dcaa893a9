"""The errors of the protocol every master's session speaks.

A trainer learns that its session cannot go on from the scheduler's reply: the session is gone, the
trainer is no longer a member, or another trainer failed. The scheduler refuses with plain data (a
``status`` naming the reason, see ``_messages``); the trainer's end raises the matching
:class:`SessionStoppedError`, which its task turns into a result the driver reads.
"""

from __future__ import annotations

from typing import ClassVar

from dlscale.errors import DlscaleError


class SessionStoppedError(DlscaleError, RuntimeError):
    """A training session that has ended for the trainer that asked; ``reason`` is how it
    travels in the scheduler's replies."""

    reason: ClassVar[str]


class SessionClosedError(SessionStoppedError):
    """A session that is not open on the scheduler (closed by the driver, or never opened)."""

    reason = "closed"


class TrainerLostError(SessionStoppedError):
    """A trainer that is no longer a member of its session: its worker was removed, or its task runs a
    second time elsewhere after that."""

    reason = "lost"


class SessionAbortedError(SessionStoppedError):
    """A session stopped because another trainer (or the driver) failed."""

    reason = "aborted"


def check_first_start(joined: set[str], trainer: str, session: str) -> None:
    """Record that ``trainer`` of ``session`` started; one that starts a second time (its task rerun
    elsewhere after its worker was lost) is refused."""
    if trainer in joined:
        raise TrainerLostError(f"trainer {trainer} of session {session} started a second time")
    joined.add(trainer)


STOPPED: dict[str, type[SessionStoppedError]] = {
    cls.reason: cls for cls in (SessionClosedError, TrainerLostError, SessionAbortedError)
}


class MalformedMessageError(DlscaleError, ValueError):
    """A protocol message (a reply, an acknowledgement, an update) without the fields its record needs."""


class TrainingConfigError(DlscaleError, ValueError):
    """A ``dlscale.training`` setting out of range."""
