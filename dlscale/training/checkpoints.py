"""Checkpoints of a fit (DL4J's ``CheckpointListener``) and the position a fit resumes from.

A checkpoint is a network archive (:mod:`dlscale.nn.archive`: parameters and optimizer state, loaded
without unpickling anything) written where the fit's state is whole: after a round of parameter
averaging (the round's states averaged), or after a segment of gradient sharing (the trainers' states
averaged and their unsent residuals added). With it goes the fit's :class:`FitPosition`: the seed that
orders the minibatches, the planned epochs, and what of the fit is done, so that
``SparkNet.fit(..., resume_from=url)`` trains the rest of the planned minibatches, in the same order.
Each checkpoint is written atomically; the listener keeps the last ``keep_last`` (and every
``keep_every``-th) and lists what is there.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dask.utils import parse_timedelta

from dlscale import storage
from dlscale.nn import archive
from dlscale.nn.listeners import TrainingListener

if TYPE_CHECKING:
    from dlscale.nn.network import Network

__all__ = ["Checkpoint", "CheckpointListener", "FitPosition", "available_checkpoints", "load_checkpoint", "restore"]

_NAME = re.compile(r"checkpoint-(\d+)-epoch(\d+)-iteration(\d+)\.dln$")


@dataclass(frozen=True)
class FitPosition:
    """Where a fit stands at a checkpoint: its master's ``approach``, the ``seed`` and ``first_epoch`` that
    order its minibatches, its planned ``epochs`` over ``minibatches`` minibatches, and what is done:
    ``epoch`` (of the fit, from 0) and, within it, the first ``rounds`` rounds of parameter averaging; for
    gradient sharing, the work items still to fit (``remaining``, item ``e * minibatches + i`` being
    minibatch ``i`` in the fit's epoch ``e``)."""

    approach: str
    seed: int
    first_epoch: int
    epochs: int
    minibatches: int
    epoch: int = 0
    rounds: int = 0
    remaining: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["remaining"] = None if self.remaining is None else list(self.remaining)
        return out

    @classmethod
    def from_json(cls, value: dict[str, Any], url: str) -> FitPosition:
        try:
            fields = {f.name for f in dataclasses.fields(cls)}
            position = cls(**{k: v for k, v in value.items() if k in fields})
            if position.remaining is not None:
                position = dataclasses.replace(position, remaining=tuple(int(i) for i in position.remaining))
            return position
        except TypeError as e:
            raise ValueError(f"{url} is not a dlscale checkpoint: its fit position is incomplete ({e})") from e


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a fit: its ``number`` (from 0), the network's ``epoch`` and ``iteration`` counts
    when it was written, and where it is (``url``)."""

    number: int
    epoch: int
    iteration: int
    url: str

    def load(self, storage_options: dict[str, Any] | None = None) -> Network:
        """The network saved in this checkpoint, with its optimizer state."""
        return load_checkpoint(self.url, storage_options)[0]


def load_checkpoint(
    url: str, storage_options: dict[str, Any] | None = None, like: Network | None = None
) -> tuple[Network, FitPosition]:
    """The network saved in the checkpoint at ``url`` and the position of its fit. With ``like``, the
    network is rebuilt on a copy of its module, loss and optimizer (no registered factory needed)."""
    if like is None:
        network, extra = archive.load_with_extra(url, storage_options)
    else:
        network, extra = archive.load_with_extra(
            url, storage_options, copy.deepcopy(like.module), loss=like.loss, optimizer=like.optimizer_factory
        )
    if not isinstance(extra, dict) or "fit" not in extra:
        raise ValueError(f"{url} is a network archive, not a checkpoint of a fit (it records no fit position)")
    return network, FitPosition.from_json(extra["fit"], url)


class CheckpointListener(TrainingListener):
    """Saves the fit's network with its optimizer state to ``directory`` (a local path or any fsspec URL,
    with ``storage_options``), as DL4J's ``CheckpointListener``: every ``save_every_n_iterations``
    iterations, at the end of every ``save_every_n_epochs``-th epoch, and/or every ``save_every`` (seconds,
    or a duration such as ``"10 minutes"``). It keeps the last ``keep_last`` checkpoints and, with
    ``keep_every``, also every ``keep_every``-th (all of them when ``keep_last`` is ``None``).

    The training master writes a checkpoint at the first point where the fit's state is whole once one is
    due: the end of a round (parameter averaging) or of a segment of the fit that ends there (gradient
    sharing). ``SparkNet.fit(..., resume_from=listener.last_checkpoint().url)`` continues from it.
    """

    def __init__(
        self,
        directory: str,
        *,
        save_every_n_iterations: int | None = None,
        save_every_n_epochs: int | None = None,
        save_every: float | str | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        for name, value in (
            ("save_every_n_iterations", save_every_n_iterations),
            ("save_every_n_epochs", save_every_n_epochs),
            ("keep_last", keep_last),
            ("keep_every", keep_every),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if save_every_n_iterations is None and save_every_n_epochs is None and save_every is None:
            raise ValueError("give save_every_n_iterations, save_every_n_epochs or save_every: when to save")
        self.directory = directory.rstrip("/")
        self.every_iterations = save_every_n_iterations
        self.every_epochs = save_every_n_epochs
        self.every_seconds = None if save_every is None else parse_timedelta(save_every)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.storage_options = storage_options
        self._last_iteration: int | None = None  # at the last checkpoint of this process's fits
        self._last_time = time.monotonic()

    # -- when ------------------------------------------------------------------------------
    def fit_started(self, iteration: int) -> None:
        """A fit starts (or resumes) with the network at ``iteration``: the intervals count from here."""
        self._last_iteration, self._last_time = iteration, time.monotonic()

    def iterations_to_due(self, iteration: int) -> int | None:
        """Steps from ``iteration`` until a checkpoint by iterations is due (``None``: none is asked for)."""
        if self.every_iterations is None:
            return None
        last = self._last_iteration if self._last_iteration is not None else 0
        return max(1, (last // self.every_iterations + 1) * self.every_iterations - iteration)

    def wants_epoch_end(self, epochs_done: int) -> bool:
        """Whether the end of an epoch, the network's ``epochs_done``-th, is due a checkpoint."""
        return self.every_epochs is not None and epochs_done % self.every_epochs == 0

    def due(self, iteration: int, epochs_done: int | None) -> bool:
        """Whether a checkpoint is due with the network at ``iteration``; ``epochs_done`` is the network's
        epoch count when an epoch has just ended, else ``None``."""
        last = self._last_iteration if self._last_iteration is not None else 0
        if self.every_iterations is not None and iteration // self.every_iterations > last // self.every_iterations:
            return True
        if epochs_done is not None and self.wants_epoch_end(epochs_done):
            return True
        return self.every_seconds is not None and time.monotonic() - self._last_time >= self.every_seconds

    # -- saving and listing ----------------------------------------------------------------
    def save(self, network: Network, position: FitPosition) -> Checkpoint:
        """Write ``network`` (with its optimizer state) and ``position`` as the next checkpoint; then drop
        the checkpoints the keep policy lets go and what writers killed in the folder left."""
        existing = self.available_checkpoints()
        number = existing[-1].number + 1 if existing else 0
        name = f"checkpoint-{number:06d}-epoch{network.epoch}-iteration{network.iteration}.dln"
        url = f"{self.directory}/{name}"
        archive.save(network, url, True, self.storage_options, extra={"fit": position.to_json()})
        self._last_iteration, self._last_time = network.iteration, time.monotonic()
        checkpoint = Checkpoint(number, network.epoch, network.iteration, url)
        self._prune([*existing, checkpoint])
        storage.remove_stale_temporaries(self.directory, self.storage_options)
        return checkpoint

    def _prune(self, checkpoints: list[Checkpoint]) -> None:
        if self.keep_last is None:
            return
        keep = {c.number for c in checkpoints[-self.keep_last :]}
        if self.keep_every is not None:
            keep |= {c.number for c in checkpoints if (c.number + 1) % self.keep_every == 0}
        fs, _ = storage.open_fs(self.directory, self.storage_options)
        for c in checkpoints:
            if c.number not in keep:
                with storage.as_storage_error("delete the checkpoint", c.url):
                    fs.rm(storage.open_fs(c.url, self.storage_options)[1])

    def available_checkpoints(self) -> list[Checkpoint]:
        """The checkpoints in the directory, oldest first."""
        return available_checkpoints(self.directory, self.storage_options)

    def last_checkpoint(self) -> Checkpoint | None:
        """The newest checkpoint in the directory, or ``None``."""
        found = self.available_checkpoints()
        return found[-1] if found else None


def available_checkpoints(directory: str, storage_options: dict[str, Any] | None = None) -> list[Checkpoint]:
    """The checkpoints a :class:`CheckpointListener` wrote to ``directory``, oldest first."""
    fs, path = storage.open_fs(directory.rstrip("/"), storage_options)
    if not fs.exists(path):
        return []
    found = []
    with storage.as_storage_error("list the checkpoints in", directory):
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    for name in names:
        m = _NAME.match(name)
        if m:
            number, epoch, iteration = map(int, m.groups())
            found.append(Checkpoint(number, epoch, iteration, f"{directory.rstrip('/')}/{name}"))
    return sorted(found, key=lambda c: c.number)


def restore(network: Network, saved: Network) -> None:
    """Give ``network`` the state of ``saved``: parameters, buffers, optimizer state and counters."""
    network.module.load_state_dict(saved.module.state_dict())
    if saved.optimizer is not None and network.optimizer is not None:
        network.set_optimizer_state(saved.optimizer_state())
    network.iteration, network.epoch = saved.iteration, saved.epoch


def checkpointers(listeners: list[TrainingListener] | tuple[TrainingListener, ...]) -> list[CheckpointListener]:
    """The checkpoint listeners among ``listeners``."""
    return [listener for listener in listeners if isinstance(listener, CheckpointListener)]
