"""dlscale: train, evaluate and serve PyTorch models on a Dask cluster through a Spark-compatible API.

Public names are imported on first use, so that ``dlscale.runtime.sizeof`` (loaded by dask's
``dask.sizeof`` entry point while dask itself is importing) pulls in nothing else.
"""

from __future__ import annotations

from dlscale._exports import lazy

__version__ = "0.1.0"

_EXPORTS = {
    "SparkContext": "dlscale.facade.context",
    "SparkConf": "dlscale.facade.conf",
    "RDD": "dlscale.facade.rdd",
    "Partitioner": "dlscale.facade.rdd",
    "ResultIterable": "dlscale.facade.rdd",
    "portable_hash": "dlscale.facade._hash",
    "StorageLevel": "dlscale.facade.persist",
    "RDDInfo": "dlscale.facade.persist",
    "Broadcast": "dlscale.facade.broadcast",
    "TaskContext": "dlscale.facade.taskcontext",
    "BarrierTaskContext": "dlscale.facade.taskcontext",
    "BarrierTaskInfo": "dlscale.facade.taskcontext",
    "RDDBarrier": "dlscale.facade.barrier",
    "SparkFiles": "dlscale.facade.files",
    "StatusTracker": "dlscale.facade.status",
    "SparkJobInfo": "dlscale.facade.status",
    "SparkStageInfo": "dlscale.facade.status",
    "Accumulator": "dlscale.facade.accumulators",
    "AccumulatorParam": "dlscale.facade.accumulators",
    "StatCounter": "dlscale.facade.statcounter",
    "InheritableThread": "dlscale.facade.threads",
    "inheritable_thread_target": "dlscale.facade.threads",
    "SparkNet": "dlscale.training.sparknet",
    "ParameterAveragingTrainingMaster": "dlscale.training.averaging",
    "TrainingMaster": "dlscale.training.master",
    "SharedTrainingMaster": "dlscale.training.sharing",
    "TrainingStats": "dlscale.monitor.stats",
    "CheckpointListener": "dlscale.training.checkpoints",
    "TensorBoardListener": "dlscale.monitor.tensorboard",
    "report": "dlscale.monitor.record",
    "predict": "dlscale.inference",
    "write_string_to_file": "dlscale.storage",
    "read_string_from_file": "dlscale.storage",
    "DlscaleError": "dlscale.errors",
    "BroadcastDestroyedError": "dlscale.errors",
    "BroadcastOperationError": "dlscale.errors",
    "AccumulatorAccessError": "dlscale.errors",
    "JobCancelledError": "dlscale.errors",
    "CheckpointError": "dlscale.errors",
    "BarrierError": "dlscale.errors",
    "UserStopIterationError": "dlscale.errors",
    "PipeFunctionExitedError": "dlscale.errors",
    "UnsupportedOperationError": "dlscale.errors",
    "MasterURLError": "dlscale.errors",
    "ClusterConnectionError": "dlscale.errors",
    "StorageError": "dlscale.errors",
    "OutputExistsError": "dlscale.errors",
    "IncompleteExportError": "dlscale.errors",
    "CorruptDataError": "dlscale.errors",
    "UnsafePickleError": "dlscale.errors",
    "LabelError": "dlscale.errors",
    "NetworkSerializationError": "dlscale.errors",
    "NonFiniteUpdateError": "dlscale.errors",
    "TrainerLostWarning": "dlscale.errors",
    "WorkersUnavailableError": "dlscale.errors",
    "EvaluationError": "dlscale.errors",
    "IncompatibleEvaluationError": "dlscale.errors",
    "DeviceError": "dlscale.errors",
    "MinibatchTooLargeError": "dlscale.errors",
}

__all__ = [*sorted(_EXPORTS), "__version__"]

__getattr__, __dir__ = lazy(__name__, _EXPORTS)
