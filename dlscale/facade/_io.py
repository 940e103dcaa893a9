"""Reading and writing RDDs on fsspec storage (local paths, ``file://``, ``s3://``, ``memory://``...)."""

from __future__ import annotations

import io
import math
import pickle
import struct
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.utils import infer_compression, read_block

from dlscale.errors import (
    CorruptDataError,
    OutputExistsError,
    StorageError,
    UnsafePickleError,
)
from dlscale.facade import _graph, _safe_pickle
from dlscale.storage import as_storage_error, atomic_write, find_files, open_fs

if TYPE_CHECKING:
    from dask.bag import Bag

    from dlscale.facade.context import SparkContext
    from dlscale.facade.rdd import RDD

_MAX_SPLIT = 64 * 2**20
_RECORD_SPLIT = 32 * 2**20  # Hadoop's block size for local files, where Spark splits binaryRecords' input
_PICKLE_MAGIC = b"DLSPKL1\n"
_LEN = struct.Struct("<Q")
_CODECS = {
    "org.apache.hadoop.io.compress.GzipCodec": "gzip",
    "org.apache.hadoop.io.compress.BZip2Codec": "bz2",
    "org.apache.hadoop.io.compress.Lz4Codec": "lz4",
    "org.apache.hadoop.io.compress.ZStandardCodec": "zstd",
}
_EXTENSIONS = {"gzip": ".gz", "bz2": ".bz2", "lz4": ".lz4", "zstd": ".zst", "xz": ".xz", "lzma": ".xz"}


def list_files(url: str, storage_options: dict[str, Any] | None) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """Files named by ``url``: a file, a directory's visible files, a glob, or comma-separated URLs.

    Names starting with ``_`` or ``.`` inside a directory are skipped, as Hadoop does
    (see :func:`dlscale.storage.find_files`).
    """
    files: list[str] = []
    fs = None
    for part in [u.strip() for u in url.split(",") if u.strip()]:
        fs, found = find_files(part, storage_options, recursive=False)
        files.extend(found)
    if fs is None:
        raise StorageError(f"no path given: {url!r}")
    return fs, files


# -- text ----------------------------------------------------------------------------------
def _read_lines(fs: fsspec.AbstractFileSystem, path: str, offset: int, length: int | None, use_unicode: bool) -> list:
    with fs.open(path, "rb", compression=infer_compression(path) if length is None else None) as f:
        data = f.read() if length is None else read_block(f, offset, length, delimiter=b"\n")
    lines = data.splitlines()
    return [line.decode("utf-8") for line in lines] if use_unicode else lines


def text_file(
    ctx: SparkContext, name: str, min_partitions: int | None, use_unicode: bool, storage_options: dict[str, Any] | None
) -> Bag:
    """The partitions of :meth:`SparkContext.textFile`."""
    fs, files = list_files(name, storage_options)
    min_partitions = ctx.defaultMinPartitions if min_partitions is None else min_partitions
    sizes = [fs.size(p) or 0 for p in files]
    goal = max(1, math.ceil(sum(sizes) / max(1, min_partitions)))
    split = min(goal, _MAX_SPLIT)
    calls = []
    for path, size in zip(files, sizes):
        if infer_compression(path) is not None or size == 0:
            calls.append((_read_lines, (fs, path, 0, None, use_unicode)))
            continue
        for offset in range(0, size, split):
            calls.append((_read_lines, (fs, path, offset, min(split, size - offset), use_unicode)))
    return _graph.from_calls("textFile", calls)


def _read_whole(fs: fsspec.AbstractFileSystem, paths: list[str], text: bool, use_unicode: bool) -> Iterator:
    for p in paths:
        with fs.open(p, "rb", compression=infer_compression(p)) as f:
            data = f.read()
        yield fs.unstrip_protocol(p), (data.decode("utf-8") if text and use_unicode else data)


def whole_files(
    ctx: SparkContext,
    path: str,
    min_partitions: int | None,
    storage_options: dict[str, Any] | None,
    text: bool,
    use_unicode: bool = True,
) -> Bag:
    """The partitions of :meth:`SparkContext.wholeTextFiles` and :meth:`SparkContext.binaryFiles`."""
    fs, files = list_files(path, storage_options)
    n = max(1, min(len(files), ctx.defaultMinPartitions if min_partitions is None else min_partitions))
    groups = [files[i * len(files) // n : (i + 1) * len(files) // n] for i in range(n)]
    calls = [(_read_whole, (fs, g, text, use_unicode)) for g in groups]
    return _graph.from_calls("wholeTextFiles" if text else "binaryFiles", calls)


def _read_records(fs: fsspec.AbstractFileSystem, path: str, offset: int, length: int, record_length: int) -> list:
    with fs.open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise CorruptDataError(
            f"{fs.unstrip_protocol(path)} changed while being read: {len(data)} bytes at byte {offset}, not {length}"
        )
    return [data[i : i + record_length] for i in range(0, length, record_length)]


def binary_records(path: str, record_length: int, storage_options: dict[str, Any] | None) -> Bag:
    """The partitions of :meth:`SparkContext.binaryRecords`: each file in splits of whole records of at most
    ``_RECORD_SPLIT`` bytes (one split for a small file, none for an empty one, as Spark splits them)."""
    if isinstance(record_length, bool) or not isinstance(record_length, int):
        raise TypeError(f"recordLength must be an int, not {type(record_length).__name__}")
    if record_length < 1:
        raise ValueError(f"recordLength must be positive, got {record_length}")
    fs, files = list_files(path, storage_options)
    split = max(1, _RECORD_SPLIT // record_length) * record_length
    calls = []
    for p in files:
        size = fs.size(p) or 0
        if size % record_length:
            raise CorruptDataError(
                f"{fs.unstrip_protocol(p)} has {size} bytes, not a whole number of {record_length}-byte records"
            )
        for offset in range(0, size, split):
            calls.append((_read_records, (fs, p, offset, min(split, size - offset), record_length)))
    return _graph.from_calls("binaryRecords", calls)


def _prepare_output(path: str, storage_options: dict[str, Any] | None) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = open_fs(path, storage_options)
    with as_storage_error("create", path):
        if fs.exists(root):
            raise OutputExistsError(f"Output directory {path} already exists")
        fs.makedirs(root, exist_ok=True)
    return fs, root.rstrip("/")


class _Output(io.BytesIO):
    """A compressor's output in memory, still readable after the compressor closes it (zstandard's does)."""

    def close(self) -> None:
        pass


def _write_text_part(
    fs: fsspec.AbstractFileSystem, root: str, ext: str, compression: str | None, i: int, items: Any
) -> list[str]:
    path = f"{root}/part-{i:05d}{ext}"
    lines = [(x if isinstance(x, bytes) else str(x).encode("utf-8")) + b"\n" for x in items]
    if compression:
        out = _Output()
        with fsspec.core.compr[compression](out, mode="wb") as f:
            f.writelines(lines)
        lines = [out.getbuffer()]
    atomic_write(fs, path, lines)
    return [path]


def save_as_text_file(rdd: RDD, path: str, codec: str | None, storage_options: dict[str, Any] | None) -> None:
    compression = _CODECS.get(codec, codec) if codec else None
    if compression is not None and compression not in fsspec.core.compr:
        raise ValueError(f"compressionCodecClass {codec!r} is not available; known: {sorted(_CODECS)}")
    fs, root = _prepare_output(path, storage_options)
    ext = _EXTENSIONS.get(compression, "") if compression else ""
    write = partial(_write_text_part, fs, root, ext, compression)
    _finish_output(rdd, fs, root, write)


def _finish_output(rdd: RDD, fs: fsspec.AbstractFileSystem, root: str, write: Callable) -> None:
    if rdd.getNumPartitions():
        rdd.ctx._compute(_graph.partitionwise("save", write, rdd._bag), rdd=rdd)
    atomic_write(fs, f"{root}/_SUCCESS", [])


# -- pickle --------------------------------------------------------------------------------
def _write_pickle_part(fs: fsspec.AbstractFileSystem, root: str, batch_size: int, i: int, items: Any) -> list[str]:
    path = f"{root}/part-{i:05d}"
    items = list(items)
    chunks = [_PICKLE_MAGIC]
    for start in range(0, len(items), batch_size):
        blob = _safe_pickle.dumps(items[start : start + batch_size])
        chunks += [_LEN.pack(len(blob)), blob]
    atomic_write(fs, path, chunks)
    return [path]


def save_as_pickle_file(rdd: RDD, path: str, batch_size: int, storage_options: dict[str, Any] | None) -> None:
    if batch_size < 1:
        raise ValueError(f"batchSize must be at least 1, got {batch_size}")
    fs, root = _prepare_output(path, storage_options)
    _finish_output(rdd, fs, root, partial(_write_pickle_part, fs, root, batch_size))


def _read_pickle_part(fs: fsspec.AbstractFileSystem, path: str, allowed: tuple[str, ...]) -> Iterator:
    url = fs.unstrip_protocol(path)
    data = memoryview(fs.cat_file(path))
    if bytes(data[: len(_PICKLE_MAGIC)]) != _PICKLE_MAGIC:
        raise CorruptDataError(f"{url} is not a dlscale pickle file (written by saveAsPickleFile)")
    pos = len(_PICKLE_MAGIC)
    while pos < len(data):
        if pos + _LEN.size > len(data):
            raise CorruptDataError(f"{url} is truncated at byte {pos}")
        (n,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        if pos + n > len(data):
            raise CorruptDataError(f"{url} is truncated: a batch needs {n} bytes at byte {pos}")
        try:
            batch = _safe_pickle.loads(data[pos : pos + n], allowed, source=url)
        except UnsafePickleError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as e:
            raise CorruptDataError(f"{url} has a corrupt batch at byte {pos}: {e}") from e
        pos += n
        yield from batch


def pickle_file(name: str, allowed: tuple[str, ...], storage_options: dict[str, Any] | None) -> Bag:
    """The partitions of :meth:`SparkContext.pickleFile`: one per file."""
    fs, files = list_files(name, storage_options)
    calls = [(_read_pickle_part, (fs, p, allowed)) for p in files]
    return _graph.from_calls("pickleFile", calls)
