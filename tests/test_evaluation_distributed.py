"""Distributed evaluation on a 2-process LocalCluster: every evaluation type equals the same type
computed in one process on the same outputs, for 1, 3 and 7 partitions, from DataSets and from
minibatch files; results travel to s3:// as JSON; bad input names what is wrong."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from dlscale import SparkNet, read_string_from_file, write_string_to_file
from dlscale.data import DataSet, MultiDataSet, list_paths, save
from dlscale.errors import EvaluationError
from dlscale.evaluation import (
    ROC,
    BaseEvaluation,
    Evaluation,
    EvaluationBinary,
    EvaluationCalibration,
    RegressionEvaluation,
    ROCBinary,
    ROCMultiClass,
    do_evaluation,
)
from dlscale.nn import Network, shipping

N, FEATURES = 700, 12


def network(outputs: int, final: torch.nn.Module | None = None, loss: str = "cross_entropy", seed: int = 0) -> Network:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, outputs)]
    return Network(torch.nn.Sequential(*layers, *([final] if final is not None else [])), loss)


def features(seed: int = 1) -> torch.Tensor:
    return torch.randn(N, FEATURES, generator=torch.Generator().manual_seed(seed))


def classes(x: torch.Tensor, k: int) -> torch.Tensor:
    """Labels with some signal in them: the arg-max of a fixed projection, some flipped."""
    g = torch.Generator().manual_seed(7)
    y = (x @ torch.randn(FEATURES, k, generator=g)).argmax(1)
    flip = torch.rand(len(y), generator=g) < 0.3
    return torch.where(flip, torch.randint(0, k, y.shape, generator=g), y)


# (name, network, labels, evaluations, metrics read from an evaluation)
def cases() -> list[tuple[str, Network, torch.Tensor, Callable[[], list[BaseEvaluation]], Callable]]:
    x = features()
    y4 = classes(x, 4)
    y2 = classes(x, 2)
    multi = (torch.rand(N, 3, generator=torch.Generator().manual_seed(3)) < 0.4).float()
    targets = x[:, :3] * 2 + 0.5
    return [
        (
            "classification",
            network(4, torch.nn.Softmax(dim=1)),
            y4,
            lambda: [Evaluation(top_n=2), ROCMultiClass(), ROCMultiClass(threshold_steps=40), EvaluationCalibration()],
            lambda es: [
                es[0].accuracy(),
                es[0].top_n_accuracy(),
                es[0].f1(averaging="macro"),
                es[0].matthews_correlation(),
                es[1].calculate_average_auc(),
                es[1].calculate_average_auprc(),
                es[2].calculate_average_auc(),
                *es[3].reliability_diagram(1)[1],
            ],
        ),
        (
            "binary",
            network(2, torch.nn.Softmax(dim=1)),
            y2,
            lambda: [ROC(), ROC(threshold_steps=25), Evaluation()],
            lambda es: [es[0].calculate_auc(), es[0].calculate_auprc(), es[1].calculate_auc(), es[2].f1()],
        ),
        (
            "multi-label",
            network(3, torch.nn.Sigmoid(), "bce"),
            multi,
            lambda: [EvaluationBinary(), ROCBinary()],
            lambda es: [*(es[0].f1(i) for i in range(3)), *(es[1].calculate_auc(i) for i in range(3))],
        ),
        (
            "regression",
            network(3, loss="mse"),
            targets,
            lambda: [RegressionEvaluation()],
            lambda es: [
                *(
                    f(i)
                    for i in range(3)
                    for f in (
                        es[0].mean_squared_error,
                        es[0].mean_absolute_error,
                        es[0].r_squared,
                        es[0].pearson_correlation,
                    )
                )
            ],
        ),
    ]


def pieces(x: torch.Tensor, y: torch.Tensor, size: int = 13) -> list[DataSet]:
    return DataSet(x, y).batch_by(size)


@pytest.mark.parametrize("case", range(4), ids=["classification", "binary", "multi-label", "regression"])
@pytest.mark.parametrize("partitions", [1, 3, 7])
def test_distributed_equals_one_process(sc, case: int, partitions: int) -> None:
    _, net, y, make, metrics = cases()[case]
    x = features()
    local = make()
    out = net.output(x)
    for e in local:
        e.eval(y, out)
    rdd = sc.parallelize(pieces(x, y), partitions)
    remote = do_evaluation(net, rdd, *make(), batch_size=50)
    assert [type(e) for e in remote] == [type(e) for e in local]
    assert metrics(remote) == pytest.approx(metrics(local), abs=1e-6)
    if case in (0, 1):  # counts: exactly equal
        assert (
            remote[-1 if case == 1 else 0].confusion_matrix().tolist()
            == local[-1 if case == 1 else 0].confusion_matrix().tolist()
        )
    for e in remote:  # and the JSON round trip keeps every number
        assert type(e).from_json(e.to_json()) == e


def test_batch_size_and_network_copies_do_not_change_results(sc) -> None:
    _, net, y, make, metrics = cases()[0]
    rdd = sc.parallelize(pieces(features(), y, 29), 5)
    results = [
        metrics(do_evaluation(net, rdd, *make(), batch_size=b, num_workers=w)) for b, w in [(1, 1), (64, 2), (1000, 1)]
    ]
    # float32 forward passes of different batch sizes differ in the last bits, which can swap the
    # ranks of two nearly equal scores in the exact AUC: 1e-5 is one swapped pair in 175 x 525
    assert results[1] == pytest.approx(results[0], abs=1e-5)
    assert results[2] == pytest.approx(results[0], abs=1e-5)


def test_the_network_reaches_each_worker_once(sc) -> None:
    _, net, y, make, _ = cases()[0]
    before = sc.client.run(shipping.copies_made)
    do_evaluation(net, sc.parallelize(pieces(features(), y), 7), *make(), num_workers=1)
    after = sc.client.run(shipping.copies_made)
    for worker, made in after.items():
        new = {k: n for k, n in made.items() if k not in before.get(worker, {})}
        assert list(new.values()) == [1], (worker, made)  # 7 partitions, one copy per worker


def test_paths_with_the_default_and_a_custom_loader(sc, tmp_path) -> None:
    _, net, y, make, metrics = cases()[0]
    x = features()
    for i, piece in enumerate(pieces(x, y, 100)):
        save(piece, str(tmp_path / f"batch-{i:03d}.dlb"))
    paths = list_paths(sc, str(tmp_path))
    expected = metrics(do_evaluation(net, sc.parallelize(pieces(x, y), 3), *make()))
    assert metrics(do_evaluation(net, paths, *make())) == pytest.approx(expected, abs=1e-6)
    as_multi = do_evaluation(Network(_TwoInputs(net.module), "cross_entropy"), paths, *make(), loader=_split_loader)
    assert metrics(as_multi) == pytest.approx(expected, abs=1e-6)


class _TwoInputs(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        out = self.inner(torch.cat([a, b], dim=1))
        return [out, out * 0]


def _split_loader(path: str) -> MultiDataSet:
    """A custom loader: a file's features as two inputs, its labels for two outputs."""
    from dlscale.data import load

    ds = load(path)
    return MultiDataSet([ds.features[:, :5], ds.features[:, 5:]], [ds.labels, ds.labels])


def test_sparknet_methods_and_results_on_s3(sc, s3) -> None:
    _, net, y, _, _ = cases()[0]
    x = features()
    spark_net = SparkNet(sc, net)
    rdd = sc.parallelize(pieces(x, y), 3)
    evaluation = spark_net.evaluate(rdd, top_n=3, labels=["ant", "bee", "cat", "dog"])
    local = Evaluation(top_n=3, labels=["ant", "bee", "cat", "dog"])
    local.eval(y, net.output(x))
    assert evaluation.top_n_accuracy() == pytest.approx(local.top_n_accuracy())
    assert "bee" in evaluation.stats()
    roc = spark_net.evaluate_roc_multiclass(rdd)
    local_roc = ROCMultiClass()
    local_roc.eval(y, net.output(x))
    assert roc.calculate_average_auc() == pytest.approx(local_roc.calculate_average_auc(), abs=1e-6)
    url = "s3://test-bucket/results/evaluation.json"
    write_string_to_file(url, evaluation.to_json(), s3)
    assert BaseEvaluation.from_json(read_string_from_file(url, s3)) == evaluation
    targets = x[:, :3]
    regression = SparkNet(sc, network(3, loss="mse")).evaluate_regression(sc.parallelize(pieces(x, targets), 2))
    assert regression.num_columns() == 3


def test_sequences_with_masked_steps(sc) -> None:
    torch.manual_seed(0)
    net = Network(torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Softmax(dim=-1)), "nll")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(60, 8, 5, generator=g)
    y = torch.randint(0, 3, (60, 8), generator=g)
    mask = (torch.rand(60, 8, generator=g) > 0.3).float()
    local = Evaluation()
    local.eval(y[mask.bool()], net.output(x)[mask.bool()])
    rdd = sc.parallelize(DataSet(x, y, None, mask).batch_by(7), 3)
    remote = do_evaluation(net, rdd, Evaluation(), batch_size=16)[0]
    assert remote.confusion_matrix().tolist() == local.confusion_matrix().tolist()
    assert remote.num_examples() == int(mask.sum())


def test_bad_input_is_named(sc) -> None:
    _, net, y, _, _ = cases()[0]
    x = features()
    with pytest.raises(EvaluationError, match="labels of shape") as info:
        do_evaluation(
            net, sc.parallelize(pieces(x, torch.nn.functional.one_hot(y.clamp(max=2), 3).float()), 2), Evaluation()
        )
    notes = getattr(info.value, "__notes__", [])
    named = r"while evaluating partition \d on worker (tcp|inproc)://\S+"
    assert any(re.fullmatch(named, note) for note in notes), notes
    broken = network(4)
    with torch.no_grad():
        broken.module[0].weight[0, 0] = float("nan")
    with pytest.raises(EvaluationError, match="NaN or infinite"):
        do_evaluation(broken, sc.parallelize(pieces(x, y), 2), Evaluation())
    with pytest.raises(TypeError, match="holds int elements"):
        do_evaluation(net, sc.parallelize(range(10), 2), Evaluation())
    with pytest.raises(ValueError, match="at least one evaluation"):
        do_evaluation(net, sc.parallelize(pieces(x, y), 2))
    with pytest.raises(ValueError, match="output=3"):
        do_evaluation(net, sc.parallelize(pieces(x, y), 2), Evaluation(), output=3)
    with pytest.raises(ValueError, match="batch_size"):
        do_evaluation(net, sc.parallelize(pieces(x, y), 2), Evaluation(), batch_size=0)


def test_per_example_and_per_output_labels_masks(sc) -> None:
    x = features()
    g = torch.Generator().manual_seed(11)
    keep = torch.rand(N, generator=g) > 0.3
    _, net, y, _, _ = cases()[0]
    rdd = sc.parallelize(
        [DataSet(x[i : i + 50], y[i : i + 50], None, keep[i : i + 50].float()) for i in range(0, N, 50)], 3
    )
    (evaluation,) = do_evaluation(net, rdd, Evaluation(), batch_size=64)
    predicted = net.output(x).argmax(1)
    assert evaluation.accuracy() == int(((predicted == y) & keep).sum()) / int(keep.sum())
    assert int(evaluation.confusion_matrix().sum()) == int(keep.sum())  # masked examples are not counted

    _, reg, targets, _, _ = cases()[3]
    kept = torch.rand(N, 3, generator=g) > 0.5
    rdd = sc.parallelize(
        [DataSet(x[i : i + 50], targets[i : i + 50], None, kept[i : i + 50].float()) for i in range(0, N, 50)], 3
    )
    (regression,) = do_evaluation(reg, rdd, RegressionEvaluation(), batch_size=64)
    errors = (reg.output(x).double() - targets.double()) ** 2
    for j in range(3):  # each column's mean over its unmasked entries, by hand
        assert regression.example_count(j) == int(kept[:, j].sum())
        assert regression.mean_squared_error(j) == pytest.approx(float(errors[kept[:, j], j].mean()), rel=1e-9)
