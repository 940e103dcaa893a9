"""Minibatch data on fsspec storage: ``DataSet``, ``MultiDataSet``, the ``.dlb`` file format, export,
paths, loaders with prefetching, file batches of raw files, and zarr groups."""

from __future__ import annotations

from dlscale.data.dataset import DataSet, DataShapeError, MultiDataSet
from dlscale.data.datasets import load_digits
from dlscale.data.export import Sink, export_minibatches, list_paths
from dlscale.data.filebatch import FileBatch, create_file_batches
from dlscale.data.format import load, save
from dlscale.data.images import (
    ImageFileBatchLoader,
    ImagePreProcessingScaler,
    parent_path_labels,
)
from dlscale.data.loaders import (
    DataSetLoader,
    Loader,
    MinibatchLoader,
    MultiDataSetLoader,
    prefetch,
    resolve_loader,
)
from dlscale.data.zarr_batches import ZarrLoader, export_zarr, list_zarr_batches

__all__ = [
    "DataSet",
    "DataSetLoader",
    "DataShapeError",
    "FileBatch",
    "ImageFileBatchLoader",
    "ImagePreProcessingScaler",
    "Loader",
    "MinibatchLoader",
    "MultiDataSet",
    "MultiDataSetLoader",
    "Sink",
    "ZarrLoader",
    "create_file_batches",
    "export_minibatches",
    "export_zarr",
    "list_paths",
    "list_zarr_batches",
    "load",
    "load_digits",
    "parent_path_labels",
    "prefetch",
    "resolve_loader",
    "save",
]
