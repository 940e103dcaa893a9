"""Parameter averaging's Dask extension: the control plane's scheduler plugin and the data plane's
worker plugin, installed together by :func:`dlscale.runtime.extensions.install`."""

from __future__ import annotations

from dlscale.training._plugins import extension
from dlscale.training.averaging._scheduler_plugin import AveragingSchedulerPlugin
from dlscale.training.averaging._worker_plugin import AveragingWorkerPlugin

AVERAGING = extension(AveragingSchedulerPlugin, AveragingWorkerPlugin)
