"""What dlscale's tasks share: settings checked before they are submitted, and the worker process
they run in (where, for error messages, its thread count for torch). The facade's tasks use it too,
so torch is imported only by what needs it: an RDD's tasks never load torch on a worker."""

from __future__ import annotations

from typing import Any

from distributed import get_worker


def check_count(name: str, value: Any, minimum: int = 1) -> None:
    """Refuse a setting that is not an integer of at least ``minimum``, naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def this_worker() -> Any:
    """The Dask worker this runs in, or ``None`` outside one (on the driver)."""
    try:
        return get_worker()
    except ValueError:
        return None


def match_threads() -> int:
    """Give torch as many intra-op threads as this worker runs tasks on; returns that number."""
    import torch  # here, not above: see the module's docstring

    worker = this_worker()
    if worker is None:
        return torch.get_num_threads()
    n = worker.state.nthreads
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def where() -> str:
    """Where this runs, for messages: ``"worker <address>"``, or ``"the driver"`` outside a worker."""
    worker = this_worker()
    return "the driver" if worker is None else f"worker {worker.address}"
