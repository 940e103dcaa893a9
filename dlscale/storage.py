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
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec
from dask.utils import parse_timedelta
from fsspec.implementations.local import LocalFileSystem

from dlscale import config
from dlscale.errors import DlscaleError, OutputExistsError, StorageError

_CHECKOUT = Path(__file__).resolve().parent.parent


def root() -> str:
    """The storage root URL (or absolute local path)."""
    configured = config.get("storage.root")
    if configured:
        return configured if has_protocol(configured) else os.path.abspath(os.path.expanduser(configured))
    if (_CHECKOUT / "storage" / "README.md").exists() and (_CHECKOUT / "pyproject.toml").exists():
        return str(_CHECKOUT / "storage" / "data")
    return os.path.expanduser(os.path.join("~", ".dlscale", "storage"))


_HADOOP_LOCAL = re.compile(r"^file:/(?!/)")
"""Hadoop's form of a local file's URL, ``file:/tmp/x`` (fsspec's is ``file:///tmp/x``)."""


def has_protocol(url: str) -> bool:
    """Whether ``url`` names its file system (``s3://...``, ``file://...``, Hadoop's ``file:/...``,
    ``simplecache::...``)."""
    return "://" in url or "::" in url or _HADOOP_LOCAL.match(url) is not None


def is_relative(url: str) -> bool:
    """Whether ``url`` is a relative path, to be found under the storage root."""
    return not (has_protocol(url) or os.path.isabs(url) or url.startswith("~"))


def resolve(url: str, storage_options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any] | None]:
    """``url`` made absolute against the storage root, with the root's options when none are given.
    Hadoop's form of a local URL (``file:/tmp/x``, as Spark writes one) becomes fsspec's (``file:///tmp/x``)."""
    if _HADOOP_LOCAL.match(url):
        return "file://" + url[len("file:") :], storage_options
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


Chunk = bytes | bytearray | memoryview


def hadoop_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """``path`` on ``fs`` as Spark (Hadoop's ``Path``) writes its URL: ``file:/tmp/x`` for a local file,
    the fsspec URL otherwise. :func:`open_fs` reads both forms."""
    return f"file:{path}" if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def _display(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """``path`` on ``fs`` as a user writes it: a plain path for a local file, a URL otherwise."""
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{32}\.tmp")
"""The names of :func:`atomic_write`'s temporary files: ``.<name>.<uuid4 hex>.tmp``."""


def _temporary(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A fresh temporary file beside ``path``, named by :data:`_TEMPORARY`'s rule."""
    return f"{fs._parent(path)}/.{os.path.basename(path)}.{uuid.uuid4().hex}.tmp"


@contextmanager
def as_storage_error(action: str, url: str) -> Iterator[None]:
    """Turn an error raised in the block into a :class:`StorageError` that says ``cannot <action> <url>``.

    Object stores do not all raise ``OSError`` (s3fs lets botocore's errors through, for a start), so
    every exception is mapped; dlscale's own errors pass unchanged.
    """
    try:
        yield
    except DlscaleError:
        raise
    except Exception as e:
        raise StorageError(f"cannot {action} {url}: {e}") from e


def atomic_write(fs: fsspec.AbstractFileSystem, path: str, chunks: Iterable[Chunk]) -> None:
    """Write the bytes of ``chunks`` to ``path`` so that a reader sees either nothing or the whole file.

    The chunks are produced first, so an error in producing them leaves nothing behind. Locally they
    go to a hidden temporary file beside ``path`` (``.<name>.<uuid>.tmp``, skipped by
    :func:`find_files`) that is renamed over it; an object store (S3 and the like) receives them in
    one upload, which it publishes only when complete. A failure of the storage raises
    :class:`StorageError` naming the file.
    """
    chunks = list(chunks)
    with as_storage_error("write", _display(fs, path)):
        if not isinstance(fs, LocalFileSystem):
            fs.pipe_file(path, b"".join(chunks))
            return
        tmp = _temporary(fs, path)
        try:
            os.makedirs(fs._parent(path), exist_ok=True)
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def remove_stale_temporaries(url: str, storage_options: dict[str, Any] | None) -> list[str]:
    """Remove the temporary files that writers killed inside :func:`atomic_write` left in folder ``url``:
    the files named by its rule (``.<name>.<uuid>.tmp``) last modified longer than
    ``dlscale.storage.stale-temporary-age`` ago, so that a writer still at work keeps its own. Only
    local folders hold such files (object stores publish an upload whole). Returns the paths removed."""
    fs, path = open_fs(url, storage_options)
    if not isinstance(fs, LocalFileSystem) or not os.path.isdir(path):
        return []
    cutoff = time.time() - parse_timedelta(config.get("storage.stale-temporary-age"))
    removed = []
    with as_storage_error("clean", url):
        for entry in os.scandir(path):
            if _TEMPORARY.fullmatch(entry.name) and entry.is_file() and entry.stat().st_mtime < cutoff:
                try:
                    os.remove(entry.path)
                except FileNotFoundError:  # removed meanwhile by another writer's clean-up
                    continue
                removed.append(entry.path)
    return removed


def write_bytes(url: str, *chunks: Chunk, storage_options: dict[str, Any] | None = None) -> None:
    """Write ``chunks``, one after another, to ``url`` atomically (see :func:`atomic_write`); a relative
    ``url`` is under the storage root."""
    fs, path = open_fs(url, storage_options)
    atomic_write(fs, path, chunks)


def _hidden(name: str) -> bool:
    """Whether a file or folder name is hidden from listings: it starts with ``_`` or ``.``, as Hadoop's
    markers (``_SUCCESS``), checksums (``.crc``) and :func:`atomic_write`'s temporary files do."""
    return name.startswith(("_", "."))


def _visible_below(fs: fsspec.AbstractFileSystem, root: str, recursive: bool) -> list[str]:
    """The files under folder ``root`` with no hidden name at any level below it."""
    root = root.rstrip("/")
    found = fs.find(root, maxdepth=None if recursive else 1)
    below = {p: p[len(root) :] if p.startswith(root) else os.path.basename(p) for p in found}
    return [p for p, rel in below.items() if not any(_hidden(part) for part in rel.split("/") if part)]


def find_files(
    url: str, storage_options: dict[str, Any] | None, recursive: bool = True, extensions: Iterable[str] | None = None
) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The file system and the sorted paths of the files that ``url`` names, the way Hadoop lists input.

    ``url`` is a file (itself, hidden name or not), a folder (its files, at every depth or, without
    ``recursive``, its own) or a glob pattern with ``*``, ``?`` or ``[`` (each match, as a file or a
    folder). Within a folder and among a pattern's matches, hidden names are skipped.
    ``extensions`` (``"png"`` or ``".png"``, any case) keeps only files with those endings. Raises
    :class:`StorageError` naming ``url`` when nothing is there or no file is left.
    """
    fs, path = open_fs(url, storage_options)
    suffixes = tuple(sorted({"." + e.lower().lstrip(".") for e in extensions})) if extensions else ()
    with as_storage_error("list", url):
        if any(c in path for c in "*?["):
            found = fs.glob(path, detail=True)
            matches = {m: info for m, info in found.items() if not _hidden(os.path.basename(m.rstrip("/")))}
        else:
            try:
                matches = {path: fs.info(path)}
            except FileNotFoundError:
                matches = {}
        if not matches:
            raise StorageError(f"Input path does not exist: {url}")
        files = sorted(
            f
            for m, info in matches.items()
            for f in (_visible_below(fs, m, recursive) if info["type"] == "directory" else [m])
            if not suffixes or f.lower().endswith(suffixes)
        )
    if not files:
        raise StorageError(f"no files{f' with extensions {list(suffixes)}' if suffixes else ''} under {url}")
    return fs, files


def check_empty(
    url: str, storage_options: dict[str, Any] | None, create: bool = False
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The file system and path of ``url``, refused if something is already there (outputs never mix);
    with ``create``, the folder is made."""
    fs, path = open_fs(url, storage_options)
    with as_storage_error("list", url):
        taken = fs.exists(path) and (not fs.isdir(path) or bool(fs.ls(path, detail=False)))
    if taken:
        raise OutputExistsError(f"output {url} already exists and is not empty; write to a new location")
    if create:
        with as_storage_error("create", url):
            fs.makedirs(path, exist_ok=True)
    return fs, path


def write_string_to_file(url: str, text: str, storage_options: dict[str, Any] | None = None) -> None:
    """Write ``text`` (UTF-8) to ``url`` atomically, e.g. evaluation results as JSON."""
    write_bytes(url, text.encode("utf-8"), storage_options=storage_options)


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
