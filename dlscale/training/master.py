"""The training-master protocol and the checks every master runs before it spends cluster time."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dlscale.data.dataset import DataSet, MultiDataSet
from dlscale.nn import shipping
from dlscale.persist import StorageLevel

if TYPE_CHECKING:
    from dlscale.nn.network import Network
    from dlscale.rdd import RDD
    from dlscale.training.sparknet import SparkNet


class TrainingMaster(abc.ABC):
    """How a :class:`~dlscale.SparkNet` trains across the cluster (DL4J's ``TrainingMaster``)."""

    @abc.abstractmethod
    def fit(self, net: SparkNet, rdd: RDD, epochs: int) -> None:
        """Train ``net.network`` on an RDD of DataSet or MultiDataSet."""

    @abc.abstractmethod
    def fit_paths(self, net: SparkNet, paths: RDD, loader: Callable[[Any], Any] | None, epochs: int) -> None:
        """Train ``net.network`` on the minibatches that ``loader`` reads from ``paths``."""


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
        raise ValueError("the network has no optimizer: pass one (e.g. functools.partial(torch.optim.SGD, lr=0.1)) "
                         "to train it")
    return shipping.serialise(network)


def probe_rdd(network: Network, rdd: RDD, batch_size: int) -> None:
    """Compute the loss on the start of ``rdd``'s first element, on the driver: a wrong element type,
    an empty RDD or labels that do not fit the loss are reported before the data is prepared."""
    first = rdd.take(1)
    if not first:
        raise ValueError("the RDD is empty: there is nothing to train on")
    element = first[0]
    if not isinstance(element, (DataSet, MultiDataSet)):
        raise TypeError(f"the RDD holds {type(element).__name__} elements; fit trains on an RDD of DataSet or "
                        "MultiDataSet (use fit_paths for an RDD of paths)")
    if element.num_examples() == 0:
        return
    sample = element.split(min(batch_size, element.num_examples()))[0]
    try:
        network.score(sample)
    except Exception as e:
        e.add_note("raised by the network on the RDD's first element, before training")
        raise
