"""Exporting minibatches from RDDs and iterables, and listing their paths."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dlscale import IncompleteExportError, OutputExistsError, SparkContext, StorageError, storage
from dlscale.data import DataSet, MultiDataSet, export_minibatches, list_paths, load, save


def sequences(sizes: list[int], seed: int = 0) -> list[DataSet]:
    """DataSets of sequences whose lengths differ between elements, with masks."""
    g = torch.Generator().manual_seed(seed)
    out, first = [], 0
    for i, n in enumerate(sizes):
        t = 2 + (i % 3)
        feats = torch.arange(first, first + n, dtype=torch.float32).reshape(n, 1, 1).expand(n, t, 2).clone()
        mask = (torch.rand(n, t, generator=g) > 0.2).float()
        out.append(DataSet(feats, torch.randint(0, 5, (n, t, 1), generator=g).float(), mask, mask.clone()))
        first += n
    return out


def reference(elements: list, batch_size: int) -> list:
    """Batches built independently: every example on its own, merged ``batch_size`` at a time."""
    singles = [one for e in elements for one in e.batch_by(1)]
    kind = type(elements[0])
    return [kind.merge(singles[i : i + batch_size]) for i in range(0, len(singles), batch_size)]


def assert_batches(paths: list[str], expected: list, storage_options: dict | None = None) -> None:
    got = [load(p, storage_options) for p in paths]
    assert [g.num_examples() for g in got] == [e.num_examples() for e in expected]
    assert all(g.equals(e) for g, e in zip(got, expected))


@pytest.mark.parametrize(
    "sizes, batch_size",
    [
        ([3, 7, 1, 12, 5, 9, 2], 4),  # batches cross every partition boundary
        ([1, 1, 1, 1, 1, 1, 1, 1, 1], 5),  # one batch spans all three partitions
        ([40, 2, 30], 8),  # elements larger than a batch
        ([6, 6, 6, 6, 6, 6], 6),  # boundaries fall exactly on partitions
    ],
)
def test_export_from_three_partitions_gives_exact_batches(
    sc: SparkContext, tmp_path: Path, sizes: list[int], batch_size: int
) -> None:
    elements = sequences(sizes)
    rdd = sc.parallelize(elements, 3)
    assert rdd.getNumPartitions() == 3
    paths = export_minibatches(rdd, str(tmp_path / "out"), batch_size)
    expected = reference(elements, batch_size)
    assert_batches(paths, expected)
    assert [Path(p).name for p in paths] == [f"dataset_{k:08d}.dlb" for k in range(len(expected))]
    assert list_paths(sc, str(tmp_path / "out")).collect() == paths


def test_export_with_an_empty_partition_and_multidatasets(sc: SparkContext, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    elements = [
        MultiDataSet(
            [torch.randn(n, 3, generator=g), torch.randint(0, 9, (n,), generator=g)], [torch.randn(n, 2, generator=g)]
        )
        for n in (5, 3, 8)
    ]
    rdd = sc.parallelize(elements, 2).union(sc.parallelize([], 1)).union(sc.parallelize(elements[:1], 1))
    paths = export_minibatches(rdd, str(tmp_path / "m"), 6)
    assert_batches(paths, reference([*elements, elements[0]], 6))
    assert all(re.fullmatch(r"multidataset_\d{8}\.dlb", Path(p).name) for p in paths)


def test_export_from_a_persisted_rdd_of_single_examples(sc: SparkContext, tmp_path: Path) -> None:
    from dlscale import StorageLevel

    x = torch.randn(50, 4)
    rdd = (
        sc.parallelize(range(50), 3)
        .map(lambda i: DataSet(x[i : i + 1], torch.tensor([i])))
        .persist(StorageLevel.MEMORY_ONLY_SER)
    )
    try:
        paths = export_minibatches(rdd, str(tmp_path / "single"), 16)
    finally:
        rdd.unpersist()
    assert_batches(paths, DataSet(x, torch.arange(50)).batch_by(16))


def test_export_to_s3_and_list_paths(sc: SparkContext, s3: dict) -> None:
    elements = sequences([4, 9, 3, 6])
    paths = export_minibatches(sc.parallelize(elements, 3), "s3://test-bucket/export/train", 5, storage_options=s3)
    assert all(p.startswith("s3://test-bucket/export/train/dataset_") for p in paths)
    assert_batches(paths, reference(elements, 5), s3)
    assert list_paths(sc, "s3://test-bucket/export", storage_options=s3).collect() == paths


def test_export_from_an_iterable(tmp_path: Path) -> None:
    elements = sequences([3, 10, 1, 4])
    paths = export_minibatches(iter(elements), str(tmp_path / "local"), 7)
    assert_batches(paths, reference(elements, 7))


def test_relative_paths_go_under_the_storage_root(sc: SparkContext, tmp_path: Path) -> None:
    import dask

    with dask.config.set({"dlscale.storage.root": str(tmp_path / "root")}):
        paths = export_minibatches(sequences([5]), "runs/a", 2)
        assert paths[0] == str(tmp_path / "root" / "runs" / "a" / "dataset_00000000.dlb")
        assert list_paths(sc, "runs/a").collect() == paths


def test_list_paths_recursion_extensions_and_hidden_files(sc: SparkContext, tmp_path: Path) -> None:
    for name in ["b/x.dlb", "a.dlb", "a.txt", "b/c/y.DLB", "_SUCCESS", ".a.dlb.tmp", "_tmp/z.dlb"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    everything = list_paths(sc, str(tmp_path)).collect()
    assert everything == [str(tmp_path / n) for n in ["a.dlb", "a.txt", "b/c/y.DLB", "b/x.dlb"]]
    assert list_paths(sc, str(tmp_path), recursive=False, extensions=["dlb"]).collect() == [str(tmp_path / "a.dlb")]
    assert list_paths(sc, str(tmp_path), extensions=[".dlb"]).count() == 3
    with pytest.raises(StorageError, match="does not exist.*nowhere"):
        list_paths(sc, str(tmp_path / "nowhere"))
    with pytest.raises(StorageError, match=r"no files.*\.csv"):
        list_paths(sc, str(tmp_path), extensions=["csv"])


def test_bad_exports_name_what_is_wrong(sc: SparkContext, tmp_path: Path) -> None:
    good = sequences([4])
    export_minibatches(good, str(tmp_path / "taken"), 2)
    with pytest.raises(OutputExistsError, match="taken"):
        export_minibatches(good, str(tmp_path / "taken"), 2)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            export_minibatches(good, str(tmp_path / "b"), bad)
    with pytest.raises(TypeError, match=r"partition 1, element 0, holds a str"):
        export_minibatches(sc.parallelize([good[0], "oops"], 2), str(tmp_path / "c"), 2)
    with pytest.raises(TypeError, match="mixes DataSet and MultiDataSet"):
        export_minibatches(sc.parallelize([good[0], MultiDataSet([torch.ones(2, 1)], [])], 2), str(tmp_path / "d"), 2)
    with pytest.raises(ValueError, match="no examples"):
        export_minibatches(sc.parallelize([], 2), str(tmp_path / "e"), 2)
    with pytest.raises(ValueError, match="no examples"):
        export_minibatches([], str(tmp_path / "f"), 2)
    assert not (tmp_path / "c").exists() and not (tmp_path / "e").exists()


def test_unreachable_bucket_is_named(s3: dict) -> None:
    broken = {
        **s3,
        "client_kwargs": {**s3["client_kwargs"], "endpoint_url": "http://127.0.0.1:9"},
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    with pytest.raises(StorageError, match="s3://test-bucket/nowhere"):
        export_minibatches(sequences([2]), "s3://test-bucket/nowhere", 2, storage_options=broken)


def run_and_kill(script: str, *args: str, until: Callable[[], bool], timeout: float = 60) -> None:
    """Run ``script`` in a fresh Python process and SIGKILL it as soon as ``until()`` holds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script, *args], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while not until():
            assert proc.poll() is None, f"the writer ended by itself: {proc.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "the writer never got there"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


SLOW_EXPORT = """
import sys, time, torch
from dlscale.data import DataSet, export_minibatches

def slowly():
    for i in range(200):
        yield DataSet(torch.full((2, 3), float(i)), torch.full((2,), i))
        time.sleep(0.05)

export_minibatches(slowly(), sys.argv[1], 2)
"""


def test_a_killed_export_is_refused_until_asked_for_what_is_there(sc: SparkContext, tmp_path: Path) -> None:
    out = tmp_path / "runs" / "train"
    run_and_kill(SLOW_EXPORT, str(out), until=lambda: len(list(out.glob("dataset_*.dlb"))) >= 5)
    written = sorted(out.glob("dataset_*.dlb"))
    assert 5 <= len(written) < 200
    assert json.loads((out / "_dlscale_export.json").read_text())["complete"] is False
    for url in (out, tmp_path / "runs", out / "dataset_00000000.dlb"):
        with pytest.raises(
            IncompleteExportError, match=f"{re.escape(str(out))}: the export to this folder did not finish"
        ):
            list_paths(sc, str(url))
    partial = list_paths(sc, str(out), require_complete=False).collect()
    assert partial == [str(p) for p in written]
    assert [int(load(p).labels[0]) for p in partial] == list(range(len(written)))


def test_a_finished_export_says_so_and_other_folders_need_no_manifest(sc: SparkContext, tmp_path: Path) -> None:
    paths = export_minibatches(sequences([3, 10, 1, 4]), str(tmp_path / "done"), 7)
    manifest = json.loads((tmp_path / "done" / "_dlscale_export.json").read_text())
    assert manifest == {
        "format": "dlscale-export",
        "version": 1,
        "complete": True,
        "batch_size": 7,
        "batches": 3,
        "examples": 18,
    }
    assert list_paths(sc, str(tmp_path / "done")).collect() == paths
    mine = tmp_path / "mine"  # minibatch files written one by one, by name: not an export
    for k, batch in enumerate(sequences([2, 2])):
        save(batch, str(mine / f"dataset_{k:08d}.dlb"))
    assert list_paths(sc, str(mine)).count() == 2


HANGING_WRITE = """
import os, sys, time
from dlscale import storage

def hang(*args):
    print("written", flush=True)
    time.sleep(600)

os.replace = hang  # the temporary file is whole; the writer dies before renaming it
storage.write_bytes(sys.argv[1], b"x" * 1000)
"""


def test_the_next_export_removes_temporaries_that_killed_writers_left(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_and_kill(HANGING_WRITE, str(out / "dataset_00000000.dlb"), until=lambda: any(out.glob(".*.tmp")))
    (left,) = out.iterdir()
    assert re.fullmatch(r"\.dataset_00000000\.dlb\.[0-9a-f]{32}\.tmp", left.name)
    (out / ".keep").write_bytes(b"")  # hidden, but not a temporary file: never removed
    old = time.time() - 2 * 3600
    os.utime(out / ".keep", (old, old))
    with pytest.raises(OutputExistsError, match="out"):  # a young temporary may be a live writer's
        export_minibatches(sequences([4]), str(out), 2)
    assert left.exists()
    os.utime(left, (old, old))
    with pytest.raises(OutputExistsError, match="out"):
        export_minibatches(sequences([4]), str(out), 2)
    assert not left.exists() and (out / ".keep").exists()
    (out / ".keep").unlink()
    assert len(export_minibatches(sequences([4]), str(out), 2)) == 2


def test_a_parallelized_rdd_is_written_by_the_driver_as_parallelize_took_it(sc: SparkContext, tmp_path: Path) -> None:
    """The driver holds a parallelized RDD's partitions: it writes them itself (fsspec's memory filesystem
    is the writing process's own, so the files are there only if the driver wrote them), with the
    elements as ``parallelize`` took them, as any job computes them, and the same bytes as the same
    elements computed and written on the workers."""
    elements = sequences([3, 7, 1, 12, 5, 9, 2])
    expected = reference(elements, 4)
    held = sc.parallelize(elements, 3)
    computed = sc.parallelize(elements, 3).map(lambda element: element)
    elements[0].features.add_(100.0)  # changed after parallelize: neither RDD sees it
    url = "memory://dlscale-test-export/held"
    fs, path = storage.open_fs(url, None)
    try:
        paths = export_minibatches(held, url, 4)
        assert_batches(paths, expected)
        assert [load(p).equals(e) for p, e in zip(paths, reference(held.collect(), 4))] == [True] * len(expected)
        on_workers = export_minibatches(computed, str(tmp_path / "computed"), 4)
        assert [Path(p).read_bytes() for p in on_workers] == [fs.cat_file(p) for p in paths]
    finally:
        fs.rm(path, recursive=True)
