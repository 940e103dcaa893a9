"""The contract every registered evaluation type meets, checked for each of them (fsspec's abstract
test suite is the model): the evaluations of parts merge into the evaluation of all the data, the
state survives JSON and YAML, and a merge with other settings or another type is refused.

A registered type without a case in ``CASES`` fails here: add its settings and data of its kind.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from dlscale import registry
from dlscale.errors import IncompatibleEvaluationError
from dlscale.evaluation import BaseEvaluation

Batch = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def classes(rng: np.random.Generator, n: int, c: int = 5) -> Batch:
    """Class indices and scores that favour the true class about half the time."""
    y = rng.integers(0, c, n)
    scores = rng.random((n, c))
    scores[np.arange(n), y] += rng.random(n) * 0.6
    return y, scores, None


def probabilities(rng: np.random.Generator, n: int, c: int = 4) -> Batch:
    """Class indices and softmax probabilities, a few exactly 0 or 1, and a mask per example."""
    y = rng.integers(0, c, n)
    p = np.exp(rng.normal(size=(n, c)) + 1.5 * np.eye(c)[y])
    p /= p.sum(axis=1, keepdims=True)
    p[rng.random(n) < 0.05] = np.eye(c)[0]
    return y, p, rng.random(n) < 0.9


def binary(rng: np.random.Generator, n: int) -> Batch:
    """0/1 labels and probabilities rounded to two places (so that scores tie)."""
    y = rng.integers(0, 2, n)
    return y, np.round(np.clip(rng.normal(0.4 + 0.2 * y, 0.2), 0, 1), 2), None


def multi_label(rng: np.random.Generator, n: int, c: int = 4) -> Batch:
    """0/1 labels per output, probabilities that lean towards them, and a mask per output."""
    y = (rng.random((n, c)) < 0.4).astype(np.float64)
    return y, np.clip(0.3 * y + 0.7 * rng.random((n, c)), 0, 1), rng.random((n, c)) < 0.8


def regression(rng: np.random.Generator, n: int, c: int = 4) -> Batch:
    """Targets, noisy predictions and a mask per output."""
    y = rng.normal(size=(n, c)) * np.arange(1, c + 1)
    return y, y + rng.normal(scale=0.3, size=(n, c)), rng.random((n, c)) < 0.8


def state(e: BaseEvaluation) -> Any:
    return e.to_dict()["accumulated"]


def regression_metrics(e: BaseEvaluation) -> list[float]:
    return [
        getattr(e, metric)(j)
        for j in range(e.num_columns())
        for metric in (
            "example_count",
            "mean_squared_error",
            "mean_absolute_error",
            "r_squared",
            "pearson_correlation",
            "relative_squared_error",
        )
    ]


@dataclass(frozen=True)
class Case:
    """How to exercise one evaluation type: data of its kind, its settings, settings it must refuse
    to merge with (overriding some of ``settings``), and, where merged parts equal one pass only up
    to rounding (sums of floats), what to compare instead of the whole evaluation."""

    data: Callable[[np.random.Generator, int], Batch]
    settings: dict[str, Any] = field(default_factory=dict)
    other: dict[str, Any] = field(default_factory=dict)
    inexact: Callable[[BaseEvaluation], Any] | None = None


CASES: dict[str, dict[str, Case]] = {
    "Evaluation": {
        "labels": Case(classes, {"labels": list("abcde"), "top_n": 2}, {"top_n": 3}),
        "binary": Case(binary, {"binary_decision_threshold": 0.4}, {"binary_decision_threshold": 0.6}),
    },
    "EvaluationBinary": {"masked": Case(multi_label, {"decision_threshold": 0.4}, {"decision_threshold": 0.6})},
    "EvaluationCalibration": {
        "bins": Case(
            probabilities, {"reliability_diagram_bins": 7, "histogram_bins": 20}, {"histogram_bins": 10}, state
        )
    },
    "RegressionEvaluation": {
        "columns": Case(
            regression, {"columns": ["w", "x", "y", "z"]}, {"columns": ["a", "b", "c", "d"]}, regression_metrics
        )
    },
    "ROC": {
        "exact": Case(binary, {"threshold_steps": 0}, {"threshold_steps": 100}),
        "histogram": Case(binary, {"threshold_steps": 100}, {"threshold_steps": 0}),
    },
    "ROCBinary": {
        "exact": Case(multi_label, {"threshold_steps": 0}, {"threshold_steps": 100}),
        "histogram": Case(multi_label, {"threshold_steps": 100}, {"threshold_steps": 0}),
    },
    "ROCMultiClass": {
        "exact": Case(probabilities, {"threshold_steps": 0}, {"threshold_steps": 100}),
        "histogram": Case(probabilities, {"threshold_steps": 100}, {"threshold_steps": 0}),
    },
}

TYPES = registry.get("evaluation").view
REGISTERED = sorted(TYPES)


@pytest.fixture(
    params=[(name, label) for name in REGISTERED for label in CASES.get(name, [None])],
    ids=lambda p: f"{p[0]}-{p[1]}" if p[1] else p[0],
)
def subject(request: pytest.FixtureRequest) -> tuple[str, Case]:
    """Every registered evaluation type (by the name its JSON carries) with each of its cases."""
    name, label = request.param
    if label is None:
        pytest.fail(f"evaluation type {name!r} is registered but has no case in CASES")
    return name, CASES[name][label]


def evaluated(name: str, settings: dict[str, Any], batch: Batch) -> BaseEvaluation:
    e = TYPES[name](**settings)
    e.eval(*batch)
    return e


def split(batch: Batch, parts: int) -> list[Batch]:
    """``batch`` cut into ``parts`` runs of examples, in order."""
    pieces = [np.array_split(a, parts) if a is not None else [None] * parts for a in batch]
    return list(zip(*pieces))


def assert_same_result(got: BaseEvaluation, want: BaseEvaluation, case: Case) -> None:
    """Equal evaluations, or where merging is exact only up to rounding, close results."""
    if case.inexact is None:
        assert got == want
    else:
        assert got.to_dict()["settings"] == want.to_dict()["settings"]
        assert_close(case.inexact(got), case.inexact(want), "result")


def assert_close(got: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            assert_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not (math.isnan(want) and isinstance(got, float) and math.isnan(got)):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), where
    else:
        assert got == want and type(got) is type(want), where


@pytest.mark.parametrize("parts", [1, 3, 7])
def test_merged_parts_equal_one_pass(subject: tuple[str, Case], parts: int) -> None:
    name, case = subject
    batch = case.data(np.random.default_rng(parts), 301)
    whole = evaluated(name, case.settings, batch)
    merged = TYPES[name](**case.settings)
    for piece in split(batch, parts):
        merged.merge(evaluated(name, case.settings, piece))
    assert_same_result(merged, whole, case)
    before = whole.to_dict()
    assert whole.merge(TYPES[name](**case.settings)).to_dict() == before  # an empty evaluation adds nothing
    assert TYPES[name](**case.settings).merge(whole).to_dict() == before


def test_json_and_yaml_round_trip(subject: tuple[str, Case]) -> None:
    name, case = subject
    kind = TYPES[name]
    for e in (evaluated(name, case.settings, case.data(np.random.default_rng(0), 101)), kind(**case.settings)):
        assert e.to_dict()["type"] == name == kind.type_name
        for back in (
            kind.from_json(e.to_json()),
            kind.from_yaml(e.to_yaml()),
            BaseEvaluation.from_json(e.to_json()),
            BaseEvaluation.from_yaml(e.to_yaml()),
        ):
            assert type(back) is kind and back == e
            assert back.to_json() == e.to_json() and back.stats() == e.stats()


def test_merge_with_other_settings_is_refused(subject: tuple[str, Case]) -> None:
    name, case = subject
    batch = case.data(np.random.default_rng(1), 50)
    mine, theirs = evaluated(name, case.settings, batch), evaluated(name, {**case.settings, **case.other}, batch)
    for a, b in ((mine, theirs), (theirs, mine)):
        before = a.to_dict()
        for key in case.other:
            with pytest.raises(IncompatibleEvaluationError, match=key):
                a.merge(b)
        assert a.to_dict() == before


def test_another_type_is_refused(subject: tuple[str, Case]) -> None:
    name, case = subject
    other = REGISTERED[(REGISTERED.index(name) + 1) % len(REGISTERED)]
    if other == name:
        pytest.skip("only one evaluation type is registered")
    first_case = next(iter(CASES[other].values()))
    theirs = evaluated(other, first_case.settings, first_case.data(np.random.default_rng(2), 20))
    with pytest.raises(IncompatibleEvaluationError):
        TYPES[name](**case.settings).merge(theirs)
    with pytest.raises(IncompatibleEvaluationError):
        TYPES[name].from_json(theirs.to_json())
