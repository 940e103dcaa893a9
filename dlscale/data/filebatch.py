"""File batches: many small raw files (images, text...) packed into one zip archive.

Training from thousands of small files on shared storage spends its time on per-file latency. A
file batch holds one minibatch worth of files, so a training step reads one object (DL4J's
``FileBatch`` and ``SparkDataUtils.createFileBatchesLocal`` / ``createFileBatchesSpark``).

Layout (see ``docs/file-batches.md``): a standard zip archive whose first entry is
``manifest.json`` (``{"format": "dlscale-filebatch", "version": 1, "paths": [...]}``), followed by
the files as ``files/00000000<extension>``, ``files/00000001<extension>``, ... in manifest order.
Reading never unpickles anything, checks every entry's CRC-32 and refuses archives that declare
more than :data:`MAX_BATCH_BYTES` of uncompressed data.
"""

from __future__ import annotations

import io
import json
import posixpath
import random
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import fsspec

from dlscale.data.loaders import check_minibatch_size
from dlscale.errors import CorruptDataError, StorageError
from dlscale.storage import check_empty, find_files, open_fs, write_bytes

if TYPE_CHECKING:
    from dlscale.facade.context import SparkContext

FORMAT = "dlscale-filebatch"
VERSION = 1
MANIFEST = "manifest.json"
MAX_BATCH_BYTES = 2**30
"""The most uncompressed bytes one file batch may hold (a guard against zip bombs)."""

_STORED = (".jpg", ".jpeg", ".png", ".gif", ".webp", ".gz", ".bz2", ".xz", ".zst", ".zip")
_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed timestamps: the same files give the same bytes


def _member(index: int, path: str) -> str:
    return f"files/{index:08d}{posixpath.splitext(path)[1]}"


def _zip_info(name: str, compress: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = compress
    info.external_attr = 0o644 << 16
    return info


@dataclass
class FileBatch:
    """The original URLs of some files and their bytes, stored together as one zip archive."""

    paths: list[str]
    contents: list[bytes]

    def __post_init__(self) -> None:
        if len(self.paths) != len(self.contents):
            raise ValueError(f"FileBatch has {len(self.paths)} paths but {len(self.contents)} contents")

    def to_bytes(self) -> bytes:
        """The zip archive; already-compressed formats are stored, everything else deflated."""
        manifest = json.dumps({"format": FORMAT, "version": VERSION, "paths": list(self.paths)}).encode()
        size = len(manifest) + sum(len(c) for c in self.contents)
        if size > MAX_BATCH_BYTES:
            raise ValueError(
                f"a file batch of {size} bytes is more than the {MAX_BATCH_BYTES} bytes readers "
                "accept; use a smaller batch_size"
            )
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr(_zip_info(MANIFEST, zipfile.ZIP_DEFLATED), manifest)
            for i, (path, data) in enumerate(zip(self.paths, self.contents)):
                compress = zipfile.ZIP_STORED if path.lower().endswith(_STORED) else zipfile.ZIP_DEFLATED
                zf.writestr(_zip_info(_member(i, path), compress), data)
        return buf.getvalue()

    def write(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        """Write the batch to ``url`` atomically: a reader sees the whole archive or none."""
        write_bytes(url, self.to_bytes(), storage_options=storage_options)

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "buffer") -> FileBatch:
        """Parse an archive written by :meth:`to_bytes`; errors start with ``source``."""
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                infos = zf.infolist()
                _check_layout(infos, source)
                manifest = json.loads(_read_member(zf, infos[0], source).decode("utf-8"))
                paths = _check_manifest(manifest, len(infos) - 1, source)
                for i, (path, info) in enumerate(zip(paths, infos[1:])):
                    if info.filename != _member(i, path):
                        raise CorruptDataError(f"{source}: entry {info.filename!r} should be {_member(i, path)!r}")
                return cls(paths, [_read_member(zf, info, source) for info in infos[1:]])
        except CorruptDataError:
            raise
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError, ValueError) as e:
            raise CorruptDataError(f"{source}: not a readable file batch: {e}") from e

    @classmethod
    def read(cls, url: str, storage_options: dict[str, Any] | None = None) -> FileBatch:
        """Read a file batch with one request; a damaged or foreign file raises an error naming it, and
        on a worker one too large for its memory is refused unread (:func:`check_minibatch_size`)."""
        check_minibatch_size(url, storage_options)
        fs, path = open_fs(url, storage_options)
        try:
            data = fs.cat_file(path)
        except FileNotFoundError as e:
            raise StorageError(f"file batch not found: {url}") from e
        except Exception as e:  # network and object-store errors do not all derive from OSError
            raise StorageError(f"cannot read file batch {url}: {e}") from e
        return cls.from_bytes(data, source=url)


def _check_layout(infos: list[zipfile.ZipInfo], source: str) -> None:
    if not infos or infos[0].filename != MANIFEST:
        raise CorruptDataError(f"{source}: not a file batch (no {MANIFEST} as the first entry)")
    declared = sum(info.file_size for info in infos)
    if declared > MAX_BATCH_BYTES:
        raise CorruptDataError(
            f"{source}: declares {declared} uncompressed bytes, more than the {MAX_BATCH_BYTES} a file batch may hold"
        )


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, source: str) -> bytes:
    """An entry's bytes, decompressing no more than its declared size; zipfile checks the CRC-32."""
    with zf.open(info) as f:
        data = f.read(info.file_size)  # read(-1) could inflate a lying entry up to 2 GiB at once
    if len(data) != info.file_size:
        raise CorruptDataError(f"{source}: entry {info.filename!r} is truncated")
    return data


def _check_manifest(manifest: Any, entries: int, source: str) -> list[str]:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptDataError(f"{source}: {MANIFEST} is not a {FORMAT} manifest")
    version = manifest.get("version")
    if not isinstance(version, int) or version < 1:
        raise CorruptDataError(f"{source}: unknown file batch format version {version!r}")
    if version > VERSION:
        raise CorruptDataError(
            f"{source}: written in file batch format version {version}; this dlscale reads up to version {VERSION}"
        )
    paths = manifest.get("paths")
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise CorruptDataError(f"{source}: {MANIFEST} has no list of paths")
    if len(paths) != entries:
        raise CorruptDataError(f"{source}: {MANIFEST} lists {len(paths)} files but the archive holds {entries}")
    return paths


def _write_batch(
    src_fs: fsspec.AbstractFileSystem, storage_options: dict[str, Any] | None, job: tuple[str, list[str]]
) -> None:
    """Read the files of one batch (concurrently on object stores) and write the batch to ``url``."""
    url, paths = job
    contents = src_fs.cat_ranges(paths, None, None, on_error="return")
    for path, data in zip(paths, contents):
        if isinstance(data, BaseException):
            raise StorageError(f"cannot read {src_fs.unstrip_protocol(path)}: {data}") from data
    FileBatch([src_fs.unstrip_protocol(p) for p in paths], contents).write(url, storage_options)


def create_file_batches(
    src_url: str,
    dst_url: str,
    batch_size: int,
    extensions: Sequence[str] | None = None,
    *,
    recursive: bool = True,
    seed: int | None = 0,
    sc: SparkContext | None = None,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Pack the files under ``src_url`` into file batches of ``batch_size`` files in ``dst_url``.

    Files whose name (or a folder below ``src_url``) starts with ``_`` or ``.`` are skipped;
    ``extensions`` ("png" or ".png", any case) keeps only matching names. The sorted listing is
    grouped by class folder, and batches of one class make poor SGD steps, so the files are
    shuffled with ``random.Random(seed)`` first; ``seed=None`` keeps the sorted order. The same
    files and seed give the same batches, byte for byte.

    Without ``sc`` the batches are written by this process (DL4J's ``createFileBatchesLocal``);
    with ``sc`` they are read and written on the cluster's workers in parallel
    (``createFileBatchesSpark``). Batches are ``dst_url/filebatch_00000000.zip``, ... (the last
    may hold fewer files); ``dst_url`` must be missing or empty. ``storage_options`` apply to both
    URLs. Returns the batches' URLs in order.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    src_fs, files = find_files(src_url, storage_options, recursive, extensions)
    if seed is not None:
        random.Random(seed).shuffle(files)
    dst_fs, root = check_empty(dst_url, storage_options, create=True)
    groups = [files[i : i + batch_size] for i in range(0, len(files), batch_size)]
    urls = [dst_fs.unstrip_protocol(f"{root.rstrip('/')}/filebatch_{i:08d}.zip") for i in range(len(groups))]
    write = partial(_write_batch, src_fs, storage_options)
    if sc is None:
        for job in zip(urls, groups):
            write(job)
    else:
        jobs = list(zip(urls, groups))
        sc.parallelize(jobs, min(len(jobs), 4 * sc.defaultParallelism)).foreach(write)
    return urls
