"""Exception hierarchy: every dlscale error is a :class:`DlscaleError` and also the matching built-in."""

from __future__ import annotations

import pickle


class DlscaleError(Exception):
    """Base class of all errors raised by dlscale."""


class MasterURLError(DlscaleError, ValueError):
    """A master URL that dlscale does not understand."""


class ClusterConnectionError(DlscaleError, ConnectionError):
    """The Dask scheduler named by a master URL could not be reached."""


class StorageError(DlscaleError, OSError):
    """A storage location that is missing, unreadable or unwritable."""


class IncompleteExportError(StorageError):
    """A folder of exported minibatches whose export did not finish: its files are only part of the data."""


class UnsafePickleError(DlscaleError, pickle.UnpicklingError):
    """A file on storage asked to load an object that is not on the allowed list."""


class CorruptDataError(DlscaleError, ValueError):
    """A stored block or file whose bytes do not match what was written."""


class OutputExistsError(DlscaleError, FileExistsError):
    """An output directory that already exists (RDDs are never written over existing output)."""


class BroadcastDestroyedError(DlscaleError, RuntimeError):
    """A broadcast variable used after ``destroy()``."""


class BroadcastOperationError(DlscaleError, RuntimeError):
    """``unpersist()`` or ``destroy()`` called on a broadcast variable in a task (only the driver may)."""


class AccumulatorAccessError(DlscaleError, RuntimeError):
    """An accumulator's value read or set in a task (only the driver may), or added to outside an RDD operation."""


class CheckpointError(DlscaleError, RuntimeError):
    """``checkpoint()`` called before ``SparkContext.setCheckpointDir``."""


class JobCancelledError(DlscaleError, RuntimeError):
    """An action whose job was cancelled (``cancelJobGroup``, ``cancelJobsWithTag``, ``cancelAllJobs``)."""


class BarrierError(DlscaleError, RuntimeError):
    """A barrier stage that cannot run (more partitions than the cluster has task slots), whose task failed,
    or a barrier call outside a barrier stage or after its stage was aborted."""


class UserStopIterationError(DlscaleError, RuntimeError):
    """A function given to an RDD operation raised ``StopIteration``: the task fails (as in PySpark) rather
    than let the loop over the partition that called the function end early and drop elements silently."""


class PipeFunctionExitedError(DlscaleError, RuntimeError):
    """A command given to ``RDD.pipe(..., checkCode=True)`` that exited with a non-zero code (PySpark's
    ``PIPE_FUNCTION_EXITED``)."""


class UnsupportedOperationError(DlscaleError, NotImplementedError):
    """A PySpark method that needs Spark's JVM (DataFrames, Hadoop formats, resource profiles); the message
    names what to use instead."""


class LabelError(DlscaleError, ValueError):
    """An example whose label cannot be derived (e.g. an image in a folder that is not a known class)."""


class NonFiniteUpdateError(DlscaleError, ValueError):
    """Training that produced NaN or infinity (a diverged step, a non-finite input), which would spread to
    every replica; the message names the minibatch where it first appeared."""


class NetworkSerializationError(DlscaleError, TypeError):
    """A network that cannot be pickled to send it to the workers."""


class WorkersUnavailableError(DlscaleError, TimeoutError):
    """A fit that waited ``dlscale.training.workers-timeout`` for the workers it needs (the cluster's, or
    ``dlscale.training.min-workers``) without seeing them all: the message says how many are up and which
    jobs are still pending."""


class TrainerLostWarning(UserWarning):
    """A training run that lost a worker and finished without it (its work done by the others)."""


class EvaluationError(DlscaleError, ValueError):
    """Labels, predictions or masks that an evaluation cannot use (wrong shape, NaN, unknown class)."""


class IncompatibleEvaluationError(DlscaleError, TypeError):
    """Two evaluations that cannot be merged (different types or settings), or JSON of another type."""


class MinibatchTooLargeError(MemoryError, DlscaleError):
    """A minibatch file too large for the memory of the worker that is to load it (refused unread).

    MemoryError comes first: it has a constructor of its own, which unpickling (an error sent back
    from a worker) can call only when it is the first base."""


class DeviceError(DlscaleError, RuntimeError):
    """A device setting (``DLSCALE_DEVICE``) that a worker cannot honour, e.g. ``cuda`` without a GPU."""
