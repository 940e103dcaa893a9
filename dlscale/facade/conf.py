"""``SparkConf``: key/value settings for a :class:`~dlscale.SparkContext`, with PySpark's methods."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

SUBMIT_ENV = "DLSCALE_CONF"
"""The environment variable through which ``dlscale run`` hands its settings to the script (JSON)."""

_SPARK_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)b?\s*$", re.IGNORECASE)


def spark_size_to_bytes(value: str | int, key: str) -> int:
    """Parse a Spark memory size such as ``"512m"`` or ``"4g"`` (binary units, as Spark uses)."""
    if isinstance(value, int):
        return value
    m = _SPARK_SIZE.match(str(value))
    if not m:
        raise ValueError(f"{key}={value!r} is not a memory size such as '512m' or '4g'")
    number, unit = float(m.group(1)), m.group(2).lower()
    return int(number * 1024 ** " kmgtp".index(unit or " "))


class SparkConf:
    """Settings for a context. Recognised keys:

    ``spark.master``, ``spark.app.name``, ``spark.default.parallelism`` (default partition count
    of shuffles), ``spark.task.cpus`` (``TaskContext.cpus()``, and on an embedded cluster the worker
    threads each task takes), and for an embedded cluster ``spark.executor.instances`` (worker processes),
    ``spark.executor.cores`` (threads per worker) and ``spark.executor.memory`` (memory limit
    per worker), ``spark.executor.resource.<NAME>.amount`` (an abstract resource each worker offers,
    such as ``GPU``). Other keys are kept and returned by :meth:`get`.

    With ``loadDefaults``, settings that ``dlscale run`` passes to the script (as ``spark-submit``
    passes its flags to PySpark) are loaded first; what the script sets afterwards wins.
    """

    def __init__(self, loadDefaults: bool = True, pairs: Iterable[tuple[str, str]] = ()) -> None:
        self._conf: dict[str, str] = {}
        if loadDefaults and os.environ.get(SUBMIT_ENV):
            try:
                submitted = json.loads(os.environ[SUBMIT_ENV])
            except json.JSONDecodeError as e:
                raise ValueError(f"{SUBMIT_ENV} holds no JSON object of settings: {e}") from e
            self.setAll(submitted.items())
        self.setAll(pairs)

    def set(self, key: str, value: object) -> SparkConf:
        self._conf[str(key)] = str(value)
        return self

    def setIfMissing(self, key: str, value: object) -> SparkConf:
        if key not in self._conf:
            self.set(key, value)
        return self

    def setAll(self, pairs: Iterable[tuple[str, object]]) -> SparkConf:
        for k, v in pairs:
            self.set(k, v)
        return self

    def setMaster(self, value: str) -> SparkConf:
        return self.set("spark.master", value)

    def setAppName(self, value: str) -> SparkConf:
        return self.set("spark.app.name", value)

    def get(self, key: str, defaultValue: str | None = None) -> str | None:
        return self._conf.get(key, defaultValue)

    def getAll(self) -> list[tuple[str, str]]:
        return list(self._conf.items())

    def contains(self, key: str) -> bool:
        return key in self._conf

    def toDebugString(self) -> str:
        return "\n".join(f"{k}={v}" for k, v in self._conf.items())

    def __repr__(self) -> str:
        return f"SparkConf({self._conf!r})"
