"""The main job: ``python -m dlscale.demo`` runs the Spark-compatible facade on an embedded cluster.

It writes text files under ``demo`` in the storage root (``storage/data/demo`` in a checkout; or
``--storage``), counts words with a shuffle, joins against a broadcast table, persists torch tensors
serialized with spilling allowed, exports minibatches and reads them back from their paths with
prefetching, and prints what the cluster holds.
"""

from __future__ import annotations

import argparse
import operator
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from dlscale import SparkContext, StorageLevel, storage
from dlscale.data import (
    DataSet,
    DataSetLoader,
    export_minibatches,
    list_paths,
    prefetch,
)

_TEXT = """\
Deeplearning4j on Spark trains networks across a cluster with parameter averaging or gradient sharing.
dlscale does the same for PyTorch models on Dask, with the names Spark users already know.
Minibatches are exported once to shared storage and every epoch trains from their paths.
"""


def _embed(i: int) -> torch.Tensor:
    return torch.sin(torch.arange(4096, dtype=torch.float32) * (i + 1))


def _example(i: int) -> DataSet:
    x = _embed(i)[:16]
    return DataSet(x.unsqueeze(0), torch.tensor([int(x.sum() > 0)]))


def _count_examples(paths: Iterator[str]) -> Iterator[int]:
    return (ds.num_examples() for ds in prefetch(paths, DataSetLoader()))


def main(argv: list[str] | None = None) -> None:
    """Run the job and print a short report."""
    parser = argparse.ArgumentParser(prog="python -m dlscale.demo", description=__doc__)
    parser.add_argument("--master", default="local[2]", help="local[N], local[*] or tcp://host:port")
    parser.add_argument("--storage", default="demo", help="local directory for the job's files "
                        "(a relative one is under the storage root)")
    args = parser.parse_args(argv)

    root = Path(storage.resolve(args.storage)[0])
    shutil.rmtree(root, ignore_errors=True)
    (root / "text").mkdir(parents=True)
    for i in range(4):
        (root / "text" / f"doc-{i}.txt").write_text(_TEXT * (i + 1))

    start = time.perf_counter()
    with SparkContext(args.master, "dlscale-demo") as sc:
        print(f"cluster: {sc.master}, {sc.defaultParallelism} worker threads, dashboard {sc.uiWebUrl}")
        lines = sc.textFile(str(root / "text"), minPartitions=4)
        counts = (
            lines.flatMap(str.split)
            .map(lambda w: (w.strip(".,").lower(), 1))
            .reduceByKey(operator.add)
            .sortBy(lambda kv: (-kv[1], kv[0]))
        )
        print(f"{lines.count()} lines in {lines.getNumPartitions()} partitions; top words: {counts.take(5)}")
        counts.saveAsTextFile(str(root / "word-counts"))

        stop_words = sc.broadcast({"the", "and", "with", "on", "for", "a", "of", "to", "are", "or"})
        content = counts.filter(lambda kv: kv[0] not in stop_words.value)
        print(f"most frequent content word: {content.first()}")

        vectors = sc.range(256, numSlices=8).map(lambda i: (i % 4, _embed(i)))
        vectors.persist(StorageLevel.MEMORY_AND_DISK_SER)
        means = vectors.mapValues(lambda t: (t, 1)).reduceByKey(lambda a, b: (a[0] + b[0], a[1] + b[1]))
        norms = {k: round(float((s / n).norm()), 4) for k, (s, n) in means.collect()}
        print(f"norms of the per-key mean vectors: {norms}")
        for info in sc.getRDDStorageInfo():
            print(
                f"persisted RDD {info.id}: {info.storageLevel}, {info.numCachedPartitions}/{info.numPartitions} "
                f"partitions, {info.memSize / 2**20:.1f} MiB in memory, {info.diskSize / 2**20:.1f} MiB on disk"
            )
        vectors.unpersist()

        examples = sc.range(1000, numSlices=3).map(_example)
        paths = export_minibatches(examples, str(root / "minibatches"), batch_size=64)
        counts = list_paths(sc, str(root / "minibatches")).mapPartitions(_count_examples).collect()
        print(f"exported 1000 examples as {len(paths)} minibatch files; read back from their paths: {counts}")
    print(f"done in {time.perf_counter() - start:.1f} s; word counts in {root / 'word-counts'}")


if __name__ == "__main__":
    main()
