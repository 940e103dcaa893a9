"""SparkNet with parameter averaging, on real worker processes, against single-process PyTorch."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import platform
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dask
import pytest
import torch
from dask.utils import key_split
from distributed import get_task_stream

import dlscale
from dlscale import (
    CorruptDataError,
    NetworkSerializationError,
    ParameterAveragingTrainingMaster,
    SharedTrainingMaster,
    SparkContext,
    SparkNet,
)
from dlscale.data import (
    DataSet,
    DataSetLoader,
    DataShapeError,
    MultiDataSet,
    export_minibatches,
    list_paths,
    load,
    save,
)
from dlscale.nn import Network, ScoreIterationListener
from dlscale.nn.listeners import TrainingListener
from dlscale.runtime.cluster import cluster_workers
from dlscale.training import _worker
from dlscale.training._errors import TrainingConfigError
from dlscale.training.averaging._worker_plugin import plugin
from tests.test_embedded import _faults_of_a_reused_buffer, _huge_pages_always
from tests.test_sharing import _networks_held, _SentNetworks

SGD = functools.partial(torch.optim.SGD, lr=0.1)
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


def mlp_network(optimizer=SGD, seed: int = 0, norm: bool = False) -> Network:
    torch.manual_seed(seed)
    layers = (
        [torch.nn.Linear(6, 12)]
        + ([torch.nn.BatchNorm1d(12)] if norm else [])
        + [torch.nn.Tanh(), torch.nn.Linear(12, 3)]
    )
    return Network(torch.nn.Sequential(*layers), "cross_entropy", optimizer)


def data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()


def rdd_of(sc: SparkContext, n: int, piece: int, slices: int):
    """An RDD of DataSets of ``piece`` examples; pieces do not line up with minibatches."""
    x, y = data(n)
    return sc.parallelize([DataSet(x[i : i + piece], y[i : i + piece]) for i in range(0, n, piece)], slices)


def trained_order(stats: dlscale.TrainingStats) -> Iterator[list[list[str]]]:
    """Per round, the minibatch files each worker fitted, as the statistics recorded them."""
    for r in stats.rounds:
        yield [w.batches for w in r.workers]


@pytest.fixture(scope="module")
def sc1() -> Iterator[SparkContext]:
    """One worker process with one thread."""
    with SparkContext("local[1]", "dlscale-training-1") as context:
        yield context


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Single-process references compute with one thread, as each worker does."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_two_workers_equal_one_process_with_twice_the_batch(sc, tmp_path, one_thread) -> None:
    """Plain SGD, averaging every minibatch: W workers of batch B are one process of batch W*B."""
    rdd = rdd_of(sc, 240, 7, 3)
    master = ParameterAveragingTrainingMaster(
        10, averaging_frequency=1, collect_training_stats=True, rng_seed=5, export_directory=str(tmp_path / "export")
    )
    spark_net = SparkNet(sc, mlp_network(), master)
    spark_net.fit(rdd, epochs=2)

    reference = mlp_network()
    rounds = list(trained_order(spark_net.training_stats))
    assert len(rounds) == 2 * 12 and all(len(r) == 2 for r in rounds)
    for shares in rounds:
        batches = [load(path) for share in shares for path in share]
        reference.fit_batch(DataSet.merge(batches))
    torch.testing.assert_close(spark_net.network.params(), reference.params(), rtol=0, atol=1e-5)
    assert not torch.equal(spark_net.network.params(), mlp_network().params())
    assert spark_net.network.epoch == 2 and spark_net.network.iteration == 24


@pytest.mark.parametrize("streaming", [False, True])
def test_one_worker_equals_one_process_exactly(sc1, tmp_path, one_thread, streaming) -> None:
    """One worker carrying momentum across rounds of 3 minibatches is single-process training."""
    rdd = rdd_of(sc1, 200, 9, 2)
    master = ParameterAveragingTrainingMaster(
        16,
        averaging_frequency=3,
        streaming=streaming,
        collect_training_stats=True,
        rng_seed=2,
        export_directory=str(tmp_path / "export"),
    )
    spark_net = SparkNet(sc1, mlp_network(MOMENTUM), master)
    spark_net.fit(rdd, epochs=2)

    reference = mlp_network(MOMENTUM)
    for shares in trained_order(spark_net.training_stats):
        (share,) = shares
        for path in share:
            reference.fit_batch(load(path))
    assert torch.equal(spark_net.network.params(), reference.params())
    state, ref_state = spark_net.network.optimizer_state()["state"], reference.optimizer_state()["state"]
    for i in ref_state:
        assert torch.equal(state[i]["momentum_buffer"], ref_state[i]["momentum_buffer"])


@pytest.mark.parametrize("mask", ["per example", "per output"])
def test_labels_masks_reach_the_workers_and_train_as_in_one_process(sc1, tmp_path, one_thread, mask) -> None:
    """Masked examples (or outputs) carry labels that would wreck the fit: through export, the
    minibatch files and a worker, the masks leave them out exactly as a single process does."""
    x, y = data(120, seed=3)
    g = torch.Generator().manual_seed(4)
    if mask == "per example":
        keep = torch.rand(120, generator=g) > 0.3
        labels = torch.where(keep, y, 2 - y)  # masked examples get wrong classes
        network = functools.partial(mlp_network, MOMENTUM)
    else:
        keep = torch.rand(120, 3, generator=g) > 0.3
        labels = torch.nn.functional.one_hot(y, 3).float().masked_fill(~keep, 50.0)  # masked: absurd targets

        def network() -> Network:
            return Network(mlp_network(MOMENTUM).module, "mse", MOMENTUM)

    pieces = [DataSet(x[i : i + 11], labels[i : i + 11], None, keep[i : i + 11].float()) for i in range(0, 120, 11)]
    master = ParameterAveragingTrainingMaster(
        16, averaging_frequency=2, collect_training_stats=True, rng_seed=2, export_directory=str(tmp_path / "export")
    )
    spark_net = SparkNet(sc1, network(), master)
    spark_net.fit(sc1.parallelize(pieces, 2), epochs=2)

    reference, unmasked = network(), network()
    for shares in trained_order(spark_net.training_stats):
        (share,) = shares
        for path in share:
            batch = load(path)
            assert batch.labels_mask is not None and batch.labels_mask.shape == (len(batch.features), *keep.shape[1:])
            reference.fit_batch(batch)
            unmasked.fit_batch(DataSet(batch.features, batch.labels))
    assert torch.equal(spark_net.network.params(), reference.params())
    assert not torch.allclose(unmasked.params(), reference.params(), atol=0.05)  # the masks matter


def test_without_save_updater_the_optimizer_restarts_every_round(sc1, tmp_path, one_thread) -> None:
    rdd = rdd_of(sc1, 120, 10, 2)
    master = ParameterAveragingTrainingMaster(
        10,
        averaging_frequency=2,
        save_updater=False,
        collect_training_stats=True,
        rng_seed=4,
        export_directory=str(tmp_path / "export"),
    )
    spark_net = SparkNet(sc1, mlp_network(MOMENTUM), master)
    spark_net.fit(rdd)

    reference = mlp_network(MOMENTUM)
    for (share,) in trained_order(spark_net.training_stats):
        reference.optimizer.state.clear()
        for path in share:
            reference.fit_batch(load(path))
    assert torch.equal(spark_net.network.params(), reference.params())


def test_buffers_and_optimizer_state_are_averaged_by_examples(sc, tmp_path, one_thread) -> None:
    """BatchNorm statistics (buffers, not parameters) and momentum are averaged like the parameters."""
    rdd = rdd_of(sc, 48, 8, 2)
    master = ParameterAveragingTrainingMaster(
        16, averaging_frequency=2, collect_training_stats=True, rng_seed=1, export_directory=str(tmp_path / "export")
    )
    spark_net = SparkNet(sc, mlp_network(MOMENTUM, norm=True), master)
    spark_net.fit(rdd)

    (shares,) = trained_order(spark_net.training_stats)
    assert sorted(len(s) for s in shares) == [1, 2]
    replicas, weights = [], []
    for share in shares:
        replica = mlp_network(MOMENTUM, norm=True)
        for path in share:
            replica.fit_batch(load(path))
        replicas.append(replica)
        weights.append(sum(load(p).num_examples() for p in share))
    w = torch.tensor(weights, dtype=torch.float64) / sum(weights)

    def mean(tensors: list[torch.Tensor]) -> torch.Tensor:
        return sum(t.double() * wi for t, wi in zip(tensors, w)).float()

    net = spark_net.network
    torch.testing.assert_close(net.params(), mean([r.params() for r in replicas]), rtol=0, atol=1e-6)
    bn = net.module[1]
    torch.testing.assert_close(bn.running_var, mean([r.module[1].running_var for r in replicas]), rtol=0, atol=1e-6)
    momentum = net.optimizer_state()["state"][0]["momentum_buffer"]
    expected = mean([r.optimizer_state()["state"][0]["momentum_buffer"] for r in replicas])
    torch.testing.assert_close(momentum, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("outer", ["nesterov", "plain"])
def test_diloco_s_outer_step_moves_the_parameters_by_the_averaged_change(sc, tmp_path, one_thread, outer) -> None:
    """With ``outer_optimizer`` the trainers step an optimizer over the round's starting parameters with
    the averaged change, negated, as their gradient (DiLoCo): checked against the same rounds replayed
    in this process; an outer SGD of lr 1 without momentum is plain averaging."""
    factory = (
        functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        if outer == "nesterov"
        else functools.partial(torch.optim.SGD, lr=1.0)
    )
    rdd = rdd_of(sc, 160, 10, 2)
    master = ParameterAveragingTrainingMaster(
        10,
        averaging_frequency=2,
        outer_optimizer=factory,
        collect_training_stats=True,
        rng_seed=3,
        export_directory=str(tmp_path / "export"),
    )
    spark_net = SparkNet(sc, mlp_network(MOMENTUM), master)
    spark_net.fit(rdd, epochs=2)

    start = mlp_network(MOMENTUM)
    anchor = start.params().clone()
    outer_optimizer = factory([anchor])
    state = _worker.state_of(start, True)
    for shares in trained_order(spark_net.training_stats):
        states = []
        for share in shares:
            replica = mlp_network(MOMENTUM)
            _worker.apply_state(replica, state)
            for path in share:
                replica.fit_batch(load(path))
            states.append(
                {
                    **_worker.state_of(replica, True),
                    "examples": 10 * len(share),
                    "batches": 1,
                    "score": 0.0,
                    "shares": [],
                }
            )
        average = _worker.average(*states)
        anchor.grad = anchor - average["params"]  # the averaged change, negated
        outer_optimizer.step()
        state = {**average, "params": anchor.detach().clone()}
    torch.testing.assert_close(spark_net.network.params(), state["params"], rtol=0, atol=1e-5)
    if outer == "plain":  # plain averaging, the default, by the same rounds
        again = dataclasses.replace(master, outer_optimizer=None, export_directory=str(tmp_path / "again"))
        plain = SparkNet(sc, mlp_network(MOMENTUM), again)
        plain.fit(rdd, epochs=2)
        torch.testing.assert_close(plain.network.params(), spark_net.network.params(), rtol=0, atol=1e-5)


def _carried(average: dict[str, Any], sent: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """A streaming trainer's state as it takes a round's ``average`` one round late: the average plus
    what it fitted since it ``sent`` its state (for every averaged tensor)."""

    def carry(a: Any, s: Any, n: Any) -> Any:
        return a + (n - s) if torch.is_tensor(a) and a.is_floating_point() and a.dim() > 0 else a

    states = average["optimizer"]["state"]
    return {
        "params": carry(average["params"], sent["params"], now["params"]),
        "buffers": {k: carry(v, sent["buffers"][k], now["buffers"][k]) for k, v in average["buffers"].items()},
        "optimizer": {
            **average["optimizer"],
            "state": {
                i: {
                    key: carry(v, sent["optimizer"]["state"][i][key], now["optimizer"]["state"][i][key])
                    for key, v in st.items()
                }
                for i, st in states.items()
            },
        },
    }


def test_streaming_rounds_take_each_average_during_the_next_round(sc, tmp_path, one_thread) -> None:
    """``streaming=True``: each trainer fits round k + 1 from its own state while round k is averaged,
    and takes round k's average, plus what it fitted since (parameters, batch-norm statistics and
    momentum alike), as soon as it is whole, after half of round k + 1 at the latest (as recorded);
    the fit ends on the last round's average. Checked against the same rounds replayed in this
    process, and unlike plain averaging of them."""
    rdd = rdd_of(sc, 160, 10, 2)
    master = ParameterAveragingTrainingMaster(
        10,
        averaging_frequency=4,
        streaming=True,
        collect_training_stats=True,
        rng_seed=3,
        export_directory=str(tmp_path / "export"),
    )
    spark_net = SparkNet(sc, mlp_network(MOMENTUM, norm=True), master)
    spark_net.fit(rdd, epochs=4)

    start = _worker.state_of(mlp_network(MOMENTUM, norm=True), True)
    replicas: dict[str, Network] = {}
    sent: dict[str, dict[str, Any]] = {}
    average = plain = start
    rounds = spark_net.training_stats.rounds
    assert len(rounds) == 8 and all(len(r.workers) == 2 for r in rounds)
    for r in rounds:
        for share in r.workers:
            if share.worker not in replicas:
                replicas[share.worker] = mlp_network(MOMENTUM, norm=True)
            net = replicas[share.worker]
            assert share.late_steps <= (len(share.batches) + 1) // 2 and (share.late_steps > 0) == bool(sent)
            for path in share.batches[: share.late_steps]:
                net.fit_batch(load(path))
            if sent:  # the last round's average comes: carried over what was fitted since
                _worker.apply_state(net, _carried(average, sent[share.worker], _worker.state_of(net, True)))
            for path in share.batches[share.late_steps :]:
                net.fit_batch(load(path))
        sent = {w: _worker.state_of(net, True) for w, net in replicas.items()}
        average = _worker.average(
            *[
                {**sent[share.worker], "examples": share.examples, "batches": 1, "score": 0.0, "shares": []}
                for share in r.workers
            ]
        )
        states = []
        for share in r.workers:  # plain averaging of the same rounds, for contrast
            net = mlp_network(MOMENTUM, norm=True)
            _worker.apply_state(net, plain)
            for path in share.batches:
                net.fit_batch(load(path))
            states.append(
                {**_worker.state_of(net, True), "examples": share.examples, "batches": 1, "score": 0.0, "shares": []}
            )
        plain = _worker.average(*states)
    result = _worker.state_of(spark_net.network, True)
    torch.testing.assert_close(result["params"], average["params"], rtol=0, atol=1e-5)
    torch.testing.assert_close(result["buffers"], average["buffers"], rtol=0, atol=1e-5)
    momentum = {i: s["momentum_buffer"] for i, s in result["optimizer"]["state"].items()}
    expected = {i: s["momentum_buffer"] for i, s in average["optimizer"]["state"].items()}
    torch.testing.assert_close(momentum, expected, rtol=0, atol=1e-5)
    assert float((result["params"] - plain["params"]).abs().max()) > 1e-3


@pytest.mark.slow  # a second local[2] context; the default run covers both ways (test_tls: Dask's comms)
def test_parts_go_over_the_workers_own_connections_or_through_dask_s_comms_alike(sc, tmp_path, one_thread) -> None:
    """``dlscale.training.transport``: ``"tcp"`` (the default: each worker connects to the other's
    listener) or ``"dask"`` (``worker.rpc``: no listener): the same fit to the last bit."""

    def fit(context: SparkContext, folder: str) -> torch.Tensor:
        master = ParameterAveragingTrainingMaster(
            10, averaging_frequency=2, rng_seed=4, export_directory=str(tmp_path / folder)
        )
        spark_net = SparkNet(context, mlp_network(MOMENTUM, norm=True), master)
        spark_net.fit(rdd_of(context, 160, 10, 2), epochs=2)
        return spark_net.network.params()

    def connected(context: SparkContext) -> dict[str, list[str] | None]:
        def peers(dask_worker: Any) -> list[str] | None:
            sockets = plugin(dask_worker).sockets
            return None if sockets is None else sockets.peers

        return context.client.run(peers)

    over_tcp = fit(sc, "tcp")
    a, b = sorted(cluster_workers(sc.client))
    peers = connected(sc)
    assert b in peers[a] and a in peers[b]  # (and the workers of earlier tests' fits, until idle)
    with dask.config.set({"dlscale.training.transport": "dask"}), SparkContext("local[2]", "dask-comms") as other:
        through_dask = fit(other, "dask")
        assert list(connected(other).values()) == [None, None]
    torch.testing.assert_close(over_tcp, through_dask, rtol=0, atol=0)


@pytest.mark.parametrize("dtype, bound", [("float16", 1e-4), ("int8", 1.5e-2)])
def test_an_exchange_in_fewer_bits_moves_the_fit_by_its_rounding(sc, tmp_path, dtype, bound) -> None:
    """The states' parts travel in ``dtype``: the fit lands near the float32 one (the parameters moved
    up to 0.6 in this fit; measured 7.4e-5 away in float16, 1.3e-2 in int8), and not on it."""
    rdd = rdd_of(sc, 160, 10, 2)
    params = {}
    for d in ("float32", dtype):
        master = ParameterAveragingTrainingMaster(
            10, averaging_frequency=2, exchange_dtype=d, rng_seed=3, export_directory=str(tmp_path / d)
        )
        spark_net = SparkNet(sc, mlp_network(MOMENTUM, norm=True), master)
        spark_net.fit(rdd, epochs=2)
        params[d] = spark_net.network.params()
    assert 0 < float((params[dtype] - params["float32"]).abs().max()) <= bound


def _profiling(dask_worker: Any) -> bool:
    return dask_worker.periodic_callbacks["profile"].is_running()


def _profile_training(value: bool, dask_worker: Any = None) -> None:
    dask.config.set({"dlscale.worker.profile-training": value})


class _ProfilerSeen(TrainingListener):
    """Whether each worker's sampling profiler runs, seen at a fit's first reported step."""

    def __init__(self, sc: SparkContext) -> None:
        self.sc, self.seen = sc, None

    def iteration_done(self, network: Network, iteration: int, epoch: int, score: float, examples: int) -> None:
        if self.seen is None:
            self.seen = set(self.sc.client.run(_profiling).values())


@pytest.mark.parametrize("profile_training", [False, True])
def test_dask_s_profiler_is_paused_while_trainers_train(sc, tmp_path, profile_training) -> None:
    """The dashboard's sampling profiler stops on a worker while a trainer runs there (it costs the
    steps), and starts again after; ``dlscale.worker.profile-training: true`` leaves it running."""
    sc.client.run(_profile_training, profile_training)
    try:
        for master in (
            ParameterAveragingTrainingMaster(10, averaging_frequency=2, export_directory=str(tmp_path / "a")),
            SharedTrainingMaster(10, export_directory=str(tmp_path / "s")),
        ):
            seen = _ProfilerSeen(sc)
            spark_net = SparkNet(sc, mlp_network(), master)
            spark_net.set_listeners(seen)
            # long enough that the driver hears of the first steps while the trainers still train
            spark_net.fit(rdd_of(sc, 400, 10, 2), epochs=12)
            assert seen.seen == {profile_training}, type(master).__name__
            deadline = time.monotonic() + 5  # restarted on each worker's event loop
            while set(sc.client.run(_profiling).values()) != {True} and time.monotonic() < deadline:
                time.sleep(0.05)
            assert set(sc.client.run(_profiling).values()) == {True}
    finally:
        sc.client.run(_profile_training, False)


def test_direct_trains_like_export_and_never_moves_minibatches(sc, tmp_path) -> None:
    rdd = rdd_of(sc, 160, 10, 2).persist(dlscale.StorageLevel.MEMORY_ONLY_SER)
    results = {}
    for approach in ("export", "direct"):
        master = ParameterAveragingTrainingMaster(
            10,
            averaging_frequency=2,
            rdd_training_approach=approach,
            rng_seed=9,
            export_directory=str(tmp_path / "export"),
        )
        spark_net = SparkNet(sc, mlp_network(), master)
        spark_net.fit(rdd, epochs=2)
        results[approach] = spark_net.network.params().clone()
    torch.testing.assert_close(results["direct"], results["export"], rtol=0, atol=1e-6)

    # "never": each worker trains the minibatches it holds, the same ones in every epoch
    master = ParameterAveragingTrainingMaster(
        10, averaging_frequency=2, rdd_training_approach="direct", repartition="never", collect_training_stats=True
    )
    spark_net = SparkNet(sc, mlp_network(), master)
    spark_net.fit(rdd, epochs=2)
    owner: dict[int, dict[str, str]] = {0: {}, 1: {}}
    for r in spark_net.training_stats.rounds:
        for share in r.workers:
            owner[r.epoch].update(dict.fromkeys(share.batches, share.worker))
    assert len(owner[0]) == 16 and owner[0] == owner[1]
    assert len(set(owner[0].values())) == 2
    rdd.unpersist()


class TwoInputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = torch.nn.Linear(4, 8), torch.nn.Linear(2, 8), torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.a(x) + self.b(z)))


def test_fit_paths_trains_multidatasets_with_a_custom_loader(sc, tmp_path, one_thread) -> None:
    x, y = data(96)
    export_minibatches(
        [MultiDataSet([x[i : i + 8, :4], x[i : i + 8, 4:]], [y[i : i + 8]]) for i in range(0, 96, 8)],
        str(tmp_path / "mds"),
        16,
    )
    paths = list_paths(sc, str(tmp_path / "mds"))
    calls = []
    torch.manual_seed(0)
    network = Network(TwoInputs(), "cross_entropy", SGD)
    master = ParameterAveragingTrainingMaster(16, averaging_frequency=1, collect_training_stats=True)
    spark_net = SparkNet(sc, network, master)
    listener = ScoreIterationListener(1)
    spark_net.set_listeners(listener)
    spark_net.fit_paths(paths, loader=load, epochs=3)
    calls = listener.history
    assert [i for i, _ in calls] == list(range(1, 10))

    torch.manual_seed(0)
    reference = Network(TwoInputs(), "cross_entropy", SGD)
    for shares in trained_order(spark_net.training_stats):
        batches = [load(p) for share in shares for p in share]
        reference.fit_batch(MultiDataSet.merge(batches))
    torch.testing.assert_close(network.params(), reference.params(), rtol=0, atol=1e-5)
    assert calls[-1][1] == pytest.approx(spark_net.training_stats.rounds[-1].score)


def test_exports_once_per_rdd_and_deletes_its_files(sc, tmp_path) -> None:
    rdd = rdd_of(sc, 64, 8, 2)
    master = ParameterAveragingTrainingMaster(8, export_directory=str(tmp_path / "export"), collect_training_stats=True)
    spark_net = SparkNet(sc, mlp_network(), master)
    spark_net.fit(rdd)
    spark_net.fit(rdd)
    (exported,) = (tmp_path / "export").iterdir()
    assert len(list(exported.iterdir())) == 8
    assert spark_net.network.epoch == 2 and len(spark_net.training_stats.rounds) == 2
    master.delete_temp_files()
    assert list((tmp_path / "export").iterdir()) == []


def test_a_later_fit_of_an_exported_rdd_computes_none_of_it_and_probes_its_files(sc, tmp_path) -> None:
    """A later fit trains from the files of the first: the RDD is not computed again (not even its first
    element, which the first fit scored on the driver), and a network that does not fit them is
    refused on a worker, before training, with the minibatch named."""
    seen = tmp_path / "seen"
    seen.mkdir()

    def counted(element: DataSet) -> DataSet:
        (seen / uuid.uuid4().hex).touch()
        return element

    rdd = rdd_of(sc, 64, 8, 2).map(counted)
    master = ParameterAveragingTrainingMaster(8, export_directory=str(tmp_path / "export"))
    spark_net = SparkNet(sc, mlp_network(), master)
    spark_net.fit(rdd)
    computed = len(list(seen.iterdir()))
    assert computed >= 8  # every element, at least once
    spark_net.fit(rdd)
    assert len(list(seen.iterdir())) == computed and spark_net.network.epoch == 2

    torch.manual_seed(0)
    wrong = Network(torch.nn.Sequential(torch.nn.Linear(6, 3)), "mse", SGD)  # 3 outputs, a class label each
    before = wrong.params().clone()
    with pytest.raises(DataShapeError, match="do not fit loss 'mse'") as info:
        SparkNet(sc, wrong, master).fit(rdd)
    assert any("before training" in note and "dataset_00000000" in note for note in info.value.__notes__)
    assert len(list(seen.iterdir())) == computed
    assert wrong.iteration == 0 and torch.equal(wrong.params(), before)


def _fit_in_job_groups(sc: SparkContext, fits: dict[str, Callable[[Network], None]]) -> list[Network]:
    """Each of ``fits`` on a new network, in a job group of its own named by its key; the networks, in
    order. The module's context goes on without a job group."""
    networks = []
    try:
        for group, fit in fits.items():
            network = mlp_network()
            sc.setJobGroup(group, group)
            fit(network)
            networks.append(network)
    finally:
        for key in ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel"):
            sc.setLocalProperty(key, None)
    return networks


def test_a_parallelized_rdd_is_counted_probed_and_exported_on_the_driver_where_it_is_held(sc, tmp_path) -> None:
    """The partitions of an RDD made by parallelize are on the driver: a fit counts their examples,
    scores the first element and writes the files there, with no job (which would ship them to the
    workers and back), and trains as a fit of the same elements computed on the workers does; a bad
    first element is refused as before."""
    x, y = data(64)
    pieces = [DataSet(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)]
    held = sc.parallelize(pieces, 2)
    computed = sc.parallelize(pieces, 2).map(lambda element: element)
    assert held.local_partitions() is not None and computed.local_partitions() is None

    def fit(rdd: Any, group: str) -> Callable[[Network], None]:
        master = ParameterAveragingTrainingMaster(8, rng_seed=0, export_directory=str(tmp_path / group))
        return lambda network: SparkNet(sc, network, master).fit(rdd)

    networks = _fit_in_job_groups(sc, {"held": fit(held, "held"), "computed": fit(computed, "computed")})
    tracker = sc.statusTracker()
    assert tracker.getJobIdsForGroup("held") == [] and len(tracker.getJobIdsForGroup("computed")) == 2
    torch.testing.assert_close(networks[0].params(), networks[1].params(), rtol=0, atol=0)
    with pytest.raises(TypeError, match="fit trains on an RDD of DataSet"):
        SparkNet(sc, mlp_network(), ParameterAveragingTrainingMaster(8)).fit(sc.parallelize([[], [1]], 2))


def test_fit_paths_reads_paths_the_driver_holds_without_a_job(sc, tmp_path) -> None:
    """``list_paths`` gives an RDD the driver holds: ``fit_paths`` reads its paths there, with no job
    (a job of a few milliseconds is a fixed cost of every fit), and trains as on the same paths computed."""
    x, y = data(64)
    export_minibatches([DataSet(x, y)], str(tmp_path / "files"), 8)
    held = list_paths(sc, str(tmp_path / "files"))
    computed = held.map(lambda path: path)

    def fit(rdd: Any) -> Callable[[Network], None]:
        return lambda network: SparkNet(sc, network, ParameterAveragingTrainingMaster(8, rng_seed=0)).fit_paths(rdd)

    networks = _fit_in_job_groups(sc, {"held paths": fit(held), "computed paths": fit(computed)})
    tracker = sc.statusTracker()
    assert tracker.getJobIdsForGroup("held paths") == [] and len(tracker.getJobIdsForGroup("computed paths")) == 1
    torch.testing.assert_close(networks[0].params(), networks[1].params(), rtol=0, atol=0)


def _not_a_minibatch(path: str) -> dict:
    return {"path": path}


def test_bad_input_is_refused_before_training(sc, tmp_path) -> None:
    x, y = data(40)
    export = tmp_path / "export"
    master = ParameterAveragingTrainingMaster(8, export_directory=str(export))

    with pytest.raises(ValueError, match="the RDD is empty"):
        SparkNet(sc, mlp_network(), master).fit(sc.parallelize([], 2))
    with pytest.raises(ValueError, match="batch_size_per_worker=64 is larger than the whole data set"):
        SparkNet(sc, mlp_network(), ParameterAveragingTrainingMaster(64, export_directory=str(export))).fit(
            sc.parallelize([DataSet(x, y)])
        )
    with pytest.raises(TypeError, match="fit trains on an RDD of DataSet"):
        SparkNet(sc, mlp_network(), master).fit(sc.parallelize([1, 2, 3]))
    with pytest.raises(DataShapeError, match="do not fit loss 'cross_entropy'") as info:
        SparkNet(sc, mlp_network(), master).fit(sc.parallelize([DataSet(x, y.float().unsqueeze(1))]))
    assert "first element" in str(info.value.__notes__)
    assert not export.exists() or not any(export.iterdir())  # nothing was exported

    export_minibatches([DataSet(x, y)], str(tmp_path / "files"), 8)
    paths = list_paths(sc, str(tmp_path / "files"))
    with pytest.raises(TypeError, match="returned a dict"):
        SparkNet(sc, mlp_network(), master).fit_paths(paths, loader=_not_a_minibatch)
    with pytest.raises(ValueError, match="paths RDD is empty"):
        SparkNet(sc, mlp_network(), master).fit_paths(sc.parallelize([], 1))

    network = mlp_network()
    network.module[0].lock = threading.Lock()
    with pytest.raises(NetworkSerializationError, match="attribute 'lock' of module '0'"):
        SparkNet(sc, network, master).fit(rdd_of(sc, 16, 8, 1))
    with pytest.raises(ValueError, match="no optimizer"):
        SparkNet(sc, mlp_network(optimizer=None), master).fit(rdd_of(sc, 16, 8, 1))


def test_a_failing_round_leaves_the_network_as_it_was(sc, tmp_path) -> None:
    x, y = data(64)
    export_minibatches([DataSet(x, y)], str(tmp_path / "files"), 8)
    (tmp_path / "files" / "dataset_00000005.dlb").write_bytes(b"not a minibatch")
    network = mlp_network()
    before = network.params().clone()
    master = ParameterAveragingTrainingMaster(8, averaging_frequency=1)
    with pytest.raises(CorruptDataError, match="dataset_00000005.dlb") as info:
        SparkNet(sc, network, master).fit_paths(list_paths(sc, str(tmp_path / "files")), epochs=2)
    assert any("while training round" in note for note in info.value.__notes__)
    assert torch.equal(network.params(), before) and network.iteration == 0 and network.epoch == 0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("batch_size_per_worker", 0),
        ("averaging_frequency", 0),
        ("exchange_dtype", "float64"),
        ("worker_prefetch_num_batches", -1),
        ("repartition", "sometimes"),
        ("rdd_training_approach", "stream"),
    ],
)
def test_master_settings_are_validated(name, value) -> None:
    kwargs = {"batch_size_per_worker": 8, name: value}
    with pytest.raises(ValueError, match=name):
        ParameterAveragingTrainingMaster(**kwargs)


def test_average_is_exact_for_one_state_and_weighted_by_examples() -> None:
    a = {
        "params": torch.tensor([1.0, 2.0]),
        "buffers": {},
        "optimizer": None,
        "examples": 3,
        "batches": 1,
        "score": 1.0,
        "shares": [],
    }
    b = {**a, "params": torch.tensor([5.0, -2.0]), "examples": 1, "score": 3.0}
    assert _worker.average(a) is a
    both = _worker.average(a, b)
    assert torch.equal(both["params"], torch.tensor([2.0, 1.0])) and both["examples"] == 4
    assert both["score"] == pytest.approx(1.5)
    # a tree of averages is the flat average
    c = {**a, "params": torch.tensor([0.0, 4.0]), "examples": 2}
    torch.testing.assert_close(_worker.average(_worker.average(a, b), c)["params"], _worker.average(a, b, c)["params"])


def test_a_fit_not_told_its_frequency_chooses_it_and_shows_why(sc, tmp_path, caplog) -> None:
    """Without ``averaging_frequency`` a fit streams the longest rounds the bounds allow, about even, from
    its first round (bounds of [4, 30] and 40 minibatches a worker an epoch: 2 rounds of 20); it
    predicts its speedup from what its first averaged rounds measured, and the receipt (the choice,
    why, the predicted and measured speedups) is the closing line and ``TrainingStats.choice``. The
    next fit of the master predicts at once from the last fit's measures. Every minibatch is fitted
    once an epoch."""
    rdd = rdd_of(sc, 800, 10, 2)  # 80 minibatches an epoch
    master = ParameterAveragingTrainingMaster(
        10, collect_training_stats=True, rng_seed=0, export_directory=str(tmp_path / "export")
    )
    spark_net = SparkNet(sc, mlp_network(MOMENTUM), master)
    with (
        dask.config.set({"dlscale.training.averaging.frequency-bounds": [4, 30]}),
        caplog.at_level(logging.INFO, logger="dlscale.training"),
    ):
        spark_net.fit(rdd, epochs=5)
        first = spark_net.training_stats.choice
        # a network this small steps in under a millisecond: one trainer may be predicted faster (see
        # the test after next); here the last fit measured an averaging that costs nothing
        m = master._measures
        master._measures = dataclasses.replace(m, averaging=1e-4, overhead=0.0, contention=0.0, end=0.0)
        spark_net.fit(rdd, epochs=2)
    stats = spark_net.training_stats
    closing = [r.getMessage() for r in caplog.records if "minibatches in" in r.getMessage()]
    assert len(closing) == 2, closing
    assert first["frequency"] == 20 and first["streaming"] and first["source"] == "this fit"
    assert first["predicted"] > 0 and first["measured"] > 0 and first["measures"]["trainers"] == 2
    assert re.fullmatch(
        r"parameter averaging: 400 minibatches in [\d.]+ s on 2 trainers; averaging every 20 minibatches "
        r"in streaming rounds \(a step .+, an averaging .+ of .+, 2 trainers, measured in this fit\): "
        r"predicted [\d.]+x, measured [\d.]+x one trainer",
        closing[0],
    ), closing[0]
    assert "measured in the last fit" in closing[1] and stats.choice["source"] == "the last fit"
    assert stats.choice["frequency"] == 20
    assert all([len(w.batches) for w in r.workers] == [20, 20] for r in stats.rounds)
    fitted = collections.Counter(path for r in stats.rounds for w in r.workers for path in w.batches)
    assert len(fitted) == 80 and set(fitted.values()) == {7}
    # a share of an epoch (40) under the bounds' low end: once an epoch, without streaming
    with dask.config.set({"dlscale.training.averaging.frequency-bounds": [50, 60]}):
        master = ParameterAveragingTrainingMaster(10, collect_training_stats=True, rng_seed=0)
        spark_net = SparkNet(sc, mlp_network(MOMENTUM), master)
        spark_net.fit(rdd, epochs=3)
    assert not spark_net.training_stats.choice["streaming"] and spark_net.training_stats.choice["frequency"] == 40


def test_the_next_fit_streams_only_where_the_last_fits_measures_predict_it_faster(sc) -> None:
    """A master's next fit streams only if the cost model, from the last fit's measures, predicts
    streaming rounds at least as fast as plain ones: given a last fit whose averaging in flight took
    a second more from the steps than the averaging itself took, plain rounds, the receipt saying
    what streaming cost; a fit that streamed no round keeps that cost for the next (no swing)."""
    rdd = rdd_of(sc, 800, 10, 2)  # 40 minibatches a worker an epoch: rounds of 20
    master = ParameterAveragingTrainingMaster(10, collect_training_stats=True, rng_seed=0)
    spark_net = SparkNet(sc, mlp_network(MOMENTUM), master)
    with dask.config.set({"dlscale.training.averaging.frequency-bounds": [4, 30]}):
        spark_net.fit(rdd, epochs=2)
        assert spark_net.training_stats.choice["streaming"]  # nothing measured before: the bounds decide
        measured = master._measures
        master._measures = dataclasses.replace(measured, contention=measured.averaging + 1.0)
        spark_net.fit(rdd, epochs=2)
        second = spark_net.training_stats.choice
        spark_net.fit(rdd, epochs=2)
        third = spark_net.training_stats.choice
    assert not second["streaming"] and second["frequency"] == 20 and second["source"] == "the last fit"
    assert "a round beside an averaging)" in second["line"]
    assert not third["streaming"] and master._measures.contention == measured.averaging + 1.0


def test_a_fit_trains_on_one_worker_where_the_last_fits_measures_predict_more_slower(sc) -> None:
    """Where the last fit's measures predict its trainers slower than one (here an averaging of 30 s a
    round), the next fit of the master trains on one worker: every minibatch once, the receipt saying
    why and predicting one trainer's pace; it keeps those measures, so the fit after does the same."""
    rdd = rdd_of(sc, 800, 10, 2)  # 40 minibatches a worker an epoch: rounds of 20
    master = ParameterAveragingTrainingMaster(10, collect_training_stats=True, rng_seed=0)
    spark_net = SparkNet(sc, mlp_network(MOMENTUM), master)
    with dask.config.set({"dlscale.training.averaging.frequency-bounds": [4, 30]}):
        spark_net.fit(rdd, epochs=1)
        slow = dataclasses.replace(master._measures, averaging=30.0)
        master._measures = slow
        first = len(spark_net.training_stats.rounds)  # the statistics of a SparkNet's fits, appended
        spark_net.fit(rdd, epochs=2)
        choice, rounds = spark_net.training_stats.choice, spark_net.training_stats.rounds[first:]
        spark_net.fit(rdd, epochs=1)
    assert choice["alone"] < 1 and choice["predicted"] == 1.0 and choice["measured"] > 0
    how = "streaming rounds" if choice["streaming"] else "rounds"
    assert choice["line"].startswith(
        f"one trainer, since 2 trainers averaging every 20 minibatches in {how} were predicted {choice['alone']:.2f}x"
    ), choice["line"]
    assert len({w.worker for r in rounds for w in r.workers}) == 1
    fitted = collections.Counter(path for r in rounds for w in r.workers for path in w.batches)
    assert len(fitted) == 80 and set(fitted.values()) == {2}
    assert master._measures == slow and spark_net.training_stats.choice["alone"] is not None


def test_frequency_bounds_that_are_not_two_ordered_counts_are_refused(sc) -> None:
    spark_net = SparkNet(sc, mlp_network(), ParameterAveragingTrainingMaster(8))
    for bounds in ([20], [50, 20], [0, 5], "20-50"):
        with (
            dask.config.set({"dlscale.training.averaging.frequency-bounds": bounds}),
            pytest.raises(TrainingConfigError, match="frequency-bounds must be two positive integers"),
        ):
            spark_net.fit(rdd_of(sc, 64, 8, 2))


def test_stats_summary_and_json(sc, tmp_path: Path) -> None:
    master = ParameterAveragingTrainingMaster(
        8, averaging_frequency=2, rdd_training_approach="direct", collect_training_stats=True
    )
    spark_net = SparkNet(sc, mlp_network(), master)
    spark_net.fit(rdd_of(sc, 64, 8, 2))
    stats = spark_net.training_stats
    assert len(stats.rounds) == 2 and stats.workers == 2
    assert sum(w.examples for r in stats.rounds for w in r.workers) == 64
    assert "64 examples" in stats.summary()
    stats.save(str(tmp_path / "stats.json"))
    assert '"approach": "parameter averaging"' in (tmp_path / "stats.json").read_text()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator settings")
def test_a_fit_leaves_its_workers_allocator_set_for_training() -> None:
    """The workers' allocator keeps ``dlscale.worker.malloc-*`` through a fit of either master and after
    it: memory the next task frees stays with the process for its next step (as in test_embedded, where
    Dask's own setting faults 8 MiB in afresh: 2,048 faults)."""
    if _huge_pages_always():  # 2 MiB pages: a handful of faults either way
        pytest.skip("transparent huge pages always on: page faults tell nothing")
    x, y = data(64)
    with SparkContext("local[1]", "allocator") as ctx:
        for master in (ParameterAveragingTrainingMaster(8, averaging_frequency=2), SharedTrainingMaster(8)):
            SparkNet(ctx, mlp_network(), master).fit(ctx.parallelize(DataSet(x, y).batch_by(8), 1), epochs=1)
            assert ctx.parallelize([0], 1).map(_faults_of_a_reused_buffer).collect()[0] < 256, master


def test_fit_paths_names_an_element_that_is_not_a_path(sc) -> None:
    with pytest.raises(TypeError, match="fit_paths trains on an RDD of paths.*element 0 is of type int: 1"):
        SparkNet(sc, mlp_network(), ParameterAveragingTrainingMaster(8)).fit_paths(sc.parallelize([1, 2, 3], 2))


@pytest.mark.parametrize("fault", ["class", "width"])
def test_a_late_bad_label_names_its_minibatch(sc, tmp_path, fault: str) -> None:
    x, y = data(64)
    paths = export_minibatches([DataSet(x, y)], str(tmp_path / "files"), 8)
    if fault == "class":
        bad = y[40:48].clone()
        bad[3] = 12  # class 12 of 3
    else:
        bad = torch.nn.functional.one_hot(y[40:48], 4).float()  # 4 columns for 3 outputs
    save(DataSet(x[40:48], bad), paths[5])
    master = ParameterAveragingTrainingMaster(8, averaging_frequency=2)
    with pytest.raises(DataShapeError, match="do not fit loss 'cross_entropy'") as info:
        SparkNet(sc, mlp_network(), master).fit_paths(list_paths(sc, str(tmp_path / "files")))
    assert f"while fitting minibatch {paths[5]}" in info.value.__notes__


@pytest.mark.parametrize("master", ["averaging", "sharing"])
def test_a_foreign_file_among_minibatch_files_is_named(sc, tmp_path, master: str) -> None:
    """A README.txt left in a directory of minibatch files is listed with them and refused when its
    turn comes, by name, as not a minibatch file (not as a truncated one)."""
    x, y = data(64)
    export_minibatches([DataSet(x, y)], str(tmp_path / "files"), 8)
    (tmp_path / "files" / "README.txt").write_text("hello")
    paths = list_paths(sc, str(tmp_path / "files"))
    assert any(p.endswith("README.txt") for p in paths.collect())
    chosen = (
        ParameterAveragingTrainingMaster(8, averaging_frequency=2) if master == "averaging" else SharedTrainingMaster(8)
    )
    with pytest.raises(CorruptDataError, match=r"README.txt: not a dlscale minibatch file"):
        SparkNet(sc, mlp_network(), chosen).fit_paths(paths)


def _parked_replicas(sc: SparkContext) -> dict[str, dict[str, int]]:
    """Each worker's parked parameter-averaging replicas: ``{worker: {session: id of the network}}``."""
    return sc.client.run(lambda dask_worker: {s: id(n) for s, n in plugin(dask_worker).parked.items()})


def test_a_fit_loop_goes_on_with_the_last_fits_replicas_unless_the_network_changed(sc, tmp_path, one_thread) -> None:
    """One ``fit`` per epoch, as DL4J's examples train: the second fit's trainers go on with the first's
    replicas, parked on their workers (the network is not sent again), and end exactly where fits
    that are sent the network each time end; a network changed on the driver in between is sent, and
    so is one whose parked replicas are gone from the workers (as from a restarted worker's)."""
    rdd = rdd_of(sc, 96, 8, 2)

    def loop(keep: bool, sent: _SentNetworks | None = None) -> tuple[Network, list[dict[str, dict[str, int]]]]:
        master = ParameterAveragingTrainingMaster(
            16, averaging_frequency=2, rng_seed=1, export_directory=str(tmp_path / f"export-{keep}")
        )
        spark_net = SparkNet(sc, mlp_network(MOMENTUM, norm=True), master)
        if sent is not None:
            spark_net.set_listeners(sent)
        parked = []
        with dask.config.set({"dlscale.training.keep-trainers": keep}):
            for fit in range(4):
                if fit == 2:
                    spark_net.network.optimizer.param_groups[0]["lr"] /= 2
                if fit == 3:
                    sc.client.run(lambda dask_worker: plugin(dask_worker).parked.clear())
                if sent is not None:
                    sent.before = _networks_held(sc)
                spark_net.fit(rdd)
                parked.append(_parked_replicas(sc))
        return spark_net.network, parked

    sent = _SentNetworks(sc)
    kept, parked = loop(True, sent)
    assert sent.held == [True, False, True, True]  # not to the second fit alone
    for w in parked[0]:
        (first,), (second,), (third,), _ = (p[w].items() for p in parked)
        assert first[0] != second[0] and first[1] == second[1]  # a new session, the same replica
        assert third[1] != second[1]  # the network changed on the driver: a replica anew
    sent_each_time, parked = loop(False)
    assert not any(p for ps in parked for p in ps.values())
    assert torch.equal(kept.params(), sent_each_time.params())
    assert torch.equal(kept.module[1].running_mean, sent_each_time.module[1].running_mean)
    state, other = kept.optimizer_state()["state"], sent_each_time.optimizer_state()["state"]
    assert all(torch.equal(state[i]["momentum_buffer"], other[i]["momentum_buffer"]) for i in other)


def _watched(sc: SparkContext, export: Path, seed: int) -> tuple[SparkNet, _SentNetworks]:
    """The batch-norm MLP averaging every 2 minibatches, with a listener that tells whether each fit
    (:func:`_fit_watched`) was sent the network."""
    master = ParameterAveragingTrainingMaster(16, averaging_frequency=2, rng_seed=seed, export_directory=str(export))
    spark_net, sent = SparkNet(sc, mlp_network(MOMENTUM, norm=True), master), _SentNetworks(sc)
    spark_net.set_listeners(sent)
    return spark_net, sent


def _fit_watched(spark_net: SparkNet, sent: _SentNetworks, rdd: Any) -> None:
    sent.before = _networks_held(spark_net.sc)
    spark_net.fit(rdd)


def test_a_loop_that_reads_nothing_between_fits_takes_the_state_once_read(sc, tmp_path) -> None:
    """The state a parameter-averaging fit ends with arrives in the background: the network takes it
    when first read. Fits that read nothing between them go on with the parked trainers (nothing
    sent) and end exactly where a loop that reads the network after every fit ends."""
    rdd = rdd_of(sc, 96, 8, 2)

    def loop(read: bool) -> tuple[Network, list[bool], list[bool]]:
        spark_net, sent = _watched(sc, tmp_path / f"export-{read}", 3)
        arriving = []
        for _ in range(3):
            _fit_watched(spark_net, sent, rdd)
            arriving.append(spark_net.network.pending() is not None)
            if read:
                spark_net.network.params()
        return spark_net.network, arriving, sent.held

    lazy, arriving, held = loop(read=False)
    assert arriving == [True, True, True]  # not one fit's state taken before the network was read
    assert held == [True, False, False]  # the second and third fits went on with the parked trainers
    read, _, held = loop(read=True)
    assert held == [True, False, False]  # reading the state does not change it: the trainers go on
    assert torch.equal(lazy.params(), read.params())
    assert lazy.pending() is None
    assert torch.equal(lazy.module[1].running_mean, read.module[1].running_mean)
    state, other = lazy.optimizer_state()["state"], read.optimizer_state()["state"]
    assert all(torch.equal(state[i]["momentum_buffer"], other[i]["momentum_buffer"]) for i in other)


def _one_hot(d: DataSet) -> DataSet:
    return DataSet(d.features, torch.nn.functional.one_hot(d.labels, 3).float())


def test_an_evaluation_between_fits_runs_on_the_state_the_workers_hold(sc, tmp_path) -> None:
    """An evaluation between two fits of a loop that has not read the network is sent the network from a
    replica its trainers parked, worker to worker: the state does not reach the driver, the next fit
    still goes on with the parked trainers, and the evaluation equals one of the network as the
    driver takes it (a batch-norm network, the running statistics the parked replicas hold). Once a
    fit has taken the replicas back, the driver takes the state and sends it."""
    rdd, test = rdd_of(sc, 96, 8, 2), rdd_of(sc, 48, 16, 2)
    spark_net, sent = _watched(sc, tmp_path, 4)
    evaluations = []
    for _ in range(2):
        _fit_watched(spark_net, sent, rdd)
        evaluations.append(spark_net.evaluate_regression(test.map(_one_hot)))  # reads every output exactly
        assert spark_net.network.pending() is not None  # evaluated without taking the state to the driver
    assert sent.held == [True, False]  # the second fit went on with the parked trainers
    spark_net.network.params()  # the state taken: the driver sends the network
    assert spark_net.evaluate_regression(test.map(_one_hot)) == evaluations[-1]
    assert evaluations[0] != evaluations[1]

    spark_net.fit(rdd)
    sc.client.run(lambda dask_worker: plugin(dask_worker).parked.clear())  # as workers that forgot them
    arriving = spark_net.network.pending()
    assert arriving is not None and arriving.ship(sc.client) is None  # nowhere to send it from
    spark_net.evaluate(test)
    assert spark_net.network.pending() is None  # the driver took the state to send it


def test_a_state_still_arriving_reaches_the_network_as_the_context_stops(tmp_path) -> None:
    """A context stopped right after a fit whose state no one read yet: the network has it after the
    stop, the same state a network read before the stop has."""
    nets = []
    for read in (True, False):
        with SparkContext("local[2]", "arriving") as sc:
            spark_net = SparkNet(
                sc, mlp_network(MOMENTUM), ParameterAveragingTrainingMaster(16, averaging_frequency=2, rng_seed=5)
            )
            spark_net.fit(rdd_of(sc, 64, 8, 2))
            if read:
                spark_net.network.params()
            else:
                assert spark_net.network.pending() is not None
        nets.append(spark_net.network)
    assert nets[1].pending() is None
    assert not torch.equal(nets[1].params(), mlp_network(MOMENTUM).params())
    assert torch.equal(nets[0].params(), nets[1].params())


def test_a_state_lost_with_every_worker_that_held_it_is_an_error_when_read(sc) -> None:
    """An arriving state whose every holder failed (as a worker lost before the driver took it) raises
    when the network is read, naming what was lost, and the network keeps the state it had."""
    from dlscale.training._parking import Arrival

    def lost() -> dict[str, Any]:
        raise OSError("worker gone")

    net = mlp_network(MOMENTUM)
    before = net.params().clone()
    net.arriving(Arrival([sc.client.submit(lost, pure=False)], "fit dlscale-averaging-x"))
    with pytest.raises(RuntimeError, match=r"fit dlscale-averaging-x trained was lost .*worker gone"):
        net.params()
    assert net.pending() is None and torch.equal(net.params(), before)


@pytest.mark.parametrize("master_name", ["averaging", "sharing"])
def test_a_fit_going_on_with_the_last_fits_trainers_probes_no_minibatch_they_trained_on(
    sc, tmp_path, master_name
) -> None:
    """A fit that goes on with the last fit's parked trainers, on the same paths read by a loader that
    pickles alike, runs no task to probe its first minibatch: the network, unchanged since, took a step
    on it. Another loader is probed on a parked replica; and a first file replaced since by one the
    network cannot take is refused by the trainers, naming it, with the network unchanged."""
    x, y = data(64)
    export_minibatches([DataSet(x, y)], str(tmp_path / "data"), 8)
    paths = list_paths(sc, str(tmp_path / "data"))
    if master_name == "averaging":
        master = ParameterAveragingTrainingMaster(8, averaging_frequency=2, rng_seed=0)
    else:
        master = SharedTrainingMaster(8, rng_seed=0)
    spark_net = SparkNet(sc, mlp_network(MOMENTUM), master)

    def probes(**kwargs: Any) -> list[str]:
        with get_task_stream(sc.client) as tasks:
            spark_net.fit_paths(paths, **kwargs)
        return [key_split(t["key"]) for t in tasks.data if "probe" in key_split(t["key"])]

    assert probes() == ["probe"]  # the network sent, and scored on the first minibatch
    assert probes() == []  # the default loader, made anew for each fit, pickles alike
    assert probes(loader=DataSetLoader()) == ["probe_parked"]  # on a parked replica
    assert probes(loader=DataSetLoader()) == []
    first = paths.first()
    save(DataSet(torch.randn(8, 7), y[:8]), first)  # seven features where the network takes six
    before = spark_net.network.params().clone()
    with pytest.raises(RuntimeError) as info:
        spark_net.fit_paths(paths, loader=DataSetLoader())
    assert any(Path(first).name in note for note in info.value.__notes__)
    assert torch.equal(spark_net.network.params(), before)


@pytest.mark.parametrize("master_name", ["averaging", "sharing"])
def test_trainers_load_each_minibatch_once_a_fit_within_the_budget(sc, tmp_path, master_name) -> None:
    """A fit's trainers keep the minibatches they load for its later epochs (dlscale.data.keep-loaded of
    their worker's memory): each file is read once by each trainer that fits it, not once an epoch; with
    nothing kept, once an epoch. Parameter averaging's fit is the same either way, to the last bit."""
    x, y = data(96)
    export_minibatches([DataSet(x, y)], str(tmp_path / "data"), 8)
    paths = list_paths(sc, str(tmp_path / "data"))

    def fit(fraction: float) -> tuple[list[str], torch.Tensor]:
        log = tmp_path / f"loads-{fraction}"
        log.touch()

        def logged(path: str) -> DataSet:
            with open(log, "a") as f:
                f.write(path + "\n")
            return load(path)

        network = mlp_network(MOMENTUM)
        if master_name == "averaging":
            master = ParameterAveragingTrainingMaster(8, averaging_frequency=2, rng_seed=0)
        else:
            master = SharedTrainingMaster(8, rng_seed=0)
        with dask.config.set({"dlscale.data.keep-loaded": fraction}):
            SparkNet(sc, network, master).fit_paths(paths, loader=logged, epochs=3)
        return log.read_text().split(), network.params()

    names = paths.collect()
    kept, params = fit(0.1)
    every, reference = fit(0.0)
    probe = collections.Counter(names[:1])  # a fit first scores its first minibatch, in a task of its own
    assert collections.Counter(every) - probe == collections.Counter(names * 3)
    loads = collections.Counter(kept) - probe
    assert set(loads) == set(names) and max(loads.values()) <= 2  # by each of the 2 trainers at most
    if master_name == "averaging":
        assert torch.equal(params, reference)
