"""Minibatch data on fsspec storage: ``DataSet``, ``MultiDataSet``, the ``.dlb`` file format, export,
paths, loaders with prefetching, file batches of raw files, and zarr groups.

Names are imported on first use, so importing the package imports none of its modules."""

from __future__ import annotations

from dlscale._exports import lazy

_EXPORTS = {
    "DataSet": "dlscale.data.dataset",
    "DataShapeError": "dlscale.data.dataset",
    "MultiDataSet": "dlscale.data.dataset",
    "load_digits": "dlscale.data.datasets",
    "Sink": "dlscale.data.export",
    "export_minibatches": "dlscale.data.export",
    "list_paths": "dlscale.data.export",
    "FileBatch": "dlscale.data.filebatch",
    "create_file_batches": "dlscale.data.filebatch",
    "load": "dlscale.data.format",
    "save": "dlscale.data.format",
    "ImageFileBatchLoader": "dlscale.data.images",
    "ImagePreProcessingScaler": "dlscale.data.images",
    "parent_path_labels": "dlscale.data.images",
    "DataSetLoader": "dlscale.data.loaders",
    "Loader": "dlscale.data.loaders",
    "MinibatchLoader": "dlscale.data.loaders",
    "MultiDataSetLoader": "dlscale.data.loaders",
    "prefetch": "dlscale.data.loaders",
    "resolve_loader": "dlscale.data.loaders",
    "ZarrLoader": "dlscale.data.zarr_batches",
    "export_zarr": "dlscale.data.zarr_batches",
    "list_zarr_batches": "dlscale.data.zarr_batches",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy(__name__, _EXPORTS)
