"""``TensorBoardListener``: a fit's loss, throughput and, for gradient sharing, what its updates cost, as
TensorBoard scalars (DL4J's ``StatsListener`` with a ``FileStatsStorage``, read by TensorBoard instead of
DL4J's UI).

tensorboard is an optional dependency (``pip install "dlscale[tensorboard]"``), imported when a listener
is made."""

from __future__ import annotations

import logging
import time
from typing import Any

from dlscale import storage
from dlscale.nn.listeners import StepReport, TrainingListener

logger = logging.getLogger("dlscale")

LOSS = "train/loss"
EXAMPLES_PER_SECOND = "train/examples_per_second"
BYTES_SENT = "sharing/bytes_sent"
THRESHOLD = "sharing/threshold"
SPARSITY = "sharing/sparsity"


class TensorBoardListener(TrainingListener):
    """Writes scalars for TensorBoard to ``log_dir`` whenever the network's iteration passes a multiple of
    ``frequency``, at that iteration as TensorBoard's step:

    - ``train/loss``: the step's loss (a round's mean loss, with parameter averaging);
    - ``train/examples_per_second``: over the steps since the previous point with this figure, from a fit's
      second step on (steps reported at the same moment, as gradient sharing's may be, have none);
    - gradient sharing only, ``sharing/bytes_sent``: the bytes of the updates sent over the steps since the
      previous point; ``sharing/threshold`` and ``sharing/sparsity`` (fraction of the parameters sent)
      of the step's update.

    The writer is torch's ``SummaryWriter``, flushed every ``flush_secs`` and at the end of every
    distributed fit; :meth:`close` ends its event file. ``log_dir`` is a local folder (a relative one is
    under the storage root, as every path dlscale writes) or a URL that TensorBoard's own file layer
    reaches (fsspec's protocols, ``s3://`` through boto3), configured from the environment: it takes no
    storage options. Listeners run on the driver, so the folder is the driver's.
    """

    def __init__(self, log_dir: str, frequency: int = 10, *, flush_secs: int = 120) -> None:
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(f"frequency must be an integer >= 1, got {frequency!r}")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(f'TensorBoardListener needs tensorboard: pip install "dlscale[tensorboard]" ({e})') from e
        self.log_dir, _ = storage.resolve(log_dir)
        self.frequency = frequency
        self.writer = SummaryWriter(self.log_dir, flush_secs=flush_secs)
        logger.info("TensorBoard logs in %s (tensorboard --logdir %s)", self.log_dir, self.log_dir)
        self._since: float | None = None  # when the step of the last throughput (or the fit's first) was reported
        self._examples = 0  # fitted since then
        self._bytes = 0  # sent since the last point

    def iteration_done(self, network: Any, iteration: int, epoch: int, score: float, examples: int) -> None:
        """A minibatch fitted in this process (``Network.fit``)."""
        self.step_done(network, StepReport(iteration, 1, epoch, score, examples, time.time()))

    def step_done(self, network: Any, step: StepReport) -> None:
        if self._since is None:
            self._since = step.time  # its examples were fitted before: throughput counts from its report
        else:
            self._examples += step.examples
        if step.update is not None:
            self._bytes += step.update.bytes
        if step.iteration // self.frequency == (step.iteration - step.iterations) // self.frequency:
            return
        writer, i = self.writer, step.iteration
        writer.add_scalar(LOSS, step.score, i)
        if step.time > self._since:  # steps reported together wait for a later point's throughput
            writer.add_scalar(EXAMPLES_PER_SECOND, self._examples / (step.time - self._since), i)
            self._since, self._examples = step.time, 0
        if step.update is not None:
            writer.add_scalar(BYTES_SENT, self._bytes, i)
            writer.add_scalar(THRESHOLD, step.update.threshold, i)
            writer.add_scalar(SPARSITY, step.update.sparsity, i)
        self._bytes = 0

    def fit_done(self, network: Any) -> None:
        """Flush what the fit wrote; the next fit's throughput starts afresh."""
        self.writer.flush()
        self._since, self._examples, self._bytes = None, 0, 0

    def flush(self) -> None:
        """Write what is pending to the event file."""
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file; a later point opens a new one in the same folder."""
        self.writer.close()
