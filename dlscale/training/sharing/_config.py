"""The ``dlscale.sharing`` settings, read in one place: a session's record of them is built on the
driver when a fit starts, sent to every worker's node, and read from there by its trainers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dask.utils import parse_bytes, parse_timedelta

from dlscale import config
from dlscale.training.sharing._exceptions import SharingConfigError


@dataclass(frozen=True)
class SharingConfig:
    """Bounds and timings of one gradient-sharing session (see ``dlscale/dlscale.yaml``)."""

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
            raise SharingConfigError(f"dlscale.sharing.keep-trainers must be true or false, got {self.keep_trainers!r}")
        for name in ("poll_interval", "end_timeout", "send_retry_delay"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise SharingConfigError(f"dlscale.sharing.{_key(name)} must be a duration >= 0, got {value!r}")

    @classmethod
    def from_dask(cls) -> SharingConfig:
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
    value = config.get(f"sharing.{_key(name)}")
    if parse is None:
        return value
    try:
        return parse(value)
    except (KeyError, TypeError, ValueError) as e:
        raise SharingConfigError(f"dlscale.sharing.{_key(name)}: {e}") from e


def _key(name: str) -> str:
    return name.replace("_", "-")


def _check(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SharingConfigError(f"dlscale.sharing.{_key(name)} must be an integer >= {minimum}, got {value!r}")
