"""The session lifecycle both masters run (``dlscale.training._session``), with a third master on it:
``tests/synchronous_master.py``, synchronous SGD that averages every step, against one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlscale import SparkNet
from dlscale.data import DataSet, export_minibatches, list_paths, load
from tests.synchronous_master import SynchronousTrainingMaster
from tests.test_training import data, mlp_network, one_thread  # noqa: F401 (a fixture)


@pytest.mark.usefixtures("one_thread")
def test_a_third_master_on_the_base_trains_as_one_process_on_the_merged_minibatches(sc, tmp_path) -> None:
    """Two trainers, each step one minibatch each, their gradients averaged by examples: one process
    stepping on the two minibatches merged, step for step (steps run on across the epochs' end, and the
    fit's last has one minibatch: the other trainer adds a zero gradient of no examples)."""
    x, y = data(10 * 16 + 5)
    export_minibatches(sc.parallelize([DataSet(x, y)], 1), str(tmp_path / "mb"), 16)
    paths = list_paths(sc, str(tmp_path / "mb"))
    spark_net = SparkNet(sc, mlp_network(), SynchronousTrainingMaster(16, rng_seed=3))
    spark_net.fit_paths(paths, epochs=2)

    urls = paths.collect()
    order = np.concatenate([np.random.default_rng([3, epoch]).permutation(len(urls)) for epoch in range(2)])
    reference = mlp_network()
    for i in range(0, len(order), 2):
        reference.fit_batch(DataSet.merge([load(urls[j]) for j in order[i : i + 2]]))
    torch.testing.assert_close(spark_net.network.params(), reference.params(), rtol=0, atol=1e-5)
    assert not torch.equal(spark_net.network.params(), mlp_network().params())
    assert spark_net.network.iteration == 11 and spark_net.network.epoch == 2
