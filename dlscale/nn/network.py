"""``Network``: a PyTorch module with its loss and optimizer, its parameters in one flat buffer.

Every parameter is a view into one contiguous vector, as DL4J keeps a network's parameters in one
flattened array: averaging parameters, sending them and encoding updates work on that one vector
without copying per layer. Gradients are torch's own, cleared (set to ``None``) before each step,
so that backward writes them without a zeroing and an accumulating pass over the whole network.

A network computes on its :attr:`~Network.device` but takes and returns CPU tensors, and pickles as
CPU tensors: a driver without a GPU can send it to GPU workers and read what they send back.

A network's state may be *arriving* (:meth:`Network.arriving`): a fit on the cluster leaves its
trained state on the workers, on its way to the driver, and the network takes it when first read
(its module, parameters or optimizer), so that a loop of fits that reads nothing between them does
not wait for the state at every fit's end.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from dlscale.data.dataset import DataSet, MultiDataSet
from dlscale.nn import losses
from dlscale.nn.listeners import TrainingListener

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
Minibatch = DataSet | MultiDataSet


def cpu_copy(value: Any) -> Any:
    """A (nested) state such as an optimizer's ``state_dict`` with every tensor copied to the CPU,
    so that it shares no storage with the original and crosses the network as CPU tensors."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [cpu_copy(v) for v in value]
    return value


def _consecutive_parts(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are, in order, the consecutive parts of ``flat``'s memory."""
    at = flat.data_ptr()
    for t in tensors:
        if t.data_ptr() != at or not t.is_contiguous():
            return False
        at += t.numel() * t.element_size()
    return True


def _as_list(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


class ArrivingState(Protocol):
    """A state on its way to a network (:meth:`Network.arriving`), from where it is held (the workers)."""

    def __call__(self, network: Network) -> None:
        """Set the state on ``network`` (it is being read)."""

    def ship(self, client: Any) -> Any | None:
        """The network with this state, without its optimizer, pickled and held on the workers (a
        future, as :func:`dlscale.nn.shipping.ship` returns) from where the state is, without the
        driver; ``None`` where that cannot be: the driver then takes the state and sends it."""


_SETTLING = threading.RLock()  # an arriving state is set on one network at a time, by one thread


def _settled(name: str) -> property:
    """An attribute kept in the instance's ``__dict__`` under ``name`` (so that pickling sees it as
    any other), read only once an arriving state has been taken (:meth:`Network.arriving`)."""

    def get(self: Network) -> Any:
        if "_arriving" in self.__dict__:
            self.settle()
        return self.__dict__[name]

    def set(self: Network, value: Any) -> None:
        self.__dict__[name] = value

    return property(get, set)


class Network:
    """A module, its loss (a name from :data:`dlscale.nn.losses.LOSSES` or a callable
    ``loss(outputs, labels)``) and an optimizer factory such as
    ``functools.partial(torch.optim.SGD, lr=0.1)`` (``None`` for a network that only infers)."""

    module = _settled("module")
    optimizer = _settled("optimizer")
    _flat = _settled("_flat")

    def __init__(
        self,
        module: torch.nn.Module,
        loss: str | losses.LossFn,
        optimizer: OptimizerFactory | None = None,
        *,
        listeners: Sequence[TrainingListener] = (),
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, not {type(module).__name__}")
        self.module = module
        self.loss = losses.resolve(loss)
        self.optimizer_factory = optimizer
        self.listeners = list(listeners)
        self.iteration = 0
        self.epoch = 0
        self.factory: tuple[str, dict] | None = None  # the registered factory that built the module
        self.metadata: dict[str, Any] = {}  # saved with the archive
        self._flatten()
        self.optimizer = optimizer(self.module.parameters()) if optimizer is not None else None

    # -- an arriving state ------------------------------------------------------------------
    def arriving(self, take: ArrivingState) -> None:
        """Let the state this network is to have arrive later: ``take(self)`` sets it (parameters, buffers
        and optimizer state) when the network is first read, and any state that was arriving is
        dropped (``take`` supersedes it). The counters (:attr:`iteration`, :attr:`epoch`) are not part
        of it."""
        self.__dict__["_arriving"] = take

    def pending(self) -> ArrivingState | None:
        """The arriving state, if the network has not been read since it was set."""
        return self.__dict__.get("_arriving")

    def settle(self) -> None:
        """Take the arriving state now, if one is (reading the network does it). Another thread that
        reads the network meanwhile waits until the state is whole."""
        with _SETTLING:
            take = self.__dict__.get("_arriving")
            if take is None or self.__dict__.get("_settling"):  # none, or this thread is setting it
                return
            self.__dict__["_settling"] = True
            try:
                take(self)
            finally:
                del self.__dict__["_settling"]
                if self.__dict__.get("_arriving") is take:
                    del self.__dict__["_arriving"]

    # -- the flat buffer -------------------------------------------------------------------
    def _flatten(self) -> None:
        params = list(self.module.parameters())
        if not params:
            raise ValueError(f"{type(self.module).__name__} has no parameters to train")
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(f"all parameters must share one dtype and device to live in one buffer, found {kinds}")
        self._flat = torch.cat([p.detach().reshape(-1) for p in params])
        self._flat_states: dict[str, torch.Tensor] = {}  # see flat_optimizer_state
        self._params = params  # a step's own walks: its gradients dropped, its modules in training mode
        self._modules = list(self.module.modules())
        offset = 0
        for p in params:
            n = p.numel()
            p.data = self._flat[offset : offset + n].view_as(p)
            p.grad = None
            offset += n

    @property
    def device(self) -> torch.device:
        """Where the parameters live and the module computes."""
        return self._flat.device

    def to(self, device: torch.device | str) -> Network:
        """Move the module, its flat buffers and the optimizer's state to ``device``; returns ``self``."""
        device = torch.device(device)
        if device == self._flat.device:
            return self
        state = self.optimizer.state_dict() if self.optimizer is not None else None
        self.module.to(device)
        self._flatten()
        if state is not None:
            self.optimizer.load_state_dict(state)  # casts the state to its parameters' device
        return self

    def num_params(self) -> int:
        """The number of parameters (the length of :meth:`params`)."""
        return self._flat.numel()

    def params(self) -> torch.Tensor:
        """All parameters as one vector: the live buffer the module computes with."""
        return self._flat

    def set_params(self, vector: torch.Tensor) -> None:
        """Copy ``vector`` into the parameters."""
        if vector.shape != self._flat.shape:
            raise ValueError(f"expected a vector of {self._flat.numel()} parameters, got shape {tuple(vector.shape)}")
        with torch.no_grad():
            self._flat.copy_(vector)

    def gradients(self) -> torch.Tensor:
        """The gradients of the last step, as one vector laid out like :meth:`params` (a copy; zero
        for a parameter that the step gave no gradient)."""
        return torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.module.parameters()]
        )

    def flat_optimizer_state(self, key: str) -> torch.Tensor | None:
        """The optimizer's per-parameter state ``key`` (such as SGD's ``"momentum_buffer"``) as one
        vector laid out as :meth:`params`, the optimizer's own tensors made views of it, so that one op
        changes it for every parameter whatever their number; ``None`` while a parameter has no such
        state (before the first step, or an optimizer that keeps none). The optimizer updates its
        state in place, so the views hold; a state loaded since is laid out again."""
        state = self._require_optimizer().state
        params = list(self.module.parameters())
        tensors = [state[p].get(key) if p in state else None for p in params]
        if not all(isinstance(t, torch.Tensor) and t.shape == p.shape for t, p in zip(tensors, params, strict=True)):
            return None
        flat = self._flat_states.get(key)
        if flat is not None and _consecutive_parts(flat, tensors):
            return flat
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        offset = 0
        for p, t in zip(params, tensors, strict=True):
            state[p][key] = flat[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
        self._flat_states[key] = flat
        return flat

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state (``torch.optim.Optimizer.state_dict``), e.g. momentum buffers."""
        return self._require_optimizer().state_dict()

    def set_optimizer_state(self, state: dict[str, Any]) -> None:
        self._require_optimizer().load_state_dict(state)

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("this network has no optimizer: pass one to train it")
        return self.optimizer

    # -- computing -------------------------------------------------------------------------
    def _call(self, features: list[torch.Tensor], masks: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """The module on ``features``. Where the data has feature masks, the module receives them as
        the keyword argument ``mask`` (a tensor for one input, a list with one entry per input for
        several), as DL4J feeds masks to its layers: padded steps are the module's to ignore."""
        if all(m is None for m in masks):
            return _as_list(self.module(*features))
        return _as_list(self.module(*features, mask=masks[0] if len(masks) == 1 else list(masks)))

    def _forward(self, batch: Minibatch) -> tuple[list[torch.Tensor], list[torch.Tensor], list, bool]:
        if isinstance(batch, DataSet):
            if batch.labels is None:
                raise ValueError("a DataSet without labels cannot be scored or evaluated")
            host, single = [batch.labels], True
        elif isinstance(batch, MultiDataSet):
            host, single = list(batch.labels), False
        else:
            raise TypeError(f"a network fits DataSet or MultiDataSet minibatches, not {type(batch).__name__}")
        batch = batch.to(self._flat.device)
        if single:
            outputs, labels, masks = (
                self._call([batch.features], [batch.features_mask]),
                [batch.labels],
                [batch.labels_mask],
            )
        else:
            outputs, labels, masks = self._call(batch.features, batch.features_masks), batch.labels, batch.labels_masks
        if isinstance(self.loss, str):
            losses.check_classes(self.loss, outputs, host)  # the labels as they came, before any kernel sees them
        return outputs, labels, masks, single

    def step(self, batch: Minibatch) -> torch.Tensor:
        """One optimizer step on ``batch``; returns its loss as a 0-d tensor where the network computes,
        unread: on an accelerator the host goes on queuing work instead of waiting for the step to end
        (:meth:`fit_batch` reads it). Listeners are not called."""
        optimizer = self._require_optimizer()
        if not all(m.training for m in self._modules):
            self.module.train()
        for p in self._params:
            p.grad = None  # backward then writes each gradient afresh (zero_grad(set_to_none=True))
        outputs, labels, masks, single = self._forward(batch)
        loss = losses.compute(self.loss, outputs, labels, masks, single)
        loss.backward()
        optimizer.step()
        self.iteration += 1
        return loss.detach()

    def fit_batch(self, batch: Minibatch) -> float:
        """One optimizer step on ``batch``, then the listeners; returns its loss."""
        score = float(self.step(batch))
        for listener in self.listeners:
            listener.iteration_done(self, self.iteration, self.epoch, score, batch.num_examples())
        return score

    def fit(self, data: Minibatch | Iterable[Minibatch], epochs: int = 1) -> float:
        """Train on a minibatch or on every minibatch of an iterable (re-iterated each epoch); returns the last loss."""
        batches = [data] if isinstance(data, (DataSet, MultiDataSet)) else data
        score = float("nan")
        for _ in range(epochs):
            for batch in batches:
                score = self.fit_batch(batch)
            self.epoch += 1
        return score

    def output(
        self, *features: torch.Tensor, mask: torch.Tensor | list[torch.Tensor | None] | None = None
    ) -> torch.Tensor | list[torch.Tensor]:
        """The network's output for ``features`` (one tensor per input), in evaluation mode; ``mask``
        is passed on to the module (see :meth:`_call`)."""
        masks = mask if isinstance(mask, list) else [mask] * (1 if mask is not None else len(features))
        device = self._flat.device
        self.module.eval()
        with torch.no_grad():
            out = self._call([f.to(device) for f in features], [None if m is None else m.to(device) for m in masks])
        out = [o.cpu() for o in out]
        return out[0] if len(out) == 1 else out

    def _inferred(self, batch: Minibatch) -> tuple[list[torch.Tensor], list[torch.Tensor], list, bool]:
        """:meth:`_forward` in evaluation mode, without gradients."""
        self.module.eval()
        with torch.no_grad():
            return self._forward(batch)

    def score(self, batch: Minibatch) -> float:
        """The loss on ``batch`` in evaluation mode, without training."""
        return float(losses.compute(self.loss, *self._inferred(batch)))

    def evaluate_batch(self, batch: Minibatch) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
        """``(outputs, labels, label masks)`` of ``batch`` in evaluation mode: what evaluations read."""
        outputs, labels, masks, _ = self._inferred(batch)
        return ([o.cpu() for o in outputs], [t.cpu() for t in labels], [None if m is None else m.cpu() for m in masks])

    def score_examples(self, batch: Minibatch, include_regularization: bool = False) -> torch.Tensor:
        """The loss of each example of ``batch`` (see :func:`dlscale.nn.losses.per_example`), plus the
        regularization term when ``include_regularization``; a vector of ``num_examples()``."""
        scores = losses.per_example(self.loss, *self._inferred(batch)).cpu()
        return scores + self.regularization_score() if include_regularization else scores

    def regularization_score(self) -> float:
        """The L2 penalty the optimizer's ``weight_decay`` stands for, ``sum(wd / 2 * |w|^2)`` over its
        parameter groups (DL4J adds its l1/l2 terms to scores the same way); 0 without an optimizer."""
        if self.optimizer is None:
            return 0.0
        total = 0.0
        for group in self.optimizer.param_groups:
            decay = float(group.get("weight_decay", 0.0) or 0.0)
            if decay:
                total += decay / 2 * sum(float(p.detach().pow(2).sum()) for p in group["params"])
        return total

    # -- archives --------------------------------------------------------------------------
    def save(self, url: str, save_updater: bool = True, storage_options: dict[str, Any] | None = None) -> None:
        """Write this network (and its optimizer state when ``save_updater``) to ``url``, atomically."""
        from dlscale.nn import archive  # the archive module builds Networks

        archive.save(self, url, save_updater, storage_options)

    @classmethod
    def load(
        cls,
        url: str,
        module: torch.nn.Module | None = None,
        storage_options: dict[str, Any] | None = None,
        *,
        loss: str | losses.LossFn | None = None,
        optimizer: OptimizerFactory | None = None,
    ) -> Network:
        """Read a network saved with :meth:`save`; see :func:`dlscale.nn.archive.load`."""
        from dlscale.nn import archive

        return archive.load(url, module, storage_options, loss=loss, optimizer=optimizer)

    # -- pickling (networks travel to the workers) ----------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        self.settle()
        state = {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("_flat", "_flat_states", "_params", "_modules", "optimizer")
        }
        optimizer_state = self.optimizer.state_dict() if self.optimizer is not None else None
        # Each parameter is a view of the flat buffer, and pickling a view writes its whole storage:
        # the module travels with CPU parameters of their own (the flat buffer once in all, not once
        # per parameter tensor), and a network travels as CPU tensors.
        own = {
            id(p): torch.nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=p.requires_grad)
            for p in self.module.parameters()
        }
        state["module"] = copy.deepcopy(self.module, own).cpu()
        state["_optimizer_state"] = cpu_copy(optimizer_state)  # its tensors may be views of a flat state
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        optimizer_state = state.pop("_optimizer_state")
        self.__dict__.update(state)
        self._flatten()
        factory = self.optimizer_factory
        self.optimizer = factory(self.module.parameters()) if factory is not None else None
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)
