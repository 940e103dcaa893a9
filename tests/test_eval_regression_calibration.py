"""RegressionEvaluation and EvaluationCalibration against scikit-learn and numpy on the same data:
metrics, masks, merging of partitions (far from zero too), metrics after JSON/YAML round trips and
bad input; the contract every evaluation type meets is in tests/contracts/test_evaluation_contract.py."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from sklearn.calibration import calibration_curve
from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

from dlscale.errors import EvaluationError, IncompatibleEvaluationError
from dlscale.evaluation.calibration import EvaluationCalibration
from dlscale.evaluation.regression import RegressionEvaluation

SEEDS = [0, 1, 2]


def as_input(x: np.ndarray, use_torch: bool) -> np.ndarray | torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)) if use_torch else x


def regression_data(seed: int, n: int = 300, c: int = 4, offset: float = 0.0, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    y = offset + scale * rng.normal(size=(n, c)) * np.arange(1, c + 1)
    p = y + rng.normal(scale=0.3 * scale, size=(n, c)) + 0.1 * scale
    return y, p


def reference(y: np.ndarray, p: np.ndarray) -> dict[str, np.ndarray]:
    """Per column metrics from scikit-learn and numpy."""
    mse = mean_squared_error(y, p, multioutput="raw_values")
    return {
        "mse": mse,
        "mae": mean_absolute_error(y, p, multioutput="raw_values"),
        "rmse": np.sqrt(mse),
        "r2": r2_score(y, p, multioutput="raw_values"),
        "pearson": np.array([np.corrcoef(y[:, j], p[:, j])[0, 1] for j in range(y.shape[1])]),
        "rse": ((y - p) ** 2).sum(axis=0) / ((y - y.mean(axis=0)) ** 2).sum(axis=0),
    }


def metrics(e: RegressionEvaluation) -> dict[str, np.ndarray]:
    cols = range(e.num_columns())
    return {
        "mse": np.array([e.mean_squared_error(j) for j in cols]),
        "mae": np.array([e.mean_absolute_error(j) for j in cols]),
        "rmse": np.array([e.root_mean_squared_error(j) for j in cols]),
        "r2": np.array([e.r_squared(j) for j in cols]),
        "pearson": np.array([e.pearson_correlation(j) for j in cols]),
        "rse": np.array([e.relative_squared_error(j) for j in cols]),
    }


def assert_metrics(got: dict[str, np.ndarray], want: dict[str, np.ndarray], rtol: float) -> None:
    for k, expected in want.items():
        np.testing.assert_allclose(got[k], expected, rtol=rtol, atol=0, err_msg=k)


# -- RegressionEvaluation -------------------------------------------------------------------------
@pytest.mark.parametrize("use_torch", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_regression_matches_sklearn(seed: int, use_torch: bool) -> None:
    y, p = regression_data(seed)
    e = RegressionEvaluation()
    for chunk in np.array_split(np.arange(len(y)), 4):
        e.eval(as_input(y[chunk], use_torch), as_input(p[chunk], use_torch))
    want = reference(y, p)
    assert_metrics(metrics(e), want, 1e-6)
    assert e.num_columns() == 4 and e.example_count(2) == len(y)
    assert e.average_mean_squared_error() == pytest.approx(want["mse"].mean(), rel=1e-6)
    assert e.average_mean_absolute_error() == pytest.approx(want["mae"].mean(), rel=1e-6)
    assert e.average_root_mean_squared_error() == pytest.approx(want["rmse"].mean(), rel=1e-6)
    assert e.average_relative_squared_error() == pytest.approx(want["rse"].mean(), rel=1e-6)
    assert e.average_pearson_correlation() == pytest.approx(want["pearson"].mean(), rel=1e-6)
    assert e.average_r_squared() == pytest.approx(r2_score(y, p), rel=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_regression_per_output_mask(seed: int) -> None:
    y, p = regression_data(seed)
    mask = np.random.default_rng(seed + 10).random(y.shape) < 0.7
    e = RegressionEvaluation()
    e.eval(torch.from_numpy(y), torch.from_numpy(p), torch.from_numpy(mask))
    for j in range(y.shape[1]):
        keep = mask[:, j]
        want = reference(y[keep, j : j + 1], p[keep, j : j + 1])
        got = metrics(e)
        assert_metrics({k: v[j : j + 1] for k, v in got.items()}, want, 1e-6)
        assert e.example_count(j) == keep.sum()


@pytest.mark.parametrize("seed", SEEDS)
def test_regression_masked_time_steps(seed: int) -> None:
    rng = np.random.default_rng(seed)
    y, p = rng.normal(size=(20, 7, 3)), rng.normal(size=(20, 7, 3))
    steps = rng.random((20, 7)) < 0.6
    e = RegressionEvaluation()
    e.eval(y, p, steps)
    assert_metrics(metrics(e), reference(y[steps], p[steps]), 1e-6)


def test_regression_one_column_shapes() -> None:
    y, p = regression_data(3, c=1)
    flat, column = RegressionEvaluation(), RegressionEvaluation()
    flat.eval(y[:, 0], p[:, 0])
    column.eval(y[:, 0], p)  # [N] labels for [N, 1] predictions
    assert flat == column and flat.num_columns() == 1
    assert flat.r_squared(0) == pytest.approx(r2_score(y, p), rel=1e-6)


def split(n: int, parts: int, seed: int) -> list[np.ndarray]:
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, n), parts - 1, replace=False))
    return np.split(np.arange(n), cuts)


@pytest.mark.parametrize("offset, scale", [(0.0, 1.0), (1e6, 1.0), (1e8, 1e-3)])
@pytest.mark.parametrize("parts", [1, 3, 7])
def test_regression_merge_equals_one_pass(parts: int, offset: float, scale: float) -> None:
    y, p = regression_data(parts, n=500, offset=offset, scale=scale)
    mask = np.random.default_rng(parts).random(y.shape) < 0.8
    whole = RegressionEvaluation()
    whole.eval(y, p, mask)
    merged = RegressionEvaluation()
    for chunk in split(len(y), parts, seed=parts):
        part = RegressionEvaluation()
        for piece in np.array_split(chunk, 2):
            part.eval(y[piece], p[piece], mask[piece])
        merged.merge(part)
    assert_metrics(metrics(merged), metrics(whole), 1e-9)
    want = {
        k: np.array([reference(y[mask[:, j], j : j + 1], p[mask[:, j], j : j + 1])[k][0] for j in range(4)])
        for k in ("r2", "pearson", "rse", "mse")
    }
    assert_metrics(metrics(merged), want, 1e-6)


def test_regression_json_yaml_round_trip() -> None:
    y, p = regression_data(4, c=2)
    e = RegressionEvaluation(columns=["price", "volume"])
    e.eval(y, p)
    for copy in (RegressionEvaluation.from_json(e.to_json()), RegressionEvaluation.from_yaml(e.to_yaml())):
        assert copy.columns == ["price", "volume"]
        assert copy.r_squared("volume") == e.r_squared(1)
    assert "price" in e.stats() and "volume" in e.stats()


def test_regression_undefined_values_are_nan() -> None:
    e = RegressionEvaluation()
    e.eval(np.full((6, 1), 0.1), np.arange(6.0)[:, None])
    assert e.mean_squared_error(0) == pytest.approx(np.mean((0.1 - np.arange(6.0)) ** 2))
    assert np.isnan(e.r_squared(0)) and np.isnan(e.relative_squared_error(0))
    assert np.isnan(e.pearson_correlation(0))
    empty = RegressionEvaluation(columns=["a"])
    assert empty.example_count("a") == 0 and np.isnan(empty.mean_squared_error("a"))
    assert np.isnan(RegressionEvaluation().average_r_squared())


def test_regression_bad_input() -> None:
    e = RegressionEvaluation()
    with pytest.raises(EvaluationError, match="do not fit"):
        e.eval(np.zeros((5, 3)), np.zeros((5, 4)))
    with pytest.raises(EvaluationError, match="NaN"):
        e.eval(np.zeros((5, 2)), np.array([[np.nan, 0]] * 5))
    with pytest.raises(EvaluationError, match="class indices"):
        e.eval(np.array([0, 1, 2, 1, 0]), np.zeros((5, 3)))
    e.eval(np.zeros((5, 3)), np.ones((5, 3)))
    with pytest.raises(EvaluationError, match="2 columns.*has 3"):
        e.eval(np.zeros((5, 2)), np.ones((5, 2)))
    with pytest.raises(EvaluationError, match="2 columns.*has 3"):
        RegressionEvaluation(columns=["a", "b", "c"]).eval(np.zeros((5, 2)), np.ones((5, 2)))
    other = RegressionEvaluation()
    other.eval(np.zeros((5, 2)), np.ones((5, 2)))
    with pytest.raises(IncompatibleEvaluationError, match="2 columns"):
        e.merge(other)
    with pytest.raises(KeyError):
        e.r_squared("a")
    with pytest.raises(IndexError):
        e.r_squared(3)
    with pytest.raises(ValueError):
        RegressionEvaluation(columns=["a", "a"])


# -- EvaluationCalibration ------------------------------------------------------------------------
def calibration_data(seed: int, n: int = 400, c: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Class indices and probabilities, with some probabilities exactly 0, 1 and on bin edges."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, c)) * 2
    prob = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    special = np.r_[0.0, 1.0, np.linspace(0, 1, 11), np.linspace(0, 1, 51)]
    where = rng.random((n, c)) < 0.2
    prob[where] = rng.choice(special, where.sum())
    y = np.array([rng.choice(c, p=row / row.sum()) if row.sum() else rng.integers(c) for row in prob])
    return y, prob


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("use_torch", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_calibration_matches_sklearn_and_numpy(seed: int, use_torch: bool, one_hot: bool) -> None:
    y, prob = calibration_data(seed)
    labels = np.eye(3)[y] if one_hot else y
    e = EvaluationCalibration(reliability_diagram_bins=10, histogram_bins=50)
    for chunk in np.array_split(np.arange(len(y)), 3):
        e.eval(as_input(labels[chunk], use_torch), as_input(prob[chunk], use_torch))
    edges = np.linspace(0, 1, 51)
    onehot = np.eye(3)[y]
    residual = np.abs(onehot - prob)
    assert e.num_classes() == 3 and e.example_count() == len(y)
    ece = []
    for k in range(3):
        prob_true, prob_pred = calibration_curve(y == k, prob[:, k], n_bins=10, strategy="uniform")
        mean_predicted, fraction_positives = e.reliability_diagram(k)
        np.testing.assert_allclose(mean_predicted, prob_pred, rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(fraction_positives, prob_true, rtol=1e-6, atol=1e-12)
        counts = np.bincount(np.searchsorted(np.linspace(0, 1, 11)[1:-1], prob[:, k]))
        counts = counts[counts > 0]
        ece.append(np.sum(counts * np.abs(prob_true - prob_pred)) / len(y))
        assert e.expected_calibration_error(k) == pytest.approx(ece[-1], rel=1e-6)
        for got, values in (
            (e.residual_plot(k), residual[:, k]),
            (e.residual_plot(k, actual_class_only=True), residual[y == k, k]),
            (e.probability_histogram(k), prob[:, k]),
            (e.probability_histogram(k, actual_class_only=True), prob[y == k, k]),
        ):
            np.testing.assert_array_equal(got[0], np.histogram(values, edges)[0])
            np.testing.assert_array_equal(got[1], edges)
    assert e.expected_calibration_error() == pytest.approx(np.mean(ece), rel=1e-6)
    np.testing.assert_array_equal(e.residual_plot()[0], np.histogram(residual, edges)[0])
    np.testing.assert_array_equal(
        e.residual_plot(actual_class_only=True)[0], np.histogram(residual[onehot == 1], edges)[0]
    )
    np.testing.assert_array_equal(e.probability_histogram()[0], np.histogram(prob, edges)[0])
    np.testing.assert_array_equal(e.label_counts(), np.bincount(y, minlength=3))
    np.testing.assert_array_equal(e.prediction_counts(), np.bincount(prob.argmax(axis=1), minlength=3))


def test_calibration_binary_single_column() -> None:
    y, prob = calibration_data(5, c=2)
    p = prob[:, 1]
    e = EvaluationCalibration(reliability_diagram_bins=5)
    e.eval(torch.from_numpy(y.astype(np.float32)), torch.from_numpy(p))
    assert e.num_classes() == 2
    for k, (truth, score) in enumerate(((y == 0, 1.0 - p), (y == 1, p))):
        prob_true, prob_pred = calibration_curve(truth, score, n_bins=5)
        np.testing.assert_allclose(e.reliability_diagram(k), (prob_pred, prob_true), rtol=1e-6, atol=1e-12)
    np.testing.assert_array_equal(e.label_counts(), np.bincount(y, minlength=2))
    indexed = EvaluationCalibration(reliability_diagram_bins=5)
    indexed.eval(y, p[:, None])  # class indices for one-column predictions
    assert indexed == e


def test_calibration_masked_time_steps() -> None:
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(10, 8, 4))
    prob = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    y = rng.integers(0, 4, (10, 8))
    steps = rng.random((10, 8)) < 0.5
    masked, kept = EvaluationCalibration(), EvaluationCalibration()
    masked.eval(y, prob, steps)
    kept.eval(y[steps], prob[steps])
    assert masked == kept and masked.example_count() == steps.sum()


@pytest.mark.parametrize("parts", [1, 3, 7])
def test_calibration_merge_equals_one_pass(parts: int) -> None:
    y, prob = calibration_data(parts, n=700)
    whole = EvaluationCalibration()
    whole.eval(y, prob)
    merged = EvaluationCalibration()
    for chunk in split(len(y), parts, seed=parts):
        part = EvaluationCalibration()
        part.eval(y[chunk], prob[chunk])
        merged.merge(part)
    a, b = whole.to_dict()["accumulated"], merged.to_dict()["accumulated"]
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-12, err_msg=k)
    for k in range(3):
        np.testing.assert_allclose(merged.reliability_diagram(k), whole.reliability_diagram(k), rtol=1e-12)
    assert merged.expected_calibration_error() == pytest.approx(whole.expected_calibration_error(), rel=1e-12)


def test_calibration_json_yaml_round_trip() -> None:
    y, prob = calibration_data(8)
    e = EvaluationCalibration(reliability_diagram_bins=7, histogram_bins=20)
    e.eval(y, prob)
    for copy in (EvaluationCalibration.from_json(e.to_json()), EvaluationCalibration.from_yaml(e.to_yaml())):
        np.testing.assert_array_equal(copy.reliability_diagram(2), e.reliability_diagram(2))
    assert "3 classes" in e.stats()


def test_calibration_bad_input() -> None:
    e = EvaluationCalibration()
    with pytest.raises(EvaluationError, match=r"\[0, 1\].*\[-0.1, 0.9\]"):
        e.eval(np.array([0, 1]), np.array([[-0.1, 0.9], [0.5, 0.5]]))
    with pytest.raises(EvaluationError, match="1.5"):
        e.eval(np.array([0, 1]), np.array([[0.0, 1.5], [0.5, 0.5]]))
    with pytest.raises(EvaluationError, match="NaN"):
        e.eval(np.array([0, 1]), np.array([[np.nan, 1.0], [0.5, 0.5]]))
    e.eval(np.array([0, 1]), np.array([[0.2, 0.8], [0.5, 0.5]]))
    with pytest.raises(EvaluationError, match="3 classes"):
        e.eval(np.array([0, 1]), np.full((2, 3), 0.3))
    three = EvaluationCalibration()
    three.eval(np.array([0, 2]), np.full((2, 3), 0.3))
    with pytest.raises(IncompatibleEvaluationError, match="3 classes"):
        e.merge(three)
    with pytest.raises(ValueError):
        EvaluationCalibration(reliability_diagram_bins=0)
    with pytest.raises(IndexError):
        e.reliability_diagram(2)


def test_calibration_save_png(tmp_path, monkeypatch) -> None:
    y, prob = calibration_data(9)
    e = EvaluationCalibration()
    e.eval(y, prob)
    path = tmp_path / "calibration.png"
    e.save_png(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        e.save_png(str(tmp_path / "again.png"))
