"""dlscale: train, evaluate and serve PyTorch models on a Dask cluster through a Spark-compatible API."""

from __future__ import annotations

import dask.sizeof

from dlscale import config  # noqa: F401  (registers the dlscale defaults with dask.config)
from dlscale._sizeof import register as _register_sizeof
from dlscale.broadcast import Broadcast
from dlscale.conf import SparkConf
from dlscale.context import SparkContext
from dlscale.errors import (
    ClusterConnectionError,
    CorruptDataError,
    DlscaleError,
    MasterURLError,
    OutputExistsError,
    StorageError,
    UnsafePickleError,
)
from dlscale.persist import RDDInfo, StorageLevel
from dlscale.rdd import RDD, Partitioner, ResultIterable, portable_hash
from dlscale.statcounter import StatCounter

__version__ = "0.1.0"

# the entry point registers it in processes that import dask first; this covers the rest
_register_sizeof(dask.sizeof.sizeof)

__all__ = [
    "RDD",
    "Broadcast",
    "ClusterConnectionError",
    "CorruptDataError",
    "DlscaleError",
    "MasterURLError",
    "OutputExistsError",
    "Partitioner",
    "RDDInfo",
    "ResultIterable",
    "SparkConf",
    "SparkContext",
    "StatCounter",
    "StorageError",
    "StorageLevel",
    "UnsafePickleError",
    "__version__",
]
