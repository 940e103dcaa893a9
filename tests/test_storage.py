"""The storage root for relative paths, text files on storage (SparkUtils' string helpers), the one atomic
write and the one lister, with the errors of every backend named."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import fsspec
import pytest

from dlscale import (
    SparkContext,
    StorageError,
    read_string_from_file,
    storage,
    write_string_to_file,
)


def test_relative_paths_resolve_under_the_root(tmp_path: Path) -> None:
    with dask.config.set({"dlscale.storage.root": str(tmp_path)}):
        assert storage.resolve("a/b.json") == (str(tmp_path / "a" / "b.json"), None)
        assert storage.resolve("") == (str(tmp_path), None)
    assert storage.resolve("/abs/x") == ("/abs/x", None)
    assert storage.resolve("memory://x", {"k": 1}) == ("memory://x", {"k": 1})
    with dask.config.set({"dlscale.storage.root": "s3://bucket/prefix/", "dlscale.storage.options": {"anon": True}}):
        assert storage.resolve("runs/1") == ("s3://bucket/prefix/runs/1", {"anon": True})
        assert storage.resolve("runs/1", {"anon": False}) == ("s3://bucket/prefix/runs/1", {"anon": False})


def test_hadoops_local_urls_are_read_and_written(tmp_path: Path) -> None:
    """``file:/tmp/x`` (Spark's form of a local URL, as ``getCheckpointFile`` gives it) is fsspec's
    ``file:///tmp/x``, never a relative path; a local path is written back in Hadoop's form."""
    assert storage.has_protocol(f"file:{tmp_path}") and not storage.is_relative(f"file:{tmp_path}")
    assert storage.resolve(f"file:{tmp_path}/a", {"k": 1}) == (f"file://{tmp_path}/a", {"k": 1})
    fs, path = storage.open_fs(f"file:{tmp_path}/a", None)
    assert path == f"{tmp_path}/a" and storage.hadoop_url(fs, path) == f"file:{tmp_path}/a"
    memory, key = storage.open_fs("memory://bucket/a", None)
    assert storage.hadoop_url(memory, key) == memory.unstrip_protocol(key)  # not a local file: fsspec's URL
    write_string_to_file(f"file:{tmp_path}/b.txt", "written")
    assert (tmp_path / "b.txt").read_text() == "written"


def test_the_default_root_is_the_checkout_storage_directory() -> None:
    root = Path(storage.root())
    assert root.name == "data" and (root.parent / "README.md").exists() and (root.parent / "s3_server.py").exists()


def test_strings_round_trip_locally_and_relative(tmp_path: Path, sc: SparkContext) -> None:
    results = {"accuracy": 0.9375, "labels": ["café", "niño"]}
    write_string_to_file(str(tmp_path / "eval" / "results.json"), json.dumps(results))
    assert json.loads(read_string_from_file(str(tmp_path / "eval" / "results.json"))) == results
    with dask.config.set({"dlscale.storage.root": str(tmp_path)}):
        write_string_to_file("notes/readme.txt", "line one\nline two\n")
        assert (tmp_path / "notes" / "readme.txt").read_text() == "line one\nline two\n"
        assert sc.textFile("notes/readme.txt").collect() == ["line one", "line two"]


def test_strings_on_s3_through_a_configured_root(s3: dict) -> None:
    with dask.config.set({"dlscale.storage.root": "s3://test-bucket/root", "dlscale.storage.options": s3}):
        write_string_to_file("eval.json", '{"f1": 0.5}')
        assert read_string_from_file("eval.json") == '{"f1": 0.5}'
    assert read_string_from_file("s3://test-bucket/root/eval.json", storage_options=s3) == '{"f1": 0.5}'


def test_string_errors_name_the_file(tmp_path: Path, s3: dict) -> None:
    with pytest.raises(StorageError, match="not found.*missing.json"):
        read_string_from_file(str(tmp_path / "missing.json"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(StorageError, match="latin1.txt is not UTF-8"):
        read_string_from_file(str(tmp_path / "latin1.txt"))
    with pytest.raises(StorageError, match="s3://no-such-bucket/x.json"):
        read_string_from_file("s3://no-such-bucket/x.json", storage_options=s3)


# -- writes: one atomic write, errors of every backend as StorageError --------------------------
def test_write_bytes_joins_chunks_atomically(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "er" / "out.bin"
    storage.write_bytes(str(target), b"head", bytearray(b"-"), memoryview(b"tail"))
    assert target.read_bytes() == b"head-tail"
    storage.write_bytes(str(target), b"new")
    assert target.read_bytes() == b"new" and sorted(os.listdir(target.parent)) == ["out.bin"]


def test_a_failure_to_produce_the_chunks_passes_and_leaves_nothing(tmp_path: Path) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"half"
        raise ValueError("the data is bad, not the storage")

    fs = fsspec.filesystem("file")
    with pytest.raises(ValueError, match="the data is bad") as e:
        storage.atomic_write(fs, str(tmp_path / "x.bin"), chunks())
    assert not isinstance(e.value, StorageError)
    assert os.listdir(tmp_path) == []


def test_local_write_errors_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a file, not a folder")
    with pytest.raises(StorageError, match=f"cannot write {tmp_path / 'file' / 'x.bin'}: ") as e:
        storage.write_bytes(str(tmp_path / "file" / "x.bin"), b"data")
    assert isinstance(e.value.__cause__, OSError)


def test_s3_write_errors_name_the_url(s3: dict) -> None:
    with pytest.raises(StorageError, match="cannot write s3://no-such-bucket/x.bin: .*bucket does not exist"):
        storage.write_bytes("s3://no-such-bucket/x.bin", b"data", storage_options=s3)
    unreachable = {
        **s3,
        "client_kwargs": {**s3["client_kwargs"], "endpoint_url": "http://127.0.0.1:9"},
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    with pytest.raises(StorageError, match="cannot write s3://test-bucket/x.bin: .*127.0.0.1:9") as e:
        storage.write_bytes("s3://test-bucket/x.bin", b"data", storage_options=unreachable)
    assert not isinstance(e.value.__cause__, OSError)  # botocore's own error, mapped all the same
    with pytest.raises(StorageError, match="cannot write s3://test-bucket/eval.json"):
        write_string_to_file("s3://test-bucket/eval.json", "{}", unreachable)
    storage.write_bytes("s3://test-bucket/ok/x.bin", b"da", b"ta", storage_options=s3)
    assert fsspec.filesystem("s3", **s3).cat_file("test-bucket/ok/x.bin") == b"data"


# -- listings: one lister, one hidden-name rule ----------------------------------------------------
@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """Visible files, Hadoop's markers and checksums, a temporary file of an atomic write, a hidden folder."""
    for name in [
        "part-00000",
        "part-00001.gz",
        "_SUCCESS",
        ".part-00000.crc",
        ".part-00002.0123abcd.tmp",
        "_temporary/0/part-00002",
        "sub/part-00003",
        "sub/.hidden/part-00004",
    ]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    return tmp_path


def test_find_files_skips_hidden_names_below_the_url(tree: Path) -> None:
    def found(url: str, **kwargs: Any) -> list[str]:
        return [os.path.relpath(p, tree) for p in storage.find_files(url, None, **kwargs)[1]]

    assert found(str(tree)) == ["part-00000", "part-00001.gz", "sub/part-00003"]
    assert found(str(tree), recursive=False) == ["part-00000", "part-00001.gz"]
    assert found(str(tree), extensions=["GZ"]) == ["part-00001.gz"]
    assert found(str(tree / "*")) == ["part-00000", "part-00001.gz", "sub/part-00003"]  # a folder matched is listed
    assert found(str(tree / "part-*"), recursive=False) == ["part-00000", "part-00001.gz"]
    assert found(str(tree / "_SUCCESS")) == ["_SUCCESS"]  # named itself, a hidden file is read
    assert found(str(tree / "sub" / ".hidden")) == ["sub/.hidden/part-00004"]  # hidden only below the url


def test_find_files_errors_name_the_url(tree: Path, sc: SparkContext) -> None:
    with pytest.raises(StorageError, match=f"Input path does not exist: {tree / 'nowhere'}$"):
        storage.find_files(str(tree / "nowhere"), None)
    with pytest.raises(StorageError, match="Input path does not exist: .*_temp\\*"):
        storage.find_files(str(tree / "_temp*"), None)  # only hidden names match
    (tree / "empty").mkdir()
    with pytest.raises(StorageError, match=f"no files under {tree / 'empty'}"):
        sc.textFile(str(tree / "empty"))
    with pytest.raises(StorageError, match=r"no files with extensions \['\.csv'\] under"):
        storage.find_files(str(tree), None, extensions=["csv"])


def test_find_files_on_s3(s3: dict, sc: SparkContext) -> None:
    for name in ["d/a.txt", "d/_SUCCESS", "d/.a.txt.crc", "d/sub/b.txt", "d/_temporary/c.txt"]:
        storage.write_bytes(f"s3://test-bucket/{name}", name.encode(), storage_options=s3)
    _, files = storage.find_files("s3://test-bucket/d", s3)
    assert files == ["test-bucket/d/a.txt", "test-bucket/d/sub/b.txt"]
    assert storage.find_files("s3://test-bucket/d/*", s3, recursive=False)[1] == files
    assert sc.textFile("s3://test-bucket/d", storage_options=s3).collect() == ["d/a.txt"]
    with pytest.raises(StorageError, match="Input path does not exist: s3://test-bucket/missing"):
        storage.find_files("s3://test-bucket/missing", s3)
    with pytest.raises(StorageError, match="s3://no-such-bucket/x"):
        storage.find_files("s3://no-such-bucket/x", s3)
    unreachable = {**s3, "client_kwargs": {**s3["client_kwargs"], "endpoint_url": "http://127.0.0.1:9"}}
    unreachable["config_kwargs"] = {"connect_timeout": 1, "retries": {"max_attempts": 1}}
    with pytest.raises(StorageError, match="cannot list s3://test-bucket/d: .*127.0.0.1:9"):
        storage.find_files("s3://test-bucket/d", unreachable)
