"""Kernel launches and host reads of a gradient-sharing trainer's step, with each compressor, counted on
the CPU: what the step would cost an accelerator besides its fit.

Run from the repository root with ``python -m benchmarks.step_ops`` (well under a minute). On a GPU a
step costs the kernels it launches and the times the host waits for the device, not the bytes it
moves; both can be counted without a GPU by watching what PyTorch dispatches (:class:`OpCount`). One
process, one thread and no cluster take the steps of two models, each from the same synthetic data
(``benchmarks._common.make_data``, minibatches of 64, SGD lr 0.01 momentum 0.9):

- ``mlp``: compare's MLP 784-2048-2048-10 (6 parameter tensors);
- ``cnn``: six blocks of a 3x3 convolution and a BatchNorm2d on the examples as 1x28x28 images, then a
  linear layer (26 parameter tensors, :func:`cnn`).

Rows, each counted over ``STEPS`` steps after ``WARMUP`` uncounted ones (past ``"topk"``'s density
warm-up), as means per step:

- ``plain``: a plain PyTorch step (zero_grad, forward, loss, backward, ``optimizer.step``), the
  baseline;
- ``network.step``: ``dlscale.nn.Network.step``, which leaves the loss unread;
- ``topk``, ``dl4j``, ``dense``: a summing trainer's step with that compressor, as the trainer takes it
  (``_Trainer._train``), from the trainer's own parts (``dlscale.training.sharing._keeping``) with a
  live peer and momentum masking: ``apply`` (a peer's message read with ``from_bytes`` and
  received; the peer's message is this trainer's previous one, so that it is of the real size),
  ``fit`` (``Keeping.fit``), ``encode`` (``Keeping.encode`` and the compressor's ``stage``) and
  ``send`` (``to_bytes``);
- ``topk kernels=device``: the same with ``TopKCompressor(kernels="device")``, whose accelerator
  kernels run on the CPU's tensors: the ops a GPU would launch (skipped, with a note, where the
  compressor has no such option).

Each row gives its ops a step (every aten op dispatched, views included), those that are not views,
those on data that a GPU would hold (``device_ops``), its host reads a step, those of data a GPU
would hold (``device_reads``: the ones that wait for it), the lines that make the reads, each phase's
figures, and for the trainers ``ops_beyond_plain`` and ``device_ops_beyond_plain`` (ops, and ops on
the device's data, less the plain step's); the ``topk`` rows also give their ten most frequent ops.
Targets: ``"topk"`` in steady state at most 1 host read a step and at most 60 ops beyond the plain
step, on both models (``targets_met``: ``met`` counting every op and read, host memory's included;
``met_on_the_device`` counting the launches and waits of a GPU, ops and reads of the device's data;
the ``topk kernels=device`` rows stand for an accelerator, the ``topk`` rows for the CPU, where the
host's kernels work in host memory by design). The results (``benchmarks/results/step_ops.json``)
name the commit they were counted on and the files of ``dlscale/`` that differed from it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from benchmarks._common import (
    BATCH,
    SGD,
    command_line,
    header,
    make_data,
    mlp,
    parse,
    shrink,
    write_results,
)
from dlscale.data import DataSet
from dlscale.encoding import Compressor, Layout, compressor
from dlscale.nn import Network
from dlscale.training.sharing._keeping import keeping

RESULTS = Path(__file__).resolve().parent / "results" / "step_ops.json"
COMPRESSORS = ("topk", "dl4j", "dense")
DEVICE_KERNELS = "topk kernels=device"
ROW_HELP = {
    "plain": "a plain PyTorch step (zero_grad, forward, loss, backward, optimizer.step): the baseline",
    "network.step": "dlscale.nn.Network.step, which leaves the loss unread",
    "topk": "a summing trainer's step with top-k (apply, fit, encode, send), live peer, masking",
    "dl4j": "the same with Deeplearning4j's threshold encoding",
    "dense": "the same with every value sent, uncompressed",
    DEVICE_KERNELS: 'the same with TopKCompressor(kernels="device"): the ops a GPU would launch',
}
"""A line on each row (:func:`_rows`), for ``--help``."""
WARMUP = 25  # "topk" warms its density up over 20 steps
STEPS = 5
PHASES = ("apply", "fit", "encode", "send")
TOP = 10  # the most frequent ops listed for the "topk" rows
TARGETS = {"host_reads": 1, "ops_beyond_plain": 60}  # "topk" in steady state, at most, on both models

aten = torch.ops.aten

# Tensor methods that hand a value to the host. On a GPU each is a copy the host waits for; on the CPU
# some dispatch nothing (tolist, numpy), so they are counted where they are called.
READS = {
    getattr(torch.Tensor, name)
    for name in (
        "item",
        "tolist",
        "numpy",
        "__array__",
        "__float__",
        "__int__",
        "__bool__",
        "__index__",
        "__complex__",
        "__format__",
    )
}
# Ops whose result's shape (or value on the host) depends on the data: on a GPU the host waits for
# the device to know it.
DATA_DEPENDENT = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.bincount.default,
}
REPEAT_INTERLEAVE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
# Not views by their schema, yet only a new look at the same memory.
VIEWS = {aten._unsafe_view.default, aten._reshape_alias.default, aten.lift_fresh.default}
_TORCH = str(Path(torch.__file__).parent) + os.sep


def _syncs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether dispatching ``func`` on a GPU makes the host wait for the device."""
    if func in DATA_DEPENDENT:
        return True
    if func in REPEAT_INTERLEAVE:
        return kwargs.get("output_size") is None
    if func in MASK_INDEXED:  # a boolean mask is turned into indices first: a nonzero
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return False


def _site() -> str:
    """The line that made the read: the innermost frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = Path(frame.f_code.co_filename)
    with contextlib.suppress(ValueError):
        path = path.relative_to(Path.cwd())
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


@dataclass
class Tally:
    """What one phase dispatched and read (see :class:`OpCount`)."""

    ops: collections.Counter[str] = field(default_factory=collections.Counter)  # by op
    non_view: int = 0
    device_ops: int = 0  # ops on data that lives on the device
    reads: collections.Counter[str] = field(default_factory=collections.Counter)  # by kind
    device_reads: int = 0  # reads of data that lives on the device
    sites: collections.Counter[str] = field(default_factory=collections.Counter)  # reads by the line making them

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def host_reads(self) -> int:
        return sum(self.reads.values())


class OpCount:
    """Counts, while the block runs, what its PyTorch code would cost an accelerator: kernel launches
    and host reads, in one thread. ``with count.phase(name)`` counts a part of the block apart
    (``count.phases[name]``, a :class:`Tally`, added to each time); ``phase(None)`` counts nothing.
    The block starts in phase ``phase``.

    - **Ops**: every aten op dispatched (a ``TorchDispatchMode`` sees each one as it reaches the
      kernels, after autograd: a backward's ops too, an op's own inner calls not), about one kernel
      launch each on a GPU. Views (``slice``, ``view``, ``detach``, ``as_strided``... by their
      schema) launch nothing but cost the host as much to dispatch, so they are counted among the
      ops and apart (``non_view``). Allocations (``empty``) count as ops too.
    - **Host reads**: each time the host takes a value of a tensor. A ``TorchFunctionMode`` sees
      the tensor methods that hand a value to the host (:data:`READS`: ``item``, ``tolist``,
      ``numpy``, ``float(t)``, ``int(t)``, ``bool(t)``, ``f"{t}"``...), some of which dispatch nothing
      on the CPU; below them, the dispatch sees ops whose result depends on the data
      (``_local_scalar_dense``, ``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave``
      without ``output_size``, indexing by a boolean mask...): on a GPU each one waits for the
      device. Each event counts once: a ``_local_scalar_dense`` inside a read already counted is
      not counted again.
    - **On the device**: on an accelerator some tensors stay on the host (a minibatch before it is
      moved, a message read from its bytes), and their ops and reads neither launch kernels nor wait
      for the device. The count follows where each tensor would live: a tensor made by an op from
      a tensor on the device, by a factory (``zeros``, ``empty``: the optimizer's and compressor's
      states, made inside the block) or by a call that names a device (``t.to(device)``,
      ``torch.tensor(..., device=device)``) is on the device, and so is every ``nn.Parameter``; one
      made outside the block's ops (the data, ``torch.from_numpy``; :meth:`place` says otherwise) or
      only from such tensors is on the host. ``device_ops`` and ``device_reads`` count those that
      touch the device. So that the state a step uses is known, enter the count before making it.

    Not seen: work done outside torch (NumPy on a tensor's memory), and copies made with ``.to()``
    or ``.cpu()`` (on the CPU they dispatch nothing: ``t.cpu().numpy()`` is one read, as on a GPU).
    """

    def __init__(self, phase: str | None = "block") -> None:
        self.phases: dict[str, Tally] = {}
        self._tally = None if phase is None else self.phases.setdefault(phase, Tally())
        self._device: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> whether it lives on the device
        self._reading = 0  # inside a read counted at the function level
        self._modes: list[Any] = []

    @contextlib.contextmanager
    def phase(self, name: str | None) -> Iterator[Tally | None]:
        """Count the block in phase ``name`` (``None``: not at all)."""
        outer, self._tally = self._tally, None if name is None else self.phases.setdefault(name, Tally())
        try:
            yield self._tally
        finally:
            self._tally = outer

    def whole(self) -> Tally:
        """Every phase's counts together."""
        whole = Tally()
        for t in self.phases.values():
            whole.ops.update(t.ops)
            whole.reads.update(t.reads)
            whole.sites.update(t.sites)
            whole.non_view += t.non_view
            whole.device_ops += t.device_ops
            whole.device_reads += t.device_reads
        return whole

    def place(self, *tensors: torch.Tensor) -> None:
        """Count ``tensors``, made outside the block, as on the device (a minibatch's features, which a
        step moves there and reads nowhere else)."""
        for t in tensors:
            self._device[t] = True

    def _moved(self, args: Any, out: Any) -> Any:
        """``out``, the result of a call that named a device: on the device. On the CPU, ``t.to(device)``
        is ``t`` itself, which may be on the host: the result is then a view of ``t`` of its own."""
        inputs = {id(t) for t in _tensors(args)}
        tally, self._tally = self._tally, None  # the view made here is not the code's: not counted
        try:
            results = [
                aten.alias.default(t) if id(t) in inputs and not t.requires_grad and not self._on_device([t]) else t
                for t in pytree.tree_leaves(out)
            ]
        finally:
            self._tally = tally
        for t in _tensors(results):
            if id(t) not in inputs or not t.requires_grad:
                self._device[t] = True
        return pytree.tree_unflatten(results, pytree.tree_structure(out))

    def _on_device(self, values: Any) -> bool:
        return any(self._device.get(t, isinstance(t, torch.nn.Parameter)) for t in _tensors(values))

    def _read(self, kind: str, device: bool) -> None:
        tally = self._tally
        if tally is not None:
            tally.reads[kind] += 1
            tally.device_reads += device
            tally.sites[_site() + ("" if device else " [host data]")] += 1

    def __enter__(self) -> OpCount:
        count = self

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if func not in READS:
                    out = func(*args, **kwargs)
                    moved = kwargs.get("device") is not None
                    if func is torch.Tensor.to:
                        moved = torch._C._nn._parse_to(*args[1:], **kwargs)[0] is not None
                    return count._moved(args, out) if moved else out
                count._read(func.__name__, count._on_device(args[:1]))
                count._reading += 1
                try:
                    return func(*args, **kwargs)
                finally:
                    count._reading -= 1

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                inputs = list(_tensors((args, kwargs)))
                device = not inputs or count._on_device(inputs)  # a factory makes its tensor on the device
                out = func(*args, **kwargs)
                written = {id(t) for t in inputs}  # an op's output that is an input keeps its place
                for t in _tensors(out):
                    if id(t) not in written:
                        count._device[t] = device
                tally = count._tally
                if tally is not None and func.namespace != "profiler":  # record_function's marks: no kernels
                    tally.ops[str(func)] += 1
                    tally.non_view += not (func.is_view or func in VIEWS)
                    tally.device_ops += device
                    if _syncs(func, args, kwargs) and not (count._reading and func is aten._local_scalar_dense.default):
                        count._read(str(func), device)
                return out

        self._modes = [Functions(), Ops()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    return (v for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor))


def cnn(seed: int = 0, channels: int = 16) -> torch.nn.Module:
    """Six blocks of a 3x3 convolution (weight, bias), a BatchNorm2d (weight, bias) and a ReLU on the
    examples as 1x28x28 images, every other block halving the image, then a linear layer to the ten
    classes: 26 parameter tensors."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Unflatten(1, (1, 28, 28))]
    width = 1
    for block in range(6):
        layers += [
            torch.nn.Conv2d(width, channels, 3, stride=1 + block % 2, padding=1),
            torch.nn.BatchNorm2d(channels),
            torch.nn.ReLU(),
        ]
        width = channels
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(channels, 10)]
    return torch.nn.Sequential(*layers)


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"mlp": mlp, "cnn": cnn}


def _batches() -> list[DataSet]:
    x, y, _, _ = make_data()
    whole = len(x) // BATCH
    return [DataSet(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(min(whole, 64))]


Step = Callable[[DataSet, Callable[[str], contextlib.AbstractContextManager[Any]]], None]
"""One step on a minibatch, each phase of it in ``phase(name)``."""
Row = tuple[Step, torch.nn.Module]
"""A row's step and the module it trains."""


def _figures(t: Tally) -> dict[str, float]:
    return {
        "ops": t.total / STEPS,
        "non_view_ops": t.non_view / STEPS,
        "host_reads": t.host_reads / STEPS,
        "device_ops": t.device_ops / STEPS,
        "device_reads": t.device_reads / STEPS,
    }


def _count(build: Callable[[], Row], batches: list[DataSet]) -> dict[str, Any]:
    """Build a row's step and take :data:`WARMUP` uncounted steps, then :data:`STEPS` counted ones,
    all inside one :class:`OpCount` (which so sees the state made); the means a step. Where a step
    runs on a GPU, its module's parameters and buffers and the minibatch's features are there."""
    with OpCount(phase=None) as count:
        step, module = build()
        count.place(*module.parameters(), *module.buffers())  # where a GPU's module has them all
        for i in range(WARMUP + STEPS):
            batch = batches[i % len(batches)]
            count.place(batch.features)
            step(batch, count.phase if i >= WARMUP else lambda _: count.phase(None))
    whole = count.whole()
    return {
        **_figures(whole),
        "reads_by_kind": {kind: n / STEPS for kind, n in sorted(whole.reads.items())},
        "reads_by_site": {site: n / STEPS for site, n in whole.sites.most_common()},
        "phases": {phase: _figures(count.phases[phase]) for phase in PHASES if phase in count.phases},
        "top_ops": [[name, n / STEPS] for name, n in whole.ops.most_common(TOP)],
    }


def plain(model: str) -> Row:
    """Compare's single process: a plain PyTorch step."""
    module = MODELS[model]()
    optimizer = SGD(module.parameters())

    def step(batch: DataSet, phase: Callable[[str], Any]) -> None:
        with phase("fit"):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(module(batch.features), batch.labels).backward()
            optimizer.step()

    return step, module


def network_step(model: str) -> Row:
    """``Network.step``: a dlscale step whose loss stays unread."""
    net = Network(MODELS[model](), "cross_entropy", SGD)

    def step(batch: DataSet, phase: Callable[[str], Any]) -> None:
        with phase("fit"):
            net.step(batch)

    return step, net.module


def trainer(model: str, make: Callable[[], Compressor | None]) -> Row:
    """A summing trainer's step with the compressor ``make()``, a live peer and momentum masking, in
    the trainer's order: the peer's message applied, the fit, the message encoded and staged, its
    bytes."""
    codec = make()
    assert codec is not None
    net = Network(MODELS[model](), "cross_entropy", SGD)
    state = codec.state(Layout.of(net.module.parameters()))
    keep = keeping(net, codec, state, aggregation="sum", momentum_masking=True)
    last: list[bytes] = []  # this trainer's previous message, as the peer's

    def step(batch: DataSet, phase: Callable[[str], Any]) -> None:
        with phase("apply"):
            keep.receive([(codec, codec.from_bytes(payload)) for payload in last])
        with phase("fit"):
            keep.fit(batch, alive=2)
        with phase("encode"):
            message = keep.encode(alive=2)
            staged = None if message is None else codec.stage(message)
        with phase("send"):
            last[:] = [] if staged is None else [codec.to_bytes(staged)]

    return step, net.module


def device_kernels() -> Compressor | None:
    """``TopKCompressor(kernels="device")``: the accelerator's kernels on the CPU's tensors; ``None``
    where the compressor has no such option."""
    from dlscale.encoding import TopKCompressor

    try:
        return TopKCompressor(kernels="device")
    except TypeError:
        return None


def _rows(model: str) -> list[tuple[str, Callable[[], Row]]]:
    """The rows of ``model``: their names and the builders of their steps."""
    rows = [("plain", functools.partial(plain, model)), ("network.step", functools.partial(network_step, model))]
    rows += [(name, functools.partial(trainer, model, functools.partial(compressor, name))) for name in COMPRESSORS]
    if device_kernels() is None:
        print(f'{model:5s} {DEVICE_KERNELS:21s} skipped: TopKCompressor takes no kernels="device" here', flush=True)
    else:
        rows.append((DEVICE_KERNELS, functools.partial(trainer, model, device_kernels)))
    return rows


def _targets(r: dict[str, Any]) -> dict[str, Any]:
    """Whether a ``"topk"`` row meets the targets: counting every op and host read, and counting those on
    data a GPU would hold only (its launches and its waits: the ops and reads of host memory, such as a
    message's bytes, launch nothing and wait for nothing)."""
    limit, reads = TARGETS["ops_beyond_plain"], TARGETS["host_reads"]
    return {
        "host_reads": r["host_reads"],
        "device_reads": r["device_reads"],
        "ops_beyond_plain": r["ops_beyond_plain"],
        "device_ops_beyond_plain": r["device_ops_beyond_plain"],
        "met": r["ops_beyond_plain"] <= limit and r["host_reads"] <= reads,
        "met_on_the_device": r["device_ops_beyond_plain"] <= limit and r["device_reads"] <= reads,
    }


def _code() -> dict[str, Any]:
    """The commit the figures are from, and the files of ``dlscale/`` that differ from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True, timeout=30)
        except OSError:
            return None
        return done.stdout.rstrip("\n") if done.returncode == 0 else None

    changed = git("status", "--porcelain", "--", "dlscale")
    return {"commit": git("rev-parse", "HEAD"), "changed": [line[3:] for line in (changed or "").splitlines()]}


def main(argv: list[str] | None = None) -> None:
    title = f"rows (models: {', '.join(MODELS)})"
    args = parse(command_line(__doc__.splitlines()[0], cases=ROW_HELP, title=title), argv, RESULTS)
    if args.smoke:
        shrink(globals(), WARMUP=2, STEPS=2)
    torch.set_num_threads(1)
    batches = _batches()
    models = {name: make() for name, make in MODELS.items()}
    report: dict[str, Any] = {
        **header("step_ops"),
        "code": _code(),
        "setup": {
            "models": {
                name: {"tensors": len(list(m.parameters())), "parameters": sum(p.numel() for p in m.parameters())}
                for name, m in models.items()
            },
            "batch": BATCH,
            "optimizer": "SGD lr 0.01 momentum 0.9",
            "threads": 1,
            "warmup_steps": WARMUP,
            "counted_steps": STEPS,
            "aggregation": "sum",
            "momentum_masking": True,
            "live_trainers": 2,
        },
        "targets": {
            "topk host_reads a step": f"<= {TARGETS['host_reads']}",
            "topk ops_beyond_plain": f"<= {TARGETS['ops_beyond_plain']}",
        },
        "runs": [],
    }
    print(
        f"{'model':5s} {'run':21s} {'ops':>5s} {'non-view':>8s} {'device':>6s} {'beyond':>6s} {'reads':>5s} "
        f"{'device':>6s}  phases: ops/reads"
    )
    for model in MODELS:
        base = None
        for name, build in _rows(model):
            r = {"model": model, "run": name, **_count(build, batches)}
            if name == "plain":
                base = r["ops"]  # all on the device
            else:
                r["ops_beyond_plain"] = r["ops"] - base
                r["device_ops_beyond_plain"] = r["device_ops"] - base
            if not name.startswith("topk"):
                del r["top_ops"]
            report["runs"].append(r)
            beyond = f"{r['ops_beyond_plain']:6.1f}" if "ops_beyond_plain" in r else " " * 6
            phases = " ".join(f"{p} {v['ops']:g}/{v['host_reads']:g}" for p, v in r["phases"].items())
            print(
                f"{model:5s} {name:21s} {r['ops']:5.1f} {r['non_view_ops']:8.1f} {r['device_ops']:6.1f} {beyond} "
                f"{r['host_reads']:5.1f} {r['device_reads']:6.1f}  {phases}",
                flush=True,
            )
    print(
        "(a step's ops: all, not views, on data on the device, beyond the plain step's; its host reads: all, "
        "of data on the device)"
    )
    report["targets_met"] = {f"{r['model']} {r['run']}": _targets(r) for r in report["runs"] if "top_ops" in r}
    for r in report["runs"]:
        if "top_ops" in r:
            top = ", ".join(f"{n.removeprefix('aten.')} {c:g}" for n, c in r["top_ops"])
            print(f"{r['model']} {r['run']}, most frequent ops a step: {top}")
            for site, n in r["reads_by_site"].items():
                print(f"    {n:g} read(s) a step at {site}")
    write_results(args.out, report, indent=1)


if __name__ == "__main__":
    main()
