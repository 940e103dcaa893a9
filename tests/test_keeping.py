"""The ways a gradient-sharing trainer keeps its update (``dlscale.training.sharing._keeping``), without a
cluster: each holds its invariant over steps with peers' messages coming in, a lone lossless trainer
steps as one process does, and momentum masking zeroes exactly what waited."""

from __future__ import annotations

import functools

import pytest
import torch
from sklearn.datasets import load_digits

from dlscale.data import DataSet
from dlscale.encoding import Dl4jCompressor, FixedThresholdAlgorithm, Layout, TopKCompressor, compressor
from dlscale.nn import Network
from dlscale.training.sharing._keeping import SharedCopy, TakenOut, Weighed, keeping

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _network(seed: int = 0, optimizer: object = SGD) -> Network:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    return Network(module, "cross_entropy", optimizer)


def _batches(n: int, seed: int = 0) -> list[DataSet]:
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    at = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    return [DataSet(x[at[i * 16 : i * 16 + 16]], y[at[i * 16 : i * 16 + 16]]) for i in range(n)]


def _keeping(name: str, aggregation: str, masking: bool = False, **kwargs: object):
    net = _network()
    comp = compressor(name, **kwargs)
    return keeping(net, comp, comp.state(Layout.of(net.module.parameters())), aggregation, masking), comp


def _sum_of(comp: object, messages: list, length: int) -> torch.Tensor:
    """The messages added to zeros: what they carry in all (the reference the replicas are held to)."""
    total = torch.zeros(length)
    for m in messages:
        comp.apply(m, total)
    return total


@pytest.mark.parametrize(
    ("name", "aggregation", "kind", "kwargs"),
    [
        ("topk", "sum", SharedCopy, {"warmup_steps": 2, "density": 0.05}),
        ("dense", "sum", SharedCopy, {}),
        ("topk", "mean", Weighed, {"warmup_steps": 2, "density": 0.05}),
        ("dl4j", "sum", TakenOut, {"threshold_algorithm": FixedThresholdAlgorithm(1e-3)}),
        ("dl4j", "mean", TakenOut, {"threshold_algorithm": FixedThresholdAlgorithm(1e-3)}),
    ],
)
def test_each_way_holds_its_invariant_with_peers_messages_coming_in(
    name: str, aggregation: str, kind: type, kwargs: dict
) -> None:
    """The shared parameters are the start plus every message sent or received; the replica is the
    shared parameters plus the residual (lossless) or the shared parameters themselves (not lossless)."""
    k, comp = _keeping(name, aggregation, **kwargs)
    peer, peer_comp = _keeping(name, aggregation, **kwargs)
    assert type(k) is kind
    start = k.params.clone()
    sent: list = []
    for batch, other in zip(_batches(6), _batches(6, seed=1), strict=True):
        k.fit(batch, alive=2)
        message = k.encode(alive=2)
        peer.fit(other, alive=2)
        from_peer = peer.encode(alive=2)
        k.receive([(comp, comp.from_bytes(peer_comp.to_bytes(peer_comp.stage(from_peer))))])
        sent += [message, from_peer]
        shared = start + _sum_of(comp, sent, start.numel())
        assert torch.allclose(k.shared(), shared, atol=1e-6)
        expected = shared + k.residual() if comp.lossless else shared
        assert torch.allclose(k.params, expected, atol=1e-6)
    assert k.residual().abs().sum() > 0


def test_a_lone_lossless_trainer_steps_as_one_process() -> None:
    for aggregation in ("sum", "mean"):
        k, _ = _keeping("topk", aggregation)
        alone = _network()
        for batch in _batches(5):
            loss = k.fit(batch, alive=1)
            assert k.encode(alive=1) is None
            assert float(loss) == alone.fit_batch(batch)
        assert torch.equal(k.params, alone.params())
        assert torch.allclose(k.shared() + k.residual(), k.params, atol=1e-6)


def test_the_mean_weighs_the_update_as_every_replica_applies_it() -> None:
    """Averaging over 4 live trainers, a replica keeps a quarter of its update: what one process's
    step moves, over 4."""
    k, _ = _keeping("dense", "mean")
    twin = _network()
    batch = _batches(1)[0]
    start = k.params.clone()
    k.fit(batch, alive=4)
    message = k.encode(alive=4)
    twin.fit_batch(batch)
    assert torch.allclose(k.params - start, (twin.params() - start) / 4, atol=1e-7)
    assert torch.allclose(message.values.float(), (twin.params() - start) / 4, atol=1e-7)


def test_momentum_masking_zeroes_the_momentum_of_what_waited() -> None:
    """With momentum masking the momentum of every element a message sends after waiting is zeroed and
    nothing else changes (a twin without masking is the reference); Adam's moments are left alone, and an
    optimizer without momentum gets no state."""
    for optimizer, key in ((SGD, "momentum_buffer"), (functools.partial(torch.optim.Adam, lr=0.01), "exp_avg")):
        comp = Dl4jCompressor(FixedThresholdAlgorithm(2e-3), "none")
        masked, twin = _network(optimizer=optimizer), _network(optimizer=optimizer)
        layout = Layout.of(masked.module.parameters())
        k = keeping(masked, comp, comp.state(layout), "sum", momentum_masking=True)
        t = keeping(twin, comp, comp.state(layout), "sum", momentum_masking=False)
        batch = _batches(1)[0]
        k.fit(batch, alive=2)
        t.fit(batch, alive=2)
        message, _ = k.encode(alive=2), t.encode(alive=2)
        new = torch.cat([masked.optimizer.state[p][key].reshape(-1) for p in masked.module.parameters()])
        old = torch.cat([twin.optimizer.state[p][key].reshape(-1) for p in twin.module.parameters()])
        sent = _sum_of(comp, [message], layout.length) != 0
        assert 0 < int(sent.sum()) < sent.numel()
        if key == "momentum_buffer":
            assert torch.equal(new[sent], torch.zeros(int(sent.sum())))
            assert torch.equal(new[~sent], old[~sent])
        else:
            assert torch.equal(new, old)
    plain = _network(optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    comp = TopKCompressor(warmup_steps=0)
    k = keeping(plain, comp, comp.state(Layout.of(plain.module.parameters())), "sum", momentum_masking=True)
    for batch in _batches(2):
        k.fit(batch, alive=2)
        k.encode(alive=2)
    assert plain.optimizer_state()["state"] == {}
