"""The training-master protocol and the checks every master runs before it spends cluster time."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from dlscale.data.dataset import DataSet, MultiDataSet
from dlscale.facade.persist import StorageLevel
from dlscale.nn import shipping
from dlscale.runtime.tasks import check_count
from dlscale.training import _sources
from dlscale.training._driver import FitContext, FitRun
from dlscale.training._parking import Warm

if TYPE_CHECKING:
    from dlscale.facade.rdd import RDD
    from dlscale.nn.network import Network
    from dlscale.training.checkpoints import FitPosition


@dataclasses.dataclass
class TrainingMaster(abc.ABC):
    """How a :class:`~dlscale.SparkNet` trains across the cluster (DL4J's ``TrainingMaster``).

    The settings every master has: ``batch_size_per_worker`` (examples per minibatch), and, by keyword,
    ``rdd_training_approach`` ("export": ``fit`` writes the RDD as minibatch files under
    ``export_directory``, default ``_training/`` under the storage root, with ``storage_options``;
    "direct": minibatches held in the workers' memory at ``storage_level``), ``collect_training_stats``
    and ``rng_seed`` (fixes the order of minibatches; otherwise random). :meth:`fit` and
    :meth:`fit_paths` check what they are given, prepare the minibatches and run :meth:`_train`, the one
    method a master implements, inside a :class:`~dlscale.training._driver.FitRun`.
    """

    approach: ClassVar[str]  # how progress, the panel and the statistics name the master's fits

    batch_size_per_worker: int
    _: dataclasses.KW_ONLY
    rdd_training_approach: str = "export"
    export_directory: str | None = None
    storage_level: StorageLevel = StorageLevel.MEMORY_ONLY_SER
    storage_options: dict[str, Any] | None = None
    collect_training_stats: bool = False
    rng_seed: int | None = None
    _exports: _sources.ExportCache = dataclasses.field(default_factory=_sources.ExportCache, init=False, repr=False)
    _warm: Warm | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_count("batch_size_per_worker", self.batch_size_per_worker)
        check_source(self.rdd_training_approach, self.storage_level)

    def fit(self, context: FitContext, rdd: RDD, epochs: int, resume: FitPosition | None = None) -> None:
        """Train ``context.network`` on an RDD of DataSet or MultiDataSet (from ``resume``, a checkpoint's
        position, onwards)."""
        check_epochs(epochs)
        self._check_settings()
        blob = self._blob(context.network)
        # an RDD exported by an earlier fit is not computed again: its first file is probed on a worker
        exported = self.rdd_training_approach == "export" and self._exports.holds(rdd, self.batch_size_per_worker)
        if not exported:
            probe_rdd(context.network, rdd, self.batch_size_per_worker)
        if self.rdd_training_approach == "direct":
            batches = _sources.in_memory(rdd, self.batch_size_per_worker, self.storage_level)
            with FitRun(context, self, blob, batches, epochs, resume) as run:
                self._train(run, batches, partitions=rdd.getNumPartitions())
        else:
            batches = self._exports.get(rdd, self.batch_size_per_worker, self.export_directory, self.storage_options)
            with FitRun(context, self, blob, batches, epochs, resume) as run:
                self._train(run, batches, probe=exported)

    def fit_paths(
        self,
        context: FitContext,
        paths: RDD,
        loader: Callable[[Any], Any] | None,
        epochs: int,
        resume: FitPosition | None = None,
    ) -> None:
        """Train ``context.network`` on the minibatches that ``loader`` reads from ``paths`` (from ``resume``,
        a checkpoint's position, onwards)."""
        check_epochs(epochs)
        self._check_settings()
        blob = self._blob(context.network)
        batches = _sources.from_paths(paths, loader)
        with FitRun(context, self, blob, batches, epochs, resume) as run:
            self._train(run, batches, probe=True)

    def _blob(self, network: Network) -> bytes | None:
        """``network`` pickled for the workers, or ``None`` when the last fit's trainers, parked, may go on
        with it (it is unchanged since: see ``_parking``); the fit pickles it then only if they cannot."""
        if network.optimizer_factory is not None and self._warm is not None and self._warm.same(network, repr(self)):
            return None
        return serialise(network)

    def _check_settings(self) -> None:
        """Refuse, before a fit prepares anything, settings out of range: the master's own (its fields
        may have been set since it was made) and the ``dlscale`` settings a master reads."""
        check_source(self.rdd_training_approach, self.storage_level)

    def delete_temp_files(self) -> None:
        """Delete the minibatch files this master exported (DL4J's ``deleteTempFiles``)."""
        self._exports.delete()

    @abc.abstractmethod
    def _train(
        self, run: FitRun, batches: _sources.Minibatches, *, partitions: int | None = None, probe: bool = False
    ) -> None:
        """Train on ``batches`` for ``run.epochs`` epochs, reporting every step to ``run`` and leaving the
        trained state in ``run.network``. ``partitions`` is the RDD's partition count when the
        minibatches are held in memory ("direct"); ``probe`` asks to check one minibatch on a worker
        first (files read by a loader, or exported by an earlier fit)."""


APPROACHES = ("export", "direct")
"""How ``fit`` trains on an RDD: from minibatch files written first, or from minibatches in memory."""


def check_source(approach: str, storage_level: Any) -> None:
    """Refuse an unknown ``rdd_training_approach`` or a ``storage_level`` that is not a StorageLevel."""
    if approach not in APPROACHES:
        raise ValueError(f"rdd_training_approach must be one of {APPROACHES}, got {approach!r}")
    if not isinstance(storage_level, StorageLevel):
        raise TypeError(f"storage_level must be a StorageLevel, not {type(storage_level).__name__}")


def check_epochs(epochs: int) -> None:
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ValueError(f"epochs must be a positive integer, got {epochs!r}")


def serialise(network: Network) -> bytes:
    """``network`` pickled for the workers to train (see :func:`dlscale.nn.shipping.serialise`)."""
    if network.optimizer is None:
        raise ValueError(
            "the network has no optimizer: pass one (e.g. functools.partial(torch.optim.SGD, lr=0.1)) to train it"
        )
    return shipping.serialise(network)


def probe_rdd(network: Network, rdd: RDD, batch_size: int) -> None:
    """Compute the loss on the start of ``rdd``'s first element, on the driver: a wrong element type,
    an empty RDD or labels that do not fit the loss are reported before the data is prepared."""
    local = rdd.local_partitions()  # parallelized: the first element is here, not to be shipped and back
    first = rdd.take(1) if local is None else next(([part[0]] for part in local if part), [])
    if not first:
        raise ValueError("the RDD is empty: there is nothing to train on")
    element = first[0]
    if not isinstance(element, (DataSet, MultiDataSet)):
        raise TypeError(
            f"the RDD holds {type(element).__name__} elements; fit trains on an RDD of DataSet or "
            "MultiDataSet (use fit_paths for an RDD of paths)"
        )
    if element.num_examples() == 0:
        return
    sample = element.split(min(batch_size, element.num_examples()))[0]
    try:
        network.score(sample)
    except Exception as e:
        e.add_note("raised by the network on the RDD's first element, before training")
        raise
