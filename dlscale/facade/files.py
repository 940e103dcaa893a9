"""Files for every task: ``SparkContext.addFile`` / ``addArchive`` (and ``addPyFile``, which adds its file
as ``addFile`` does) and ``SparkFiles``.

An added file, directory or archive travels to the workers in a worker plugin of its own, Dask's way to
give every worker something, those that join later included: the plugin writes it into the context's
directory on the worker, ``dlscale-files-<applicationId>`` in the worker's local directory, and deletes
it when the context stops and unregisters the plugin. An archive is unpacked into a directory named after
it (or after the URL's fragment, ``a.zip#name``), its members checked first. The driver keeps its own
copies, as PySpark does, in a temporary directory deleted on stop.

``SparkFiles.get(name)`` in a task is the path on the task's worker, in the directory of the task's
context (from the job's annotation): two contexts on one cluster do not see each other's files.
Elsewhere it is the driver's copy of the newest running context.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import posixpath
import shutil
import tarfile
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import PureWindowsPath
from typing import Any
from urllib.parse import quote

from distributed import Client, get_worker
from distributed.diagnostics.plugin import WorkerPlugin

from dlscale import storage
from dlscale.facade.taskcontext import TaskContext

__all__ = ["SparkFiles"]

logger = logging.getLogger("dlscale")

ARCHIVES = (".zip", ".jar", ".tar", ".tar.gz", ".tgz")  # what addArchive unpacks, as Spark


@dataclass(frozen=True)
class _Content:
    """What was added: a file's bytes, a directory's files (``None`` for a directory) by relative path,
    or an archive's bytes, with the archive's own name (its format)."""

    kind: str  # "file", "directory" or "archive"
    data: bytes | dict[str, bytes | None]
    source: str

    def digest(self) -> str:
        h = hashlib.sha256(self.kind.encode())
        items = sorted(self.data.items()) if isinstance(self.data, dict) else [("", self.data)]
        for path, data in items:
            h.update(f"\0{path}\0{'d' if data is None else len(data)}\0".encode())
            h.update(data or b"")
        return h.hexdigest()

    def write(self, target: str) -> None:
        """Make ``target``: the file, the directory, or the archive unpacked."""
        if isinstance(self.data, dict):
            os.makedirs(target)
            for path, data in sorted(self.data.items()):
                full = os.path.join(target, *path.split("/"))
                if data is None:
                    os.makedirs(full, exist_ok=True)
                    continue
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "wb") as f:
                    f.write(data)
        elif self.kind == "archive":
            _unpack(self.source, self.data, target)
        else:
            with open(target, "wb") as f:
                f.write(self.data)


def _check_member(member: str, archive: str) -> None:
    """Refuse a member that would land outside the archive's directory (an absolute path or ``..``)."""
    parts = member.replace("\\", "/").split("/")
    if member.startswith(("/", "\\")) or PureWindowsPath(member).drive or ".." in parts:
        raise ValueError(f"archive {archive!r}: member {member!r} would be unpacked outside its directory; refused")


def _unpack(archive: str, data: bytes, target: str) -> None:
    """Unpack a ``.zip`` / ``.jar`` or a (gzipped) tar into ``target``, after checking every member."""
    os.makedirs(target)
    try:
        if archive.lower().endswith((".zip", ".jar")):
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for name in z.namelist():
                    _check_member(name, archive)
                z.extractall(target)
            return
        with tarfile.open(fileobj=io.BytesIO(data)) as t:
            for member in t.getmembers():
                _check_member(member.name, archive)
            # the "data" filter also refuses links out of the directory and device files
            t.extractall(target, filter="data")
    except tarfile.FilterError as e:
        raise ValueError(f"archive {archive!r}: member {e.tarinfo.name!r} refused: {e}") from e
    except (zipfile.BadZipFile, tarfile.ReadError) as e:
        raise ValueError(f"archive {archive!r} cannot be unpacked: {e}") from e


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _place(root: str, name: str, content: _Content) -> str:
    """Write ``content`` as ``root/name``, built aside and moved in so that no task sees it half written."""
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}.", dir=root)
    try:
        built = os.path.join(staging, name)
        content.write(built)
        target = os.path.join(root, name)
        _remove(target)
        os.rename(built, target)
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def worker_root(local_directory: str, application: str) -> str:
    """The directory of ``application``'s files on a worker whose local directory is ``local_directory``."""
    return os.path.join(local_directory, f"dlscale-files-{application}")


class _AddedFile(WorkerPlugin):
    """Writes one added file, directory or unpacked archive into its context's directory on each worker,
    and deletes it (and the directory, once empty) when unregistered."""

    def __init__(self, application: str, name: str, content: _Content) -> None:
        self.application = application
        self.file_name = name
        self.content = content

    def setup(self, worker: Any) -> None:
        _place(worker_root(worker.local_directory, self.application), self.file_name, self.content)

    def teardown(self, worker: Any) -> None:
        root = worker_root(worker.local_directory, self.application)
        _remove(os.path.join(root, self.file_name))
        try:
            os.rmdir(root)
        except OSError:  # other files are left, or it is gone
            pass


def _read(fs: Any, path: str, url: str, recursive: bool) -> bytes | dict[str, bytes | None]:
    """The bytes of file ``path`` on ``fs`` (``url`` for messages), or with ``recursive`` a directory's files."""
    if fs.isdir(path):
        if not recursive:
            raise IsADirectoryError(f"addFile: {url} is a directory; pass recursive=True to add it")
        root = path.rstrip("/")
        found = fs.find(root, withdirs=True, detail=True)
        return {
            posixpath.relpath(p, root): None if info["type"] == "directory" else fs.cat_file(p)
            for p, info in found.items()
            if p.rstrip("/") != root
        }
    if not fs.isfile(path):
        raise FileNotFoundError(f"File {url} does not exist")
    return fs.cat_file(path)


_open: list[Files] = []  # the Files of the running contexts, oldest first
_open_lock = threading.Lock()


class Files:
    """The files, directories and archives that one context added: what ``listFiles`` and ``listArchives``
    list, the driver's copies, and the workers' plugins."""

    def __init__(self, application: str) -> None:
        self._application = application
        self._root: str | None = None
        self._digests: dict[str, tuple[str, str]] = {}  # name -> (first URL, content digest)
        self.files: list[str] = []
        self.archives: list[str] = []
        self._plugins: list[str] = []
        self._lock = threading.Lock()
        with _open_lock:
            _open.append(self)

    def root(self) -> str:
        """The driver's directory of copies, made on first use."""
        with self._lock:
            if self._root is None:
                self._root = tempfile.mkdtemp(prefix=f"dlscale-files-{self._application}-")
            return self._root

    def add(
        self,
        client: Client,
        path: str,
        *,
        archive: bool,
        recursive: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        """Add a local path or fsspec URL (an archive's with an optional ``#name``) for every task."""
        source, _, fragment = path.partition("#") if archive else (path, "", "")
        if storage.has_protocol(source):
            url = path
        else:  # listed as Spark lists it: file:/dir/name, a directory with a final /
            source = os.path.abspath(os.path.expanduser(source))
            url = f"file:{quote(source)}{'/' if os.path.isdir(source) else ''}{'#' + fragment if fragment else ''}"
        listed = self.archives if archive else self.files
        if url in listed:
            logger.warning("The path %s has been added already. Overwriting of added paths is not supported.", path)
            return
        fs, remote = storage.open_fs(source, storage_options)
        base = posixpath.basename(remote.rstrip("/"))
        if archive and (fs.isdir(remote) or not base.lower().endswith(ARCHIVES)):
            raise ValueError(f"addArchive takes a {', '.join(ARCHIVES)} file, got {path!r}")
        name = fragment or base
        if name in ("", ".", "..") or "/" in name:
            raise ValueError(f"{path!r} does not name a file: {name!r}")
        data = _read(fs, remote, url, recursive)
        content = _Content("archive" if archive else "directory" if isinstance(data, dict) else "file", data, base)
        digest = content.digest()
        root = self.root()
        with self._lock:
            if name in self._digests:
                first, known = self._digests[name]
                if known != digest:
                    raise ValueError(
                        f"File {name} was already registered with a different path "
                        f"(old path = {first}, new path = {url})"
                    )
            else:
                _place(root, name, content)  # refuses an unsafe archive before any worker sees it
                plugin = f"dlscale-file-{self._application}-{name}"
                try:
                    client.register_plugin(_AddedFile(self._application, name, content), name=plugin)
                except BaseException:  # a worker could not write it: nothing of the addition stays
                    _remove(os.path.join(root, name))
                    with contextlib.suppress(Exception):
                        client.unregister_worker_plugin(plugin)
                    raise
                self._plugins.append(plugin)
                self._digests[name] = (url, digest)
            if url not in listed:
                listed.append(url)

    def close(self, client: Client | None) -> None:
        """Unregister the workers' plugins through ``client`` (if the cluster is still there), which deletes
        the workers' copies, and delete the driver's."""
        with _open_lock:
            _open.remove(self)
        if client is not None:
            try:
                for plugin in self._plugins:
                    client.unregister_worker_plugin(plugin)
            except Exception as e:  # stopping goes on: workers that are gone took their copies with them
                logger.warning("could not delete the workers' copies of added files: %s: %s", type(e).__name__, e)
        self._plugins.clear()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


class SparkFiles:
    """Where the files added with ``SparkContext.addFile``, ``addPyFile`` and ``addArchive`` are: in a task,
    on its worker; elsewhere, the driver's copies of the newest running context."""

    def __init__(self) -> None:
        raise NotImplementedError("Do not construct SparkFiles objects")

    @classmethod
    def get(cls, filename: str) -> str:
        """The absolute path of the added file (or unpacked archive) ``filename``."""
        return os.path.abspath(os.path.join(cls.getRootDirectory(), filename))

    @classmethod
    def getRootDirectory(cls) -> str:
        """The directory that holds the added files: the task's context's on its worker, in a task."""
        task = TaskContext.get()
        application = None if task is None else task._job.get("app")
        if application is not None:
            return worker_root(get_worker().local_directory, application)
        with _open_lock:
            if not _open:
                raise RuntimeError(
                    "SparkFiles works on the driver of a running SparkContext and in the tasks of its actions "
                    "(not in those of toLocalIterator)"
                )
            files = _open[-1]
        return files.root()
