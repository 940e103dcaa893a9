"""Evaluation types that accumulate over batches, merge across workers and round-trip through JSON."""

from __future__ import annotations

from dlscale.evaluation._base import BaseEvaluation

__all__ = ["BaseEvaluation"]
