"""Minibatch storage: load throughput against raw reads, export throughput, and zarr against files.

Run from the repository root with ``python -m benchmarks.minibatch_io``. Three measurements, each
with its baseline in this same script:

- **load**: ``dlscale.data.load`` of every ``.dlb`` file against reading the same files' bytes
  with ``open(path, "rb").read()``, from local disk (the page cache dropped for those files with
  ``posix_fadvise(DONTNEED)`` before each pass) and from the page cache. Target: load ≥ 0.8 of raw
  from local disk.
- **export**: ``export_minibatches`` of an RDD on ``SparkContext("local[2]")`` against ``save`` of
  the same minibatches one after another in this process.
- **zarr vs files**: loading every minibatch from a zarr group (one chunk per minibatch) against
  from ``.dlb`` files, on local disk and on a local S3 server (moto, 127.0.0.1).

Results go to ``benchmarks/results/minibatch_io.json``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import dask
import torch
import zarr

from benchmarks._common import command_line, header, parse, shrink, timed, write_results
from dlscale import SparkContext, StorageLevel, storage
from dlscale.data import (
    DataSet,
    DataSetLoader,
    ZarrLoader,
    export_minibatches,
    export_zarr,
    load,
    save,
)

RESULTS = Path(__file__).resolve().parent / "results" / "minibatch_io.json"
BATCH = 256
SHAPE = (3, 32, 32)  # CIFAR-sized images: 3 MiB of float32 features per minibatch
N_BATCHES = 48
S3_BATCHES = 12
REPEATS = 5
S3_REPEATS = 3
TARGET = 0.8
MEASUREMENT_HELP = {
    "load": "dlscale.data.load of each .dlb file against open().read(), from local disk and page cache",
    "export": 'export_minibatches on SparkContext("local[2]") against save in one process',
    "zarr vs files": "every minibatch from a zarr group against from .dlb files, local disk and S3 (moto)",
}
"""A line on each measurement, for ``--help``."""


def make_data(n_batches: int, seed: int = 0) -> list[DataSet]:
    g = torch.Generator().manual_seed(seed)
    return [
        DataSet(torch.randn(BATCH, *SHAPE, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(n_batches)
    ]


def drop_cache(paths: list[str]) -> None:
    """Evict the files from the page cache, so the next read comes from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: list[str]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            f.read()


def dlb_load(paths: list[str]) -> None:
    for p in paths:
        load(p)


def bench_load(paths: list[str], nbytes: int) -> dict[str, Any]:
    """Each repeat reads raw, loads, loads, reads raw (ABBA), so that a drift or an effect of
    position within a repeat weighs on both equally; a repeat's time for each is the mean of its two."""
    out: dict[str, Any] = {}
    for where in ("local disk", "page cache"):
        times: dict[str, list[float]] = {"raw read": [], "dlscale load": []}
        for _ in range(REPEATS):
            passes: dict[str, list[float]] = {"raw read": [], "dlscale load": []}
            for name, fn in (
                ("raw read", raw_read),
                ("dlscale load", dlb_load),
                ("dlscale load", dlb_load),
                ("raw read", raw_read),
            ):
                if where == "local disk":
                    drop_cache(paths)
                else:
                    raw_read(paths)
                passes[name].append(timed(lambda fn=fn: fn(paths)))
            for name, pair in passes.items():
                times[name].append(statistics.mean(pair))
        medians = {k: statistics.median(v) for k, v in times.items()}
        out[where] = {
            "seconds": times,
            "GB/s": {k: nbytes / v / 1e9 for k, v in medians.items()},
            "load / raw": medians["raw read"] / medians["dlscale load"],
        }
    out["target"] = {"load / raw from local disk": f">= {TARGET}", "met": out["local disk"]["load / raw"] >= TARGET}
    return out


def element(i: int) -> DataSet:
    """Element ``i`` of the export benchmark's RDD: 64 examples, made where it is needed."""
    g = torch.Generator().manual_seed(1000 + i)
    return DataSet(torch.randn(64, *SHAPE, generator=g), torch.randint(0, 10, (64,), generator=g))


def bench_export(sc: SparkContext, root: Path) -> dict[str, Any]:
    """The RDD is made and persisted on the workers first, as the export docs advise, so that
    what is timed is the export itself: counting, re-batching 64-example elements into minibatches
    of 256, moving the pieces that cross partitions, and writing."""
    n = N_BATCHES * BATCH // 64
    rdd = sc.parallelize(range(n), 4).map(element).persist(StorageLevel.MEMORY_ONLY)
    rdd.count()
    local = [DataSet.merge([element(i) for i in range(k, k + BATCH // 64)]) for k in range(0, n, BATCH // 64)]
    nbytes = sum(d.nbytes() for d in local)
    times: dict[str, list[float]] = {"save in one process": [], "export_minibatches local[2]": []}
    for r in range(REPEATS):
        out = root / f"single-{r}"
        times["save in one process"].append(
            timed(lambda out=out: [save(b, str(out / f"dataset_{k:08d}.dlb")) for k, b in enumerate(local)])
        )
        times["export_minibatches local[2]"].append(
            timed(lambda r=r: export_minibatches(rdd, str(root / f"export-{r}"), BATCH))
        )
        if r == 0:
            _, exported = storage.find_files(str(root / "export-0"), None)  # the minibatches, not the manifest
            assert all(load(p).equals(b) for p, b in zip(exported, local)) and len(exported) == len(local)
        shutil.rmtree(out)
        shutil.rmtree(root / f"export-{r}")
    rdd.unpersist()
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "seconds": times,
        "MB/s": {k: nbytes / v / 1e6 for k, v in medians.items()},
        "export / single process": medians["save in one process"] / medians["export_minibatches local[2]"],
    }


def bench_zarr(data: list[DataSet], url: str, storage_options: dict | None, repeats: int) -> dict[str, Any]:
    files = export_minibatches(data, f"{url}/files", BATCH, storage_options=storage_options)
    refs = export_zarr(data, f"{url}/group.zarr", BATCH, storage_options=storage_options)
    expected = data[-1]
    assert DataSetLoader(storage_options)(files[-1]).equals(expected)
    assert ZarrLoader(storage_options)(refs[-1]).equals(expected)
    nbytes = sum(d.nbytes() for d in data)
    times: dict[str, list[float]] = {".dlb files": [], "zarr": []}
    for _ in range(repeats):
        # a fresh loader each time (the zarr loader caches the opened group); each minibatch is
        # dropped before the next is read, as in training
        for name, loader, names in (
            (".dlb files", DataSetLoader(storage_options), files),
            ("zarr", ZarrLoader(storage_options), refs),
        ):
            times[name].append(timed(lambda loader=loader, names=names: all(loader(n) is not None for n in names)))
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "minibatches": len(data),
        "seconds": times,
        "GB/s": {k: nbytes / v / 1e9 for k, v in medians.items()},
        "zarr / files": medians[".dlb files"] / medians["zarr"],
    }


def s3_zarr(data: list[DataSet]) -> dict[str, Any]:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "s3_server", Path(__file__).resolve().parent.parent / "storage" / "s3_server.py"
    )
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    server, endpoint = launcher.start(buckets=("bench",))
    try:
        return bench_zarr(data, "s3://bench/io", launcher.storage_options(endpoint), S3_REPEATS)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = command_line(__doc__.splitlines()[0], cases=MEASUREMENT_HELP, title="measurements")
    args = parse(parser, argv, RESULTS)
    if args.smoke:
        shrink(globals(), N_BATCHES=4, S3_BATCHES=2, REPEATS=1, S3_REPEATS=1)
    data = make_data(N_BATCHES)
    nbytes = sum(d.nbytes() for d in data)
    # under the storage root, on disk (a tmpfs /tmp would make "local disk" mean memory)
    os.makedirs(storage.root(), exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="minibatch-io-benchmark-", dir=storage.root()))
    try:
        paths = export_minibatches(data, str(root / "load"), BATCH)
        file_bytes = sum(os.path.getsize(p) for p in paths)
        report: dict[str, Any] = {
            **header("minibatch_io", zarr=zarr.__version__, dask=dask.__version__),
            "data": {
                "minibatches": N_BATCHES,
                "examples per minibatch": BATCH,
                "features": list(SHAPE),
                "tensor bytes": nbytes,
                "file bytes": file_bytes,
            },
            "load": bench_load(paths, file_bytes),
        }
        with SparkContext("local[2]", "minibatch-io-benchmark") as sc:
            report["export"] = bench_export(sc, root)
        report["zarr vs files"] = {
            "local disk (page cache)": bench_zarr(data, str(root / "zarr"), None, REPEATS),
            "s3 (moto on 127.0.0.1)": s3_zarr(data[:S3_BATCHES]),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_r, exp = report["load"], report["export"]
    for where in ("local disk", "page cache"):
        r = load_r[where]
        print(
            f"load from {where}: raw {r['GB/s']['raw read']:.2f} GB/s, dlscale {r['GB/s']['dlscale load']:.2f} GB/s, "
            f"load / raw = {r['load / raw']:.2f}"
        )
    print(f"target load / raw from local disk >= {TARGET}: {'met' if load_r['target']['met'] else 'missed'}")
    print(
        "export: "
        + ", ".join(f"{k} {v:.0f} MB/s" for k, v in exp["MB/s"].items())
        + f"; export / single process = {exp['export / single process']:.2f}"
    )
    for where, z in report["zarr vs files"].items():
        print(
            f"zarr vs files, {where}: "
            + ", ".join(f"{k} {v:.2f} GB/s" for k, v in z["GB/s"].items())
            + f"; zarr / files = {z['zarr / files']:.2f}"
        )
    write_results(args.out, report)


if __name__ == "__main__":
    sys.exit(main())
