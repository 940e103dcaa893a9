"""Loss functions by name, with DL4J's label masks: masked examples, time steps and outputs do not count."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dlscale.data.dataset import DataShapeError
from dlscale.registry import Registry, UnknownNameError

LossFn = Callable[..., torch.Tensor]

_BOUNDS: dict[int, tuple[weakref.ref, int, int, int]] = {}
"""``id(labels)``: a weak reference to them, their version, their smallest and largest value."""


def _bounds(labels: torch.Tensor) -> tuple[int, int]:
    """The smallest and largest of integer labels on the CPU (not empty), read once for each tensor and
    version: a minibatch kept for a fit's later epochs is read at its first step only (reading it took
    a tenth of a small model's step, more than its numpy calls alone, on the host beside the step)."""
    key = id(labels)
    known = _BOUNDS.get(key)
    if known is not None and known[0]() is labels and known[1] == labels._version:
        return known[2], known[3]
    a = labels.numpy()  # host memory, by numpy: nothing dispatched to the network's device
    low, high = int(a.min()), int(a.max())
    _BOUNDS[key] = (weakref.ref(labels, functools.partial(_forget, key)), labels._version, low, high)
    return low, high


def _forget(key: int, ref: weakref.ref) -> None:
    known = _BOUNDS.get(key)
    if known is not None and known[0] is ref:  # not a newer tensor's entry under a reused id
        _BOUNDS.pop(key, None)


def _class_loss(fn: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def per_step(output: torch.Tensor, labels: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        if output.dim() == 3:  # [N, T, C] sequences: torch wants classes in dimension 1
            output = output.transpose(1, 2)
            labels = labels.transpose(1, 2) if labels.dim() == 3 else labels
        return fn(output, labels, reduction=reduction)

    def mean(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # torch's "mean" leaves labels equal to ignore_index (-100) out of the count, the unreduced
        # values' mean counts them as 0: the same only without such labels, checked where it costs no wait
        if labels.is_floating_point() or (
            labels.device.type == "cpu"
            and (not labels.numel() or _bounds(labels)[0] >= 0 or not bool((labels == -100).any()))
        ):
            return per_step(output, labels, reduction="mean")
        return per_step(output, labels).mean()

    per_step.class_indices = True  # integer labels are class indices (see check_classes)
    per_step.mean = mean
    return per_step


def _elementwise(fn: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def per_step(output: torch.Tensor, labels: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        if labels.dtype != output.dtype and not labels.is_floating_point():
            labels = labels.to(output.dtype)
        return fn(output, labels, reduction=reduction)

    per_step.mean = functools.partial(per_step, reduction="mean")
    return per_step


REGISTRY: Registry[LossFn] = Registry("loss", Callable)
REGISTRY.register("cross_entropy", _class_loss(F.cross_entropy))
REGISTRY.register("nll", _class_loss(F.nll_loss))
REGISTRY.register("mse", _elementwise(F.mse_loss))
REGISTRY.register("l1", _elementwise(F.l1_loss))
REGISTRY.register("smooth_l1", _elementwise(F.smooth_l1_loss))
REGISTRY.register("bce", _elementwise(F.binary_cross_entropy))
REGISTRY.register("bce_with_logits", _elementwise(F.binary_cross_entropy_with_logits))
LOSSES = REGISTRY.view
"""The named losses, read-only: ``loss(output, labels)`` gives the loss of every element, unreduced (add
one with :func:`dlscale.registry.register`). A loss with a ``mean`` attribute, ``mean(output, labels)``
equal to the mean of its unreduced values, is reduced by it where nothing is masked: torch's own
reduction is one kernel forward and backward where the mean of the unreduced values is three."""


def check_classes(name: str, outputs: list[torch.Tensor], labels: list[torch.Tensor]) -> None:
    """Refuse class indices outside ``[0, classes)`` (torch's ``ignore_index`` -100 aside) for loss ``name``,
    checking the labels where they are on the CPU: on a GPU, torch's kernel meets such a label with a
    device-side assert that leaves the process's CUDA context unusable for anything after it."""
    if not getattr(REGISTRY.lookup(name), "class_indices", False):
        return
    for out, y in zip(outputs, labels):
        if y.is_floating_point() or y.device.type != "cpu" or y.numel() == 0 or out.dim() < 2:
            continue  # class probabilities, or labels already on the device (checking there would wait for it)
        classes = out.shape[-1] if out.dim() <= 3 else out.shape[1]  # [N, C], [N, T, C]; torch's [N, C, ...]
        low, high = _bounds(y)
        if 0 <= low and high < classes:
            continue
        a = y.numpy()
        wrong = ((a < 0) & (a != -100)) | (a >= classes)
        if wrong.any():
            raise DataShapeError(
                f"labels of shape {tuple(y.shape)} ({y.dtype}) do not fit loss {name!r} for outputs of shape "
                f"{tuple(out.shape)} ({out.dtype}): class {int(a[wrong][0])} is outside 0..{classes - 1}"
            )


def _unreduced(name: str, output: torch.Tensor, labels: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """Loss ``name`` per example, step and output (``mean``: their mean); labels that do not fit it are
    reported as such."""
    fn = REGISTRY.lookup(name)
    try:
        if mean:
            reduced = getattr(fn, "mean", None)
            return reduced(output, labels) if reduced is not None else fn(output, labels).mean()
        return fn(output, labels)
    except (RuntimeError, ValueError, IndexError) as e:
        raise DataShapeError(
            f"labels of shape {tuple(labels.shape)} ({labels.dtype}) do not fit loss {name!r} for outputs of "
            f"shape {tuple(output.shape)} ({output.dtype}): {e}"
        ) from e


def _masked(name: str, per: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss ``name``'s unreduced values ``per`` averaged down to one value per entry of ``mask``
    (``[examples]``, ``[examples, time]`` or ``[examples, outputs]``), and the mask in their dtype."""
    if per.shape[: mask.dim()] != mask.shape:
        if mask.dim() == 2 and per.dim() < 2:
            raise DataShapeError(
                f"labels_mask of shape {tuple(mask.shape)} masks single outputs, but loss {name!r} gives one "
                f"value per example (shape {tuple(per.shape)}): mask whole examples with a labels mask of shape "
                "[examples], or use a loss computed per output (mse, l1, smooth_l1, bce, bce_with_logits)"
            )
        raise DataShapeError(
            f"labels_mask of shape {tuple(mask.shape)} does not fit loss {name!r}, whose values have shape "
            f"{tuple(per.shape)}; a labels mask is [examples], [examples, time] or [examples, outputs]"
        )
    return per.reshape(*mask.shape, -1).mean(dim=-1), mask.to(per.dtype)


def named_loss(name: str, output: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of loss ``name`` over examples (and time steps or outputs), leaving out what ``mask``
    masks: whole examples (``[examples]``), time steps (``[examples, time]``) or single outputs
    (``[examples, outputs]``, DL4J's per-output masking)."""
    if mask is None:
        return _unreduced(name, output, labels, mean=True)
    per, mask = _masked(name, _unreduced(name, output, labels), mask)
    return (per * mask).sum() / mask.sum().clamp_min(1)


def resolve(loss: str | LossFn) -> str | LossFn:
    """A registered loss name (or one an installed plug-in offers), or a callable
    ``loss(outputs, labels) -> scalar``; anything else is refused."""
    if isinstance(loss, str):
        try:
            REGISTRY.lookup(loss)
        except UnknownNameError as e:
            raise UnknownNameError(f"{e}; or pass a callable loss(outputs, labels)") from None
        return loss
    if callable(loss):
        return loss
    raise TypeError(f"loss must be a name or a callable, not {type(loss).__name__}")


def compute(
    loss: str | LossFn,
    outputs: list[torch.Tensor],
    labels: list[torch.Tensor],
    masks: list[torch.Tensor | None],
    single: bool,
) -> torch.Tensor:
    """The training objective: a named loss summed over output/label pairs, or the user's callable."""
    if not isinstance(loss, str):
        return loss(outputs[0], labels[0]) if single else loss(outputs, labels)
    if len(outputs) != len(labels):
        raise DataShapeError(f"the network gives {len(outputs)} outputs for {len(labels)} label arrays")
    total = named_loss(loss, outputs[0], labels[0], masks[0])
    for out, y, m in zip(outputs[1:], labels[1:], masks[1:]):
        total = total + named_loss(loss, out, y, m)
    return total


def _per_example_named(
    name: str, output: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    per = _unreduced(name, output, labels)
    if mask is None:
        return per.reshape(per.shape[0], -1).mean(dim=1)
    per, mask = _masked(name, per, mask)
    per, mask = per.reshape(per.shape[0], -1), mask.reshape(mask.shape[0], -1)
    return (per * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1)


def per_example(
    loss: str | LossFn,
    outputs: list[torch.Tensor],
    labels: list[torch.Tensor],
    masks: list[torch.Tensor | None],
    single: bool,
) -> torch.Tensor:
    """The loss of each example: for a named loss, its mean over the example's outputs and unmasked
    time steps, summed over output/label pairs (their mean over examples is :func:`compute` when
    nothing is masked); a callable loss is applied to one example at a time."""
    n = outputs[0].shape[0]
    if not isinstance(loss, str):
        pick = (lambda ts, i: ts[0][i : i + 1]) if single else (lambda ts, i: [t[i : i + 1] for t in ts])
        return (
            torch.stack(
                [
                    torch.as_tensor(loss(pick(outputs, i), pick(labels, i)), dtype=torch.float32).reshape(())
                    for i in range(n)
                ]
            )
            if n
            else torch.zeros(0)
        )
    if len(outputs) != len(labels):
        raise DataShapeError(f"the network gives {len(outputs)} outputs for {len(labels)} label arrays")
    total = torch.zeros(n, dtype=outputs[0].dtype, device=outputs[0].device)
    for out, y, m in zip(outputs, labels, masks):
        total = total + _per_example_named(loss, out, y, m)
    return total
