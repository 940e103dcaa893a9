"""ROC, ROCBinary and ROCMultiClass against scikit-learn: AUC, average precision and curves in exact
mode, histogram mode against exact, edge cases, and metrics after merging and JSON/YAML round trips;
the contract every evaluation type meets is in tests/contracts/test_evaluation_contract.py."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from sklearn import metrics

from dlscale.errors import EvaluationError, IncompatibleEvaluationError
from dlscale.evaluation._base import BaseEvaluation
from dlscale.evaluation.roc import ROC, ROCBinary, ROCMultiClass

SEEDS = [0, 1, 2]


def binary_data(seed: int, n: int = 400, decimals: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """0/1 labels and probabilities that carry some signal (rounded to force ties if asked)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    s = np.clip(rng.normal(0.4 + 0.2 * y, 0.2), 0, 1)
    return y, (np.round(s, decimals) if decimals is not None else s)


def softmax_data(seed: int, n: int = 300, c: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Class indices and softmax probabilities that favour the true class."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, c, n)
    logits = rng.normal(size=(n, c)) + 1.5 * np.eye(c)[y]
    p = np.exp(logits)
    return y, p / p.sum(axis=1, keepdims=True)


def sklearn_quiet(fn, *args, **kwargs):
    """A scikit-learn metric with its undefined-metric warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def assert_curves_equal(ours: tuple[np.ndarray, ...], theirs: tuple[np.ndarray, ...]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


def parts(
    evaluation: type[BaseEvaluation], n_parts: int, labels: np.ndarray, predictions: np.ndarray, **settings
) -> BaseEvaluation:
    """``labels``/``predictions`` evaluated in ``n_parts`` separate evaluations, merged."""
    pieces = []
    for y, p in zip(np.array_split(labels, n_parts), np.array_split(predictions, n_parts), strict=True):
        e = evaluation(**settings)
        e.eval(y, p)
        pieces.append(e)
    for e in pieces[1:]:
        pieces[0].merge(e)
    return pieces[0]


# -- ROC, exact mode ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("decimals", [None, 1, 2])
def test_exact_matches_sklearn(seed: int, decimals: int | None) -> None:
    y, s = binary_data(seed, decimals=decimals)
    roc = ROC()
    roc.eval(y, s)
    assert math.isclose(roc.calculate_auc(), metrics.roc_auc_score(y, s), abs_tol=1e-12)
    assert math.isclose(roc.calculate_auprc(), metrics.average_precision_score(y, s), abs_tol=1e-12)
    assert_curves_equal(roc.get_roc_curve(), metrics.roc_curve(y, s, drop_intermediate=False))
    assert_curves_equal(roc.get_precision_recall_curve(), metrics.precision_recall_curve(y, s))
    assert roc.count_actual_positive() == y.sum()
    assert roc.count_actual_negative() == (y == 0).sum()


@pytest.mark.parametrize("seed", SEEDS)
def test_input_forms_agree(seed: int) -> None:
    """[N] / [N, 1] / [N, 2] predictions, 0/1 / one-hot / index labels, numpy or torch: same result."""
    y, s = binary_data(seed)
    two = np.stack([1 - s, s], axis=1)
    one_hot = np.eye(2)[y]
    forms = [
        (y, s),
        (y[:, None], s[:, None]),
        (one_hot, two),
        (y, two),
        (torch.from_numpy(y), torch.from_numpy(s)),
        (torch.from_numpy(one_hot), torch.from_numpy(two)),
    ]
    results = []
    for labels, predictions in forms:
        roc = ROC()
        roc.eval(labels, predictions)
        results.append(roc)
    assert all(r == results[0] for r in results)
    assert math.isclose(results[-1].calculate_auc(), metrics.roc_auc_score(y, s), abs_tol=1e-12)


def test_float32_torch_scores_match_sklearn_on_the_same_values() -> None:
    y, s = binary_data(5)
    s32 = torch.from_numpy(s).float()
    roc = ROC()
    roc.eval(torch.from_numpy(y), s32)
    assert math.isclose(roc.calculate_auc(), metrics.roc_auc_score(y, s32.numpy()), abs_tol=1e-12)


def test_masked_time_steps_equal_unmasked_rows() -> None:
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, (20, 7))
    p = np.clip(rng.normal(0.4 + 0.2 * y, 0.2), 0, 1)
    mask = rng.random((20, 7)) < 0.6
    sequences = ROC()
    sequences.eval(y[..., None], p[..., None], mask)
    rows = ROC()
    rows.eval(y[mask], p[mask])
    assert sequences == rows
    assert math.isclose(sequences.calculate_auc(), metrics.roc_auc_score(y[mask], p[mask]), abs_tol=1e-12)


# -- ROC, edge cases ------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [0, 10])
def test_only_positives(steps: int) -> None:
    s = np.array([0.2, 0.7, 0.9, 0.7])
    roc = ROC(steps)
    roc.eval(np.ones(4), s)
    assert math.isnan(roc.calculate_auc())
    assert math.isnan(sklearn_quiet(metrics.roc_auc_score, np.ones(4), s))
    assert roc.calculate_auprc() == sklearn_quiet(metrics.average_precision_score, np.ones(4), s) == 1.0
    fpr, tpr, _ = roc.get_roc_curve()
    assert np.isnan(fpr).all() and tpr[-1] == 1.0


@pytest.mark.parametrize("steps", [0, 10])
def test_only_negatives(steps: int) -> None:
    s = np.array([0.2, 0.7, 0.9, 0.7])
    roc = ROC(steps)
    roc.eval(np.zeros(4), s)
    assert math.isnan(roc.calculate_auc())
    assert math.isnan(sklearn_quiet(metrics.roc_auc_score, np.zeros(4), s))
    assert roc.calculate_auprc() == sklearn_quiet(metrics.average_precision_score, np.zeros(4), s) == 0.0
    assert_curves_equal(roc.get_precision_recall_curve(), sklearn_quiet(metrics.precision_recall_curve, np.zeros(4), s))


@pytest.mark.parametrize("steps", [0, 10])
def test_all_equal_scores(steps: int) -> None:
    y = np.array([0, 1, 1, 0, 1])
    s = np.full(5, 0.3)
    roc = ROC(steps)
    roc.eval(y, s)
    assert roc.calculate_auc() == metrics.roc_auc_score(y, s) == 0.5
    assert math.isclose(roc.calculate_auprc(), metrics.average_precision_score(y, s), abs_tol=1e-12)
    assert math.isclose(roc.calculate_auprc(), 0.6, abs_tol=1e-12)


@pytest.mark.parametrize("steps", [0, 10])
def test_no_data(steps: int) -> None:
    roc = ROC(steps)
    roc.eval(np.zeros(0), np.zeros(0))
    assert math.isnan(roc.calculate_auc()) and math.isnan(roc.calculate_auprc())
    assert roc.count_actual_positive() == roc.count_actual_negative() == 0
    assert "nan" in roc.stats()


# -- ROC, histogram mode --------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_histogram_approaches_exact(seed: int) -> None:
    y, s = binary_data(seed, n=5000)
    exact, coarse, fine = ROC(), ROC(10), ROC(1000)
    for roc in (exact, coarse, fine):
        roc.eval(y, s)
    assert abs(fine.calculate_auc() - exact.calculate_auc()) < 0.01
    assert abs(fine.calculate_auprc() - exact.calculate_auprc()) < 0.01
    assert abs(fine.calculate_auc() - exact.calculate_auc()) <= abs(coarse.calculate_auc() - exact.calculate_auc())
    assert fine.count_actual_positive() == exact.count_actual_positive()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("steps", [7, 20, 49, 100])
def test_histogram_equals_exact_on_bin_edges(seed: int, steps: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 300)
    s = np.clip(rng.integers(0, steps + 1, 300) + 3 * y, 0, steps) / steps
    exact, histogram = ROC(), ROC(steps)
    exact.eval(y, s)
    histogram.eval(y, s)
    assert math.isclose(histogram.calculate_auc(), metrics.roc_auc_score(y, s), abs_tol=1e-12)
    assert math.isclose(histogram.calculate_auprc(), metrics.average_precision_score(y, s), abs_tol=1e-12)
    assert_curves_equal(histogram.get_roc_curve(), exact.get_roc_curve())
    assert_curves_equal(histogram.get_precision_recall_curve(), exact.get_precision_recall_curve())


def test_histogram_clamps_scores_outside_unit_interval() -> None:
    y = np.array([0, 1, 0, 1])
    clamped, outside = ROC(4), ROC(4)
    clamped.eval(y, np.array([0.0, 1.0, 0.5, 0.75]))
    outside.eval(y, np.array([-3.0, 2.5, 0.5, 0.75]))
    assert clamped == outside


def test_histogram_state_size_does_not_grow() -> None:
    for n in (10, 10_000):
        y, s = binary_data(0, n=n)
        roc = ROC(50)
        roc.eval(y, s)
        accumulated = roc.to_dict()["accumulated"]
        assert len(accumulated["positives"]) == len(accumulated["negatives"]) == 51
        assert sum(accumulated["positives"]) + sum(accumulated["negatives"]) == n


# -- ROCBinary ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("steps", [0, 25])
def test_rocbinary_per_output_masks_match_sklearn(seed: int, steps: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, (300, 3))
    p = np.clip(rng.normal(0.4 + 0.2 * y, 0.2), 0, 1)
    if steps:
        p = np.round(p * steps) / steps
    mask = rng.random((300, 3)) < 0.7
    roc = ROCBinary(steps)
    roc.eval(torch.from_numpy(y), torch.from_numpy(p), torch.from_numpy(mask))
    assert roc.num_outputs() == 3
    for j in range(3):
        yj, pj = y[mask[:, j], j], p[mask[:, j], j]
        assert math.isclose(roc.calculate_auc(j), metrics.roc_auc_score(yj, pj), abs_tol=1e-12)
        assert math.isclose(roc.calculate_auprc(j), metrics.average_precision_score(yj, pj), abs_tol=1e-12)
        assert_curves_equal(roc.get_roc_curve(j), metrics.roc_curve(yj, pj, drop_intermediate=False))
        assert_curves_equal(roc.get_precision_recall_curve(j), metrics.precision_recall_curve(yj, pj))
        assert roc.count_actual_positive(j) == yj.sum()
        assert roc.count_actual_negative(j) == (yj == 0).sum()
    assert "average" in roc.stats()


@pytest.mark.parametrize("seed", SEEDS)
def test_rocbinary_average_matches_sklearn_macro(seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, (200, 4))
    p = np.clip(rng.normal(0.4 + 0.2 * y, 0.2), 0, 1)
    roc = ROCBinary()
    roc.eval(y, p)
    assert math.isclose(roc.calculate_average_auc(), metrics.roc_auc_score(y, p, average="macro"), abs_tol=1e-12)
    assert math.isclose(
        roc.calculate_average_auprc(), metrics.average_precision_score(y, p, average="macro"), abs_tol=1e-12
    )


def test_rocbinary_undefined_output_makes_average_nan() -> None:
    roc = ROCBinary()
    roc.eval(np.array([[0, 1], [1, 1]]), np.array([[0.2, 0.4], [0.6, 0.9]]))
    assert roc.calculate_auc(0) == 1.0 and math.isnan(roc.calculate_auc(1))
    assert math.isnan(roc.calculate_average_auc())
    with pytest.raises(IndexError):
        roc.calculate_auc(2)


# -- ROCMultiClass --------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("one_hot", [False, True])
def test_multiclass_matches_sklearn_ovr(seed: int, one_hot: bool) -> None:
    y, p = softmax_data(seed)
    roc = ROCMultiClass()
    roc.eval(torch.from_numpy(np.eye(4)[y] if one_hot else y), torch.from_numpy(p))
    assert roc.num_classes() == 4
    assert math.isclose(
        roc.calculate_average_auc(), metrics.roc_auc_score(y, p, multi_class="ovr", average="macro"), abs_tol=1e-12
    )
    y_bin = np.eye(4)[y]
    assert math.isclose(
        roc.calculate_average_auprc(), metrics.average_precision_score(y_bin, p, average="macro"), abs_tol=1e-12
    )
    for k in range(4):
        assert math.isclose(roc.calculate_auc(k), metrics.roc_auc_score(y == k, p[:, k]), abs_tol=1e-12)
        assert math.isclose(roc.calculate_auprc(k), metrics.average_precision_score(y == k, p[:, k]), abs_tol=1e-12)
        assert_curves_equal(roc.get_roc_curve(k), metrics.roc_curve(y == k, p[:, k], drop_intermediate=False))
        assert_curves_equal(roc.get_precision_recall_curve(k), metrics.precision_recall_curve(y == k, p[:, k]))
        assert roc.count_actual_positive(k) == (y == k).sum()
    assert roc.stats().count("\n") == 6


def test_multiclass_sequences_with_mask() -> None:
    y, p = softmax_data(4, n=60, c=3)
    mask = np.random.default_rng(4).random(60) < 0.5
    sequences, rows = ROCMultiClass(), ROCMultiClass()
    sequences.eval(y.reshape(6, 10), p.reshape(6, 10, 3), mask.reshape(6, 10))
    rows.eval(y[mask], p[mask])
    assert sequences == rows


# -- merging and serialisation --------------------------------------------------------------------
@pytest.mark.parametrize("n_parts", [1, 3, 7])
@pytest.mark.parametrize("steps", [0, 100])
def test_merge_equals_one_pass(n_parts: int, steps: int) -> None:
    y, s = binary_data(1, n=700)
    yc, pc = softmax_data(1, n=700)
    yb = np.random.default_rng(1).integers(0, 2, (700, 3))
    pb = np.clip(yb * 0.3 + np.random.default_rng(2).random((700, 3)) * 0.7, 0, 1)
    for kind, labels, predictions in ((ROC, y, s), (ROCMultiClass, yc, pc), (ROCBinary, yb, pb)):
        whole = kind(steps)
        whole.eval(labels, predictions)
        merged = parts(kind, n_parts, labels, predictions, threshold_steps=steps)
        if kind is ROC:
            assert merged.calculate_auc() == whole.calculate_auc()
            assert merged.calculate_auprc() == whole.calculate_auprc()
        else:
            assert merged.calculate_average_auc() == whole.calculate_average_auc()


def test_exact_merge_order_does_not_matter() -> None:
    y, s = binary_data(6, n=500, decimals=2)
    forward = parts(ROC, 5, y, s)
    backward = parts(ROC, 5, y[::-1], s[::-1])
    assert forward != backward  # the pairs are kept in another order ...
    assert forward.calculate_auc() == backward.calculate_auc()  # ... but ties are grouped the same
    assert forward.calculate_auprc() == backward.calculate_auprc()


def test_input_buffers_can_be_reused() -> None:
    y, s = binary_data(7)
    buffer = s.copy()
    roc = ROC()
    roc.eval(y, buffer)
    buffer[:] = 0.5
    assert math.isclose(roc.calculate_auc(), metrics.roc_auc_score(y, s), abs_tol=1e-12)


def test_reset() -> None:
    y, p = softmax_data(0)
    filled = ROCMultiClass()
    filled.eval(y, p)
    filled.reset()
    assert filled == ROCMultiClass() and filled.num_classes() == 0


@pytest.mark.parametrize("steps", [0, 30])
def test_json_and_yaml_round_trip(steps: int) -> None:
    y, s = binary_data(2)
    yc, pc = softmax_data(2)
    rng = np.random.default_rng(2)
    yb, pb, mb = rng.integers(0, 2, (50, 2)), rng.random((50, 2)), rng.random((50, 2)) < 0.8
    roc, multi, binary = ROC(steps), ROCMultiClass(steps), ROCBinary(steps)
    roc.eval(y, s)
    multi.eval(yc, pc)
    binary.eval(yb, pb, mb)
    for e in (roc, multi, binary, ROC(steps), ROCBinary(steps)):
        for back in (
            type(e).from_json(e.to_json()),
            type(e).from_yaml(e.to_yaml()),
            BaseEvaluation.from_json(e.to_json()),
        ):
            if isinstance(e, ROC):
                metrics_of = [e.calculate_auc(), e.calculate_auprc(), *e.get_roc_curve()]
                back_metrics = [back.calculate_auc(), back.calculate_auprc(), *back.get_roc_curve()]
            else:
                metrics_of = [e.calculate_average_auc(), e.calculate_average_auprc()]
                back_metrics = [back.calculate_average_auc(), back.calculate_average_auprc()]
            np.testing.assert_equal(back_metrics, metrics_of)  # nan equals nan here


def test_incompatible_merges() -> None:
    for kind in (ROCBinary, ROCMultiClass):
        two, three = kind(), kind()
        two.eval(np.eye(2)[[0, 1, 1]], np.full((3, 2), 0.5))
        three.eval(np.eye(3)[[0, 1, 2]], np.full((3, 3), 1 / 3))
        with pytest.raises(IncompatibleEvaluationError):
            two.merge(three)
        with pytest.raises(EvaluationError):
            two.eval(np.eye(3)[[0, 1, 2]], np.full((3, 3), 1 / 3))


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [ROC, ROCBinary, ROCMultiClass])
def test_bad_input_raises(kind: type[BaseEvaluation]) -> None:
    p = np.full((4, 2), 0.5)
    e = kind()
    with pytest.raises(EvaluationError):
        e.eval(np.zeros((4, 3)), p)
    with pytest.raises(EvaluationError):
        e.eval(np.zeros((4, 2)), np.where(np.eye(4, 2) == 1, np.nan, p))
    with pytest.raises(EvaluationError):
        e.eval(torch.zeros(4, 2), torch.full((4, 2), float("inf")))


def test_unsupported_shapes_and_settings() -> None:
    with pytest.raises(EvaluationError):
        ROC().eval(np.array([0, 1, 2]), np.full((3, 3), 1 / 3))
    with pytest.raises(EvaluationError):
        ROC().eval(np.array([0, 2]), np.full((2, 2), 0.5))
    with pytest.raises(EvaluationError):
        ROCMultiClass().eval(np.array([0, 1]), np.array([0.3, 0.6]))
    with pytest.raises(EvaluationError):
        ROCMultiClass().eval(np.eye(3), np.full((3, 3), 1 / 3), np.ones((3, 3)))
    with pytest.raises(EvaluationError):
        ROCBinary().eval(np.array([0, 1, 1]), np.full((3, 3), 0.5))
    with pytest.raises(ValueError):
        ROC(-1)
    with pytest.raises(ValueError):
        ROCBinary(threshold_steps=2.5)  # type: ignore[arg-type]
