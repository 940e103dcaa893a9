"""The contract every registered threshold algorithm and residual post-processor meets, checked for
each of them: made by name with its defaults, pickled and cloned into an independent copy, and
following its update contract (``dlscale/encoding/thresholds.py``, ``dlscale/encoding/residual.py``).
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from dlscale import registry
from dlscale.encoding import ResidualPostProcessor, ThresholdAlgorithm, residual_post_processor, threshold_algorithm

ALGORITHMS = registry.get("threshold_algorithm").view
POST_PROCESSORS = registry.get("residual_post_processor").view
TINY, HUGE = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
SPARSITIES = [0.0, 1e-5, 1e-3, 0.02, 0.07, 0.5, 1.0, 0.0, 1e-4]
LENGTHS = [None, 1, 100, 20_000, 10**7]


def assert_valid_threshold(value: float) -> None:
    """A threshold is a positive, finite float32 value."""
    assert type(value) is float and math.isfinite(value) and TINY <= value <= HUGE


def trajectory(algorithm: ThresholdAlgorithm) -> list[float]:
    return [algorithm.update(s, n) for s, n in zip(SPARSITIES * 2, LENGTHS * 4)]


# -- threshold algorithms -------------------------------------------------------------------------
@pytest.fixture(params=sorted(ALGORITHMS))
def algorithm(request: pytest.FixtureRequest) -> ThresholdAlgorithm:
    """A fresh algorithm of every registered name, made by name with its defaults."""
    made = threshold_algorithm(request.param)
    assert isinstance(made, ALGORITHMS[request.param]) and isinstance(made, ThresholdAlgorithm)
    return made


def test_algorithm_update_returns_the_next_threshold(algorithm: ThresholdAlgorithm) -> None:
    assert_valid_threshold(algorithm.threshold)
    for sparsity, length in zip(SPARSITIES, LENGTHS * 2):
        returned = algorithm.update(sparsity, length)
        assert returned == algorithm.threshold
        assert_valid_threshold(returned)


def test_algorithm_threshold_stays_a_positive_float32(algorithm: ThresholdAlgorithm) -> None:
    for sparsity in (0.0, 1.0, 0.0):
        for _ in range(500):
            assert_valid_threshold(algorithm.update(sparsity))


@pytest.mark.parametrize(
    ("sparsity", "length", "message"),
    [
        (-0.1, None, "sparsity must be a number in"),
        (1.5, None, "sparsity must be a number in"),
        (float("nan"), None, "sparsity must be a number in"),
        (True, None, "sparsity must be a number in"),
        ("0.1", None, "sparsity must be a number in"),
        (0.1, 0, "length must be a positive integer"),
        (0.1, -5, "length must be a positive integer"),
        (0.1, 2.5, "length must be a positive integer"),
        (0.1, True, "length must be a positive integer"),
    ],
)
def test_algorithm_refuses_bad_updates(algorithm: ThresholdAlgorithm, sparsity, length, message: str) -> None:
    before = algorithm.threshold
    with pytest.raises(ValueError, match=message):
        algorithm.update(sparsity, length)
    assert algorithm.threshold == before


def test_algorithm_pickles_and_clones(algorithm: ThresholdAlgorithm) -> None:
    algorithm.update(0.5)
    back = pickle.loads(pickle.dumps(algorithm))
    copy = algorithm.clone()
    for other in (back, copy):
        assert type(other) is type(algorithm) and other is not algorithm
        assert other.threshold == algorithm.threshold and repr(other) == repr(algorithm)
    before = algorithm.threshold
    copy_path = trajectory(copy)
    assert algorithm.threshold == before  # the clone is independent
    assert trajectory(back) == copy_path == trajectory(algorithm)  # and all three follow the same rule


# -- residual post-processors ---------------------------------------------------------------------
@pytest.fixture(params=sorted(POST_PROCESSORS))
def processor(request: pytest.FixtureRequest) -> ResidualPostProcessor:
    """A fresh post-processor of every registered name, made by name with its defaults."""
    made = residual_post_processor(request.param)
    assert isinstance(made, POST_PROCESSORS[request.param]) and isinstance(made, ResidualPostProcessor)
    return made


def test_processor_changes_the_residual_in_place_towards_zero(processor: ResidualPostProcessor) -> None:
    g = torch.Generator().manual_seed(0)
    for iteration in range(13):
        threshold = 0.05 * (1 + iteration % 3)
        residual = torch.randn(1000, generator=g) * 10 ** torch.randint(-3, 2, (1000,), generator=g)
        before = residual.clone()
        storage = residual.data_ptr()
        assert processor.process(iteration, threshold, residual) is None
        assert residual.data_ptr() == storage and residual.shape == before.shape and residual.dtype == before.dtype
        assert torch.all(residual.abs() <= before.abs())  # never away from zero ...
        assert torch.all((residual == 0) | (torch.sign(residual) == torch.sign(before)))  # ... nor past it


def test_processor_pickles_and_clones(processor: ResidualPostProcessor) -> None:
    back = pickle.loads(pickle.dumps(processor))
    copy = processor.clone()
    residual = torch.linspace(-3, 3, 101)
    for other in (back, copy):
        assert type(other) is type(processor) and other is not processor and repr(other) == repr(processor)
        for iteration in range(11):
            mine, theirs = residual.clone(), residual.clone()
            processor.process(iteration, 0.1, mine)
            other.process(iteration, 0.1, theirs)
            assert torch.equal(mine, theirs)
