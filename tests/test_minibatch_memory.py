"""A minibatch file too large for its worker's memory is refused by name before it is read, and the
worker lives on (rather than being killed by its nanny and the fit failing with forgotten futures)."""

from __future__ import annotations

import functools
import importlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import dask
import pytest
import torch

from dlscale import (
    DlscaleError,
    MinibatchTooLargeError,
    ParameterAveragingTrainingMaster,
    SparkConf,
    SparkContext,
    SparkNet,
)
from dlscale.data import DataSet, FileBatch, MinibatchLoader, save
from dlscale.data import format as dlb
from dlscale.data.loaders import check_minibatch_size
from dlscale.nn import Network

MEMORY_LIMIT = 600 * 2**20  # a worker with torch loaded takes about 260 MiB of it
FEATURES = 64


@pytest.fixture(scope="module")
def small_sc() -> Iterator[SparkContext]:
    conf = SparkConf().setMaster("local[1]").set("spark.executor.memory", str(MEMORY_LIMIT))
    with SparkContext(conf=conf) as ctx:
        ctx.client.run(importlib.import_module, "dlscale.training._worker")  # torch imported once, up front
        yield ctx


def _sparse_minibatch(path: Path, examples: int) -> int:
    """A ``.dlb`` file whose header declares ``examples`` rows of float32 features (and int64
    labels), its data a hole in the file: large on paper, no disk space and no time to write.
    Returns its size."""
    features = examples * FEATURES * 4
    labels_at = features + (-features % dlb.ALIGN)
    arrays = [
        {"field": "features", "index": 0, "dtype": "float32", "shape": [examples, FEATURES], "offset": 0},
        {"field": "labels", "index": 0, "dtype": "int64", "shape": [examples], "offset": labels_at},
    ]
    arrays[0]["nbytes"], arrays[1]["nbytes"] = features, examples * 8
    header = json.dumps({"kind": "DataSet", "num_examples": examples, "counts": {}, "arrays": arrays}).encode()
    data = labels_at + examples * 8
    preamble = dlb._PREAMBLE.pack(dlb.MAGIC, dlb.VERSION, 0, len(header), 0, 0, data)
    start = len(preamble) + len(header) + (-(len(preamble) + len(header)) % dlb.ALIGN)
    with open(path, "wb") as f:
        f.write(preamble + header)
        f.truncate(start + data + 4)
    return start + data + 4


def _memory_events(ctx: SparkContext) -> list[str]:
    logs = ctx.client.get_worker_logs() | ctx.client.get_worker_logs(nanny=True)
    words = ("exceeded", "Restarting worker", "Worker process died")
    return [msg for entries in logs.values() for _, msg in entries if any(w in msg for w in words)]


def test_fit_refuses_a_minibatch_larger_than_worker_memory_by_name(small_sc: SparkContext, tmp_path: Path) -> None:
    ctx = small_sc
    pids = ctx.client.run(os.getpid)
    g = torch.Generator().manual_seed(0)
    paths = []
    for i in range(4):
        paths.append(str(tmp_path / f"batch_{i}.dlb"))
        if i == 1:  # not the first: the fit's probe passes and the prefetching training task meets it
            size = _sparse_minibatch(tmp_path / "batch_1.dlb", MEMORY_LIMIT // (FEATURES * 4) + 1000)
        else:
            save(DataSet(torch.randn(16, FEATURES, generator=g), torch.randint(0, 2, (16,), generator=g)), paths[-1])
    assert size > MEMORY_LIMIT and os.stat(paths[1]).st_blocks * 512 < 2**20  # large, yet sparse
    network = Network(torch.nn.Linear(FEATURES, 2), "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1))
    master = ParameterAveragingTrainingMaster(16, averaging_frequency=2, rng_seed=0)
    with pytest.raises(MinibatchTooLargeError) as e:
        SparkNet(ctx, network, master).fit_paths(ctx.parallelize(paths, 1))
    message = str(e.value)
    assert paths[1] in message and "600.00 MiB" in message and "max-minibatch-fraction" in message
    assert isinstance(e.value, MemoryError)
    assert ctx.client.run(os.getpid) == pids, "a worker was restarted"
    assert _memory_events(ctx) == []


def test_a_minibatch_over_half_the_limit_is_refused(small_sc: SparkContext, tmp_path: Path) -> None:
    path = str(tmp_path / "large.dlb")
    _sparse_minibatch(tmp_path / "large.dlb", MEMORY_LIMIT // 2 // (FEATURES * 4))  # just over half the limit
    with pytest.raises(MinibatchTooLargeError, match="large.dlb"):
        small_sc.client.submit(MinibatchLoader(), path, pure=False).result()


def test_the_error_survives_the_trip_from_a_worker() -> None:
    from distributed.protocol.pickle import dumps, loads

    error = loads(dumps(MinibatchTooLargeError("minibatch x.dlb is too large")))
    assert type(error) is MinibatchTooLargeError and error.args == ("minibatch x.dlb is too large",)
    assert isinstance(error, MemoryError) and isinstance(error, DlscaleError)


def test_a_file_batch_too_large_is_refused_unread(small_sc: SparkContext, tmp_path: Path) -> None:
    path = tmp_path / "filebatch_00000000.zip"
    with open(path, "wb") as f:
        f.truncate(MEMORY_LIMIT)  # its size is all that is looked at
    with pytest.raises(MinibatchTooLargeError, match="filebatch_00000000.zip"):
        small_sc.client.submit(FileBatch.read, str(path), pure=False).result()


def test_a_bad_fraction_setting_is_named(tmp_path: Path) -> None:
    with dask.config.set({"dlscale.data.max-minibatch-fraction": "half"}):
        with pytest.raises(ValueError, match="dlscale.data.max-minibatch-fraction must be a positive number"):
            check_minibatch_size(str(tmp_path / "any.dlb"))
