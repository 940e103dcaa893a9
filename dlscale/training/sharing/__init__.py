"""Gradient sharing: ``SharedTrainingMaster`` and the plugins that carry its updates (see
``docs/gradient-sharing.md``)."""

from __future__ import annotations

from dlscale.training.sharing.master import SharedTrainingMaster

__all__ = ["SharedTrainingMaster"]
