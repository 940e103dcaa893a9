"""Library defaults: settings under the ``dlscale`` namespace of :mod:`dask.config`, and where
dlscale's messages go.

Override settings like any Dask setting: ``dask.config.set({"dlscale.local.threads-per-worker": 2})``
or the environment (``DASK_DLSCALE__LOCAL__THREADS_PER_WORKER=2``).

Messages go through the ``dlscale`` logger, at level ``INFO`` unless the application sets another.
While the application has configured no handler of its own (none on the way to the root logger),
they are printed on standard error, through tqdm so that they never break a progress bar: as
``logging.lastResort`` does for warnings, and as Spark prints its own messages.
"""

from __future__ import annotations

import logging
import os
import sys
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


class _Fallback(logging.Handler):
    """Prints a record on standard error when no other handler takes it."""

    def emit(self, record: logging.LogRecord) -> None:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return
            logger = logger.parent if logger.propagate else None
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


_handler = _Fallback()
_handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
_logger = logging.getLogger("dlscale")
_logger.addHandler(_handler)
if _logger.level == logging.NOTSET:
    _logger.setLevel(logging.INFO)
