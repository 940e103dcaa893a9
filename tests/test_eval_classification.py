"""Evaluation and EvaluationBinary against scikit-learn on random data: every metric, masks, binary
predictions, edge cases (classes never predicted or never present, tied scores), metrics after
merging and after JSON/YAML round trips, and the errors for bad input and incompatible merges.
What every evaluation type must do (merge exactly, round-trip, refuse other settings) is checked
for all of them in tests/contracts/test_evaluation_contract.py."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from sklearn import metrics as skm

from dlscale.errors import EvaluationError, IncompatibleEvaluationError
from dlscale.evaluation._base import BaseEvaluation
from dlscale.evaluation.classification import Evaluation, EvaluationBinary

AS_INPUT = [pytest.param(np.asarray, id="numpy"), pytest.param(torch.from_numpy, id="torch")]
CASES = [(seed, c) for seed in (0, 1, 2) for c in (3, 5, 10)]


def approx(value: float | np.ndarray) -> object:
    return pytest.approx(value, abs=1e-6)


def one_hot(y: np.ndarray, c: int) -> np.ndarray:
    return np.eye(c)[y]


def random_data(seed: int, c: int, n: int = 300) -> tuple[np.ndarray, np.ndarray]:
    """Class indices and continuous scores (no ties), with the predictions right about half the time."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, c, n)
    scores = rng.random((n, c))
    scores[np.arange(n), y] += rng.random(n) * 0.6
    return y, scores


def evaluated(y: np.ndarray, scores: np.ndarray, **settings: object) -> Evaluation:
    e = Evaluation(**settings)
    e.eval(y, scores)
    return e


def sk_rates(y: np.ndarray, pred: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray]:
    """False positive and false negative rates per class from scikit-learn's confusion matrix."""
    cm = skm.confusion_matrix(y, pred, labels=range(c))
    tp = np.diag(cm)
    fp, fn = cm.sum(axis=0) - tp, cm.sum(axis=1) - tp
    tn = cm.sum() - tp - fp - fn
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.nan_to_num(fp / (fp + tn)), np.nan_to_num(fn / (fn + tp))


def check_against_sklearn(e: Evaluation, y: np.ndarray, pred: np.ndarray, c: int) -> None:
    """Every metric of ``e`` equals scikit-learn's on ``y`` and ``pred``: per class, and for more than
    two classes (two mean the positive class) also macro- and micro-averaged."""
    labels, kw = list(range(c)), {"labels": list(range(c)), "zero_division": 0}
    assert e.num_examples() == len(y)
    assert e.accuracy() == approx(skm.accuracy_score(y, pred))
    assert e.matthews_correlation() == approx(skm.matthews_corrcoef(y, pred))
    assert [e.matthews_correlation(k) for k in labels] == approx(
        [skm.matthews_corrcoef(y == k, pred == k) for k in labels]
    )
    scores = {"precision": skm.precision_score, "recall": skm.recall_score, "f1": skm.f1_score}
    for name, score in scores.items():
        assert [getattr(e, name)(k) for k in labels] == approx(score(y, pred, average=None, **kw))
    for beta in (0.5, 2.0):
        assert [e.f_beta(beta, k) for k in labels] == approx(skm.fbeta_score(y, pred, beta=beta, average=None, **kw))
    p, r = skm.precision_score(y, pred, average=None, **kw), skm.recall_score(y, pred, average=None, **kw)
    assert [e.g_measure(k) for k in labels] == approx(np.sqrt(p * r))
    fpr, fnr = sk_rates(y, pred, c)
    assert [e.false_positive_rate(k) for k in labels] == approx(fpr)
    assert [e.false_negative_rate(k) for k in labels] == approx(fnr)
    if c > 2:
        for averaging in ("macro", "micro"):
            for name, score in scores.items():
                assert getattr(e, name)(averaging=averaging) == approx(score(y, pred, average=averaging, **kw))
            for beta in (0.5, 2.0):
                assert e.f_beta(beta, averaging=averaging) == approx(
                    skm.fbeta_score(y, pred, beta=beta, average=averaging, **kw)
                )
        assert e.g_measure() == approx(np.mean(np.sqrt(p * r)))
        assert e.false_positive_rate() == approx(fpr.mean())
        assert e.false_alarm_rate() == approx((fpr.mean() + fnr.mean()) / 2)
    cm = skm.confusion_matrix(y, pred, labels=labels)
    assert np.array_equal(e.confusion_matrix(), cm)
    assert np.array_equal(e.true_positives(), np.diag(cm))
    assert np.array_equal(e.false_positives(), cm.sum(axis=0) - np.diag(cm))
    assert np.array_equal(e.false_negatives(), cm.sum(axis=1) - np.diag(cm))
    assert np.array_equal(e.true_negatives(), len(y) - cm.sum(axis=0) - cm.sum(axis=1) + np.diag(cm))
    assert [e.class_count(k) for k in labels] == [int(np.sum(y == k)) for k in labels]


# -- Evaluation against scikit-learn ----------------------------------------------------------
@pytest.mark.parametrize("as_input", AS_INPUT)
@pytest.mark.parametrize(("seed", "c"), CASES)
def test_metrics_match_sklearn(seed: int, c: int, as_input: Callable) -> None:
    y, scores = random_data(seed, c)
    e = Evaluation()
    e.eval(as_input(y), as_input(scores))
    check_against_sklearn(e, y, scores.argmax(axis=1), c)


@pytest.mark.filterwarnings("ignore:'k' .* greater than or equal to 'n_classes'")
@pytest.mark.parametrize("top_n", [1, 2, 3])
@pytest.mark.parametrize(("seed", "c"), CASES)
def test_top_n_accuracy_matches_sklearn(seed: int, c: int, top_n: int) -> None:
    y, scores = random_data(seed, c)
    e = evaluated(y, scores, top_n=top_n)
    assert e.top_n_accuracy() == approx(skm.top_k_accuracy_score(y, scores, k=top_n, labels=range(c)))
    assert e.accuracy() == approx(skm.accuracy_score(y, scores.argmax(axis=1)))
    if top_n == 1:
        assert e.top_n_accuracy() == e.accuracy()


def test_class_never_predicted() -> None:
    y, scores = random_data(3, 4)
    scores[:, 2] = -1.0
    pred = scores.argmax(axis=1)
    assert 2 not in pred and 2 in y
    e = evaluated(y, scores, labels=["a", "b", "c", "d"])
    check_against_sklearn(e, y, pred, 4)
    assert e.precision("c") == 0.0
    assert "Never predicted (1 of 4 classes): 2 (c)" in e.stats()


def test_single_class_present() -> None:
    _, scores = random_data(4, 3)
    y = np.zeros(len(scores), dtype=np.int64)
    e = evaluated(one_hot(y, 3), scores)
    check_against_sklearn(e, y, scores.argmax(axis=1), 3)
    assert e.matthews_correlation() == 0.0


def test_equal_scores_predict_the_first_class() -> None:
    y, _ = random_data(5, 4)
    scores = np.full((len(y), 4), 0.25)
    e = evaluated(y, scores, top_n=2)
    check_against_sklearn(e, y, np.zeros_like(y), 4)
    assert e.top_n_accuracy() == approx(np.mean(y < 2))  # ties ranked by index, like the arg-max


@pytest.mark.parametrize("as_input", AS_INPUT)
def test_masked_time_steps(as_input: Callable) -> None:
    rng = np.random.default_rng(6)
    n, t, c = 40, 7, 5
    y, scores = random_data(6, c, n * t)
    y, scores = y.reshape(n, t), scores.reshape(n, t, c)
    mask = rng.random((n, t)) < 0.6
    e = Evaluation()
    e.eval(as_input(one_hot(y, c)), as_input(scores), as_input(mask.astype(np.float32)))
    check_against_sklearn(e, y[mask], scores[mask].argmax(axis=1), c)
    assert e == evaluated(y[mask], scores[mask])


@pytest.mark.parametrize("as_input", AS_INPUT)
def test_a_mask_per_sequence_covers_each_of_its_steps(as_input: Callable) -> None:
    rng = np.random.default_rng(8)
    n, t, c = 40, 7, 5
    y, scores = random_data(8, c, n * t)
    y, scores = y.reshape(n, t), scores.reshape(n, t, c)
    keep = rng.random(n) < 0.6
    e = Evaluation()
    e.eval(as_input(y), as_input(scores), as_input(keep.astype(np.float32)))
    check_against_sklearn(e, y[keep].reshape(-1), scores[keep].reshape(-1, c).argmax(axis=1), c)


def test_one_hot_and_indices_agree() -> None:
    y, scores = random_data(7, 6)
    by_index, by_one_hot = evaluated(y, scores, top_n=3), evaluated(torch.tensor(one_hot(y, 6)), scores, top_n=3)
    assert by_index == by_one_hot
    assert by_index.stats() == by_one_hot.stats()


@pytest.mark.parametrize("positive", [0, 1])
@pytest.mark.parametrize("threshold", [0.3, 0.5])
def test_binary_single_column(positive: int, threshold: float) -> None:
    rng = np.random.default_rng(8)
    y, p = rng.integers(0, 2, 200), rng.random(200)
    pred = (p >= threshold).astype(np.int64)
    e = Evaluation(binary_positive_class=positive, binary_decision_threshold=threshold)
    e.eval(y, p)
    assert e.num_classes() == 2
    check_against_sklearn(e, y, pred, 2)
    for name, score in [("precision", skm.precision_score), ("recall", skm.recall_score), ("f1", skm.f1_score)]:
        expected = score(y, pred, pos_label=positive, zero_division=0)
        assert getattr(e, name)() == approx(expected)
        assert getattr(e, name)(averaging="micro") == approx(expected)  # two classes: always the positive one
    assert e.f_beta(2.0) == approx(skm.fbeta_score(y, pred, beta=2.0, pos_label=positive))
    assert e.false_alarm_rate() == approx((e.false_positive_rate(positive) + e.false_negative_rate(positive)) / 2)
    column = Evaluation(binary_positive_class=positive, binary_decision_threshold=threshold)
    column.eval(torch.tensor(y[:, None].astype(np.float32)), torch.tensor(p[:, None]))
    assert column == e


def test_two_columns_use_the_arg_max() -> None:
    y, scores = random_data(9, 2)
    e = evaluated(y, scores, binary_decision_threshold=0.9)
    pred = scores.argmax(axis=1)
    check_against_sklearn(e, y, pred, 2)
    assert e.precision() == approx(skm.precision_score(y, pred))
    assert e.precision(0) == approx(skm.precision_score(y, pred, pos_label=0))


def test_before_any_batch_metrics_are_zero() -> None:
    e = Evaluation(top_n=2)
    assert (e.accuracy(), e.top_n_accuracy(), e.precision(), e.f1(averaging="micro"), e.matthews_correlation()) == (
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
    )
    assert e.num_classes() == e.num_examples() == 0
    assert e.confusion_matrix().shape == (0, 0) and e.true_positives().size == 0
    assert "no examples" in e.stats()
    named = Evaluation(labels=["x", "y", "z"])
    assert named.confusion_matrix().shape == (3, 3) and named.precision("z") == 0.0


# -- merging and serialization ----------------------------------------------------------------
@pytest.mark.parametrize("parts", [1, 3, 7])
def test_merged_parts_give_the_metrics_of_the_whole(parts: int) -> None:
    y, scores = random_data(10, 5, 301)
    whole = evaluated(y, scores, top_n=2)
    merged = Evaluation(top_n=2)
    for ys, ss in zip(np.array_split(y, parts), np.array_split(scores, parts), strict=True):
        merged.merge(evaluated(ys, ss, top_n=2))
    for metric in ("accuracy", "top_n_accuracy", "precision", "recall", "f1", "matthews_correlation"):
        assert getattr(merged, metric)() == getattr(whole, metric)()


def test_json_and_yaml_round_trip() -> None:
    y, scores = random_data(11, 3)
    e = evaluated(y, scores, labels=["cat", "dog", "bird"], top_n=2, binary_decision_threshold=0.4)
    for restored in (
        Evaluation.from_json(e.to_json()),
        Evaluation.from_yaml(e.to_yaml()),
        BaseEvaluation.from_json(e.to_json()),
    ):
        assert restored.f1("dog") == e.f1("dog") and restored.top_n_accuracy() == e.top_n_accuracy()


# -- bad input and incompatible merges --------------------------------------------------------
def test_bad_input_is_refused() -> None:
    y, scores = random_data(12, 3, 10)
    with pytest.raises(EvaluationError, match=r"\(10, 4\).*\(10, 3\)"):
        Evaluation().eval(np.zeros((10, 4)), scores)
    scores[3, 1] = np.nan
    with pytest.raises(EvaluationError, match="NaN"):
        Evaluation().eval(y, scores)
    with pytest.raises(EvaluationError, match="class index 5"):
        Evaluation().eval(np.full(10, 5), np.ones((10, 3)))
    e = evaluated(y, np.ones((10, 3)))
    with pytest.raises(EvaluationError, match="4 classes.*3"):
        e.eval(y, np.ones((10, 4)))
    with pytest.raises(EvaluationError, match="3 classes.*4 class names"):
        Evaluation(labels=["a", "b", "c", "d"]).eval(y, np.ones((10, 3)))
    with pytest.raises(EvaluationError, match="per-output mask"):
        Evaluation().eval(y, np.ones((10, 3)), np.ones((10, 3)))
    with pytest.raises(ValueError, match="averaging"):
        e.precision(averaging="weighted")
    with pytest.raises(ValueError, match="class 3"):
        e.recall(3)
    with pytest.raises(ValueError, match="beta"):
        e.f_beta(-1.0)
    with pytest.raises(ValueError, match="top_n"):
        Evaluation(top_n=0)
    with pytest.raises(ValueError, match="binary_positive_class"):
        Evaluation(binary_positive_class=2)
    with pytest.raises(ValueError, match="distinct"):
        Evaluation(labels=["a", "a"])
    with pytest.raises(ValueError, match="decision thresholds"):
        EvaluationBinary(decision_threshold=[0.5, 0.5], labels=["a", "b", "c"])


def test_incompatible_merges() -> None:
    y, scores = random_data(13, 3, 20)
    with pytest.raises(IncompatibleEvaluationError, match="4 classes"):
        evaluated(y, scores).merge(evaluated(y, np.ones((20, 4))))


# -- EvaluationBinary -------------------------------------------------------------------------
def multi_label(seed: int, n: int = 200, c: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """0/1 labels, probabilities that lean towards them, and a random per-output mask."""
    rng = np.random.default_rng(seed)
    y = (rng.random((n, c)) < rng.uniform(0.2, 0.8, c)).astype(np.float64)
    p = np.clip(0.3 * y + 0.7 * rng.random((n, c)), 0, 1)
    return y, p, rng.random((n, c)) < 0.7


def check_binary_against_sklearn(
    e: EvaluationBinary, y: np.ndarray, p: np.ndarray, mask: np.ndarray, thresholds: np.ndarray
) -> None:
    """Every metric of each output equals scikit-learn's on that column's unmasked entries."""
    c = y.shape[1]
    assert e.num_outputs() == c
    for k in range(c):
        yk, pk = y[mask[:, k], k], (p[mask[:, k], k] >= thresholds[k]).astype(np.int64)
        tn, fp, fn, tp = skm.confusion_matrix(yk, pk, labels=[0, 1]).ravel()
        assert (e.true_positives(k), e.false_positives(k), e.true_negatives(k), e.false_negatives(k)) == (
            tp,
            fp,
            tn,
            fn,
        )
        assert e.total_count(k) == len(yk)
        assert e.accuracy(k) == approx(skm.accuracy_score(yk, pk))
        assert e.precision(k) == approx(skm.precision_score(yk, pk, zero_division=0))
        assert e.recall(k) == approx(skm.recall_score(yk, pk, zero_division=0))
        assert e.f1(k) == approx(skm.f1_score(yk, pk, zero_division=0))
        assert e.f_beta(0.5, k) == approx(skm.fbeta_score(yk, pk, beta=0.5, zero_division=0))
        assert e.g_measure(k) == approx(np.sqrt(e.precision(k) * e.recall(k)))
        assert e.matthews_correlation(k) == approx(skm.matthews_corrcoef(yk, pk))
        assert e.false_positive_rate(k) == approx(fp / (fp + tn) if fp + tn else 0.0)
        assert e.false_negative_rate(k) == approx(fn / (fn + tp) if fn + tp else 0.0)
    assert e.average_accuracy() == approx(np.mean([e.accuracy(k) for k in range(c)]))
    assert e.average_precision() == approx(np.mean([e.precision(k) for k in range(c)]))
    assert e.average_recall() == approx(np.mean([e.recall(k) for k in range(c)]))
    assert e.average_f1() == approx(np.mean([e.f1(k) for k in range(c)]))


@pytest.mark.parametrize("as_input", AS_INPUT)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_binary_metrics_match_sklearn(seed: int, masked: bool, as_input: Callable) -> None:
    y, p, mask = multi_label(seed)
    if not masked:
        mask = np.ones_like(mask)
    e = EvaluationBinary()
    e.eval(as_input(y), as_input(p), as_input(mask.astype(np.float64)) if masked else None)
    check_binary_against_sklearn(e, y, p, mask, np.full(y.shape[1], 0.5))


def test_binary_per_output_thresholds() -> None:
    y, p, mask = multi_label(3)
    thresholds = [0.2, 0.5, 0.65, 0.8]
    e = EvaluationBinary(decision_threshold=thresholds, labels=["a", "b", "c", "d"])
    e.eval(torch.tensor(y), torch.tensor(p), torch.tensor(mask))
    check_binary_against_sklearn(e, y, p, mask, np.array(thresholds))
    assert e.precision("c") == e.precision(2)
    assert [line.split()[0] for line in e.stats().splitlines()[2:6]] == ["a", "b", "c", "d"]
    with pytest.raises(EvaluationError, match="3 outputs.*4 decision thresholds"):
        EvaluationBinary(decision_threshold=thresholds).eval(y[:, :3], p[:, :3])


def test_binary_sequences_with_masks() -> None:
    y, p, mask = multi_label(4, n=60)
    y, p, mask = y.reshape(10, 6, 4), p.reshape(10, 6, 4), mask.reshape(10, 6, 4)
    steps = np.random.default_rng(4).random((10, 6)) < 0.5
    per_step = EvaluationBinary()
    per_step.eval(y, p, steps)
    check_binary_against_sklearn(per_step, y[steps], p[steps], np.ones((steps.sum(), 4), bool), np.full(4, 0.5))
    per_output = EvaluationBinary()
    per_output.eval(y, p, mask)
    check_binary_against_sklearn(per_output, y.reshape(-1, 4), p.reshape(-1, 4), mask.reshape(-1, 4), np.full(4, 0.5))


@pytest.mark.parametrize("parts", [1, 3, 7])
def test_binary_merge_and_json(parts: int) -> None:
    y, p, mask = multi_label(5, n=101)
    whole = EvaluationBinary(decision_threshold=0.4)
    whole.eval(y, p, mask)
    merged = EvaluationBinary(decision_threshold=0.4).merge(EvaluationBinary(decision_threshold=0.4))
    for ys, ps, ms in zip(*(np.array_split(a, parts) for a in (y, p, mask)), strict=True):
        part = EvaluationBinary(decision_threshold=0.4)
        part.eval(ys, ps, ms)
        merged.merge(part)
    assert merged.average_f1() == whole.average_f1()
    other = EvaluationBinary(decision_threshold=0.4)
    other.eval(y[:, :2], p[:, :2])
    with pytest.raises(IncompatibleEvaluationError, match="2 outputs"):
        whole.merge(other)


def test_binary_bad_labels() -> None:
    y, p, _ = multi_label(6, n=10)
    with pytest.raises(EvaluationError, match="0 or 1"):
        EvaluationBinary().eval(y * 2, p)
    with pytest.raises(EvaluationError, match="class indices"):
        EvaluationBinary().eval(np.zeros(10), p)
    assert EvaluationBinary().average_f1() == 0.0 and "no examples" in EvaluationBinary().stats()
