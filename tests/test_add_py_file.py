"""Shipping the user's own code to the workers with ``SparkContext.addPyFile`` (PySpark's name): a
network whose module class lives in a file the workers cannot import trains once the file is added."""

from __future__ import annotations

import functools
import importlib
import os
import sys
import textwrap
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

from dlscale import ParameterAveragingTrainingMaster, SparkContext, SparkNet
from dlscale.data import DataSet
from dlscale.nn import Network

SOURCE = textwrap.dedent("""
    import torch

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, x):
            return 2 * self.linear(x)
""")


def a_module(directory: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A module of a fresh name in ``directory``, importable on the driver only."""
    name = f"user_models_{uuid.uuid4().hex[:8]}"
    path = directory / f"{name}.py"
    path.write_text(SOURCE)
    monkeypatch.syspath_prepend(str(directory))
    return name, path


def fit_once(sc, name: str, tmp_path: Path) -> Network:
    module = importlib.import_module(name).Scaled()
    net = Network(module, "cross_entropy", functools.partial(torch.optim.SGD, lr=0.1))
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    rdd = sc.parallelize(DataSet(x, (x[:, 0] > 0).long()).batch_by(8), 2)
    master = ParameterAveragingTrainingMaster(
        8, averaging_frequency=2, export_directory=str(tmp_path / uuid.uuid4().hex)
    )
    SparkNet(sc, net, master).fit(rdd)
    return net


def test_a_module_the_workers_lack_trains_once_added(sc, tmp_path, monkeypatch) -> None:
    name, path = a_module(tmp_path, monkeypatch)
    with pytest.raises(ModuleNotFoundError, match=name):
        fit_once(sc, name, tmp_path)
    sc.addPyFile(str(path))
    net = fit_once(sc, name, tmp_path)
    assert type(net.module).__module__ == name
    found = sc.client.run(lambda: sys.modules[name].__file__)
    assert len(found) == 2 and all(f.endswith(f"{name}.py") for f in found.values())


def test_from_object_storage(sc, tmp_path, monkeypatch, s3) -> None:
    name, local = a_module(tmp_path, monkeypatch)
    url = f"s3://test-bucket/code/{name}.py"
    with fsspec.open(url, "w", **s3) as f:
        f.write(local.read_text())
    sc.addPyFile(url, storage_options=s3)
    fit_once(sc, name, tmp_path)


def test_bad_paths_are_named(sc, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file .*missing.py"):
        sc.addPyFile(str(tmp_path / "missing.py"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"\.py, \.zip or \.egg file, got .*notes.txt"):
        sc.addPyFile(str(tmp_path / "notes.txt"))


def test_added_files_go_with_their_context(tmp_path) -> None:
    """PySpark's order of events (its test_add_py_file, then test_add_py_file_locally in a new context):
    a file added to a context is importable by its workers and its driver, and not by the driver of a
    later context until added there too."""
    name = f"userlibrary_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    path.write_text("class UserClass:\n    def hello(self):\n        return 'Hello World!'\n")

    def hello(_: int) -> str:
        return importlib.import_module(name).UserClass().hello()

    try:
        with SparkContext("local[1]") as first:
            with pytest.raises(ModuleNotFoundError, match=name):
                first.parallelize([0]).map(hello).first()
            first.addPyFile(str(path))
            assert first.parallelize([0]).map(hello).first() == "Hello World!"
            assert name not in sys.modules  # the job ran on the worker only
        with SparkContext("local[1]") as second:
            with pytest.raises(ImportError):
                importlib.import_module(name)
            second.addPyFile(str(path))
            assert hello(0) == "Hello World!"  # on the driver
            copies = second._py_files
        assert copies not in sys.path and not os.path.exists(copies)
    finally:
        sys.modules.pop(name, None)


@pytest.mark.pyspark
def test_listed_and_found_as_an_added_file_as_pyspark(sc, spark, tmp_path) -> None:
    """PySpark's addPyFile adds the file as addFile does (the example of its ``SparkFiles.get``): listFiles
    lists it beside the files added before, tasks and the driver find it with ``SparkFiles.get``, and it is
    importable in tasks. The same program on both."""
    from pyspark import SparkFiles as PySparkFiles

    from dlscale import SparkFiles

    stem = f"listed_{uuid.uuid4().hex[:8]}"
    text, module = tmp_path / f"{stem}.txt", tmp_path / f"{stem}.py"
    text.write_text("100")
    module.write_text("VALUE = 42\n")

    def program(c, files) -> tuple:
        def ours() -> list[str]:
            return sorted(u.replace(f"file:{tmp_path}", "") for u in c.listFiles if u.startswith(f"file:{tmp_path}/"))

        def in_task(_) -> list:
            path = files.get(module.name)
            assert path.startswith(files.getRootDirectory())
            return [(os.path.basename(path), Path(path).read_text(), importlib.import_module(stem).VALUE)]

        c.addFile(str(text))
        before = ours()
        c.addPyFile(str(module))
        c.addPyFile(str(module))  # again: listed once
        listed = ours()
        found = sorted(set(c.parallelize(range(4), 4).mapPartitions(in_task).collect()))
        return before, listed, found, Path(files.get(module.name)).read_text()

    try:
        expected = program(spark, PySparkFiles)
        sys.modules.pop(stem, None)
        got = program(sc, SparkFiles)
    finally:
        sys.modules.pop(stem, None)
    assert got == expected
    assert got[1] == [f"/{stem}.py", f"/{stem}.txt"]
