"""Storage levels and RDD persistence on Dask workers.

- Deserialized levels (``MEMORY_ONLY``, ``MEMORY_AND_DISK``) keep partitions as objects in
  worker memory; dlscale's ``sizeof`` for tensors makes Dask's accounting correct, and Dask
  spills them to the worker's disk under memory pressure.
- Serialized levels (``MEMORY_ONLY_SER``, ``MEMORY_AND_DISK_SER``, ``OFF_HEAP``) keep each
  partition as one byte blob: its size is known exactly and spilling it is a plain write.
- ``DISK_ONLY`` writes each partition to a block file (the worker's local directory, or
  ``dlscale.persist.disk-dir`` on shared storage) and keeps only a small record in memory.
  Each block carries a keyed BLAKE2b tag bound to its application, RDD, partition and version,
  so a block altered, swapped or planted on disk is refused rather than unpickled.

A persisted RDD's graph is a :class:`PersistedLayer` over the held futures. Once the RDD is
unpersisted, :func:`resolve` swaps that layer for the RDD's lineage in every graph built on it,
so children recompute (PySpark's behaviour) instead of asking for released keys. Partitions lost
with a worker are recomputed from lineage by Dask; a lost ``DISK_ONLY`` block makes the scheduler
recompute the partition that wrote it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import shutil
import struct
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import fsspec
from dask._task_spec import Alias
from dask.bag import Bag
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.sizeof import sizeof
from dask.utils import parse_timedelta
from distributed import WorkerPlugin, get_client, get_worker
from distributed.client import futures_of
from distributed.protocol import deserialize_bytes, serialize_bytes
from distributed.utils import sync

from dlscale import config
from dlscale.errors import CorruptDataError, DlscaleError, StorageError
from dlscale.facade import _graph, barrier
from dlscale.runtime.extensions import Extension, install
from dlscale.runtime.replicas import set_replication
from dlscale.storage import as_storage_error, atomic_write

if TYPE_CHECKING:
    from dlscale.facade.context import SparkContext
    from dlscale.facade.rdd import RDD

logger = logging.getLogger("dlscale.persist")


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


@dataclass(frozen=True)
class _BlockSpec:
    app_id: str
    rdd_id: int
    dir_name: str  # of this persist's blocks, unique: a new persist never meets an old one's deletion
    key: bytes
    shared_dir: str | None  # on shared storage: the directory of this RDD's blocks
    storage_options: dict


@dataclass
class Stored:
    """The persisted state of one RDD."""

    level: StorageLevel
    lineage: Bag  # the graph that computes the partitions, restored on unpersist
    futures: list  # the persisted keys: partitions, blobs or block records
    blocks: _BlockSpec | None = None  # DISK_ONLY: where the blocks go and the key that signs them
    released: bool = False  # unpersisted: graphs built on the RDD compute it from lineage again


class PersistedLayer(MaterializedLayer):
    """The graph layer that reads a persisted RDD's partitions from its held futures.

    It carries its :class:`Stored`, so that :func:`resolve` can put the lineage back once the RDD is
    unpersisted: a graph built on the RDD must not ask for keys that were released.
    """

    def __init__(self, mapping: dict, stored: Stored) -> None:
        super().__init__(mapping)
        self.stored = stored


def _released(layer: Any) -> bool:
    return isinstance(layer, PersistedLayer) and layer.stored.released


def resolve(bag: Bag) -> Bag:
    """``bag`` with the layer of each unpersisted RDD in it replaced by that RDD's lineage."""
    graph = bag.__dask_graph__()
    if not any(map(_released, graph.layers.values())):
        return bag
    layers, deps = dict(graph.layers), {name: set(d) for name, d in graph.dependencies.items()}
    dead = [name for name, layer in layers.items() if _released(layer)]
    while dead:
        name = dead.pop()
        lineage = layers[name].stored.lineage
        for held in deps[name]:  # the released futures; at MEMORY_ONLY their layer has the lineage's name
            del layers[held], deps[held]
        layers[name] = MaterializedLayer({k: Alias(k, (lineage.name, k[1])) for k in layers[name]})
        deps[name] = {lineage.name}
        sub = lineage.__dask_graph__()
        for n, layer in sub.layers.items():
            if n not in layers:
                layers[n], deps[n] = layer, set(sub.dependencies[n])
                if _released(layer):
                    dead.append(n)
    return Bag(HighLevelGraph(layers, deps), bag.name, bag.npartitions)


def _persisted_bag(reader: Bag, stored: Stored) -> Bag:
    graph = reader.__dask_graph__()
    layers = {**graph.layers, reader.name: PersistedLayer(graph.layers[reader.name].mapping, stored)}
    return Bag(HighLevelGraph(layers, graph.dependencies), reader.name, reader.npartitions)


# -- serialized partitions -----------------------------------------------------------------
def _serialize(_i: int, part: Any) -> list[bytes]:
    return [serialize_bytes(list(part))]


def _deserialize(_i: int, blobs: list) -> list:
    # a writable copy: tensors built on it may be changed in place without touching the cache
    return deserialize_bytes(bytearray(blobs[0]))


# -- disk blocks ---------------------------------------------------------------------------
_MAGIC = b"DLSBLK2\n"
_HEADER = struct.Struct("<8s32sQ")  # magic, tag, payload length
_MAX_RECOMPUTES = 3  # a block lost this often in one worker process is an error, not bad luck


@dataclass(frozen=True)
class BlockRecord:
    """Where one DISK_ONLY partition lives."""

    url: str  # a local path on ``worker`` (worker-local blocks) or a shared fsspec URL
    nbytes: int
    worker: str | None  # address of the worker whose disk holds it; None on shared storage
    version: str  # random per write: part of the file name and bound into the tag


def _tag(spec: _BlockSpec, i: int, version: str, payload: bytes | memoryview) -> bytes:
    """HMAC-BLAKE2b of ``payload`` bound to its place: application, RDD, partition and version."""
    app = spec.app_id.encode()
    mac = hmac.new(spec.key, digestmod=hashlib.blake2b)
    mac.update(struct.pack("<Q", len(app)) + app + struct.pack("<QQ", spec.rdd_id, i) + bytes.fromhex(version))
    mac.update(payload)
    return mac.digest()[:32]


def _local_block_dir(worker: Any, app_id: str, dir_name: str | None = None) -> str:
    base = os.path.join(worker.local_directory, "dlscale-blocks", app_id)
    return base if dir_name is None else os.path.join(base, dir_name)


def _write_block(spec: _BlockSpec, i: int, part: Any) -> list[BlockRecord]:
    payload = serialize_bytes(list(part))
    version = uuid.uuid4().hex
    header = _HEADER.pack(_MAGIC, _tag(spec, i, version, payload), len(payload))
    name = f"part-{i:05d}-{version}.blk"
    if spec.shared_dir is None:
        worker = get_worker()
        url = os.path.join(_local_block_dir(worker, spec.app_id, spec.dir_name), name)
        record = BlockRecord(url, len(payload), worker.address, version)
    else:
        url = f"{spec.shared_dir}/{name}"
        record = BlockRecord(url, len(payload), None, version)
    fs, path = fsspec.core.url_to_fs(url, **spec.storage_options)
    atomic_write(fs, path, [header, payload])
    return [record]


def _read_local(path: str) -> bytearray:
    with open(path, "rb") as f:
        return bytearray(f.read())


def _fetch_block(spec: _BlockSpec, rec: BlockRecord) -> bytearray:
    if rec.worker is None:
        with fsspec.open(rec.url, "rb", **spec.storage_options) as f:
            return bytearray(f.read())
    worker = get_worker()
    if worker.address == rec.worker:
        return _read_local(rec.url)
    # the task ran elsewhere: fetch the block from the worker whose disk holds it, if that one is alive
    # (connecting to a dead worker would take distributed.comm.timeouts.connect to fail)
    if not get_client().run_on_scheduler(_is_worker, rec.worker):
        raise ConnectionError(f"worker {rec.worker}, whose disk held the block, is gone")
    return bytearray(sync(worker.loop, worker.rpc(rec.worker).dlscale_read_block, path=rec.url))


def _is_worker(address: str, dask_scheduler: Any = None) -> bool:
    return address in dask_scheduler.workers


def _read_block(spec: _BlockSpec, held: str, i: int, records: list[BlockRecord]) -> list:
    rec = records[0]
    try:
        data = _fetch_block(spec, rec)
    except DlscaleError:
        raise
    except OSError as e:  # deleted, or on the disk of a worker that is gone
        raise _lost(spec, held, i, rec, e) from e
    if len(data) < _HEADER.size:
        raise CorruptDataError(f"persisted block {rec.url} is truncated ({len(data)} bytes)")
    magic, tag, length = _HEADER.unpack_from(data)
    payload = memoryview(data)[_HEADER.size :]
    if magic != _MAGIC or length != len(payload) or not hmac.compare_digest(tag, _tag(spec, i, rec.version, payload)):
        raise CorruptDataError(
            f"persisted block {rec.url} of RDD {spec.rdd_id} partition {i} was altered on disk, swapped with "
            "another block or not written by this application; refusing to load it"
        )
    return deserialize_bytes(payload)


_recomputes: Counter = Counter()  # lost blocks met in this worker process, by (application, directory, partition)


def _lost(spec: _BlockSpec, held: str, i: int, rec: BlockRecord, cause: Exception) -> StorageError:
    """Have the scheduler recompute a lost block's partition from lineage, as Spark does.

    The scheduler forgets the block's record, which Dask then recomputes (writing a new block), and
    reschedules this reading task, so the error returned, raised by the task, is ignored; it reaches
    the user only when the scheduler would not (the reader was stale or the RDD unpersisted) or the
    block was lost again and again.
    """
    what = f"DISK_ONLY block {rec.url} of RDD {spec.rdd_id} partition {i} is lost ({type(cause).__name__}: {cause})"
    _recomputes[spec.app_id, spec.dir_name, i] += 1
    if _recomputes[spec.app_id, spec.dir_name, i] > _MAX_RECOMPUTES:
        return StorageError(f"{what}, and it was recomputed {_MAX_RECOMPUTES} times already")
    worker = get_worker()
    reader = worker.get_current_task()
    run_id = worker.state.tasks[reader].run_id
    if get_client().run_on_scheduler(_forget_record, (held, i), reader, run_id, worker.address):
        logger.warning("%s; recomputing the partition from lineage", what)
        return StorageError(f"{what}; its partition is being recomputed from lineage")
    return StorageError(what)


def _forget_record(key: Any, reader: Any, run_id: int, worker: str, dask_scheduler: Any = None) -> bool:
    """Scheduler side: release the record of a lost block, so that Dask recomputes it from lineage and
    reschedules its readers, unless the reader that found the loss is stale (the record was replaced)."""
    ts, rts = dask_scheduler.tasks.get(_as_key(key)), dask_scheduler.tasks.get(_as_key(reader))
    if ts is None or ts.state != "memory" or rts is None or rts.processing_on is None:
        return False
    if rts.processing_on.address != worker or rts.run_id != run_id:
        return False
    dask_scheduler.transitions({ts.key: "released"}, stimulus_id=f"dlscale-lost-block-{time.time()}")
    return True


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


def _remove_local_blocks(app_id: str, dir_name: str | None, dask_worker: Any = None) -> None:
    shutil.rmtree(_local_block_dir(dask_worker, app_id, dir_name), ignore_errors=True)


_SETTLED_ON_SCHEDULER = ("released", "erred", "forgotten")
_RUNNABLE_ON_WORKER = ("waiting", "ready", "constrained", "executing", "long-running", "cancelled", "resumed")


def _computing(keys: list, dask_scheduler: Any = None) -> list:
    """The keys of the tasks that compute ``keys`` (Dask fuses a block's writer with the lineage under
    its own key): ``keys`` and, recursively, their dependencies, short of keys that a client holds
    (another persisted RDD), which write no block of these."""
    tasks, seen = dask_scheduler.tasks, set()
    stack = [k for k in map(_as_key, keys) if k in tasks]
    while stack:
        k = stack.pop()
        if k not in seen:
            seen.add(k)
            stack.extend(dts.key for dts in tasks[k].dependencies if not dts.who_wants)
    return list(seen)


def _busy_on_scheduler(keys: list, dask_scheduler: Any = None) -> list:
    tasks = dask_scheduler.tasks
    return [k for k in map(_as_key, keys) if k in tasks and tasks[k].state not in _SETTLED_ON_SCHEDULER]


def _busy_on_worker(keys: list, dask_worker: Any = None) -> list:
    tasks = dask_worker.state.tasks
    return [k for k in map(_as_key, keys) if k in tasks and tasks[k].state in _RUNNABLE_ON_WORKER]


class DiskBlocks:
    """The DISK_ONLY blocks of a context that are not deleted yet.

    Blocks are deleted once no task that writes or reads them is pending or running (a writer still
    running would write its block after the deletion), in the background for a non-blocking
    unpersist. An RDD stays listed until its blocks are gone, so :meth:`close` (on
    ``SparkContext.stop``) deletes whatever an earlier deletion left, temporary files of killed
    writers included.
    """

    def __init__(self, ctx: SparkContext) -> None:
        self._ctx = ctx
        self._pending: dict[str, tuple[Stored, list]] = {}  # directory name: its Stored, the tasks to wait for
        self._app_dirs: dict[str | None, dict] = {}  # None: the workers' local directories
        self._janitor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def add(self, stored: Stored) -> None:
        spec = stored.blocks
        app_dir = None if spec.shared_dir is None else spec.shared_dir.rsplit("/", 1)[0]
        with self._lock:
            self._pending[spec.dir_name] = (stored, [])
            self._app_dirs[app_dir] = spec.storage_options

    def drop(self, stored: Stored, writers: list, blocking: bool) -> None:
        """Delete the blocks of ``stored``, whose futures are released, once the tasks ``writers``
        (:func:`_computing` the records) are done; now, or in the background."""
        with self._lock:
            self._pending[stored.blocks.dir_name] = (stored, writers)
        if blocking:
            self._drop(stored, writers)
            return
        with self._lock:
            if self._janitor is None:
                self._janitor = ThreadPoolExecutor(1, thread_name_prefix="dlscale-unpersist")
            self._janitor.submit(self._drop_logged, stored, writers)

    def _drop(self, stored: Stored, writers: list) -> None:
        spec, client = stored.blocks, self._ctx._client
        timeout = config.get("persist.unpersist-timeout")
        deadline = time.monotonic() + parse_timedelta(timeout)
        while busy := client.run_on_scheduler(_busy_on_scheduler, writers) or [
            k for ks in client.run(_busy_on_worker, writers).values() for k in ks
        ]:
            if time.monotonic() > deadline:
                raise StorageError(
                    f"the DISK_ONLY blocks of RDD {spec.rdd_id} are still written or read by tasks {busy[:3]} "
                    f"after {timeout} (dlscale.persist.unpersist-timeout); they are deleted on SparkContext.stop()"
                )
            time.sleep(0.05)
        if spec.shared_dir is None:
            client.run(_remove_local_blocks, spec.app_id, spec.dir_name)
        else:
            _remove_shared(spec.shared_dir, spec.storage_options)
        with self._lock:
            self._pending.pop(spec.dir_name, None)

    def _drop_logged(self, stored: Stored, writers: list) -> None:
        try:
            self._drop(stored, writers)
        except Exception as e:  # the RDD stays listed: close() tries again
            logger.warning("could not delete the DISK_ONLY blocks of RDD %d yet: %s", stored.blocks.rdd_id, e)

    def close(self) -> None:
        """Finish the deletions under way, then delete every block directory of the application."""
        if self._janitor is not None:
            self._janitor.shutdown(wait=True)
            self._janitor = None
        for stored, writers in list(self._pending.values()):
            self._drop_logged(stored, writers)
        for app_dir, options in self._app_dirs.items():
            try:
                if app_dir is None:
                    self._ctx._client.run(_remove_local_blocks, self._ctx.applicationId, None)
                else:
                    _remove_shared(app_dir, options)
            except Exception as e:  # stopping goes on: the cluster is closed all the same
                logger.warning("could not delete the DISK_ONLY block directory %s: %s", app_dir or "of the workers", e)


def _remove_shared(url: str, storage_options: dict) -> None:
    with as_storage_error("delete", url):
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
        if fs.exists(path):
            fs.rm(path, recursive=True)


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
    spec = None
    if level.useDisk and not level.useMemory:
        shared = config.get("persist.disk-dir")
        options = dict(config.get("persist.storage-options") or {})
        if shared is None and level.replication > 1:
            raise ValueError(
                f"{level!r} needs dlscale.persist.disk-dir set to shared storage: blocks on a "
                "worker's local disk are not copied to other workers"
            )
        dir_name, block_dir = f"rdd-{rdd.id()}-{uuid.uuid4().hex[:8]}", None
        if shared is not None:
            block_dir = f"{str(shared).rstrip('/')}/{ctx.applicationId}/{dir_name}"
        else:
            install(client, BLOCKS)
        spec = _BlockSpec(ctx.applicationId, rdd.id(), dir_name, ctx._block_key, block_dir, options)
        to_hold = _graph.partitionwise("diskBlocks", partial(_write_block, spec), lineage)
        read = partial(_read_block, spec, to_hold.name)
    elif not level.deserialized:
        to_hold, read = _graph.partitionwise("serialized", _serialize, lineage), _deserialize
    else:
        to_hold, read = lineage, None
    with ctx._jobs.task_resources():
        held = client.persist(barrier.run_stages(client, to_hold, cpus=ctx._barrier_cpus))
    futures = futures_of(held)
    if level.replication > 1 and level.useMemory:
        set_replication(client, futures, level.replication)
    stored = Stored(level, lineage, futures, spec)
    if read is None:
        reader = _graph.select("persisted", [[(held, i)] for i in range(held.npartitions)], [held])
    else:
        reader = _graph.partitionwise("readPersisted", read, held)
    if spec is not None:
        ctx._disk_blocks.add(stored)
    rdd._bag, rdd._stored = _persisted_bag(reader, stored), stored
    ctx._persisted[rdd.id()] = rdd
    return rdd


def unpersist(rdd: RDD, blocking: bool = False) -> RDD:
    """Implements :meth:`RDD.unpersist`.

    The futures are released, not cancelled: cancelling also cancels every task that depends on them,
    and Dask's scheduler fails on a dependent that no client wants (a task of a running or failed
    job), which drops the client's connection and with it every other persisted RDD.
    """
    stored = rdd._stored
    if stored is None:
        return rdd
    client = rdd.ctx._client
    if stored.level.replication > 1 and stored.level.useMemory:
        set_replication(client, stored.futures, 1)
    if stored.blocks is not None:
        writers = client.run_on_scheduler(_computing, [f.key for f in stored.futures])
    stored.released = True
    for f in stored.futures:
        f.release()
    rdd._bag, rdd._stored = stored.lineage, None
    rdd.ctx._persisted.pop(rdd.id(), None)
    if stored.blocks is not None:
        rdd.ctx._disk_blocks.drop(stored, writers, blocking)
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
