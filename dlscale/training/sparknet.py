"""``SparkNet``: a network trained across the cluster (DL4J's ``SparkDl4jMultiLayer`` and
``SparkComputationGraph`` in one, since a torch module may have one input or several)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from dlscale.nn.listeners import TrainingListener
from dlscale.nn.network import Network
from dlscale.stats import TrainingStats
from dlscale.training.averaging import ParameterAveragingTrainingMaster
from dlscale.training.master import TrainingMaster

if TYPE_CHECKING:
    from dlscale.context import SparkContext
    from dlscale.rdd import RDD

DEFAULT_BATCH_SIZE_PER_WORKER = 32


class SparkNet:
    """Trains ``network`` on the cluster of ``sc`` with ``training_master`` (by default parameter
    averaging with 32 examples per worker minibatch). The trained network is :attr:`network`, on the
    driver, after every ``fit``."""

    def __init__(self, sc: SparkContext, network: Network, training_master: TrainingMaster | None = None) -> None:
        if not isinstance(network, Network):
            raise TypeError(f"network must be a dlscale.nn.Network, not {type(network).__name__}")
        if training_master is None:
            training_master = ParameterAveragingTrainingMaster(DEFAULT_BATCH_SIZE_PER_WORKER)
        if not isinstance(training_master, TrainingMaster):
            raise TypeError(f"training_master must be a TrainingMaster, not {type(training_master).__name__}")
        self.sc = sc
        self.network = network
        self.training_master = training_master
        self.listeners: list[TrainingListener] = []
        self.training_stats: TrainingStats | None = None

    def fit(self, rdd: RDD, epochs: int = 1) -> Network:
        """Train on an RDD of DataSet or MultiDataSet for ``epochs`` passes; returns :attr:`network`."""
        self.training_master.fit(self, rdd, epochs)
        return self.network

    def fit_paths(self, paths: RDD, loader: Callable[[Any], Any] | None = None, epochs: int = 1) -> Network:
        """Train on the minibatch files named by ``paths`` (e.g. from :func:`dlscale.data.list_paths`),
        read on the workers by ``loader`` (default: ``.dlb`` files); returns :attr:`network`."""
        self.training_master.fit_paths(self, paths, loader, epochs)
        return self.network

    def get_network(self) -> Network:
        """The network on the driver, with the parameters of the last ``fit``."""
        return self.network

    def set_listeners(self, *listeners: TrainingListener | Iterable[TrainingListener]) -> None:
        """Listeners called on the driver after every round, with the round's mean score and examples
        (they replace the previous ones)."""
        flat: list[Any] = []
        for item in listeners:
            flat.extend(item if isinstance(item, (list, tuple)) else [item])
        for listener in flat:
            if not isinstance(listener, TrainingListener):
                raise TypeError(f"listeners must be TrainingListener instances, not {type(listener).__name__}")
        self.listeners = flat

    def _add_stats(self, stats: TrainingStats) -> None:
        if self.training_stats is None:
            self.training_stats = stats
        else:
            self.training_stats.prepare_seconds += stats.prepare_seconds
            self.training_stats.rounds.extend(stats.rounds)
            self.training_stats.trainers.extend(stats.trainers)
