"""The session lifecycle both masters run (``dlscale.training._session``), with a third master on it:
``tests/synchronous_master.py``, synchronous SGD that averages every step, against one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlscale import SparkNet
from dlscale.data import DataSet, export_minibatches, list_paths, load
from dlscale.monitor import record
from dlscale.monitor.stats import EpochTally, TrainingStats
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


def exactly_once(stats: TrainingStats, per_epoch: int, epochs: int) -> int:
    """Check a fit's exactly-once tally: an epoch each of ``per_epoch`` minibatches, each fitted (once,
    or redone after a lost trainer held it), none lost and none twice. Returns how many were redone."""
    tallies = stats.exactly_once
    assert [t.planned for t in tallies] == [per_epoch] * epochs, tallies
    assert all(t.lost == 0 and t.duplicated == 0 and t.once + t.redone == t.planned for t in tallies), tallies
    return sum(t.redone for t in tallies)


def test_every_fit_tallies_what_its_trainers_reported_and_records_it(sc, tmp_path, monkeypatch, caplog) -> None:
    """Counted from the trainers' reports, per epoch of each fit (the record's epochs go on from the
    network's): in the statistics, and one line per fit in the file ``DLSCALE_RECORD`` names. Nothing
    was lost or redone, so the fit says nothing of it."""
    x, y = data(10 * 16 + 5)
    rdd = sc.parallelize(DataSet(x, y).batch_by(16), 2)
    monkeypatch.setenv(record.RECORD_ENV, str(tmp_path / "record.jsonl"))
    spark_net = SparkNet(sc, mlp_network(), SynchronousTrainingMaster(16, rng_seed=3, collect_training_stats=True))
    with caplog.at_level("INFO", logger="dlscale.training"):
        spark_net.fit(rdd, epochs=2)
        spark_net.fit(rdd, epochs=1)
    assert spark_net.training_stats.exactly_once == [EpochTally(e, 11, 11, 0, 0, 0) for e in range(3)]
    assert exactly_once(spark_net.training_stats, 11, 3) == 0
    fits = [r for r in record.read(tmp_path / "record.jsonl") if r["kind"] == "fit"]
    assert [[e["epoch"] for e in f["epochs"]] for f in fits] == [[0, 1], [2]]
    assert all(f["approach"] == "synchronous SGD" and f["workers_lost"] == [] and f["seconds"] > 0 for f in fits)
    assert fits[-1]["epochs"] == [{"epoch": 2, "planned": 11, "once": 11, "redone": 0, "lost": 0, "duplicated": 0}]
    assert "redone" not in caplog.text
