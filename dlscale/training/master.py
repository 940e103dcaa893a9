"""The training-master protocol and the checks every master runs before it spends cluster time."""

from __future__ import annotations

import abc
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import cloudpickle

from dlscale.data.dataset import DataSet, MultiDataSet
from dlscale.errors import NetworkSerializationError
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


def check_count(name: str, value: Any, minimum: int = 1) -> None:
    """Refuse a setting that is not an integer of at least ``minimum``, naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_epochs(epochs: int) -> None:
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ValueError(f"epochs must be a positive integer, got {epochs!r}")


def serialise(network: Network) -> bytes:
    """``network`` pickled for the workers, without its listeners (they run on the driver); a network
    that cannot be pickled is refused here, naming the attribute at fault."""
    if network.optimizer is None:
        raise ValueError("the network has no optimizer: pass one (e.g. functools.partial(torch.optim.SGD, lr=0.1)) "
                         "to train it")
    listeners, network.listeners = network.listeners, []
    try:
        return cloudpickle.dumps(network, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise NetworkSerializationError(
            f"the network cannot be serialised to send it to the workers: {_culprit(network)}: {e}") from e
    finally:
        network.listeners = listeners


def _culprit(network: Network) -> str:
    """The first part of ``network`` that does not pickle, by name."""
    candidates = [("the loss", network.loss), ("the optimizer factory", network.optimizer_factory)]
    for name, module in network.module.named_modules():
        for attr, value in vars(module).items():
            if attr not in ("_parameters", "_buffers", "_modules"):
                candidates.append((f"attribute {attr!r} of module {name or type(module).__name__!r}", value))
    for what, value in candidates:
        try:
            cloudpickle.dumps(value)
        except Exception:  # noqa: BLE001 - looking for the first failure
            return what
    return "an unknown part"


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
