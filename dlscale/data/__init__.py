"""Minibatch data: ``DataSet``, ``MultiDataSet`` and the minibatch file format on fsspec storage."""

from __future__ import annotations

from dlscale.data.dataset import DataSet, DataShapeError, MultiDataSet
from dlscale.data.format import load, save

__all__ = ["DataSet", "DataShapeError", "MultiDataSet", "load", "save"]
