"""What a driver process records for ``dlscale certify``: one JSON line per event in a local file.

When the environment variable :data:`RECORD_ENV` names a file, :func:`append` adds a line to it
(every ``SparkNet.fit`` records its tally there as it ends, and :func:`report` a script's final
metrics); when it is unset, nothing is written. ``dlscale certify`` sets it for each run of a
script and reads the lines back with :func:`read`, so the script itself needs no change beyond an
optional ``dlscale.report(...)`` of the metrics it wants compared.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import time
from pathlib import Path
from typing import Any

RECORD_ENV = "DLSCALE_RECORD"

logger = logging.getLogger(__name__)


def append(kind: str, **fields: Any) -> None:
    """Append ``{"kind": kind, "time": ..., **fields}`` as one JSON line to the file
    :data:`RECORD_ENV` names; nothing when it is unset. One write of the whole line, in append
    mode, so that lines from several threads or processes do not interleave."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def report(**metrics: float) -> None:
    """Report a script's final metrics, e.g. ``dlscale.report(accuracy=0.97, loss=0.1)``: logged at
    INFO and recorded for ``dlscale certify``, which compares them between its runs.

    Raises ``ValueError`` naming a metric whose value is not a real number."""
    checked = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"metric {name!r} must be a real number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"metric {name!r} must be a finite number, got {value!r}")
        checked[name] = float(value)
    logger.info("metrics: %s", ", ".join(f"{k}={v:g}" for k, v in checked.items()))
    append("metrics", metrics=checked)


def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records in ``path``, in the order written; none for a missing or empty file. A line cut
    short (a process killed while writing it) is skipped."""
    file = Path(path)
    if not file.exists():
        return []
    records = []
    for line in file.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
