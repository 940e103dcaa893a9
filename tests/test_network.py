"""Network (flat parameters, losses, listeners) against plain PyTorch, and the network archive."""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import tracemalloc
import zipfile
from pathlib import Path
from typing import Any

import dask.config
import pytest
import torch
import torch.nn.functional as F

from dlscale import CorruptDataError
from dlscale.data import DataSet, DataShapeError, MultiDataSet
from dlscale.nn import (
    Network,
    PerformanceListener,
    ScoreIterationListener,
    build,
    losses,
    model_factory,
)


@model_factory
def mlp(inputs: int = 8, hidden: int = 16, classes: int = 3) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, classes))


class TwoInTwoOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 6), torch.nn.Linear(2, 6)
        self.cls, self.reg = torch.nn.Linear(6, 3), torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x) + self.b(z))
        return self.cls(h), self.reg(h)


def fresh(factory: object, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return factory()


def data(n: int = 64, seed: int = 1) -> DataSet:
    g = torch.Generator().manual_seed(seed)
    return DataSet(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


@pytest.mark.parametrize(
    "optimizer",
    [
        functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        functools.partial(torch.optim.Adam, lr=0.01),
    ],
    ids=["sgd-momentum", "adam"],
)
def test_training_equals_plain_pytorch(optimizer: functools.partial) -> None:
    net = Network(fresh(mlp), "cross_entropy", optimizer)
    ref = fresh(mlp)
    opt = optimizer(ref.parameters())
    for batch in data().batch_by(16) * 2:
        net.fit(batch)
        opt.zero_grad()
        F.cross_entropy(ref(batch.features), batch.labels).backward()
        opt.step()
    assert torch.equal(net.params(), flat(ref))
    assert net.iteration == 8
    # every parameter is a view of the one buffer; the gradients of the last step read as one vector too
    first = net.module[0].weight
    assert first.data_ptr() == net.params().data_ptr()
    assert torch.equal(net.gradients(), torch.cat([p.grad.reshape(-1) for p in ref.parameters()]))


def test_multi_input_multi_output_sums_the_losses() -> None:
    g = torch.Generator().manual_seed(2)
    mds = MultiDataSet(
        [torch.randn(12, 4, generator=g), torch.randn(12, 2, generator=g)],
        [torch.randint(0, 3, (12,), generator=g), torch.randn(12, 1, generator=g)],
    )
    opt = functools.partial(torch.optim.SGD, lr=0.05)
    net = Network(fresh(TwoInTwoOut), "mse", opt)
    with (
        pytest.raises(DataShapeError, match=r"labels of shape \(12,\).*do not fit loss 'mse'.*\(12, 3\)"),
        pytest.warns(UserWarning),
    ):
        net.fit(mds)  # class indices cannot be regressed on the 3 class scores

    def both(outputs: list, labels: list) -> torch.Tensor:
        return F.cross_entropy(outputs[0], labels[0]) + F.mse_loss(outputs[1], labels[1])

    net = Network(fresh(TwoInTwoOut), both, opt)
    ref = fresh(TwoInTwoOut)
    ref_opt = opt(ref.parameters())
    for _ in range(3):
        net.fit(mds)
        ref_opt.zero_grad()
        both(list(ref(*mds.features)), mds.labels).backward()
        ref_opt.step()
    assert torch.equal(net.params(), flat(ref))
    with torch.no_grad():
        assert net.score(mds) == pytest.approx(float(both(list(ref(*mds.features)), mds.labels)))


def test_masked_sequence_loss_ignores_padding() -> None:
    g = torch.Generator().manual_seed(3)
    out = torch.randn(4, 5, 3, generator=g)
    labels = torch.randint(0, 3, (4, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)

    class Fixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    net = Network(Fixed(), "cross_entropy")
    keep = mask.bool()
    expected = F.cross_entropy(out[keep], labels[keep])
    assert net.score(DataSet(out, labels, None, mask)) == pytest.approx(float(expected), rel=1e-6)
    assert net.score(DataSet(out, labels)) == pytest.approx(
        float(F.cross_entropy(out.reshape(-1, 3), labels.reshape(-1)))
    )


@pytest.mark.parametrize("name", ["cross_entropy", "nll", "mse", "l1", "smooth_l1", "bce", "bce_with_logits"])
@pytest.mark.parametrize("shape", [(6, 3), (6, 4, 3)], ids=["examples", "sequences"])
def test_named_losses_reduce_to_the_mean_of_their_unreduced_values(name: str, shape: tuple[int, ...]) -> None:
    """Reduced by torch's own mean, a named loss is the mean of its values over examples and steps, as
    unreduced: labels of ignore_index (-100) count as a loss of 0 (torch's mean would leave them out)."""
    g = torch.Generator().manual_seed(4)
    out = torch.rand(shape, generator=g) * 0.8 + 0.1
    if name in ("cross_entropy", "nll"):
        cases = [torch.randint(0, 3, shape[:-1], generator=g)]
        cases.append(cases[0].clone().index_fill_(0, torch.tensor([1, 4]), -100))
        if name == "cross_entropy":  # class probabilities
            cases.append(torch.softmax(torch.randn(shape, generator=g), dim=-1))
    else:
        cases = [torch.rand(shape, generator=g).round()]
    fn = losses.REGISTRY.lookup(name)
    for labels in cases:
        expected = fn(out, labels).mean()
        assert torch.allclose(losses.named_loss(name, out, labels, None), expected, rtol=1e-6, atol=0)
    if name in ("cross_entropy", "nll"):  # what would go wrong with torch's mean on ignored labels
        assert not torch.allclose(fn.mean(out, cases[1]), fn(out, cases[1], reduction="mean"), rtol=1e-3)


def test_bad_input_is_named() -> None:
    net = Network(fresh(mlp), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(DataShapeError, match=r"labels of shape \(4, 2\).*cross_entropy.*\(4, 3\)"):
        net.fit(DataSet(torch.randn(4, 8), torch.randn(4, 2)))
    with pytest.raises(ValueError, match="unknown loss 'hinge'"):
        Network(fresh(mlp), "hinge")
    with pytest.raises(RuntimeError, match="no optimizer"):
        Network(fresh(mlp), "mse").fit(data(4))
    with pytest.raises(TypeError, match="DataSet or MultiDataSet"):
        net.fit_batch((torch.randn(4, 8), torch.zeros(4)))
    with pytest.raises(ValueError, match="expected a vector of 195"):
        net.set_params(torch.zeros(3))


def test_pickled_network_continues_identically() -> None:
    net = Network(fresh(mlp), "cross_entropy", functools.partial(torch.optim.Adam, lr=0.01))
    batches = data().batch_by(16)
    net.fit(batches[:2])
    copy = pickle.loads(pickle.dumps(net))
    net.fit(batches[2:])
    copy.fit(batches[2:])
    assert torch.equal(copy.params(), net.params())


def test_a_pickled_network_holds_its_parameters_once() -> None:
    """Every parameter is a view of the one flat buffer, and pickling a view writes its whole storage:
    a network of 8 parameter tensors pickled naively is 8 times its parameters (a 5.8M-parameter
    MLP's blob was 155 MiB instead of 44, and took 4 s to ship over 1 Gbit/s)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(4)]
    net = Network(torch.nn.Sequential(*layers), "mse", functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    net.fit_batch(DataSet(torch.randn(8, 256), torch.randn(8, 256)))
    size = 4 * net.num_params()
    blob = pickle.dumps(net)
    assert 2 * size < len(blob) < 2 * size + 64 * 1024  # the parameters once and the momentum once
    copy = pickle.loads(blob)
    assert torch.equal(copy.params(), net.params())
    assert all(
        p.grad is None and p.untyped_storage().data_ptr() == copy.params().data_ptr() for p in copy.module.parameters()
    )
    assert net.module[0].weight.untyped_storage().data_ptr() == net.params().data_ptr()  # the original keeps its views


def test_listeners_see_every_iteration() -> None:
    scores, perf = ScoreIterationListener(frequency=2), PerformanceListener(frequency=2)
    net = Network(fresh(mlp), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1), listeners=[scores, perf])
    got = [net.fit_batch(b) for b in data(80).batch_by(8)]
    assert scores.history == [(i, got[i - 1]) for i in range(2, 11, 2)]
    assert len(perf.history) == 4 and all(h["examples/s"] > 0 for h in perf.history)


# -- archives --------------------------------------------------------------------------------
def trained(optimizer: functools.partial | None = None) -> Network:
    net = build(mlp, {"hidden": 16}, "cross_entropy", optimizer or functools.partial(torch.optim.Adam, lr=0.01))
    net.fit(data().batch_by(16)[:2])
    return net


def test_round_trip_restores_outputs_and_training(tmp_path: Path, s3: dict) -> None:
    for url, options in ((str(tmp_path / "net.dln"), None), ("s3://test-bucket/models/net.dln", s3)):
        net = trained()
        net.save(url, storage_options=options)
        back = Network.load(url, storage_options=options)  # the registered factory rebuilds the module
        x = data(9, seed=5).features
        assert torch.equal(back.output(x), net.output(x))
        assert (back.iteration, back.factory) == (net.iteration, ("tests.test_network:mlp", {"hidden": 16}))
        rest = data().batch_by(16)[2:]
        net.fit(rest)
        back.fit(rest)  # Adam's moments were restored: training continues identically
        assert torch.equal(back.params(), net.params())


def test_without_updater_the_optimizer_starts_fresh(tmp_path: Path) -> None:
    net = trained()
    net.save(str(tmp_path / "n.dln"), save_updater=False)
    back = Network.load(str(tmp_path / "n.dln"), module=fresh(mlp, seed=9))
    assert torch.equal(back.params(), net.params()) and back.optimizer_state()["state"] == {}


def test_custom_parts_must_be_supplied(tmp_path: Path) -> None:
    net = Network(fresh(mlp), lambda out, y: F.cross_entropy(out, y), lambda ps: torch.optim.SGD(ps, lr=0.1))
    net.save(str(tmp_path / "c.dln"))
    with pytest.raises(ValueError, match="records no factory.*module="):
        Network.load(str(tmp_path / "c.dln"))
    with pytest.raises(ValueError, match="custom loss.*loss="):
        Network.load(str(tmp_path / "c.dln"), module=fresh(mlp))
    back = Network.load(str(tmp_path / "c.dln"), module=fresh(mlp), loss="cross_entropy")
    assert torch.equal(back.params(), net.params()) and back.optimizer is None


class RunsCode:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch PWNED_BY_ARCHIVE",))


def test_crafted_and_damaged_archives_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    good = tmp_path / "good.dln"
    trained().save(str(good))
    with zipfile.ZipFile(good) as z:
        header, blob = json.loads(z.read("network.json")), z.read("tensors.bin")

    def archive(name: str, header: dict, blob: bytes) -> str:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:
            z.writestr("network.json", json.dumps(header))
            z.writestr("tensors.bin", blob)
        (tmp_path / name).write_bytes(out.getvalue())
        return str(tmp_path / name)

    evil = archive(
        "evil.dln", {**header, "factory": {"name": "os:system", "kwargs": {"command": "touch PWNED_BY_ARCHIVE"}}}, blob
    )
    with pytest.raises(ValueError, match="'os:system', which is not registered"):
        Network.load(evil)
    (tmp_path / "pickled.dln").write_bytes(pickle.dumps(RunsCode()))
    torch.save({"x": RunsCode()}, str(tmp_path / "torchsave.dln"))
    for name in ("pickled.dln", "torchsave.dln"):
        with pytest.raises(CorruptDataError, match=f"{name}: not a dlscale network archive"):
            Network.load(str(tmp_path / name), module=fresh(mlp))
    assert not (tmp_path / "PWNED_BY_ARCHIVE").exists()
    flipped = bytearray(blob)
    flipped[5] ^= 1
    with pytest.raises(CorruptDataError, match="flipped.dln: tensor data checksum mismatch"):
        Network.load(archive("flipped.dln", header, bytes(flipped)))
    with pytest.raises(CorruptDataError, match="newer.dln: written in archive version 9"):
        Network.load(archive("newer.dln", {**header, "version": 9}, blob))
    with pytest.raises(ValueError, match="holds 195 parameters; the module has"):
        Network.load(str(good), module=mlp(hidden=4))


def test_an_archived_muon_optimizer_is_rebuilt(tmp_path: Path) -> None:
    net = Network(torch.nn.Linear(4, 3, bias=False), "mse", functools.partial(torch.optim.Muon, lr=0.02))
    net.fit(DataSet(torch.randn(8, 4), torch.randn(8, 3)))
    net.save(str(tmp_path / "muon.dln"))
    back = Network.load(str(tmp_path / "muon.dln"), module=torch.nn.Linear(4, 3, bias=False))
    assert isinstance(back.optimizer, torch.optim.Muon) and torch.equal(back.params(), net.params())


def test_an_archived_argument_out_of_range_names_the_archive(tmp_path: Path) -> None:
    good = tmp_path / "good.dln"
    trained().save(str(good))
    with zipfile.ZipFile(good) as z:
        header = json.loads(z.read("network.json"))
    header["optimizer"]["kwargs"]["lr"] = -1.0
    crafted = rezipped(good, "negative.dln", header, zipfile.ZIP_STORED)
    with pytest.raises(ValueError, match="Invalid learning rate") as info:
        Network.load(str(crafted))
    assert info.value.__notes__ == [f"while rebuilding the network archived in {crafted}"]


def rezipped(path: Path, name: str, header: dict | None = None, compress: int = zipfile.ZIP_DEFLATED) -> Path:
    """The archive at ``path`` written again as ``name``, its members compressed with ``compress``
    and its header replaced by ``header`` when given."""
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    if header is not None:
        members["network.json"] = json.dumps(header).encode()
    out = path.parent / name
    with zipfile.ZipFile(out, "w", compress) as z:
        for n, data in members.items():
            z.writestr(n, data)
    return out


def test_compressed_members_inflate_within_the_bound(tmp_path: Path) -> None:
    good = tmp_path / "good.dln"
    net = trained()
    net.metadata = {"padding": "0" * 4_000_000}  # 4 MB of header that deflates to a few kB
    net.save(str(good))
    bomb = rezipped(good, "bomb.dln")
    assert bomb.stat().st_size < 100_000
    back = Network.load(str(bomb))  # within the default bound, a compressed archive loads
    assert torch.equal(back.params(), net.params())
    with dask.config.set({"dlscale.nn.max-inflated-bytes": "1MiB"}):
        tracemalloc.start()
        try:
            with pytest.raises(
                CorruptDataError, match=r"bomb.dln: its compressed members declare \d+ bytes, more than the 1048576"
            ):
                Network.load(str(bomb))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 1_000_000  # refused from the declared sizes, before anything was inflated


def _patch_declared_size(data: bytes, name: bytes, size: int) -> bytes:
    """``data`` (a zip archive) with member ``name``'s uncompressed size set to ``size`` in its local
    and central directory headers: a member that lies about how much it inflates to."""
    out = bytearray(data)
    for signature, field in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        at = out.index(signature + b"")
        while out[at + (30 if signature == b"PK\x03\x04" else 46) :].find(name) != 0:
            at = out.index(signature, at + 4)
        out[at + field : at + field + 4] = size.to_bytes(4, "little")
    return bytes(out)


def test_a_declared_size_lie_is_stopped_during_inflation(tmp_path: Path) -> None:
    good = tmp_path / "good.dln"
    net = trained()
    net.metadata = {"padding": "0" * 20_000_000}  # inflates to 20 MB
    net.save(str(good))
    deflated = rezipped(good, "deflated.dln").read_bytes()
    liar = tmp_path / "liar.dln"
    liar.write_bytes(_patch_declared_size(deflated, b"network.json", 5_000))  # says 5 kB
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDataError, match="liar.dln: .*network.json"):
            Network.load(str(liar))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000  # inflation stopped at the declared 5 kB, far short of the 20 MB it holds


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda h: h.pop("tensors"), "has no 'tensors' field"),
        (lambda h: h.pop("num_params"), "has no 'num_params' field"),
        (lambda h: h.update(num_params="195"), "field 'num_params' is '195', expected an integer"),
        (lambda h: h.update(version=True), "field 'version' is True, expected an integer"),
        (lambda h: h["factory"].pop("name"), "has no 'factory.name' field"),
        (
            lambda h: h.update(factory={"name": "tests.test_network:mlp", "kwargs": [16]}),
            "'factory.kwargs' is \\[16\\]",
        ),
        (lambda h: h["factory"].update(kwargs={"width": 3}), "'factory.kwargs' does not fit factory"),
        (lambda h: h["tensors"][0].pop("offset"), "has no 'tensors\\[0\\].offset' field"),
        (lambda h: h["tensors"].__setitem__(0, "params"), "'tensors\\[0\\]' is 'params', expected an object"),
        (lambda h: h["tensors"][0].update(shape=["195"]), "'tensors\\[0\\].shape' is \\['195'\\], expected a list"),
        (lambda h: h["tensors"][0].update(nbytes=4), "'tensors\\[0\\]' is inconsistent"),
        (lambda h: h.update(tensors=[]), "'tensors' is empty"),
        (lambda h: h["optimizer"].update({"class": "Optimizer"}), "'Optimizer', an abstract optimizer"),
        (lambda h: h["optimizer"].update({"class": "lr_scheduler"}), "unknown optimizer 'lr_scheduler'"),
        (lambda h: h["optimizer"].update(kwargs={"speed": 1}), "'optimizer.kwargs' does not fit torch.optim.Adam"),
        (lambda h: h.update(optimizer_state={"tensor": 99}), "'optimizer_state' does not fit the Adam optimizer"),
        (lambda h: h.update(optimizer_state=[1]), "'optimizer_state' is \\[1\\], expected an object or null"),
        (lambda h: h.update(metadata="x"), "'metadata' is 'x', expected an object"),
    ],
)
def test_crafted_headers_name_the_field(tmp_path: Path, change: Any, message: str) -> None:
    good = tmp_path / "good.dln"
    trained().save(str(good))
    with zipfile.ZipFile(good) as z:
        header = json.loads(z.read("network.json"))
    change(header)
    crafted = rezipped(good, "crafted.dln", header, zipfile.ZIP_STORED)
    with pytest.raises(CorruptDataError, match=f"crafted.dln: .*{message}"):
        Network.load(str(crafted))


def _reference_step(module: torch.nn.Module, loss: torch.Tensor, lr: float) -> torch.Tensor:
    """The parameters after one plain SGD step on ``loss``, computed with torch alone."""
    grads = torch.autograd.grad(loss, list(module.parameters()))
    return torch.cat([(p.detach() - lr * g).reshape(-1) for p, g in zip(module.parameters(), grads)])


def test_a_labels_mask_per_example_leaves_masked_examples_out() -> None:
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(10, 8, generator=g), torch.randint(0, 3, (10,), generator=g)
    keep = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0], dtype=torch.bool)
    batch = DataSet(x, y, None, keep.float())
    reference = fresh(mlp)
    ref_loss = F.cross_entropy(reference(x[keep]), y[keep])  # only the unmasked examples, by hand
    per_example = F.cross_entropy(reference(x), y, reduction="none").detach() * keep
    net = Network(fresh(mlp), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1))
    torch.testing.assert_close(torch.tensor(net.score(batch)), ref_loss.detach())
    torch.testing.assert_close(net.score_examples(batch), per_example)
    net.fit_batch(batch)
    torch.testing.assert_close(net.params(), _reference_step(reference, ref_loss, 0.1))


def test_a_labels_mask_per_output_leaves_masked_outputs_out() -> None:
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(10, 8, generator=g), torch.randn(10, 3, generator=g)
    keep = torch.rand(10, 3, generator=g) > 0.4
    batch = DataSet(x, y, None, keep.float())
    reference = fresh(mlp)
    out = reference(x)
    ref_loss = ((out - y) ** 2)[keep].mean()  # the mean over unmasked outputs only
    ref_examples = (((out - y) ** 2) * keep).sum(1).detach() / keep.sum(1).clamp_min(1)
    net = Network(fresh(mlp), "mse", functools.partial(torch.optim.SGD, lr=0.1))
    torch.testing.assert_close(torch.tensor(net.score(batch)), ref_loss.detach())
    torch.testing.assert_close(net.score_examples(batch), ref_examples)
    net.fit_batch(batch)
    torch.testing.assert_close(net.params(), _reference_step(reference, ref_loss, 0.1))
    one_hot = DataSet(x, F.one_hot(y.argmax(1), 3).float(), None, keep.float())
    with pytest.raises(
        DataShapeError, match="masks single outputs, but loss 'cross_entropy' gives one value per example"
    ):
        Network(fresh(mlp), "cross_entropy").score(one_hot)


def test_a_labels_mask_per_example_covers_every_step_of_a_sequence() -> None:
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(6, 5, 8, generator=g), torch.randn(6, 5, 3, generator=g)
    keep = torch.tensor([True, False, True, False, True, True])
    reference = fresh(mlp)
    ref_loss = F.mse_loss(reference(x[keep]), y[keep])
    net = Network(fresh(mlp), "mse", functools.partial(torch.optim.SGD, lr=0.1))
    net.fit_batch(DataSet(x, y, None, keep.float()))
    torch.testing.assert_close(net.params(), _reference_step(reference, ref_loss, 0.1))


@pytest.mark.parametrize("loss", ["cross_entropy", "nll"])
def test_class_indices_out_of_range_are_refused_where_the_labels_are(loss: str) -> None:
    """A class index outside the outputs is refused from the labels as they came (on the CPU), naming the
    class: on a GPU, torch's kernel would meet it with a device-side assert that ruins the process's CUDA
    context. torch's ignore_index (-100) stays allowed; sequences count classes in their last dimension."""
    net = Network(fresh(mlp), loss, functools.partial(torch.optim.SGD, lr=0.1))
    x = torch.randn(4, 8)
    for bad, named in ((torch.tensor([0, 1, 3, 2]), "class 3 is outside 0..2"), (torch.tensor([0, -2, 1, 1]), "-2")):
        with pytest.raises(DataShapeError, match=f"do not fit loss '{loss}'.*{named}"):
            net.fit_batch(DataSet(x, bad))
    net.fit_batch(DataSet(x, torch.tensor([0, -100, 2, 1])))
    sequences = Network(torch.nn.Linear(8, 3), loss, functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(DataShapeError, match="class 3 is outside 0..2"):
        sequences.score(DataSet(torch.randn(2, 5, 8), torch.tensor([[0, 1, 2, 1, 0], [2, 2, 3, 0, 0]])))


def test_labels_read_once_are_read_again_once_changed_in_place() -> None:
    """A minibatch's labels are read once for every fit of them (a kept minibatch's at its first step
    only); changed in place, they are read again: a bad class refused, ignored labels counted as 0."""
    net = Network(fresh(mlp), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1))
    x, labels = torch.randn(4, 8), torch.tensor([0, 1, 2, 1])
    batch = DataSet(x, labels)
    net.fit_batch(batch)
    labels[2] = 3
    with pytest.raises(DataShapeError, match="class 3 is outside 0..2"):
        net.fit_batch(batch)
    labels[2] = -100
    out = net.output(x)
    expected = torch.nn.functional.cross_entropy(out, labels, reduction="none").mean()
    torch.testing.assert_close(losses.named_loss("cross_entropy", out, labels, None), expected)
    assert not torch.allclose(torch.nn.functional.cross_entropy(out, labels), expected)
