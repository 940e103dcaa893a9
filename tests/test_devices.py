"""Choosing the device (DLSCALE_DEVICE) and training, evaluating and inferring on worker GPUs.

The CUDA tests run where torch sees a GPU and are skipped elsewhere; the rest runs everywhere.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Iterator

import dask.config
import distributed
import pytest
import torch

from dlscale import (
    DeviceError,
    ParameterAveragingTrainingMaster,
    SharedTrainingMaster,
    SparkContext,
    SparkNet,
)
from dlscale.data import DataSet, load
from dlscale.nn import Network
from dlscale.runtime.devices import device_for, setting

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")


def network(seed: int = 0) -> Network:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    return Network(module, "cross_entropy", functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))


def minibatches(n: int = 600, size: int = 20) -> list[DataSet]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] + x[:, 2] > 1).long()
    return [DataSet(x[i : i + size], y[i : i + size]) for i in range(0, n, size)]


def accuracy(net: Network, batches: list[DataSet]) -> float:
    merged = DataSet.merge(batches)
    return float((net.output(merged.features).argmax(1) == merged.labels).double().mean())


@pytest.fixture
def gpu_workers(request: pytest.FixtureRequest) -> Iterator[SparkContext]:
    """Worker processes told DLSCALE_DEVICE through their environment; the driver sets nothing."""
    device, workers = request.param
    with (
        distributed.LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            resources={"GPU": 1},
            env={"DLSCALE_DEVICE": device},
        ) as cluster,
        SparkContext(cluster.scheduler_address, "devices") as sc,
    ):
        yield sc


# -- the setting, everywhere ------------------------------------------------------------------
def test_the_environment_wins_over_the_config_and_bad_values_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DLSCALE_DEVICE", raising=False)
    assert setting() == "auto"
    with dask.config.set({"dlscale.device": "CPU"}):
        assert setting() == "cpu"
        monkeypatch.setenv("DLSCALE_DEVICE", "cuda:1")
        assert setting() == "cuda:1"
    for bad in ("gpu", "cuda:x", "cuda:"):
        monkeypatch.setenv("DLSCALE_DEVICE", bad)
        with pytest.raises(ValueError, match=f"DLSCALE_DEVICE.*{bad!r}"):
            setting()
    monkeypatch.setenv("DLSCALE_DEVICE", "cpu")
    assert device_for() == torch.device("cpu")


@no_cuda
def test_auto_is_the_cpu_and_cuda_is_refused_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLSCALE_DEVICE", "auto")
    assert device_for(1, 2) == torch.device("cpu")
    monkeypatch.setenv("DLSCALE_DEVICE", "cuda")
    with pytest.raises(DeviceError, match="DLSCALE_DEVICE=cuda but the driver has no usable GPU"):
        device_for()


@no_cuda
@pytest.mark.parametrize("gpu_workers", [("cuda", 1)], indirect=True)
def test_workers_without_a_gpu_refuse_cuda_naming_the_worker(gpu_workers: SparkContext) -> None:
    sc = gpu_workers
    (worker,) = sc.client.scheduler_info()["workers"]
    net = network()
    before = net.params().clone()
    master = ParameterAveragingTrainingMaster(20, averaging_frequency=2)
    with pytest.raises(DeviceError, match=f"DLSCALE_DEVICE=cuda but worker {worker} has no usable GPU"):
        SparkNet(sc, net, master).fit(sc.parallelize(minibatches(), 2))
    assert torch.equal(net.params(), before)  # nothing half-trained


def test_minibatches_and_networks_stay_put_on_their_own_device() -> None:
    batch = minibatches(40)[0]
    assert batch.to("cpu") is batch
    net = network()
    assert net.to("cpu") is net and net.device == torch.device("cpu")
    assert pickle.loads(pickle.dumps(net)).device == torch.device("cpu")


# -- on a GPU -----------------------------------------------------------------------------------
@cuda
def test_a_network_on_the_gpu_computes_what_it_computes_on_the_cpu() -> None:
    batches = minibatches()
    on_cpu, on_gpu = network(), network().to("cuda")
    assert on_gpu.device.type == "cuda" and all(p.is_cuda for p in on_gpu.module.parameters())
    assert on_gpu.params().data_ptr() == next(on_gpu.module.parameters()).data_ptr()  # still one flat buffer
    for batch in batches * 2:
        assert abs(on_cpu.fit_batch(batch) - on_gpu.fit_batch(batch)) < 1e-4
    torch.testing.assert_close(on_gpu.params().cpu(), on_cpu.params(), rtol=0, atol=1e-4)
    out = on_gpu.output(batches[0].features)
    assert out.device.type == "cpu"  # results come back on the CPU
    torch.testing.assert_close(out, on_cpu.output(batches[0].features), rtol=0, atol=1e-4)
    outputs, labels, _ = on_gpu.evaluate_batch(batches[0])
    assert outputs[0].device.type == labels[0].device.type == "cpu"
    # it travels as CPU tensors, optimizer state included, and moves back to the GPU with its momentum
    copy = pickle.loads(pickle.dumps(on_gpu))
    assert copy.device.type == "cpu"
    assert all(not s["momentum_buffer"].is_cuda for s in copy.optimizer_state()["state"].values())
    torch.testing.assert_close(copy.params(), on_gpu.params().cpu(), rtol=0, atol=0)
    copy.to("cuda")
    assert all(s["momentum_buffer"].is_cuda for s in copy.optimizer.state.values())


@cuda
@pytest.mark.parametrize("gpu_workers", [("cuda", 1)], indirect=True)
def test_parameter_averaging_on_a_gpu_worker_from_a_cpu_driver(gpu_workers: SparkContext, tmp_path) -> None:
    sc = gpu_workers
    master = ParameterAveragingTrainingMaster(
        20, averaging_frequency=3, collect_training_stats=True, rng_seed=1, export_directory=str(tmp_path / "export")
    )
    spark_net = SparkNet(sc, network(), master)
    spark_net.fit(sc.parallelize(minibatches(), 3), epochs=2)
    assert spark_net.network.device.type == "cpu"
    reference = network()
    for r in spark_net.training_stats.rounds:
        for path in r.workers[0].batches:
            reference.fit_batch(load(path))
    torch.testing.assert_close(spark_net.network.params(), reference.params(), rtol=0, atol=1e-4)
    assert all(peak > 0 for peak in sc.client.run(torch.cuda.max_memory_allocated).values())


@cuda
@pytest.mark.parametrize("gpu_workers", [("auto", 2)], indirect=True)
def test_gradient_sharing_evaluation_and_inference_on_gpu_workers(gpu_workers: SparkContext) -> None:
    sc = gpu_workers
    batches = minibatches(1200)
    train, test = batches[:50], batches[50:]
    master = SharedTrainingMaster(batch_size_per_worker=20, workers_per_node=2)
    spark_net = SparkNet(sc, network(), master)
    spark_net.fit(sc.parallelize(train, 4), epochs=8)
    reference = network()
    reference.fit(train, epochs=8)
    assert accuracy(spark_net.network, test) >= accuracy(reference, test) - 0.05
    assert all(peak > 0 for peak in sc.client.run(torch.cuda.max_memory_allocated).values())

    evaluation = spark_net.evaluate(sc.parallelize(test, 3))
    assert evaluation.accuracy() == pytest.approx(accuracy(spark_net.network, test), abs=1e-9)
    merged = DataSet.merge(test)
    pairs = sc.parallelize([(i, merged.features[i]) for i in range(merged.num_examples())], 3)
    outputs = dict(spark_net.feed_forward_with_key(pairs).collect())
    expected = spark_net.network.output(merged.features)
    torch.testing.assert_close(torch.stack([outputs[i] for i in range(len(outputs))]), expected, rtol=0, atol=1e-4)
