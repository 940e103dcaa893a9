"""Gradient sharing's Dask extension: the control plane's scheduler plugin and the data plane's
worker plugin, installed together by :func:`dlscale.runtime.extensions.install`."""

from __future__ import annotations

from dlscale.training._plugins import extension
from dlscale.training.sharing._scheduler_plugin import SharingSchedulerPlugin
from dlscale.training.sharing._worker_plugin import SharingWorkerPlugin

SHARING = extension(SharingSchedulerPlugin, SharingWorkerPlugin)
