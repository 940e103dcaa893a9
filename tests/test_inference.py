"""Distributed inference on a 2-process LocalCluster: keyed outputs equal a local forward pass for
every key (single and multiple inputs, masked sequences of different lengths), per-example scores
equal the loss computed locally, and predictions over Dask arrays and dataframes stay lazy."""

from __future__ import annotations

import os

import dask.array as da
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dlscale
from dlscale import SparkNet
from dlscale.data import DataSet, MultiDataSet
from dlscale.data.dataset import DataShapeError
from dlscale.inference import (
    calculate_score,
    feed_forward_with_key,
    feed_forward_with_mask_and_key,
    predict,
    score_examples,
)
from dlscale.nn import Network


def mlp(inputs: int = 10, outputs: int = 4, **kwargs) -> Network:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(inputs, 32), torch.nn.ReLU(), torch.nn.Linear(32, outputs))
    return Network(module, "cross_entropy", **kwargs)


class TwoInTwoOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(10, 8), torch.nn.Linear(4, 8)
        self.head1, self.head2 = torch.nn.Linear(8, 3), torch.nn.Linear(8, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        h = torch.tanh(self.a(a) + self.b(b))
        return [self.head1(h), self.head2(h)]


class MaskedSequence(torch.nn.Module):
    """Per-step outputs and a masked mean over the real steps: padding must not change either."""

    def __init__(self) -> None:
        super().__init__()
        self.step, self.pool = torch.nn.Linear(6, 3), torch.nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        if mask is None:
            mask = torch.ones(x.shape[:2])
        mean = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return [self.step(x) * mask[..., None], self.pool(mean)]


def keyed(x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(f"key-{i}", x[i].clone()) for i in range(len(x))]  # a view would pickle its whole base


def test_ten_thousand_keys_over_five_partitions(sc) -> None:
    net = mlp()
    x = torch.randn(10_000, 10, generator=torch.Generator().manual_seed(1))
    expected = net.output(x)
    pairs = sc.parallelize(keyed(x), 5)
    for batch_size in (64, 7):
        result = feed_forward_with_key(net, pairs, batch_size).collect()
        assert len(result) == 10_000
        got = dict(result)
        assert len(got) == 10_000  # every key exactly once
        stacked = torch.stack([got[f"key-{i}"] for i in range(10_000)])
        torch.testing.assert_close(stacked, expected, atol=1e-6, rtol=0)


def test_several_inputs_and_outputs(sc) -> None:
    torch.manual_seed(2)
    net = Network(TwoInTwoOut(), "cross_entropy")
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(10_000, 10, generator=g), torch.randn(10_000, 4, generator=g)
    pairs = sc.parallelize([(i, [a[i].clone(), b[i].clone()]) for i in range(10_000)], 5)
    result = SparkNet(sc, net).feed_forward_with_key(pairs, 32).collect()
    got = dict(result)
    assert len(result) == len(got) == 10_000
    first, second = net.output(a, b)
    torch.testing.assert_close(torch.stack([got[i][0] for i in range(10_000)]), first, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.stack([got[i][1] for i in range(10_000)]), second, atol=1e-6, rtol=0)


def test_masked_sequences_of_different_lengths(sc) -> None:
    torch.manual_seed(4)
    net = Network(MaskedSequence(), "mse")
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 12, (10_000,), generator=g).tolist()
    examples = [torch.randn(t, 6, generator=g) for t in lengths]
    # the reference: examples of one length together, unpadded, without masks
    expected: dict[int, list[torch.Tensor]] = {}
    for t in set(lengths):
        idx = [i for i, n in enumerate(lengths) if n == t]
        steps, pooled = net.output(torch.stack([examples[i] for i in idx]))
        expected.update({i: [steps[j], pooled[j]] for j, i in enumerate(idx)})
    pairs = sc.parallelize([(i, (x, torch.ones(len(x)))) for i, x in enumerate(examples)], 5)
    for batch_size in (1, 50):
        result = feed_forward_with_mask_and_key(net, pairs, batch_size).collect()
        got = dict(result)
        assert len(result) == len(got) == 10_000
        for i in range(10_000):
            assert got[i][0].shape == (lengths[i], 3)
            torch.testing.assert_close(got[i][0], expected[i][0], atol=1e-6, rtol=0)
            torch.testing.assert_close(got[i][1], expected[i][1], atol=1e-6, rtol=0)


def test_score_examples_and_calculate_score(sc) -> None:
    net = mlp(optimizer=lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01))
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(300, 10, generator=g), torch.randint(0, 4, (300,), generator=g)
    expected = F.cross_entropy(net.output(x), y, reduction="none")
    rdd = sc.parallelize(DataSet(x, y).batch_by(17), 4)
    torch.testing.assert_close(torch.tensor(score_examples(net, rdd).collect()), expected, atol=1e-6, rtol=0)
    penalty = 0.005 * float(net.params().pow(2).sum())
    with_reg = torch.tensor(score_examples(net, rdd, include_regularization=True, batch_size=40).collect())
    torch.testing.assert_close(with_reg, expected + penalty, atol=1e-5, rtol=0)
    keyed_pairs = sc.parallelize([(f"k{i}", DataSet(x[i : i + 1], y[i : i + 1])) for i in range(300)], 3)
    got = dict(score_examples(net, keyed_pairs).collect())
    torch.testing.assert_close(torch.tensor([got[f"k{i}"] for i in range(300)]), expected, atol=1e-6, rtol=0)
    assert calculate_score(net, rdd) == pytest.approx(net.score(DataSet(x, y)), abs=1e-6)
    assert calculate_score(net, rdd, average=False) == pytest.approx(float(expected.sum()), rel=1e-6)


def test_predict_on_dask_arrays_and_dataframes(sc) -> None:
    net = mlp()
    x = np.random.default_rng(7).standard_normal((2_000, 10)).astype(np.float32)
    expected = net.output(torch.from_numpy(x)).numpy()
    arr = da.from_array(x, chunks=(300, 5))
    out = dlscale.predict(net, arr, batch_size=64)
    assert isinstance(out, da.Array) and out.shape == (2_000, 4)
    np.testing.assert_allclose(sc.client.compute(out).result(), expected, atol=1e-6)
    images = np.random.default_rng(8).standard_normal((500, 1, 2, 5)).astype(np.float32)  # more axes than outputs
    flat = Network(torch.nn.Sequential(torch.nn.Flatten(), mlp().module), "cross_entropy")
    out = predict(flat, da.from_array(images, chunks=(128, 1, 2, 5)))
    assert out.shape == (500, 4) and out.chunks[0] == (128, 128, 128, 116)
    np.testing.assert_allclose(
        sc.client.compute(out).result(), flat.output(torch.from_numpy(images)).numpy(), atol=1e-6
    )
    dd = pytest.importorskip("dask.dataframe")
    import pandas as pd

    frame = dd.from_pandas(pd.DataFrame(x, columns=[f"f{i}" for i in range(10)]), npartitions=4)
    preds = predict(net, frame, columns=["w", "x", "y", "z"])
    got = sc.client.compute(preds).result()
    assert list(got.columns) == ["w", "x", "y", "z"]
    np.testing.assert_allclose(got.sort_index().to_numpy(), expected, atol=1e-6)


def test_bad_input_is_named(sc) -> None:
    net = mlp()
    x = torch.randn(20, 10)
    with pytest.raises(TypeError, match="not a \\(key, value\\) pair"):
        feed_forward_with_key(net, sc.parallelize(list(x), 2)).collect()
    mixed = keyed(x)
    mixed[5] = ("odd", torch.randn(9))
    with pytest.raises(DataShapeError, match="'odd'"):
        feed_forward_with_key(net, sc.parallelize(mixed, 2)).collect()
    multi = [(i, [x[i], x[i]] if i % 2 else [x[i]]) for i in range(20)]
    with pytest.raises(DataShapeError, match="inputs"):
        feed_forward_with_key(Network(TwoInTwoOut(), "mse"), sc.parallelize(multi, 2)).collect()
    broken = mlp()
    with torch.no_grad():
        broken.module[0].bias[0] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        feed_forward_with_key(broken, sc.parallelize(keyed(x), 2)).collect()
    with pytest.raises(ValueError, match="one example"):
        score_examples(net, sc.parallelize([("k", DataSet(x[:2], torch.zeros(2, dtype=torch.long)))], 1)).collect()
    with pytest.raises(TypeError, match="dask Array or DataFrame"):
        predict(net, x)
    with pytest.raises(ValueError, match="batch_size"):
        feed_forward_with_key(net, sc.parallelize(keyed(x), 2), batch_size=0)
    multi_ds = [MultiDataSet([x[:3]], [torch.zeros(3, dtype=torch.long)])]
    assert len(score_examples(net, sc.parallelize(multi_ds, 1)).collect()) == 3


def test_predict_files_writes_one_npy_per_minibatch_file(sc, tmp_path) -> None:
    from dlscale.data import export_minibatches, list_paths
    from dlscale.errors import OutputExistsError
    from dlscale.inference import predict_files

    net = mlp()
    x = torch.randn(50, 10, generator=torch.Generator().manual_seed(3))
    paths = export_minibatches([DataSet(x, torch.zeros(50, dtype=torch.long))], str(tmp_path / "in"), 16)
    counts = predict_files(net, list_paths(sc, str(tmp_path / "in")), str(tmp_path / "out"), batch_size=7)
    assert counts == [16, 16, 16, 2]
    names = sorted(os.listdir(tmp_path / "out"))
    assert names == [os.path.basename(p).replace(".dlb", ".npy") for p in paths]  # nothing else, no temporaries
    written = np.concatenate([np.load(tmp_path / "out" / name) for name in names])
    np.testing.assert_allclose(written, net.output(x).numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(OutputExistsError, match="out"):
        predict_files(net, list_paths(sc, str(tmp_path / "in")), str(tmp_path / "out"))
