"""Correct ``dask.sizeof`` for torch tensors.

Dask falls back to ``sys.getsizeof`` for unknown types, which counts a tensor as ~80 bytes
whatever its data: workers would then keep far more in memory than their limit allows (the
same mis-sizing of off-heap arrays that the DL4J guide warns about for Spark). The entry point
``dask.sizeof`` makes every process that imports dask register this. Minibatches register their
size where they are defined (:mod:`dlscale.data.dataset`), so that sizing any other dlscale object (a
partition's statistics, say) imports nothing: torch's import takes seconds a task would wait for.
"""

from __future__ import annotations

import sys
from typing import Any


def tensor_nbytes(t: Any) -> int:
    """Host bytes held by ``t``: its data for CPU tensors, only the object for device tensors."""
    import torch

    overhead = sys.getsizeof(t)
    if t.device.type not in ("cpu", "meta"):
        return overhead
    if t.layout == torch.sparse_coo:
        return overhead + tensor_nbytes(t._indices()) + tensor_nbytes(t._values())
    if t.layout != torch.strided:
        return overhead + tensor_nbytes(t.values())
    return overhead + t.nelement() * t.element_size()


def register(sizeof: Any) -> None:
    """Register the torch handlers on dask's ``sizeof`` dispatch (lazily: torch may be absent)."""

    @sizeof.register_lazy("torch")
    def _register_torch() -> None:
        import torch

        @sizeof.register(torch.Tensor)
        def _sizeof_tensor(t: torch.Tensor) -> int:
            return tensor_nbytes(t)

        @sizeof.register(torch.nn.Module)
        def _sizeof_module(m: torch.nn.Module) -> int:
            return sys.getsizeof(m) + sum(tensor_nbytes(t) for t in m.state_dict().values())
