"""The storage root for relative paths, and text files on storage (SparkUtils' string helpers)."""

from __future__ import annotations

import json
from pathlib import Path

import dask
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
