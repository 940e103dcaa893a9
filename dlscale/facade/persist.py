"""Storage levels and RDD persistence on Dask workers.

- Deserialized levels (``MEMORY_ONLY``, ``MEMORY_AND_DISK``) keep partitions as objects in
  worker memory; dlscale's ``sizeof`` for tensors makes Dask's accounting correct, and Dask
  spills them to the worker's disk under memory pressure.
- Serialized levels (``MEMORY_ONLY_SER``, ``MEMORY_AND_DISK_SER``, ``OFF_HEAP``) keep each
  partition as one byte blob: its size is known exactly and spilling it is a plain write.
- ``DISK_ONLY`` writes each partition to a block file (the worker's local directory, or
  ``dlscale.persist.disk-dir`` on shared storage) and keeps only a small record in memory.
  Blocks carry a keyed BLAKE2b tag, so a block altered or planted on disk is refused rather
  than unpickled.

Lost partitions (a dead worker) are recomputed from lineage by Dask.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import struct
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import fsspec
from dask.sizeof import sizeof
from distributed import WorkerPlugin, get_worker
from distributed.client import futures_of
from distributed.protocol import deserialize_bytes, serialize_bytes
from distributed.utils import sync

from dlscale import config
from dlscale.errors import CorruptDataError, StorageError
from dlscale.facade import _graph
from dlscale.runtime.extensions import Extension, install
from dlscale.runtime.replicas import set_replication
from dlscale.storage import atomic_write

if TYPE_CHECKING:
    from dask.bag import Bag

    from dlscale.facade.context import SparkContext
    from dlscale.facade.rdd import RDD


class StorageLevel:
    """Where and how persisted partitions are kept (PySpark's fields, Scala Spark's meaning)."""

    NONE: StorageLevel
    DISK_ONLY: StorageLevel
    DISK_ONLY_2: StorageLevel
    DISK_ONLY_3: StorageLevel
    MEMORY_ONLY: StorageLevel
    MEMORY_ONLY_2: StorageLevel
    MEMORY_ONLY_SER: StorageLevel
    MEMORY_ONLY_SER_2: StorageLevel
    MEMORY_AND_DISK: StorageLevel
    MEMORY_AND_DISK_2: StorageLevel
    MEMORY_AND_DISK_SER: StorageLevel
    MEMORY_AND_DISK_SER_2: StorageLevel
    MEMORY_AND_DISK_DESER: StorageLevel
    OFF_HEAP: StorageLevel

    def __init__(self, useDisk: bool, useMemory: bool, useOffHeap: bool, deserialized: bool, replication: int = 1):
        if replication < 1:
            raise ValueError(f"replication must be at least 1, got {replication}")
        self.useDisk = useDisk
        self.useMemory = useMemory
        self.useOffHeap = useOffHeap
        self.deserialized = deserialized
        self.replication = replication

    def __repr__(self) -> str:
        return (
            f"StorageLevel({self.useDisk}, {self.useMemory}, {self.useOffHeap}, "
            f"{self.deserialized}, {self.replication})"
        )

    def __str__(self) -> str:
        result = "Disk " if self.useDisk else ""
        result += "Memory " if self.useMemory else ""
        result += "OffHeap " if self.useOffHeap else ""
        result += "Deserialized " if self.deserialized else "Serialized "
        return result + f"{self.replication}x Replicated"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorageLevel) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))


StorageLevel.NONE = StorageLevel(False, False, False, False)
StorageLevel.DISK_ONLY = StorageLevel(True, False, False, False)
StorageLevel.DISK_ONLY_2 = StorageLevel(True, False, False, False, 2)
StorageLevel.DISK_ONLY_3 = StorageLevel(True, False, False, False, 3)
StorageLevel.MEMORY_ONLY = StorageLevel(False, True, False, True)
StorageLevel.MEMORY_ONLY_2 = StorageLevel(False, True, False, True, 2)
StorageLevel.MEMORY_ONLY_SER = StorageLevel(False, True, False, False)
StorageLevel.MEMORY_ONLY_SER_2 = StorageLevel(False, True, False, False, 2)
StorageLevel.MEMORY_AND_DISK = StorageLevel(True, True, False, True)
StorageLevel.MEMORY_AND_DISK_2 = StorageLevel(True, True, False, True, 2)
StorageLevel.MEMORY_AND_DISK_SER = StorageLevel(True, True, False, False)
StorageLevel.MEMORY_AND_DISK_SER_2 = StorageLevel(True, True, False, False, 2)
StorageLevel.MEMORY_AND_DISK_DESER = StorageLevel.MEMORY_AND_DISK
StorageLevel.OFF_HEAP = StorageLevel(True, True, True, False)


@dataclass(frozen=True)
class RDDInfo:
    """What a persisted RDD holds (Spark's ``RDDInfo``); sizes are bytes of partition data."""

    id: int
    name: str | None
    storageLevel: StorageLevel
    numPartitions: int
    numCachedPartitions: int
    memSize: int
    diskSize: int


@dataclass
class Stored:
    """The persisted state of one RDD."""

    level: StorageLevel
    lineage: Bag  # the graph that computes the partitions, restored on unpersist
    futures: list  # the persisted keys: partitions, blobs or block records
    block_dir: str | None = None  # DISK_ONLY on shared storage: the directory of this RDD's blocks


# -- serialized partitions -----------------------------------------------------------------
def _serialize(_i: int, part: Any) -> list[bytes]:
    return [serialize_bytes(list(part))]


def _deserialize(_i: int, blobs: list) -> list:
    # a writable copy: tensors built on it may be changed in place without touching the cache
    return deserialize_bytes(bytearray(blobs[0]))


# -- disk blocks ---------------------------------------------------------------------------
_MAGIC = b"DLSBLK1\n"
_HEADER = struct.Struct("<8s32sQ")  # magic, tag, payload length


@dataclass(frozen=True)
class BlockRecord:
    """Where one DISK_ONLY partition lives."""

    url: str  # a local path on ``worker`` (worker-local blocks) or a shared fsspec URL
    nbytes: int
    worker: str | None  # address of the worker whose disk holds it; None on shared storage


@dataclass(frozen=True)
class _BlockSpec:
    app_id: str
    rdd_id: int
    key: bytes
    shared_dir: str | None
    storage_options: dict


def _tag(key: bytes, payload: bytes | memoryview) -> bytes:
    return hmac.new(key, payload, hashlib.blake2b).digest()[:32]


def _local_block_dir(worker: Any, app_id: str, rdd_id: int | None = None) -> str:
    base = os.path.join(worker.local_directory, "dlscale-blocks", app_id)
    return base if rdd_id is None else os.path.join(base, f"rdd-{rdd_id}")


def _write_block(spec: _BlockSpec, i: int, part: Any) -> list[BlockRecord]:
    payload = serialize_bytes(list(part))
    header = _HEADER.pack(_MAGIC, _tag(spec.key, payload), len(payload))
    name = f"part-{i:05d}.blk"
    if spec.shared_dir is None:
        worker = get_worker()
        url = os.path.join(_local_block_dir(worker, spec.app_id, spec.rdd_id), name)
        record = BlockRecord(url, len(payload), worker.address)
    else:
        url = f"{spec.shared_dir}/{name}"
        record = BlockRecord(url, len(payload), None)
    fs, path = fsspec.core.url_to_fs(url, **spec.storage_options)
    atomic_write(fs, path, [header, payload])
    return [record]


def _read_local(path: str) -> bytearray:
    with open(path, "rb") as f:
        return bytearray(f.read())


def _read_block(spec: _BlockSpec, i: int, records: list[BlockRecord]) -> list:
    rec = records[0]
    if rec.worker is None:
        with fsspec.open(rec.url, "rb", **spec.storage_options) as f:
            data = bytearray(f.read())
    else:
        worker = get_worker()
        if worker.address == rec.worker:
            data = _read_local(rec.url)
        else:  # the task ran elsewhere: fetch the block from the worker whose disk holds it
            data = bytearray(sync(worker.loop, worker.rpc(rec.worker).dlscale_read_block, path=rec.url))
    if len(data) < _HEADER.size:
        raise CorruptDataError(f"persisted block {rec.url} is truncated ({len(data)} bytes)")
    magic, tag, length = _HEADER.unpack_from(data)
    payload = memoryview(data)[_HEADER.size :]
    if magic != _MAGIC or length != len(payload) or not hmac.compare_digest(tag, _tag(spec.key, payload)):
        raise CorruptDataError(
            f"persisted block {rec.url} of partition {i} was altered on disk or not written by this "
            "application; refusing to load it"
        )
    return deserialize_bytes(payload)


class BlockServer(WorkerPlugin):
    """Serves a worker's local DISK_ONLY blocks to tasks running on other workers."""

    idempotent = True
    name = "dlscale-blocks"

    def setup(self, worker: Any) -> None:
        self.worker = worker

        async def dlscale_read_block(path: str) -> bytes:
            root = os.path.realpath(os.path.join(worker.local_directory, "dlscale-blocks"))
            real = os.path.realpath(path)
            if not real.startswith(root + os.sep):
                raise StorageError(f"worker {worker.address} serves only its own blocks, not {path}")
            return bytes(await worker.loop.run_in_executor(None, _read_local, real))

        worker.handlers["dlscale_read_block"] = dlscale_read_block


BLOCKS = Extension(BlockServer.name, worker_plugin=BlockServer)


def _remove_local_blocks(app_id: str, rdd_id: int | None, dask_worker: Any = None) -> None:
    shutil.rmtree(_local_block_dir(dask_worker, app_id, rdd_id), ignore_errors=True)


# -- persist / unpersist -------------------------------------------------------------------
def persist(rdd: RDD, level: StorageLevel | None) -> RDD:
    """Implements :meth:`RDD.persist`."""
    level = StorageLevel.MEMORY_ONLY if level is None else level
    if not isinstance(level, StorageLevel):
        raise TypeError(f"storageLevel must be a StorageLevel, not {type(level).__name__}")
    if rdd._stored is not None:
        if rdd._stored.level == level:
            return rdd
        raise ValueError(
            f"Cannot change storage level of an RDD after it was already assigned a level "
            f"(RDD {rdd.id()} is {rdd._stored.level}, asked for {level})"
        )
    if level == StorageLevel.NONE:
        return rdd
    ctx, lineage = rdd.ctx, rdd._bag
    client = ctx.client
    block_dir = None
    if level.useDisk and not level.useMemory:
        shared = config.get("persist.disk-dir")
        options = dict(config.get("persist.storage-options") or {})
        if shared is None and level.replication > 1:
            raise ValueError(
                f"{level!r} needs dlscale.persist.disk-dir set to shared storage: blocks on a "
                "worker's local disk are not copied to other workers"
            )
        if shared is not None:
            block_dir = f"{str(shared).rstrip('/')}/{ctx.applicationId}/rdd-{rdd.id()}"
        else:
            install(client, BLOCKS)
        spec = _BlockSpec(ctx.applicationId, rdd.id(), ctx._block_key, block_dir, options)
        to_hold = _graph.partitionwise("diskBlocks", partial(_write_block, spec), lineage)
        read = partial(_read_block, spec)
    elif not level.deserialized:
        to_hold, read = _graph.partitionwise("serialized", _serialize, lineage), _deserialize
    else:
        to_hold, read = lineage, None
    held = client.persist(to_hold)
    futures = futures_of(held)
    if level.replication > 1 and level.useMemory:
        set_replication(client, futures, level.replication)
    rdd._bag = _graph.partitionwise("readPersisted", read, held) if read is not None else held
    rdd._stored = Stored(level, lineage, futures, block_dir)
    ctx._persisted[rdd.id()] = rdd
    return rdd


def unpersist(rdd: RDD, blocking: bool = False) -> RDD:
    """Implements :meth:`RDD.unpersist`."""
    stored = rdd._stored
    if stored is None:
        return rdd
    rdd._bag, rdd._stored = stored.lineage, None
    rdd.ctx._persisted.pop(rdd.id(), None)
    client = rdd.ctx._client
    if stored.level.replication > 1 and stored.level.useMemory:
        set_replication(client, stored.futures, 1)
    client.cancel(stored.futures)
    if stored.level.useDisk and not stored.level.useMemory:
        if stored.block_dir is not None:
            fs, path = fsspec.core.url_to_fs(stored.block_dir, **(config.get("persist.storage-options") or {}))
            if fs.exists(path):
                fs.rm(path, recursive=True)
        else:
            client.run(_remove_local_blocks, rdd.ctx.applicationId, rdd.id(), wait=blocking)
    return rdd


# -- storage report ------------------------------------------------------------------------
def _key_sizes(keys: list, dask_worker: Any = None) -> dict:
    """``{key: (bytes in memory, bytes on disk)}`` for the keys this worker holds."""
    data = dask_worker.data
    fast = getattr(data, "fast", data)
    weights = getattr(fast, "weights", {})
    slow = getattr(data, "_slow_uncached", None)
    spilled = getattr(slow, "weight_by_key", {})
    out = {}
    for k in map(_as_key, keys):
        if k in spilled:
            out[str(k)] = (0, int(spilled[k].disk), int(spilled[k].memory))
        elif k in fast:
            size = int(weights[k]) if k in weights else int(sizeof(fast[k]))
            out[str(k)] = (size, 0, size)
    return out


def _as_key(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def storage_info(ctx: SparkContext, rdds: list[RDD]) -> list[RDDInfo]:
    """Implements :meth:`SparkContext.getRDDStorageInfo`."""
    infos = []
    for rdd in sorted(rdds, key=lambda r: r.id()):
        stored = rdd._stored
        if stored is None:
            continue
        keys = [f.key for f in stored.futures]
        per_worker = ctx.client.run(_key_sizes, keys)
        found: dict[str, tuple[int, int, int]] = {}
        for sizes in per_worker.values():
            for k, v in sizes.items():
                found.setdefault(k, v)  # replicas are counted once
        mem = sum(v[0] for v in found.values())
        disk = sum(v[1] for v in found.values())
        if stored.level.useDisk and not stored.level.useMemory:
            records = [r for part in ctx.client.gather(stored.futures) for r in part]
            mem, disk = 0, sum(r.nbytes for r in records)
        elif not stored.level.deserialized:
            # a blob is the partition's exact size, in memory or on disk
            mem = sum(v[2] for v in found.values() if v[0])
            disk = sum(v[2] for v in found.values() if v[1])
        infos.append(RDDInfo(rdd.id(), rdd.name(), stored.level, rdd.getNumPartitions(), len(found), mem, disk))
    return infos
