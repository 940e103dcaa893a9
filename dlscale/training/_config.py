"""The ``dlscale.training`` settings of a session, read in one place: a session's record of them is built
on the driver when a fit starts and sent to the workers, whose trainers read it from there.

Settings every master's session has are ``dlscale.training.*``; those of gradient sharing alone are
``dlscale.training.sharing.*``. The keys these had before (``dlscale.sharing.*``,
``dlscale.averaging.transport``) are still read, with a :class:`FutureWarning` naming the new key.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dask.config
from dask.utils import parse_bytes, parse_timedelta

from dlscale.training._errors import TrainingConfigError

KEYS = {  # a field of SessionConfig: its key under dlscale.
    "poll_interval": "training.poll-interval",
    "end_timeout": "training.end-timeout",
    "keep_trainers": "training.keep-trainers",
    "send_buffer": "training.sharing.send-buffer",
    "coalesce": "training.sharing.coalesce",
    "mesh_fanout": "training.sharing.mesh-fanout",
    "lease": "training.sharing.lease",
    "send_retries": "training.sharing.send-retries",
    "send_retry_delay": "training.sharing.send-retry-delay",
    "max_trainers": "training.sharing.max-trainers",
}
DEPRECATED = {  # an old key under dlscale.: the key that took its place
    **{f"sharing.{key.rsplit('.', 1)[1]}": key for key in KEYS.values()},
    "sharing.transport": "training.transport",
    "averaging.transport": "training.transport",
}
_UNSET = object()


def setting(key: str) -> Any:
    """``dlscale.<key>``; where a key it took the place of is set, that one's value, with a warning."""
    for old, new in DEPRECATED.items():
        if new == key and (value := dask.config.get(f"dlscale.{old}", _UNSET)) is not _UNSET:
            warnings.warn(f"dlscale.{old} is now dlscale.{key}: set that instead", FutureWarning, stacklevel=3)
            return value
    return dask.config.get(f"dlscale.{key}")


@dataclass(frozen=True)
class SessionConfig:
    """Bounds and timings of one training session (see ``dlscale/dlscale.yaml``)."""

    send_buffer: int  # bytes of encoded updates a worker holds unsent before its trainers wait
    coalesce: int  # bytes of waiting messages sent to one peer in one call
    mesh_fanout: int  # children per node of the mesh's tree
    poll_interval: float  # seconds between a waiting trainer's calls to the scheduler
    lease: int  # minibatches a trainer takes from the scheduler in one call
    end_timeout: float  # seconds a trainer waits for its peers' last updates, or for a lost minibatch held in memory
    send_retries: int  # retries of a send that failed with a connection error before its peer is dropped
    send_retry_delay: float  # seconds before the first retry, doubling with each one
    max_trainers: int | None = None  # trainers a fit places at most (None: workers_per_node on every worker)
    keep_trainers: bool = True  # whether a fit's trainers stay on their workers for the next fit of the network

    def __post_init__(self) -> None:
        for name in ("send_buffer", "coalesce", "mesh_fanout", "lease"):
            _check(name, getattr(self, name), 1)
        if self.max_trainers is not None:
            _check("max_trainers", self.max_trainers, 1)
        _check("send_retries", self.send_retries, 0)
        if not isinstance(self.keep_trainers, bool):
            raise TrainingConfigError(
                f"dlscale.{KEYS['keep_trainers']} must be true or false, got {self.keep_trainers!r}"
            )
        for name in ("poll_interval", "end_timeout", "send_retry_delay"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise TrainingConfigError(f"dlscale.{KEYS[name]} must be a duration >= 0, got {value!r}")

    @classmethod
    def from_dask(cls) -> SessionConfig:
        """The settings as ``dask.config`` has them here."""
        return cls(
            send_buffer=_read("send_buffer", parse_bytes),
            coalesce=_read("coalesce", parse_bytes),
            mesh_fanout=_read("mesh_fanout"),
            poll_interval=_read("poll_interval", parse_timedelta),
            lease=_read("lease"),
            end_timeout=_read("end_timeout", parse_timedelta),
            send_retries=_read("send_retries"),
            send_retry_delay=_read("send_retry_delay", parse_timedelta),
            max_trainers=_read("max_trainers"),
            keep_trainers=_read("keep_trainers"),
        )


def _read(name: str, parse: Callable[[Any], Any] | None = None) -> Any:
    value = setting(KEYS[name])
    if parse is None:
        return value
    try:
        return parse(value)
    except (KeyError, TypeError, ValueError) as e:
        raise TrainingConfigError(f"dlscale.{KEYS[name]}: {e}") from e


def _check(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TrainingConfigError(f"dlscale.{KEYS[name]} must be an integer >= {minimum}, got {value!r}")
