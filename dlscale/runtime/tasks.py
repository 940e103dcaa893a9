"""What dlscale's tasks share: settings checked before they are submitted, and the worker process
they run in (its address for error messages, its thread count for torch)."""

from __future__ import annotations

from typing import Any

import torch
from distributed import get_worker


def check_count(name: str, value: Any, minimum: int = 1) -> None:
    """Refuse a setting that is not an integer of at least ``minimum``, naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def match_threads() -> int:
    """Give torch as many intra-op threads as this worker runs tasks on; returns that number."""
    try:
        n = get_worker().state.nthreads
    except ValueError:  # not on a worker
        return torch.get_num_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def worker_address() -> str:
    """This worker's address (``"the driver"`` outside a worker)."""
    try:
        return get_worker().address
    except ValueError:
        return "the driver"
