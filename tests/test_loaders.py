"""Loaders and background prefetching, in this process and inside worker tasks; what every
registered loader must do is checked in tests/contracts/test_loader_contract.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import dask
import pytest
import torch
from distributed.system import MEMORY_LIMIT

from dlscale import CorruptDataError, SparkContext
from dlscale.data import (
    DataSet,
    DataSetLoader,
    MinibatchLoader,
    MultiDataSet,
    ZarrLoader,
    export_minibatches,
    list_paths,
    load,
    loaders,
    prefetch,
    resolve_loader,
    save,
)
from dlscale.data.loaders import WAITED, KeptLoader, keep_loaded
from dlscale.nn.partitions import minibatches
from dlscale.registry import UnknownNameError


@pytest.fixture
def batches(tmp_path: Path) -> list[str]:
    g = torch.Generator().manual_seed(0)
    return export_minibatches([DataSet(torch.randn(40, 6, generator=g), torch.arange(40))], str(tmp_path / "b"), 4)


class Recording:
    """A loader that notes when each path was loaded, waiting ``wait`` seconds first (storage's latency)."""

    def __init__(self, wait: float = 0.0) -> None:
        self.loaded: list[str] = []
        self.wait = wait

    def __call__(self, path: str) -> DataSet:
        time.sleep(self.wait)
        self.loaded.append(path)
        return load(path)


def test_prefetch_yields_every_batch_in_order(batches: list[str]) -> None:
    for depth in (0, 1, 3):
        got = list(prefetch(batches, DataSetLoader(), depth))
        assert all(g.equals(load(p)) for g, p in zip(got, batches)) and len(got) == len(batches)


def test_prefetch_reads_ahead_but_no_further_than_its_depth(batches: list[str]) -> None:
    loader = Recording(wait=10 * WAITED)
    it = prefetch(batches, loader, depth=2)
    next(it)
    time.sleep(0.3)  # let the thread fill the queue
    # one in use, two queued, and one loaded and waiting for room
    assert len(loader.loaded) == 4
    next(it)
    time.sleep(0.3)
    assert len(loader.loaded) == 5
    it.close()
    assert not [t for t in threading.enumerate() if t.name == "dlscale-prefetch"]


def test_loads_that_do_not_wait_on_storage_are_not_read_ahead(batches: list[str], monkeypatch) -> None:
    """A load that is all computation gains nothing from a thread: each minibatch is loaded when asked for.
    (The bound is raised for the test: on a loaded machine a local load may be descheduled for longer
    than the half millisecond a waiting load is told by, and then is read ahead, as one that waits.)"""
    monkeypatch.setattr(loaders, "WAITED", 1.0)
    loader = Recording()
    it = prefetch(batches, loader, depth=2)
    for i in range(3):
        next(it)
        time.sleep(0.1)
        assert len(loader.loaded) == i + 1
        assert not [t for t in threading.enumerate() if t.name == "dlscale-prefetch"]


def test_prefetch_depth_comes_from_the_config(batches: list[str]) -> None:
    loader = Recording(wait=10 * WAITED)
    with dask.config.set({"dlscale.data.prefetch": 1}):
        it = prefetch(batches, loader)
        next(it)
        time.sleep(0.3)
        assert len(loader.loaded) == 3
        it.close()
    with pytest.raises(ValueError, match="depth"):
        next(prefetch(batches, loader, depth=-1))


def test_an_error_arrives_with_its_batch(batches: list[str], tmp_path: Path) -> None:
    broken = tmp_path / "broken.dlb"
    broken.write_bytes(b"DLSBATCH" + b"\0" * 10)
    paths = [batches[0], str(broken), batches[1]]
    it = prefetch(paths, DataSetLoader(), depth=2)
    assert next(it).equals(load(batches[0]))
    with pytest.raises(CorruptDataError, match="broken.dlb"):
        next(it)


def test_a_loader_that_returns_something_else_is_named(batches: list[str]) -> None:
    def not_a_loader(path: str) -> dict:
        return {"path": path}

    with pytest.raises(TypeError, match=r"not_a_loader.*returned a dict for .*dataset_00000000\.dlb"):
        list(prefetch(batches, not_a_loader, depth=1))

    def failing(path: str) -> DataSet:
        raise KeyError("no such column")

    with pytest.raises(KeyError) as info:
        list(prefetch(batches, failing, depth=0))
    assert any("dataset_00000000.dlb" in note for note in info.value.__notes__)


def test_native_loaders_check_the_kind(tmp_path: Path) -> None:
    save(MultiDataSet([torch.ones(2, 3)], [torch.zeros(2, 1)]), str(tmp_path / "m.dlb"))
    with pytest.raises(TypeError, match=r"m\.dlb holds a MultiDataSet.*MultiDataSetLoader"):
        DataSetLoader()(str(tmp_path / "m.dlb"))


def test_loaders_by_name_and_the_default(batches: list[str]) -> None:
    default = resolve_loader()
    assert type(default) is MinibatchLoader and default.storage_options is None
    assert resolve_loader(storage_options={"anon": True}).storage_options == {"anon": True}
    assert type(resolve_loader("dlb-dataset")) is DataSetLoader and type(resolve_loader("zarr")) is ZarrLoader
    loader = Recording()
    assert resolve_loader(loader) is loader
    with pytest.raises(UnknownNameError, match="unknown loader 'csv'; known: dlb, dlb-dataset, dlb-multi, image, zarr"):
        resolve_loader("csv")
    # a partition of paths, read by the default or by a loader's name, as evaluation and inference read them
    for spec in (None, "dlb-dataset"):
        assert all(g.equals(load(p)) for g, p in zip(minibatches(batches, spec), batches))


def test_custom_loader_with_prefetch_on_the_workers(sc: SparkContext, tmp_path: Path) -> None:
    """A custom format (CSV) loaded inside worker tasks, with prefetching."""
    for i in range(6):
        rows = "\n".join(f"{i * 10 + r},{(i * 10 + r) % 3}" for r in range(5))
        (tmp_path / f"part-{i}.csv").write_text(rows)

    def csv_loader(path: str) -> DataSet:
        values = torch.tensor([[float(v) for v in line.split(",")] for line in Path(path).read_text().splitlines()])
        return DataSet(values[:, :1], values[:, 1].long())

    paths = list_paths(sc, str(tmp_path), extensions=["csv"])
    sums = paths.mapPartitions(lambda it: (float(ds.features.sum()) for ds in prefetch(it, csv_loader, 2))).collect()
    assert sums == [float(sum(i * 10 + r for r in range(5))) for i in range(6)]


def test_a_kept_loader_loads_each_minibatch_once_within_its_budget(batches: list[str]) -> None:
    """What a fit's trainer reads again in later epochs comes from memory, as long as every kept minibatch of
    the process stays within the budget: the first ones loaded are kept, the rest are loaded each time, and
    leaving the loader gives its bytes back."""
    size = load(batches[0]).nbytes()
    recording = Recording()
    with KeptLoader(recording, 3.5 * size / MEMORY_LIMIT) as kept:  # room for three
        first = [kept(p) for p in batches]
        again = [kept(p) for p in batches]
        assert all(a.equals(load(p)) for a, p in zip(again, batches))
        assert all(a is f for a, f in zip(again[:3], first[:3])) and kept.nbytes == 3 * size
        assert recording.loaded == batches + batches[3:]
        with KeptLoader(recording, 3.5 * size / MEMORY_LIMIT) as other:  # the budget is the process's
            other(batches[0])
            assert other.nbytes == 0
    with KeptLoader(Recording(), 3.5 * size / MEMORY_LIMIT) as kept:
        [kept(p) for p in batches]
        assert kept.nbytes == 3 * size
    kept(batches[0])  # a load after the release (a prefetching thread's, say) keeps nothing
    assert kept.nbytes == 0 and not kept.kept
    nothing = Recording()
    with KeptLoader(nothing, 0.0) as kept:
        [kept(p) for p in batches + batches]
    assert nothing.loaded == batches + batches


def test_keep_loaded_must_be_a_fraction() -> None:
    for bad in (-0.1, 1.5, "10%", True):
        with dask.config.set({"dlscale.data.keep-loaded": bad}), pytest.raises(ValueError, match="keep-loaded"):
            keep_loaded()
