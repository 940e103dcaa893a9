"""Packages whose names are imported on first use (PEP 562).

A package's ``__init__`` that imports its modules makes every ``import dlscale.<package>.<module>``
wait for the whole package, and two threads importing a package and one of its modules at once can
each hold what the other needs: Python then hands one of them a half-initialized module ("cannot
import name ... from partially initialized module"). A worker imports from several threads (its event
loop unpickling a message, its task threads), so each package here names its exports instead and
imports a module only when one of its names is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose name ``n`` is ``exports[n]``'s attribute ``n``."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # found directly from now on
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
