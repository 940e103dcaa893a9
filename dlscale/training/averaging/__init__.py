"""Parameter averaging: ``ParameterAveragingTrainingMaster``, its resident trainers and the plugins that
carry their averaging (see ``docs/training.md``).

Names are imported on first use, so importing the package imports none of its modules."""

from __future__ import annotations

from dlscale._exports import lazy

_EXPORTS = {
    "ParameterAveragingTrainingMaster": "dlscale.training.averaging.master",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy(__name__, _EXPORTS)
