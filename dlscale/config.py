"""Library defaults under the ``dlscale`` namespace of :mod:`dask.config`.

Override them like any Dask setting: ``dask.config.set({"dlscale.local.threads-per-worker": 2})``
or the environment (``DASK_DLSCALE__LOCAL__THREADS_PER_WORKER=2``).
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

_FN = os.path.join(os.path.dirname(__file__), "dlscale.yaml")

with open(_FN) as _f:
    _defaults = yaml.safe_load(_f)

dask.config.update_defaults(_defaults)


def get(key: str) -> Any:
    """Return the setting ``dlscale.<key>``."""
    return dask.config.get(f"dlscale.{key}")
