"""Gradient sharing: ``SharedTrainingMaster`` and the plugins that carry its updates (see
``docs/gradient-sharing.md``).

Names are imported on first use, so importing the package imports none of its modules."""

from __future__ import annotations

from dlscale._exports import lazy

_EXPORTS = {
    "SharedTrainingMaster": "dlscale.training.sharing.master",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy(__name__, _EXPORTS)
