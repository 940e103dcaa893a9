"""Files for every task (``SparkContext.addFile`` / ``addArchive``, ``SparkFiles``) on real worker processes:
files, directories and archives on the workers and the driver, a worker that joins later, unsafe archives
refused, two contexts kept apart, everything gone on stop, and the same program against PySpark."""

from __future__ import annotations

import io
import os
import re
import tarfile
import uuid
import zipfile
from pathlib import Path
from typing import Any

import distributed
import fsspec
import pytest

from dlscale import SparkContext, SparkFiles
from dlscale.facade.files import worker_root


def unique(stem: str) -> str:
    """A name no other test gives a file of the session's contexts."""
    return f"{stem}-{uuid.uuid4().hex[:8]}"


def a_zip(path: Path, members: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)
    return path


def a_tar(path: Path, members: dict[str, str], mode: str = "w:gz") -> Path:
    with tarfile.open(path, mode) as t:
        for name, text in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(text)
            t.addfile(info, io.BytesIO(text.encode()))
    return path


def tree(root: str) -> dict[str, str]:
    """The files below ``root``, by relative path, with their text."""
    out = {}
    for here, _, files in os.walk(root):
        for f in files:
            full = os.path.join(here, f)
            out[os.path.relpath(full, root)] = Path(full).read_text()
    return out


def seen_by_tasks(c: Any, names: list[str], files: Any) -> list[Any]:
    """What each of four tasks finds under the names, as paths relative to its root directory."""

    def look(_: Any) -> list[Any]:
        root = files.getRootDirectory()
        out = []
        for name in names:
            path = files.get(name)
            assert os.path.isabs(path) and path.startswith(root)
            out.append((name, tree(path) if os.path.isdir(path) else Path(path).read_text()))
        return [out]

    return c.parallelize(range(4), 4).mapPartitions(look).collect()


def add_everything(c: Any, tmp_path: Path) -> tuple[list[str], list[str], list[str]]:
    """A file, a directory and three archives (one renamed by a fragment) added to ``c``: the names tasks
    find them by, and ``listFiles`` and ``listArchives`` with ``tmp_path`` left out."""
    text = tmp_path / f"{unique('data')}.txt"
    text.write_text("100")
    folder = tmp_path / unique("folder")
    (folder / "sub").mkdir(parents=True)
    (folder / "top.txt").write_text("top")
    (folder / "sub" / "deep.txt").write_text("deep")
    (folder / "empty").mkdir()
    zipped = a_zip(tmp_path / f"{unique('zipped')}.zip", {"a.txt": "A", "inner/b.txt": "B"})
    tarred = a_tar(tmp_path / f"{unique('tarred')}.tar.gz", {"t.txt": "T"})
    plain = a_tar(tmp_path / f"{unique('plain')}.tar", {"p/q.txt": "Q"}, mode="w")
    renamed = unique("renamed")
    c.addFile(str(text))
    c.addFile(str(text))  # again: nothing happens
    c.addFile(str(folder), recursive=True)
    c.addArchive(str(zipped))
    c.addArchive(f"{tarred}#{renamed}")
    c.addArchive(str(plain))
    c.addArchive(str(plain))

    def ours(urls: list[str]) -> list[str]:
        return sorted(u.replace(f"file:{tmp_path}", "") for u in urls if u.startswith(f"file:{tmp_path}/"))

    return [text.name, folder.name, zipped.name, renamed, plain.name], ours(c.listFiles), ours(c.listArchives)


def same_program(found: Any) -> str:
    """``found`` with the names' random parts left out, to compare two runs."""
    return re.sub(r"-[0-9a-f]{8}", "", repr(found))


def test_files_directories_and_archives_reach_every_task_and_the_driver(sc: SparkContext, tmp_path: Path) -> None:
    names, files, archives = add_everything(sc, tmp_path)
    text, folder, zipped, renamed, plain = names
    assert files == sorted([f"/{folder}/", f"/{text}"])
    assert same_program(archives) == same_program([f"/{plain}", f"/tarred.tar.gz#{renamed}", f"/{zipped}"])
    expected = [
        (text, "100"),
        (folder, {"top.txt": "top", os.path.join("sub", "deep.txt"): "deep"}),
        (zipped, {"a.txt": "A", os.path.join("inner", "b.txt"): "B"}),
        (renamed, {"t.txt": "T"}),
        (plain, {os.path.join("p", "q.txt"): "Q"}),
    ]
    assert seen_by_tasks(sc, names, SparkFiles) == [expected] * 4
    assert os.path.isdir(SparkFiles.get(os.path.join(folder, "empty")))
    # on the driver: its own copies, outside the workers' directories
    driver = SparkFiles.getRootDirectory()
    assert SparkFiles.get(text) == os.path.join(driver, text) and Path(SparkFiles.get(text)).read_text() == "100"
    assert tree(SparkFiles.get(renamed)) == {"t.txt": "T"}
    application = sc.applicationId
    workers = sc.client.run(lambda dask_worker: worker_root(dask_worker.local_directory, application))
    assert len(set(workers.values())) == 2 and driver not in workers.values()


def test_the_same_name_from_another_path(sc: SparkContext, tmp_path: Path) -> None:
    """As PySpark's local mode: another path with the same content is listed too; other content is refused
    (with the message Spark gives on a cluster), and what was added stays as it was."""
    name = f"{unique('clash')}.txt"
    for folder, text in (("a", "one"), ("b", "one"), ("c", "two")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text(text)
    sc.addFile(str(tmp_path / "a" / name))
    sc.addFile(str(tmp_path / "b" / name))
    with pytest.raises(ValueError, match=f"File {name} was already registered with a different path .*c/{name}"):
        sc.addFile(str(tmp_path / "c" / name))
    ours = [u for u in sc.listFiles if u.endswith(name)]
    assert ours == [f"file:{tmp_path}/a/{name}", f"file:{tmp_path}/b/{name}"]
    assert seen_by_tasks(sc, [name], SparkFiles) == [[(name, "one")]] * 4


def test_bad_paths_are_refused(sc: SparkContext, tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    before = (sc.listFiles, sc.listArchives)
    with pytest.raises(FileNotFoundError, match=f"File file:{tmp_path}/missing.txt does not exist"):
        sc.addFile(str(tmp_path / "missing.txt"))
    with pytest.raises(IsADirectoryError, match="is a directory; pass recursive=True"):
        sc.addFile(str(tmp_path / "folder"))
    with pytest.raises(ValueError, match=r"addArchive takes a \.zip, .* file, got .*notes\.txt"):
        sc.addArchive(str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match="does not name a file"):
        sc.addArchive(f"{a_zip(tmp_path / 'x.zip', {'a': 'a'})}#sub/dir")
    with pytest.raises(ValueError, match="cannot be unpacked"):
        (tmp_path / "broken.zip").write_bytes(b"not a zip")
        sc.addArchive(str(tmp_path / "broken.zip"))
    assert (sc.listFiles, sc.listArchives) == before


@pytest.mark.parametrize(
    ("kind", "member"),
    [("zip", "../evil.txt"), ("zip", "/tmp/evil.txt"), ("zip", "ok/../../evil.txt"), ("tar.gz", "../evil.txt")],
)
def test_members_outside_the_archive_are_refused(sc: SparkContext, tmp_path: Path, kind: str, member: str) -> None:
    stem = unique("slip")
    path = tmp_path / f"{stem}.{kind}"
    (a_zip if kind == "zip" else a_tar)(path, {"fine.txt": "ok", member: "evil"})
    with pytest.raises(ValueError, match=f"archive '{stem}.{kind}': member '{member}' would be unpacked outside"):
        sc.addArchive(str(path))
    assert not any(stem in u for u in sc.listArchives)
    assert not os.path.exists(SparkFiles.get(path.name))
    application, name = sc.applicationId, path.name
    found = sc.client.run(lambda dask_worker: os.path.exists(worker_root(dask_worker.local_directory, application)))
    if any(found.values()):
        listed = sc.client.run(lambda dask_worker: os.listdir(worker_root(dask_worker.local_directory, application)))
        assert not any(name in names for names in listed.values())
    assert not (tmp_path / "evil.txt").exists() and not Path("/tmp/evil.txt").exists()


def test_a_link_out_of_a_tar_is_refused(sc: SparkContext, tmp_path: Path) -> None:
    path = tmp_path / f"{unique('link')}.tar"
    with tarfile.open(path, "w") as t:
        link = tarfile.TarInfo("escape")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc"
        t.addfile(link)
    with pytest.raises(ValueError, match=f"archive '{path.name}': member 'escape' refused"):
        sc.addArchive(str(path))


def test_from_object_storage(sc: SparkContext, tmp_path: Path, s3: dict) -> None:
    name = f"{unique('remote')}.txt"
    with fsspec.open(f"s3://test-bucket/files/{name}", "w", **s3) as f:
        f.write("from s3")
    archive = a_zip(tmp_path / "deps.zip", {"dep.txt": "dep"})
    with fsspec.open("s3://test-bucket/files/deps.zip", "wb", **s3) as f:
        f.write(archive.read_bytes())
    renamed = unique("deps")
    sc.addFile(f"s3://test-bucket/files/{name}", storage_options=s3)
    sc.addArchive(f"s3://test-bucket/files/deps.zip#{renamed}", storage_options=s3)
    assert f"s3://test-bucket/files/{name}" in sc.listFiles
    assert f"s3://test-bucket/files/deps.zip#{renamed}" in sc.listArchives
    assert seen_by_tasks(sc, [name, renamed], SparkFiles) == [[(name, "from s3"), (renamed, {"dep.txt": "dep"})]] * 4


def test_a_worker_that_joins_later_gets_the_files_and_all_go_on_stop(tmp_path: Path) -> None:
    (tmp_path / "late.txt").write_text("late")
    archive = a_zip(tmp_path / "late.zip", {"x.txt": "x"})

    def found(dask_worker: Any, application: str) -> tuple[str, dict[str, str]]:
        root = worker_root(dask_worker.local_directory, application)
        return root, tree(root)

    with SparkContext("local[1]") as c:
        c.addFile(str(tmp_path / "late.txt"))
        c.addArchive(str(archive))
        c.client.cluster.scale(2)
        c.client.wait_for_workers(2)
        on_workers = c.client.run(found, application=c.applicationId)
        driver = SparkFiles.getRootDirectory()
        assert os.path.isdir(driver)
    assert [files for _, files in on_workers.values()] == [
        {"late.txt": "late", os.path.join("late.zip", "x.txt"): "x"}
    ] * 2
    assert not any(os.path.exists(root) for root, _ in on_workers.values()) and not os.path.exists(driver)


def test_an_addition_a_worker_cannot_write_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "blocked.txt").write_text("x")

    def block(dask_worker: Any, application: str) -> None:
        Path(worker_root(dask_worker.local_directory, application)).write_text("a file where the directory goes")

    with SparkContext("local[1]") as c:
        c.client.run(block, application=c.applicationId)
        with pytest.raises(FileExistsError):
            c.addFile(str(tmp_path / "blocked.txt"))
        assert c.listFiles == [] and not os.path.exists(SparkFiles.get("blocked.txt"))
        plugins = c.client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.worker_plugins))
        assert not any(c.applicationId in p for p in plugins)


def test_stop_after_the_cluster_is_gone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "kept.txt").write_text("x")
    with distributed.LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster:
        c = SparkContext(cluster=cluster)
        c.addFile(str(tmp_path / "kept.txt"))
        driver = SparkFiles.getRootDirectory()
    c.stop()
    assert not os.path.exists(driver) and c not in SparkContext._running
    assert not [r for r in caplog.records if r.name == "dlscale"]


def test_two_contexts_on_one_cluster_keep_their_files_apart(sc: SparkContext, tmp_path: Path) -> None:
    name = f"{unique('mine')}.txt"
    for who in ("first", "second"):
        (tmp_path / who).mkdir()
        (tmp_path / who / name).write_text(who)
    sc.addFile(str(tmp_path / "first" / name))
    with distributed.Client(sc.client.scheduler.address) as client:
        other = SparkContext(client=client)
        try:
            other.addFile(str(tmp_path / "second" / name))
            plugins = client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.worker_plugins))
            assert sum(other.applicationId in p for p in plugins) == 1
            assert seen_by_tasks(sc, [name], SparkFiles) == [[(name, "first")]] * 4
            assert seen_by_tasks(other, [name], SparkFiles) == [[(name, "second")]] * 4
            assert Path(SparkFiles.get(name)).read_text() == "second"  # the newest context's, on the driver
            roots = other.parallelize([0], 1).map(lambda _: SparkFiles.getRootDirectory()).collect()
            assert other.applicationId in roots[0] and sc.applicationId not in roots[0]
            driver = SparkFiles.getRootDirectory()
        finally:
            other.stop()
        plugins = client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.worker_plugins))
        assert not any(other.applicationId in p for p in plugins)
        assert any(sc.applicationId in p for p in plugins)
        application = other.applicationId
        gone = client.run(lambda dask_worker: os.path.exists(worker_root(dask_worker.local_directory, application)))
        assert not any(gone.values()) and not os.path.exists(driver)
    assert Path(SparkFiles.get(name)).read_text() == "first"
    assert seen_by_tasks(sc, [name], SparkFiles) == [[(name, "first")]] * 4


@pytest.mark.pyspark
def test_as_pyspark(sc: SparkContext, spark: Any, tmp_path: Path) -> None:
    """The same program on both: what tasks find under each name, and what the lists hold."""
    from pyspark import SparkFiles as PySparkFiles

    results = []
    for c, files in ((sc, SparkFiles), (spark, PySparkFiles)):
        names, listed, archives = add_everything(c, tmp_path)
        results.append(same_program((seen_by_tasks(c, names, files), listed, archives)))
    assert results[0] == results[1]


def test_not_in_the_tasks_of_to_local_iterator(sc: SparkContext) -> None:
    """Those tasks carry no job annotation, so a task cannot tell whose files it would see: it is told."""
    with pytest.raises(RuntimeError, match=r"not in those of toLocalIterator"):
        list(sc.parallelize([0], 1).map(lambda _: SparkFiles.get("x")).toLocalIterator())
