"""``SparkContext``: the entry point, owning a Dask client and (by default) an embedded cluster."""

from __future__ import annotations

import contextlib
import getpass
import importlib
import itertools
import logging
import os
import re
import shutil
import ssl
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from html import escape
from typing import Any, ClassVar, NoReturn, Self

import dask.config
import distributed
from dask.bag import Bag
from dask.utils import format_bytes, parse_timedelta
from distributed.comm.core import FatalCommClosedError
from distributed.diagnostics.plugin import UploadFile

from dlscale import __version__, config, storage
from dlscale.errors import ClusterConnectionError, DlscaleError, MasterURLError, UnsupportedOperationError
from dlscale.facade import _graph, _io, _ops, barrier, persist, status
from dlscale.facade.accumulators import (
    COMPLEX_ACCUMULATOR_PARAM,
    FLOAT_ACCUMULATOR_PARAM,
    INT_ACCUMULATOR_PARAM,
    Accumulator,
    AccumulatorParam,
    Accumulators,
)
from dlscale.facade.broadcast import Broadcast
from dlscale.facade.conf import SparkConf, spark_size_to_bytes
from dlscale.facade.embedded import EmbeddedCluster
from dlscale.facade.files import Files
from dlscale.facade.jobs import INTERRUPT_ON_CANCEL, JOB_DESCRIPTION, JOB_GROUP, Jobs
from dlscale.facade.rdd import RDD
from dlscale.facade.taskcontext import TASK_CPUS, ResourceInformation, TaskContext
from dlscale.runtime.cluster import cluster_workers
from dlscale.runtime.extensions import install_dashboard_pages

_LOCAL = re.compile(r"^local(?:\[(\d+|\*)(?:\s*,\s*(\d+))?\])?$")
_DRIVER_RESOURCE = re.compile(r"^spark\.driver\.resource\.([^.]+)\.amount$")
# Spark's test cluster: local-cluster[workers, cores per worker, memory per worker in MiB]
_LOCAL_CLUSTER = re.compile(r"^local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]$")
_ADDRESS = re.compile(r"^(tcp|tls|ws|wss|inproc)://.+")
_RESOURCE = re.compile(r"^spark\.executor\.resource\.([^.]+)\.amount$")
_SPARK_MANAGERS = ("spark://", "yarn", "mesos://", "k8s://")
# PySpark's message for a context made in a task, or pickled (referred to by a task's function or a broadcast value)
_CONTEXT_ONLY_ON_DRIVER = (
    "[CONTEXT_ONLY_VALID_ON_DRIVER] It appears that you are attempting to reference SparkContext from a broadcast "
    "variable, action, or transformation. SparkContext can only be used on the driver, not in code that runs on "
    "workers. For more information, see SPARK-5063."
)
_SCHEDULER_PORT = 8786  # Dask's default, for an address without a port
# Spark's log levels (in the order its message lists them) as the driver's logging levels
_LOG_LEVELS = {
    "ALL": 1,
    "DEBUG": logging.DEBUG,
    "ERROR": logging.ERROR,
    "WARN": logging.WARNING,
    "INFO": logging.INFO,
    "OFF": logging.CRITICAL + 1,
    "FATAL": logging.CRITICAL,
    "TRACE": 5,
}


def _chain(e: BaseException) -> Iterator[BaseException]:
    """``e`` and the exceptions that caused it, most recent first."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or cause.__context__


def _cause(e: BaseException) -> str:
    """What went wrong, never empty: ``e`` and its causes up to the first that explains itself
    (Dask raises some connection errors with no text and the reason in their cause)."""
    parts = []
    for cause in _chain(e):
        text = str(cause)
        parts.append(f"{type(cause).__name__}: {text}" if text else repr(cause))
        if text:
            break
    return ", from ".join(parts)


def _tls_failure(e: BaseException) -> bool:
    """Whether a failed ``tls://`` connection got an answer that was no TLS handshake: an SSL error,
    a connection Dask gave up at once, or tornado refusing to start TLS on the stream."""
    return any(isinstance(c, (ssl.SSLError, FatalCommClosedError, ValueError)) for c in _chain(e))


def _dashboard_address(setting: Any) -> str | None:
    """Where an embedded cluster's dashboard listens (``dlscale.local.dashboard-address``): a port
    alone (``":0"``, ``8787``) is bound to 127.0.0.1, as the scheduler and workers are; a host is
    used as given (``"0.0.0.0:8787"`` for every interface); ``None`` starts no dashboard."""
    if setting is None:
        return None
    address = str(setting)
    port = address.removeprefix(":")
    return f"127.0.0.1:{port}" if port.isdigit() else address


def _tick(setting: Any) -> dict[str, Any]:
    """Dask's tick setting for an embedded cluster's processes (``dlscale.local.tick-interval``), checked
    here, before any process starts; none for ``None`` (Dask's own)."""
    if setting is None:
        return {}
    try:
        seconds = parse_timedelta(setting)
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"dlscale.local.tick-interval must be a duration such as '500ms', got {setting!r}") from e
    if not seconds or seconds <= 0:
        raise ValueError(f"dlscale.local.tick-interval must be a positive duration, got {setting!r}")
    return {"admin": {"tick": {"interval": f"{seconds}s"}}}


def _task_cpus(conf: SparkConf) -> int:
    """``spark.task.cpus``: the CPUs of each task, 1 unless set."""
    value = conf.get("spark.task.cpus")
    if value is None:
        return 1
    try:
        cpus = int(value)
    except ValueError:
        cpus = 0
    if cpus < 1:
        raise ValueError(f"spark.task.cpus must be a positive integer, got {value!r}")
    return cpus


def _parse_local(master: str) -> tuple[int, int] | None:
    """The workers and the attempts per task (Spark's ``maxFailures``) of ``local``, ``local[N]``,
    ``local[*]`` or ``local[N, F]``; ``None`` for any other master."""
    m = _LOCAL.match(master)
    if not m:
        return None
    n, failures = m.group(1), int(m.group(2) or 1)
    if n is None:
        return 1, failures
    return (os.cpu_count() or 1 if n == "*" else int(n)), failures


def _checked_conf(conf: SparkConf | dict[str, Any] | None, master: str | None, client: Any, cluster: Any) -> SparkConf:
    """The context's SparkConf from ``conf``, once the constructor's arguments are checked."""
    if conf is not None and not isinstance(conf, (SparkConf, dict)):
        raise TypeError(f"conf must be a SparkConf or a dict, not {type(conf).__name__}")
    checked = conf if isinstance(conf, SparkConf) else SparkConf().setAll((conf or {}).items())
    allowed = (checked.get("spark.executor.allowSparkContext") or "").lower() == "true"
    if TaskContext.get() is not None and not allowed:
        raise RuntimeError(_CONTEXT_ONLY_ON_DRIVER)
    if sum(x is not None for x in (master, client, cluster)) > 1:
        raise ValueError("give at most one of master, client and cluster")
    if client is not None and not isinstance(client, distributed.Client):
        raise TypeError(f"client must be a distributed.Client, not {type(client).__name__}")
    return checked


def _connect_to_scheduler(master: str, security: distributed.Security | None) -> distributed.Client:
    """A client of the Dask scheduler at ``master`` (``tcp://``, ``tls://``, ``inproc://``), its failures
    told as what a user can do about them."""
    scheme, location = distributed.comm.parse_address(master)
    if scheme != "inproc":
        try:
            distributed.comm.parse_host_port(location, _SCHEDULER_PORT)
        except ValueError as e:
            raise MasterURLError(f"master {master!r} is not a valid scheduler address: {e}") from e
    timeout = config.get("connect-timeout")
    try:
        return _new_client(master, timeout=timeout, security=security)
    except Exception as e:
        _explain(e, master, scheme, location, timeout)
        raise


def _new_client(*args: Any, **kwargs: Any) -> distributed.Client:
    """``distributed.Client(*args, **kwargs)``; one whose making raised is closed first (found in the
    error's traceback): its event loop thread runs until it is closed, and left to the garbage
    collector, its ``__del__`` stops that thread's loop runner under the lock of every loop runner, which
    a client being made in the same thread at that moment holds: a deadlock of the process
    (distributed's ``LoopRunner``)."""
    try:
        return distributed.Client(*args, **kwargs)
    except Exception as e:
        trace = e.__traceback__
        while trace is not None:
            unmade = trace.tb_frame.f_locals.get("self")
            if isinstance(unmade, distributed.Client):
                with contextlib.suppress(Exception):
                    unmade.close()
                break
            trace = trace.tb_next
        raise


def _explain(e: Exception, master: str, scheme: str, location: str, timeout: Any) -> None:
    """Raise what a user can do about ``e``, the failure to connect to ``master``, where there is
    something to say; return otherwise."""
    if isinstance(e, TypeError):
        if scheme != "tls":
            return
        raise ClusterConnectionError(
            f"{master} needs TLS credentials: pass security=distributed.Security(...) or set "
            "distributed.comm.tls.ca-file and distributed.comm.tls.client.cert/key in Dask's "
            f"configuration ({e})"
        ) from e
    if isinstance(e, (OSError, TimeoutError, ValueError)):
        if scheme == "tls" and _tls_failure(e):
            raise ClusterConnectionError(
                f"the TLS handshake with the Dask scheduler at {master} failed ({_cause(e)}): the scheduler "
                f"may speak plain TCP (then give tcp://{location}), or not accept these credentials (check "
                "security= or distributed.comm.tls.* in Dask's configuration)"
            ) from e
        if isinstance(e, ValueError):
            return
        raise ClusterConnectionError(
            f"could not reach the Dask scheduler at {master} within {timeout} (dlscale.connect-timeout): {_cause(e)}"
        ) from e


class SparkContext:
    """Connection to a Dask cluster, with PySpark's ``SparkContext`` methods.

    ``master`` is ``local`` (one worker process), ``local[N]`` (N worker processes),
    ``local[*]`` (one per core; the default) or the address of a running Dask scheduler
    (``tcp://host:8786``, ``tls://...``; ``security`` is the :class:`distributed.Security` for
    ``tls://``, by default the one Dask's configuration describes). Alternatively pass ``client=`` (an existing
    :class:`distributed.Client`) or ``cluster=`` (any Dask cluster object, such as a
    dask-jobqueue ``SLURMCluster``). The context closes what it created on :meth:`stop` and
    never what it was given.
    """

    _running: ClassVar[list[SparkContext]] = []  # oldest first; getOrCreate returns the last
    _active_spark_context: ClassVar[SparkContext | None] = None  # PySpark's: the last started, None once it stops
    _lock = threading.RLock()

    def __init__(
        self,
        master: str | None = None,
        appName: str | None = None,
        *,
        client: distributed.Client | None = None,
        cluster: Any = None,
        conf: SparkConf | dict[str, Any] | None = None,
        security: distributed.Security | None = None,
    ) -> None:
        self._conf = _checked_conf(conf, master, client, cluster)
        self.appName = appName or self._conf.get("spark.app.name") or "dlscale"
        self._task_cpus = _task_cpus(self._conf)
        self._owned_cluster: Any = None
        self._max_failures = 1  # attempts per task: F of local[N, F]; a failed task is otherwise not retried
        self._owns_client = client is None
        if client is not None:
            self.master = client.scheduler.address
            self._client = client
        elif cluster is not None:
            self.master = cluster.scheduler_address
            self._client = _new_client(cluster)
        else:
            self.master = master or self._conf.get("spark.master") or "local[*]"
            self._client = self._connect(self.master, security)
        self._conf.set("spark.master", self.master).set("spark.app.name", self.appName)
        install_dashboard_pages(self._client)

        self.startTime = int(time.time() * 1000)
        self.applicationId = f"app-{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
        # key that authenticates blocks this application writes to disk (see dlscale.persist)
        self._block_key = os.urandom(32)
        self._rdd_ids = iter(range(1 << 62))
        self._persisted: weakref.WeakValueDictionary[int, RDD] = weakref.WeakValueDictionary()
        self._disk_blocks = persist.DiskBlocks(self)
        self._broadcasts: weakref.WeakSet[Broadcast] = weakref.WeakSet()
        self._accumulators = Accumulators()
        retained = int(self._conf.get("spark.ui.retainedJobs") or 1000)
        # on the cluster it started, the context has each worker offer its threads as TASK_CPUS, of which a
        # task takes spark.task.cpus: a worker runs threads // spark.task.cpus tasks at once, as a Spark executor
        self._limit_task_cpus = self._owned_cluster is not None and self._task_cpus > 1
        self._jobs = Jobs(
            self.applicationId,
            retries=self._max_failures - 1,
            retained=retained,
            cpus=self._task_cpus,
            limit_cpus=self._limit_task_cpus,
        )
        self._task_counts = status.install(self._client, self.applicationId, retained)
        self._checkpoint_dir: tuple[str, dict[str, Any] | None] | None = None  # URL, storage options
        self._to_checkpoint: weakref.WeakSet[RDD] = weakref.WeakSet()  # marked, not yet checkpointed
        self._py_files: str | None = None  # the driver's copies of addPyFile's files, made on first use
        self._py_paths: list[str] = []  # what addPyFile put on the driver's sys.path
        self._spark_user = os.environ.get("SPARK_USER") or getpass.getuser()
        self._files = Files(self.applicationId)
        self._stopped = False
        self._stopping: list[Callable[[], None]] = []  # what must reach the driver before the cluster goes
        with SparkContext._lock:
            SparkContext._running.append(self)
            SparkContext._active_spark_context = self

    # -- cluster ownership ---------------------------------------------------------------
    def _connect(self, master: str, security: distributed.Security | None) -> distributed.Client:
        if m := _LOCAL_CLUSTER.match(master):  # Spark's local-cluster[N, C, M]: N workers of C threads and M MiB
            workers, cores, mib = map(int, m.groups())
            if min(workers, cores, mib) < 1:
                raise MasterURLError(f"master {master!r} asks for no workers, threads or memory; use at least 1")
            self._conf.setIfMissing("spark.executor.cores", str(cores))
            self._conf.setIfMissing("spark.executor.memory", f"{mib}m")
            master = f"local[{workers}]"
        local = _parse_local(master)
        if local is not None:
            n, self._max_failures = local
            if n < 1:
                raise MasterURLError(f"master {master!r} asks for {n} workers; use at least 1")
            if self._max_failures < 1:
                raise MasterURLError(f"master {master!r} allows {self._max_failures} attempts per task; use at least 1")
            self._owned_cluster = EmbeddedCluster(**self._local_cluster_kwargs(n))
            # Its workers are on this machine: scattered networks and gathered results go straight to and
            # from them, not through the scheduler, which carries each twice. Dask's own setting wins.
            direct = dask.config.get("distributed.client.direct-to-workers")
            return _new_client(self._owned_cluster, direct_to_workers=True if direct is None else direct)
        if _ADDRESS.match(master):
            return _connect_to_scheduler(master, security)
        hint = ""
        if master.startswith(_SPARK_MANAGERS):
            hint = (
                " dlscale runs on Dask, not on a Spark cluster manager: give the address of a"
                " Dask scheduler (tcp://host:8786) or pass cluster= (e.g. a dask-jobqueue cluster)."
            )
        raise MasterURLError(
            f"unknown master URL {master!r}; expected local, local[N], local[*], local[N, F], tcp://host:port "
            f"or tls://host:port.{hint}"
        )

    def _local_cluster_kwargs(self, n: int) -> dict[str, Any]:
        conf = self._conf
        threads = int(conf.get("spark.executor.cores") or config.get("local.threads-per-worker"))
        memory: Any = config.get("local.memory-limit")
        if conf.contains("spark.executor.memory"):
            memory = spark_size_to_bytes(conf.get("spark.executor.memory"), "spark.executor.memory")
        workers = int(conf.get("spark.executor.instances") or n)
        resources = {m.group(1): float(v) for k, v in conf.getAll() if (m := _RESOURCE.match(k))}
        cpus = self._task_cpus
        if cpus > 1:
            sized = conf.contains("spark.executor.cores") or conf.contains("spark.executor.instances")
            if threads < cpus and not sized:
                # local[N]: Spark's one executor of N cores runs N // cpus tasks at once; so many worker
                # processes of cpus threads run as many
                cores = workers * threads
                if cores < cpus:
                    raise ValueError(
                        f"The number of cores per executor (={cores}) has to be >= the number of cpus per task = "
                        f"{cpus}: give local[N] at least spark.task.cpus threads"
                    )
                workers, threads = cores // cpus, cpus
            elif threads < cpus:  # Spark's check, a worker process standing for an executor
                raise ValueError(
                    f"The number of cores per executor (={threads}) has to be >= the number of cpus per task = "
                    f"{cpus}: set spark.executor.cores (threads per worker process) to at least spark.task.cpus"
                )
            resources[TASK_CPUS] = float(threads)
        memory_settings = {
            name: value
            for name in ("target", "spill", "pause")
            if (value := config.get(f"local.memory-{name}")) is not None
        }
        return {
            "n_workers": workers,
            "threads_per_worker": threads,
            "memory_limit": memory,
            "dashboard_address": _dashboard_address(config.get("local.dashboard-address")),
            "resources": resources,
            "config": {
                "distributed": {"worker": {"memory": memory_settings}, **_tick(config.get("local.tick-interval"))}
            },
        }

    @property
    def resources(self) -> dict[str, ResourceInformation]:
        """The driver's resources (PySpark's): those ``spark.driver.resource.<name>.amount`` gives it, a
        resource of quantity n with the addresses ``"0"`` to ``"n-1"``."""
        return {
            m.group(1): ResourceInformation(m.group(1), [str(i) for i in range(int(float(v)))])
            for k, v in self._conf.getAll()
            if (m := _DRIVER_RESOURCE.match(k))
        }

    @property
    def client(self) -> distributed.Client:
        """The Dask client this context computes with."""
        if self._stopped:
            raise RuntimeError(f"the SparkContext {self.applicationId} has been stopped")
        return self._client

    def stop(self) -> None:
        """Release every persisted RDD, delete the application's DISK_ONLY blocks (waiting for tasks still
        writing them) and the files added with ``addFile`` and ``addArchive`` (the driver's and the workers'),
        and close the client and cluster this context created."""
        if self._stopped:
            return
        for fetch in self._stopping:
            fetch()
        for rdd in list(self._persisted.values()):
            rdd.unpersist()
        self._disk_blocks.close()
        for b in list(self._broadcasts):
            b.destroy()
        self._stopped = True
        self._remove_py_files()
        # a closed client's cluster is gone, and the plugins and the workers' copies of the files with it
        reachable = self._client.status != "closed"
        self._files.close(self._client if reachable else None)
        if self._task_counts and reachable:
            status.uninstall(self._client, self.applicationId)
        if self._owns_client:
            self._client.close()
        if self._owned_cluster is not None:
            self._owned_cluster.close()
        with SparkContext._lock:
            SparkContext._running.remove(self)
            if SparkContext._active_spark_context is self:  # as PySpark: none until a context starts
                SparkContext._active_spark_context = None

    def _on_stop(self, fetch: Callable[[], None]) -> None:
        """Call ``fetch`` as the context stops, before anything is released: what a library built on the
        context keeps on the cluster for the driver (a fit's trained state) reaches the driver first."""
        self._stopping.append(fetch)

    def __reduce__(self) -> NoReturn:
        """A context cannot be pickled: it belongs to the driver. A function given to an RDD operation, or a
        broadcast value, that refers to it fails with PySpark's error (``CONTEXT_ONLY_VALID_ON_DRIVER``)."""
        raise RuntimeError(_CONTEXT_ONLY_ON_DRIVER)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @classmethod
    def getOrCreate(cls, conf: SparkConf | None = None) -> SparkContext:
        """The most recently created context that is still running, or a new one from ``conf``."""
        with cls._lock:
            return cls._running[-1] if cls._running else cls(conf=conf)

    def getConf(self) -> SparkConf:
        return SparkConf().setAll(self._conf.getAll())

    # -- properties ----------------------------------------------------------------------
    @property
    def defaultParallelism(self) -> int:
        """Total worker threads (``spark.default.parallelism`` when set)."""
        if self._conf.contains("spark.default.parallelism"):
            return int(self._conf.get("spark.default.parallelism"))
        return max(1, sum(w["nthreads"] for w in cluster_workers(self.client).values()))

    @property
    def defaultMinPartitions(self) -> int:
        return min(self.defaultParallelism, 2)

    @property
    def uiWebUrl(self) -> str | None:
        """The Dask dashboard."""
        return self.client.dashboard_link

    @property
    def version(self) -> str:
        return __version__

    def _new_rdd_id(self) -> int:
        return next(self._rdd_ids)

    @property
    def _barrier_cpus(self) -> int:
        """The worker threads a barrier task takes: ``spark.task.cpus`` where the context limits tasks by
        CPUs, else 1."""
        return self._task_cpus if self._limit_task_cpus else 1

    def _default_reduce_partitions(self, rdd: RDD) -> int:
        if self._conf.contains("spark.default.parallelism"):
            return self.defaultParallelism
        return rdd.getNumPartitions()

    # -- creating RDDs -------------------------------------------------------------------
    def parallelize(self, c: Iterable[Any], numSlices: int | None = None) -> RDD:
        """Distribute a local collection, sliced by position exactly as PySpark slices it."""
        n = self._check_slices(numSlices)
        if isinstance(c, range):
            return self.range(c.start, c.stop, c.step, n)
        if not isinstance(c, Sequence) or isinstance(c, (str, bytes)):
            try:
                c = list(c)
            except TypeError:
                raise TypeError(f"parallelize needs an iterable collection, got {type(c).__name__}") from None
        # PySpark ships a list in batches of min(len // n, 1024) elements and slices the batches
        batch = max(1, min(len(c) // n, 1024))
        nb = -(-len(c) // batch)
        parts = [list(c[(i * nb // n) * batch : ((i + 1) * nb // n) * batch]) for i in range(n)]
        blobs = _graph.pickle_partitions(parts)  # the elements as they are now: what every job computes
        rdd = RDD(_graph.from_pickled("parallelize", blobs), self)
        rdd._local = _graph.PickledPartitions(blobs)
        return rdd

    def range(self, start: int, end: int | None = None, step: int = 1, numSlices: int | None = None) -> RDD:
        """Integers from ``start`` to ``end`` (exclusive); each partition is generated on its worker."""
        if end is None:
            start, end = 0, start
        n = self._check_slices(numSlices)
        r = range(start, end, step)
        size = len(r)
        calls = [(list, (r[i * size // n : (i + 1) * size // n],)) for i in range(n)]
        return RDD(_graph.from_calls("range", calls), self)

    def emptyRDD(self) -> RDD:
        """An RDD with no partitions."""
        return RDD(_graph.from_pickled("empty", []), self)

    def from_bag(self, bag: Bag) -> RDD:
        """An RDD of the elements of ``bag``, partition for partition (dlscale's extension; the way
        back from :meth:`RDD.to_bag`). Each partition is made a list as it is computed, so a bag whose
        partitions are iterators can be read more than once."""
        if not isinstance(bag, Bag):
            raise TypeError(f"bag must be a dask.bag.Bag, not {type(bag).__name__}")
        return RDD(_graph.partitionwise("fromBag", _ops.elements, bag), self)

    def union(self, rdds: Sequence[RDD]) -> RDD:
        """The concatenation of the partitions of ``rdds``; of RDDs partitioned alike (the same partitioner),
        partition i is the union of their partitions i and the partitioner is kept (Spark's
        ``PartitionerAwareUnionRDD``)."""
        rdds = list(rdds)
        if not rdds:
            raise ValueError("union needs at least one RDD")
        first = rdds[0].partitioner
        if first is not None and all(r.partitioner == first for r in rdds[1:]):
            bag = _graph.partitionwise("union", _ops.concatenated, *[r._bag for r in rdds])
            return RDD(bag, self, first, parents=tuple(rdds))
        sources = [[(r._bag, i)] for r in rdds for i in range(r.getNumPartitions())]
        return RDD(_graph.select("union", sources, [r._bag for r in rdds]), self, parents=tuple(rdds))

    def broadcast(self, value: Any) -> Broadcast:
        """Send ``value`` to every worker once; tasks read it through ``.value``."""
        return Broadcast(self, value)

    def accumulator(self, value: Any, accum_param: AccumulatorParam | None = None) -> Accumulator:
        """An :class:`~dlscale.facade.accumulators.Accumulator` starting at ``value``: tasks add to it, the
        driver reads ``.value``. ``accum_param`` says how to add values (``zero``, ``addInPlace``); ints,
        floats and complex numbers have one by default. Additions in a task reach the driver with the task's
        result; each task of an action counts once, however often it ran (docs/facade.md)."""
        if accum_param is None:
            if isinstance(value, int):
                accum_param = INT_ACCUMULATOR_PARAM
            elif isinstance(value, float):
                accum_param = FLOAT_ACCUMULATOR_PARAM
            elif isinstance(value, complex):
                accum_param = COMPLEX_ACCUMULATOR_PARAM
            else:
                raise TypeError(f"No default accumulator param for type {type(value)}")
        return self._accumulators.new(value, accum_param)

    def setCheckpointDir(self, dirName: str, *, storage_options: dict[str, Any] | None = None) -> None:
        """Checkpoint RDDs under ``dirName`` (a local path or any fsspec URL), in a new directory of this
        context's own there, as Spark does."""
        fs, root = storage.open_fs(dirName, storage_options)
        path = f"{root.rstrip('/')}/{uuid.uuid4()}"
        with storage.as_storage_error("create", dirName):
            fs.makedirs(path, exist_ok=True)
        self._checkpoint_dir = (storage.hadoop_url(fs, path), storage_options)

    def getCheckpointDir(self) -> str | None:
        """The directory RDDs are checkpointed in, or ``None`` before ``setCheckpointDir``: its URL as Spark
        writes it (``file:/tmp/x/<uuid>`` for a local directory, the fsspec URL otherwise)."""
        return None if self._checkpoint_dir is None else self._checkpoint_dir[0]

    # -- job control -----------------------------------------------------------------------
    def setLocalProperty(self, key: str, value: str | None) -> None:
        """Set a property of the jobs this thread starts (``None`` removes it); tasks read it through
        ``TaskContext.getLocalProperty``."""
        self._jobs.set_property(key, value)

    def getLocalProperty(self, key: str) -> str | None:
        """This thread's local property ``key``, or ``None``."""
        return self._jobs.properties().get(key)

    def setJobGroup(self, groupId: str, description: str, interruptOnCancel: bool = False) -> None:
        """Put the jobs this thread starts in group ``groupId`` (``cancelJobGroup`` cancels them). A
        cancelled job's running tasks are always interrupted: ``interruptOnCancel`` is kept as a property."""
        self._jobs.set_property(JOB_GROUP, groupId)
        self._jobs.set_property(JOB_DESCRIPTION, description)
        self._jobs.set_property(INTERRUPT_ON_CANCEL, str(bool(interruptOnCancel)).lower())

    def setInterruptOnCancel(self, interruptOnCancel: bool) -> None:
        """Set this thread's ``spark.job.interruptOnCancel`` property. A cancelled job's running tasks are
        always interrupted, so it is kept as a property only."""
        self._jobs.set_property(INTERRUPT_ON_CANCEL, str(bool(interruptOnCancel)).lower())

    def setJobDescription(self, value: str) -> None:
        """Describe the jobs this thread starts."""
        self._jobs.set_property(JOB_DESCRIPTION, value)

    def addJobTag(self, tag: str) -> None:
        """Tag the jobs this thread starts with ``tag`` (not empty, no comma)."""
        self._jobs.add_tag(tag)

    def removeJobTag(self, tag: str) -> None:
        """Stop tagging this thread's jobs with ``tag`` (nothing happens if it was not added)."""
        self._jobs.remove_tag(tag)

    def getJobTags(self) -> set[str]:
        """The tags of the jobs this thread starts."""
        return self._jobs.tags()

    def clearJobTags(self) -> None:
        """Remove all of this thread's job tags."""
        self._jobs.set_tags(set())

    def cancelJobGroup(self, groupId: str) -> None:
        """Cancel the running jobs of group ``groupId``: their waiting tasks never start, their running tasks
        are interrupted, and the threads that started them raise ``JobCancelledError``."""
        self._jobs.cancel_group(self.client, groupId)

    def cancelJobsWithTag(self, tag: str) -> None:
        """Cancel the running jobs tagged ``tag``, as ``cancelJobGroup`` does."""
        self._jobs.cancel_tag(self.client, tag)

    def cancelAllJobs(self) -> None:
        """Cancel every running job of this context, as ``cancelJobGroup`` does."""
        self._jobs.cancel_all(self.client)

    def addPyFile(self, path: str, *, storage_options: dict[str, Any] | None = None) -> None:
        """Make a ``.py`` module or a ``.zip`` / ``.egg`` of packages importable on every worker, those
        that join later included (Dask's upload plugin), and on the driver until this context stops (as
        PySpark: the driver imports a copy, put on its ``sys.path``). ``path`` is a local file or a URL
        with a protocol (``s3://...``). As in PySpark, the file is also added as ``addFile`` adds it:
        ``listFiles`` lists it and ``SparkFiles.get(name)`` finds it."""
        name = os.path.basename(path.rstrip("/"))
        if not name.endswith((".py", ".zip", ".egg")):
            raise ValueError(f"addPyFile takes a .py, .zip or .egg file, got {path!r}")
        client = self.client
        if storage.has_protocol(path):
            fs, remote = storage.open_fs(path, storage_options)
            if not fs.isfile(remote):
                raise FileNotFoundError(f"addPyFile: no such file {path!r}")
        elif not os.path.isfile(os.path.expanduser(path)):
            raise FileNotFoundError(f"addPyFile: no such file {path!r}")
        # PySpark's addPyFile is addFile first: the same checks (another file of the same name is refused)
        self._files.add(client, path, archive=False, storage_options=storage_options)
        if self._py_files is None:
            self._py_files = tempfile.mkdtemp(prefix=f"dlscale-pyfiles-{self.applicationId}-")
        local = os.path.join(self._py_files, name)
        shutil.copyfile(os.path.join(self._files.root(), name), local)  # addFile's driver copy
        # the workers' plugin only: Dask's upload_file would also import the file in the scheduler, which
        # for local[N] is the driver's process, and leave it there after this context stops
        client.register_plugin(UploadFile(local), name=f"dlscale-pyfile-{name}-{uuid.uuid4().hex[:8]}")
        entry = self._py_files if name.endswith(".py") else local
        if entry not in self._py_paths:
            sys.path.insert(1, entry)
            self._py_paths.append(entry)
        importlib.invalidate_caches()

    def addFile(self, path: str, recursive: bool = False, *, storage_options: dict[str, Any] | None = None) -> None:
        """Give every task a copy of a file, or with ``recursive`` a directory, found by ``SparkFiles.get(name)``
        on the workers (those that join later included) and on the driver. ``path`` is a local path or any
        fsspec URL. Adding a path again does nothing; another path of the same name must have the same content."""
        self._files.add(self.client, path, archive=False, recursive=recursive, storage_options=storage_options)

    def addArchive(self, path: str, *, storage_options: dict[str, Any] | None = None) -> None:
        """Give every task an archive (``.zip``, ``.jar``, ``.tar``, ``.tar.gz``, ``.tgz``) unpacked into a
        directory named after it, or after the URL's fragment (``deps.zip#deps``), as ``addFile`` does. An
        archive with a member outside that directory (an absolute path, ``..``) is refused."""
        self._files.add(self.client, path, archive=True, storage_options=storage_options)

    @property
    def listFiles(self) -> list[str]:
        """The files and directories added with ``addFile`` and ``addPyFile``, as URLs (``file:/path``)."""
        return list(self._files.files)

    @property
    def listArchives(self) -> list[str]:
        """The archives added with ``addArchive``, as URLs (``file:/path``, with its ``#name``)."""
        return list(self._files.archives)

    def statusTracker(self) -> status.StatusTracker:
        """The :class:`~dlscale.facade.status.StatusTracker` of this context's jobs."""
        return status.StatusTracker(self)

    def _remove_py_files(self) -> None:
        """Take addPyFile's files off the driver's ``sys.path`` and delete them: a module not yet imported
        cannot be imported from a stopped context's files (as in PySpark, where they go with the context)."""
        for entry in self._py_paths:
            if entry in sys.path:
                sys.path.remove(entry)
        self._py_paths.clear()
        if self._py_files is not None:
            shutil.rmtree(self._py_files, ignore_errors=True)
            self._py_files = None
        importlib.invalidate_caches()

    def textFile(
        self,
        name: str,
        minPartitions: int | None = None,
        use_unicode: bool = True,
        *,
        storage_options: dict[str, Any] | None = None,
    ) -> RDD:
        """Lines of text files (a file, a directory, a glob, or comma-separated paths)."""
        return RDD(_io.text_file(self, name, minPartitions, use_unicode, storage_options), self)

    def wholeTextFiles(
        self,
        path: str,
        minPartitions: int | None = None,
        use_unicode: bool = True,
        *,
        storage_options: dict[str, Any] | None = None,
    ) -> RDD:
        """``(url, content)`` for every file under ``path``."""
        return RDD(
            _io.whole_files(self, path, minPartitions, storage_options, text=True, use_unicode=use_unicode), self
        )

    def binaryFiles(
        self,
        path: str,
        minPartitions: int | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
    ) -> RDD:
        """``(url, bytes)`` for every file under ``path``."""
        return RDD(_io.whole_files(self, path, minPartitions, storage_options, text=False), self)

    def pickleFile(
        self,
        name: str,
        minPartitions: int | None = None,
        *,
        allowed: Iterable[str] = (),
        storage_options: dict[str, Any] | None = None,
    ) -> RDD:
        """Objects written by :meth:`RDD.saveAsPickleFile`.

        Only plain data (built-in types, numpy arrays, torch tensors) is loaded; name further
        classes as ``"module:QualName"`` in ``allowed``. Anything else is refused without running.
        """
        return RDD(_io.pickle_file(name, tuple(allowed), storage_options), self)

    def binaryRecords(self, path: str, recordLength: int, *, storage_options: dict[str, Any] | None = None) -> RDD:
        """The fixed-length records (``bytes`` of ``recordLength``) of a flat binary file, or of every file
        of a directory (a glob, comma-separated paths; any fsspec URL), in splits of whole records. A
        file whose size is not a whole number of records is refused here (Spark fails the job)."""
        return RDD(_io.binary_records(path, recordLength, storage_options), self)

    def getRDDStorageInfo(self) -> list[Any]:
        """What each persisted RDD holds in worker memory and on disk."""
        return persist.storage_info(self, list(self._persisted.values()))

    def _check_slices(self, numSlices: int | None) -> int:
        if numSlices is None:
            return self.defaultParallelism
        if isinstance(numSlices, bool) or not isinstance(numSlices, int):
            raise TypeError(f"numSlices must be an int, not {type(numSlices).__name__}")
        if numSlices < 1:
            raise ValueError(f"numSlices must be at least 1, got {numSlices}")
        return numSlices

    def runJob(
        self,
        rdd: RDD,
        partitionFunc: Callable[[Iterable[Any]], Iterable[Any]],
        partitions: Sequence[int] | None = None,
        allowLocal: bool = False,
    ) -> list:
        """The elements ``partitionFunc(iterator)`` returns for each of ``partitions`` (all by default), in
        the order given; only those partitions are computed. ``allowLocal`` has no effect, as in PySpark."""
        partitionFunc = _ops.user_function(partitionFunc, "runJob", "partitionFunc")
        n = rdd.getNumPartitions()
        partitions = range(n) if partitions is None else list(partitions)
        for p in partitions:
            if not 0 <= p < n:
                raise ValueError(f"Attempting to access a non-existent partition: {p}. Total number of partitions: {n}")
        parts = rdd.mapPartitions(partitionFunc)._run_partitions(iter, partitions)
        return list(itertools.chain.from_iterable(parts))

    def setLogLevel(self, logLevel: str) -> None:
        """Set the level of the driver's ``dlscale`` and ``distributed`` loggers to Spark's level
        ``logLevel`` (any case): ALL, TRACE, DEBUG, INFO, WARN, ERROR, FATAL or OFF. The workers keep
        theirs."""
        level = _LOG_LEVELS.get(logLevel.upper()) if isinstance(logLevel, str) else None
        if level is None:
            raise ValueError(f"Supplied level {logLevel} did not match one of: {','.join(_LOG_LEVELS)}")
        for name in ("dlscale", "distributed"):
            logging.getLogger(name).setLevel(level)

    def sparkUser(self) -> str:
        """The user running this context: ``SPARK_USER`` if set, else the operating system's user, as
        Spark takes it when the context starts."""
        return self._spark_user

    # -- parts of PySpark that need Spark's JVM --------------------------------------------
    def sequenceFile(
        self,
        path: str,
        keyClass: str | None = None,
        valueClass: str | None = None,
        keyConverter: str | None = None,
        valueConverter: str | None = None,
        minSplits: int | None = None,
        batchSize: int = 0,
    ) -> RDD:
        """Not supported: SequenceFiles are a Hadoop format."""
        raise _hadoop_input("sequenceFile")

    def hadoopFile(
        self,
        path: str,
        inputFormatClass: str,
        keyClass: str,
        valueClass: str,
        keyConverter: str | None = None,
        valueConverter: str | None = None,
        conf: dict[str, str] | None = None,
        batchSize: int = 0,
    ) -> RDD:
        """Not supported: Hadoop input formats need the JVM."""
        raise _hadoop_input("hadoopFile")

    def newAPIHadoopFile(
        self,
        path: str,
        inputFormatClass: str,
        keyClass: str,
        valueClass: str,
        keyConverter: str | None = None,
        valueConverter: str | None = None,
        conf: dict[str, str] | None = None,
        batchSize: int = 0,
    ) -> RDD:
        """Not supported: Hadoop input formats need the JVM."""
        raise _hadoop_input("newAPIHadoopFile")

    def hadoopRDD(
        self,
        inputFormatClass: str,
        keyClass: str,
        valueClass: str,
        keyConverter: str | None = None,
        valueConverter: str | None = None,
        conf: dict[str, str] | None = None,
        batchSize: int = 0,
    ) -> RDD:
        """Not supported: Hadoop input formats need the JVM."""
        raise _hadoop_input("hadoopRDD")

    def newAPIHadoopRDD(
        self,
        inputFormatClass: str,
        keyClass: str,
        valueClass: str,
        keyConverter: str | None = None,
        valueConverter: str | None = None,
        conf: dict[str, str] | None = None,
        batchSize: int = 0,
    ) -> RDD:
        """Not supported: Hadoop input formats need the JVM."""
        raise _hadoop_input("newAPIHadoopRDD")

    def _compute_within(self, tasks: list, timeout: float, rdd: RDD | None = None) -> dict[int, Any]:
        """The results of ``tasks`` finished within ``timeout`` seconds, by index (``Jobs.run_within``), after
        adding the accumulator records they brought back."""
        done = self._jobs.run_within(self.client, tasks, timeout, rdd)
        self._accumulators.deliver(_graph.carried(done.values()), None)
        return done

    def _compute(self, collection: Any, action: set | None = None, rdd: RDD | None = None) -> Any:
        """The result of an action's graph, after adding the accumulator records it brought back (``action``:
        the partitions whose records an earlier part of the same action added, see ``Accumulators.deliver``).
        ``rdd`` is the RDD the action computes, whose lineage gives the job's stages.
        A reduction's result is unwrapped; a bag is computed partition by partition, so that each keeps its
        records, and comes back as Dask returns it (its elements in one list)."""
        if isinstance(collection, Bag):
            bag_tasks = collection.to_delayed(optimize_graph=not barrier.has_stages(collection))
            return list(itertools.chain.from_iterable(self._compute(bag_tasks, action, rdd)))
        try:
            run_stages = partial(barrier.run_stages, self.client, cpus=self._barrier_cpus)
            result = self._jobs.run(self.client, collection, run_stages, rdd)
        except TypeError as e:
            # a dlscale error raised while Dask serialized the graph is the real cause: raise that
            cause = e.__cause__ or e.__context__
            while cause is not None and not isinstance(cause, DlscaleError):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            raise cause from None
        self._accumulators.deliver(_graph.carried(result if isinstance(result, list) else [result]), action)
        return result.value if isinstance(result, _graph.Carried) else result

    def __repr__(self) -> str:
        return f"<SparkContext master={self.master} appName={self.appName}>"

    def _repr_html_(self) -> str:
        """What a notebook shows: the application, its master, the dashboard (and its training page), every
        worker with its threads and memory, and the Dask client's own view, in Dask's style."""
        title = (
            '<div style="width: 24px; height: 24px; background-color: #FFF7E5; border: 3px solid #E25A1C; '
            'border-radius: 5px; position: absolute;"></div><div style="margin-left: 48px;">'
            '<h3 style="margin-bottom: 0px;">SparkContext</h3>'
            f'<p style="color: #9D9D9D; margin-bottom: 0px;">{escape(self.appName)} ({self.applicationId})</p>'
        )
        cells = [f"<strong>Master:</strong> {escape(self.master)}", f"<strong>dlscale:</strong> {__version__}"]
        if self._stopped:
            return f"<div>{title}{_html_table(cells + ['<strong>Status:</strong> stopped', ''])}</div></div>"
        link = self.uiWebUrl
        if link:
            cells.append(f'<strong>Dashboard:</strong> <a href="{escape(link)}" target="_blank">{escape(link)}</a>')
            page = link.rsplit("/", 1)[0] + "/training"  # the training page, when dlscale.panel installs it
            cells.append(
                f'<strong>Training:</strong> <a href="{escape(page)}" target="_blank">{escape(page)}</a>'
                if config.get("panel")
                else ""
            )
        workers = cluster_workers(self.client)
        memory = sum(w.get("memory_limit") or 0 for w in workers.values())
        cells += [
            f"<strong>Workers:</strong> {len(workers)}",
            f"<strong>Total threads:</strong> {sum(w['nthreads'] for w in workers.values())}, "
            f"<strong>total memory:</strong> {format_bytes(memory)}",
        ]
        rows = "".join(
            f"<tr><td>{escape(address)}</td><td>{escape(str(w.get('name')))}</td><td>{w['nthreads']}</td>"
            f"<td>{format_bytes(w['memory_limit']) if w.get('memory_limit') else 'no limit'}</td></tr>"
            for address, w in sorted(workers.items())
        )
        return (
            f"<div>{title}{_html_table(cells)}"
            '<details><summary><h4 style="display: inline;">Workers</h4></summary>'
            '<table style="text-align: left;"><tr><th>address</th><th>name</th><th>threads</th><th>memory</th></tr>'
            f"{rows}</table></details>"
            '<details><summary><h4 style="display: inline;">Dask client</h4></summary>'
            f"{self.client._repr_html_()}</details></div></div>"
        )


def _html_table(cells: list[str]) -> str:
    """``cells`` two to a row, as Dask's own reprs lay out their figures."""
    rows = "".join(
        "<tr>" + "".join(f'<td style="text-align: left;">{c}</td>' for c in cells[i : i + 2]) + "</tr>"
        for i in range(0, len(cells), 2)
    )
    return f'<table style="width: 100%; text-align: left;">{rows}</table>'


def _hadoop_input(method: str) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"SparkContext.{method} needs Hadoop's input formats (Spark's JVM), which dlscale does not have: read "
        "files with textFile, wholeTextFiles, binaryFiles, binaryRecords or pickleFile, which take a path or any "
        "fsspec URL (storage_options= for its options)"
    )
