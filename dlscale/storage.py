"""The storage root and small text files on it (DL4J's ``SparkUtils.writeStringToFile``).

Like Hadoop's default file system, the storage root is where a relative path points: give
``"train/batches"`` and it means ``<root>/train/batches``. The root is ``dlscale.storage.root``
(any fsspec URL: a local directory, ``s3://bucket/prefix``, ``hdfs://...``), with
``dlscale.storage.options`` as its default ``storage_options``. Left unset, it is the ``storage/data``
directory of the source checkout dlscale runs from, or ``~/.dlscale/storage`` for an installed copy.
Relative paths are resolved on the driver, so workers always receive absolute URLs.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dlscale import config
from dlscale.errors import OutputExistsError, StorageError

_CHECKOUT = Path(__file__).resolve().parent.parent


def root() -> str:
    """The storage root URL (or absolute local path)."""
    configured = config.get("storage.root")
    if configured:
        return configured if has_protocol(configured) else os.path.abspath(os.path.expanduser(configured))
    if (_CHECKOUT / "storage" / "README.md").exists() and (_CHECKOUT / "pyproject.toml").exists():
        return str(_CHECKOUT / "storage" / "data")
    return os.path.expanduser(os.path.join("~", ".dlscale", "storage"))


def has_protocol(url: str) -> bool:
    """Whether ``url`` names its file system (``s3://...``, ``file://...``, ``simplecache::...``)."""
    return "://" in url or "::" in url


def is_relative(url: str) -> bool:
    """Whether ``url`` is a relative path, to be found under the storage root."""
    return not (has_protocol(url) or os.path.isabs(url) or url.startswith("~"))


def resolve(url: str, storage_options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any] | None]:
    """``url`` made absolute against the storage root, with the root's options when none are given."""
    if not is_relative(url):
        return os.path.expanduser(url) if url.startswith("~") else url, storage_options
    base = root()
    if storage_options is None and has_protocol(base):
        storage_options = dict(config.get("storage.options") or {})
    if not url or url == ".":
        return base, storage_options
    return (f"{base.rstrip('/')}/{url}" if has_protocol(base) else os.path.join(base, url)), storage_options


def open_fs(url: str, storage_options: dict[str, Any] | None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of ``url`` (relative to the storage root if relative); errors name the URL."""
    url, storage_options = resolve(url, storage_options)
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as e:
        raise StorageError(f"cannot open {url!r}: {e}") from e


def atomic_write(fs: fsspec.AbstractFileSystem, path: str, write: Callable[[Any], None]) -> None:
    """Write ``path`` so that a reader sees either nothing or the whole file.

    Local files are written under a temporary name and renamed; object stores (S3 and the like)
    publish an object only when its upload completes.
    """
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(fs._parent(path), exist_ok=True)
        tmp = f"{fs._parent(path)}/.{os.path.basename(path)}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                write(f)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    else:
        with fs.open(path, "wb") as f:
            write(f)


def _visible(root: str, path: str) -> bool:
    """False for a file whose name, or a folder below ``root``, starts with ``_`` or ``.`` (as Hadoop)."""
    rel = path[len(root) :] if path.startswith(root) else os.path.basename(path)
    return not any(part.startswith(("_", ".")) for part in rel.split("/") if part)


def find_files(
    url: str, storage_options: dict[str, Any] | None, recursive: bool = True, extensions: Iterable[str] | None = None
) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The file system and the sorted paths of the visible files at or under ``url``.

    Names starting with ``_`` or ``.`` (markers, temporary files) are skipped at any depth;
    ``extensions`` (``"png"`` or ``".png"``, any case) keeps only files with those endings.
    """
    fs, path = open_fs(url, storage_options)
    suffixes = tuple(sorted({"." + e.lower().lstrip(".") for e in extensions})) if extensions else ()
    try:
        if fs.isdir(path):
            found = fs.find(path, maxdepth=None if recursive else 1)
        elif fs.isfile(path):
            found = [path]
        else:
            raise StorageError(f"path does not exist: {url}")
    except StorageError:
        raise
    except Exception as e:  # object-store errors do not all derive from OSError
        raise StorageError(f"cannot list {url}: {e}") from e
    files = sorted(p for p in found if _visible(path.rstrip("/"), p) and (not suffixes or p.lower().endswith(suffixes)))
    if not files:
        raise StorageError(f"no files{f' with extensions {list(suffixes)}' if suffixes else ''} under {url}")
    return fs, files


def check_empty(url: str, storage_options: dict[str, Any] | None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The file system and path of ``url``, refused if something is already there: outputs never mix."""
    fs, path = open_fs(url, storage_options)
    try:
        taken = fs.exists(path) and (not fs.isdir(path) or bool(fs.ls(path, detail=False)))
    except Exception as e:  # object-store errors do not all derive from OSError
        raise StorageError(f"cannot reach {url}: {e}") from e
    if taken:
        raise OutputExistsError(f"output {url} already exists and is not empty; write to a new location")
    return fs, path


def write_string_to_file(url: str, text: str, storage_options: dict[str, Any] | None = None) -> None:
    """Write ``text`` (UTF-8) to ``url`` atomically, e.g. evaluation results as JSON."""
    fs, path = open_fs(url, storage_options)
    data = text.encode("utf-8")
    try:
        atomic_write(fs, path, lambda f: f.write(data))
    except OSError as e:
        raise StorageError(f"cannot write {url}: {e}") from e


def read_string_from_file(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """The UTF-8 text stored at ``url``."""
    fs, path = open_fs(url, storage_options)
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise StorageError(f"file not found: {url}") from e
    except Exception as e:  # object-store errors do not all derive from OSError
        raise StorageError(f"cannot read {url}: {e}") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StorageError(f"{url} is not UTF-8 text: {e}") from e
