"""``SparkNet``: a network trained across the cluster (DL4J's ``SparkDl4jMultiLayer`` and
``SparkComputationGraph`` in one, since a torch module may have one input or several)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from dlscale import inference
from dlscale.evaluation import (
    ROC,
    BaseEvaluation,
    Evaluation,
    RegressionEvaluation,
    ROCMultiClass,
    do_evaluation,
)
from dlscale.evaluation.distributed import Loader
from dlscale.monitor.stats import TrainingStats
from dlscale.nn.listeners import TrainingListener
from dlscale.nn.network import Network
from dlscale.training._driver import FitContext
from dlscale.training.averaging import ParameterAveragingTrainingMaster
from dlscale.training.checkpoints import FitPosition, load_checkpoint, restore
from dlscale.training.master import TrainingMaster

if TYPE_CHECKING:
    from dlscale.facade.context import SparkContext
    from dlscale.facade.rdd import RDD

DEFAULT_BATCH_SIZE_PER_WORKER = 32


class SparkNet:
    """Trains ``network`` on the cluster of ``sc`` with ``training_master`` (by default parameter
    averaging with 32 examples per worker minibatch). The trained network is :attr:`network`, on the
    driver, after every ``fit``: parameter averaging's state arrives in the background and is taken
    when the network is first read (or as ``sc`` stops), so a loop of fits that reads nothing between
    them does not wait for it (``Network.arriving``)."""

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
        held = weakref.ref(network)  # a fit's state arrives when the network is read: at the latest as sc stops
        sc._on_stop(lambda: (n := held()) is not None and n.settle())

    def fit(
        self,
        rdd: RDD,
        epochs: int = 1,
        *,
        resume_from: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> Network:
        """Train on an RDD of DataSet or MultiDataSet for ``epochs`` passes; returns :attr:`network`.
        ``resume_from``, a checkpoint's URL (:class:`~dlscale.training.checkpoints.CheckpointListener`),
        continues the fit that wrote it: the network takes the checkpoint's state and trains the minibatches
        of the planned epochs that the checkpoint had not, in the same order."""
        resume = self._resume(resume_from, storage_options)
        self.training_master.fit(self._fit_context(), rdd, epochs, resume)
        return self.network

    def fit_paths(
        self,
        paths: RDD,
        loader: Callable[[Any], Any] | None = None,
        epochs: int = 1,
        *,
        resume_from: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> Network:
        """Train on the minibatch files named by ``paths`` (e.g. from :func:`dlscale.data.list_paths`),
        read on the workers by ``loader`` (default: ``.dlb`` files); returns :attr:`network`.
        ``resume_from`` as for :meth:`fit`."""
        resume = self._resume(resume_from, storage_options)
        self.training_master.fit_paths(self._fit_context(), paths, loader, epochs, resume)
        return self.network

    def _resume(self, url: str | None, storage_options: dict[str, Any] | None) -> FitPosition | None:
        """Set :attr:`network` to the checkpoint at ``url``; the position of its fit (``None`` without one)."""
        if url is None:
            return None
        saved, position = load_checkpoint(url, storage_options, like=self.network)
        restore(self.network, saved)
        return position

    # -- evaluation (DL4J's evaluate, evaluateROC, evaluateRegression, doEvaluation) ------------
    def evaluate(
        self,
        data: RDD,
        batch_size: int | None = None,
        top_n: int = 1,
        labels: list[str] | None = None,
        loader: Loader | None = None,
    ) -> Evaluation:
        """Classification metrics (accuracy, precision, recall, F1, top-N accuracy, ...) of the network on
        ``data``; see :meth:`do_evaluation` for ``data``, ``batch_size`` and ``loader``."""
        return self.do_evaluation(data, Evaluation(labels=labels, top_n=top_n), batch_size=batch_size, loader=loader)[0]

    def evaluate_roc(
        self, data: RDD, threshold_steps: int = 0, batch_size: int | None = None, loader: Loader | None = None
    ) -> ROC:
        """The ROC curve, AUC and AUPRC of a binary classifier (exact when ``threshold_steps`` is 0)."""
        return self.do_evaluation(data, ROC(threshold_steps), batch_size=batch_size, loader=loader)[0]

    def evaluate_roc_multiclass(
        self, data: RDD, threshold_steps: int = 0, batch_size: int | None = None, loader: Loader | None = None
    ) -> ROCMultiClass:
        """One-vs-all ROC curves and AUCs of a multi-class classifier."""
        return self.do_evaluation(data, ROCMultiClass(threshold_steps), batch_size=batch_size, loader=loader)[0]

    def evaluate_regression(
        self, data: RDD, batch_size: int | None = None, loader: Loader | None = None
    ) -> RegressionEvaluation:
        """Per-column MSE, MAE, RMSE, RSE, Pearson correlation and R² of a regression network."""
        return self.do_evaluation(data, RegressionEvaluation(), batch_size=batch_size, loader=loader)[0]

    def do_evaluation(
        self,
        data: RDD,
        *evaluations: BaseEvaluation,
        batch_size: int | None = None,
        num_workers: int | None = None,
        loader: Loader | None = None,
        output: int = 0,
    ) -> list[BaseEvaluation]:
        """Several evaluations in one pass over ``data`` (an RDD of DataSet/MultiDataSet, or of paths read
        by ``loader``); see :func:`dlscale.evaluation.do_evaluation`."""
        return do_evaluation(
            self.network,
            data,
            *evaluations,
            batch_size=batch_size,
            num_workers=num_workers,
            loader=loader,
            output=output,
        )

    # -- inference (DL4J's feedForwardWithKey, scoreExamples, calculateScore) -------------------
    def feed_forward_with_key(self, pair_rdd: RDD, batch_size: int | None = None) -> RDD:
        """``(key, output)`` for every ``(key, features)``; see :func:`dlscale.inference.feed_forward_with_key`."""
        return inference.feed_forward_with_key(self.network, pair_rdd, batch_size)

    def feed_forward_with_mask_and_key(self, pair_rdd: RDD, batch_size: int | None = None) -> RDD:
        """``(key, output)`` for every ``(key, (features, mask))``; see
        :func:`dlscale.inference.feed_forward_with_mask_and_key`."""
        return inference.feed_forward_with_mask_and_key(self.network, pair_rdd, batch_size)

    def score_examples(self, rdd: RDD, include_regularization: bool = False, batch_size: int | None = None) -> RDD:
        """The loss of every example (keyed for an RDD of ``(key, DataSet)``); see
        :func:`dlscale.inference.score_examples`."""
        return inference.score_examples(self.network, rdd, include_regularization, batch_size)

    def calculate_score(self, rdd: RDD, average: bool = True, batch_size: int | None = None) -> float:
        """The mean (``average``) or total loss over ``rdd``."""
        return inference.calculate_score(self.network, rdd, average, batch_size)

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

    def _fit_context(self) -> FitContext:
        """What the training master is handed: the client, the network, the listeners, and where the
        fit's statistics go (appended to :attr:`training_stats`)."""
        return FitContext(self.sc.client, self.network, tuple(self.listeners), self._record_stats)

    def _record_stats(self, stats: TrainingStats) -> None:
        if self.training_stats is None:
            self.training_stats = stats
        else:
            self.training_stats.extend(stats)
