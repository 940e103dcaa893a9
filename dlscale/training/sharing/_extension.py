"""Gradient sharing's Dask extension: the control plane's scheduler plugin and the data plane's
worker plugin, installed together by :func:`dlscale.runtime.extensions.install`."""

from __future__ import annotations

from dlscale.runtime.extensions import Extension
from dlscale.training.sharing._scheduler_plugin import SharingSchedulerPlugin
from dlscale.training.sharing._worker_plugin import SharingWorkerPlugin

SHARING = Extension("dlscale-sharing", scheduler_plugin=SharingSchedulerPlugin, worker_plugin=SharingWorkerPlugin)
