"""``RDD.toDebugString``: an RDD's lineage in the layout of Spark's.

Each RDD keeps the name of the operation that made it and its parents. As in PySpark, a chain of
Python functions applied partition by partition (``map``, ``filter``, ...) is one ``PythonRDD``; a
persisted or checkpointed RDD ends the chain. Spark's class names stand for the other operations, a
shuffle starts an indented ``+-(n)`` block, and a persisted RDD shows its storage level and what it
holds, as Spark shows them.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from dlscale.facade import persist

if TYPE_CHECKING:
    from dlscale.facade.rdd import RDD

_PYTHON = "PythonRDD"
_SHUFFLED = "ShuffledRDD"
_KINDS = {
    "parallelize": "ParallelCollectionRDD",
    "range": "ParallelCollectionRDD",
    "empty": "EmptyRDD",
    "union": "UnionRDD",
    "coalesce": "CoalescedRDD",
    "partitionBy": _SHUFFLED,
    "repartition": _SHUFFLED,
    "cartesian": "CartesianRDD",
    "zip": "ZippedPartitionsRDD2",
    "textFile": "HadoopRDD",
    "pickleFile": "HadoopRDD",
    "binaryRecords": "HadoopRDD",
    "wholeTextFiles": "WholeTextFileRDD",
    "binaryFiles": "BinaryFileRDD",
}


def _kind(rdd: RDD) -> str:
    return _KINDS.get(rdd._operation, _PYTHON)


def _pipelined(rdd: RDD) -> bool:
    """Whether a Python function applied to ``rdd`` runs in the same ``PythonRDD`` (PySpark's rule)."""
    return _kind(rdd) == _PYTHON and rdd._stored is None and rdd._checkpoint_mark is None


def _bytes(size: int) -> str:
    """Spark's ``Utils.bytesToString``: 1 decimal, the largest binary unit the size is at least twice."""
    for unit, shift in (("EiB", 60), ("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 2 << shift:
            return f"{size / (1 << shift):.1f} {unit}"
    return f"{float(size):.1f} B"


class _Printer:
    def __init__(self, root: RDD) -> None:
        persisted = []
        stack, seen = [root], set()
        while stack:
            rdd = stack.pop()
            if id(rdd) not in seen:
                seen.add(id(rdd))
                persisted += [rdd] if rdd._stored is not None else []
                stack.extend(rdd._parents)
        self._info = {i.id: i for i in persist.storage_info(root.ctx, persisted)} if persisted else {}

    def _self(self, rdd: RDD) -> tuple[list[str], list[RDD]]:
        """The lines describing ``rdd`` (with the chain of Python functions it ends) and its parents."""
        ops = [rdd._operation]
        parents = rdd._parents
        if _kind(rdd) == _PYTHON:
            while len(parents) == 1 and _pipelined(parents[0]):
                ops.append(parents[0]._operation)
                parents = parents[0]._parents
        name = f"{rdd.name()} " if rdd.name() else ""
        level = str(rdd.getStorageLevel()) if rdd._stored is not None else ""
        lines = [f"{name}{_kind(rdd)}[{rdd.id()}] at {', '.join(reversed(ops))} [{level}]"]
        info = self._info.get(rdd.id()) if rdd._stored is not None else None
        if info is not None:
            lines.append(
                f"    CachedPartitions: {info.numCachedPartitions}; MemorySize: {_bytes(info.memSize)}; "
                f"DiskSize: {_bytes(info.diskSize)}"
            )
        return lines, list(parents)

    def _children(self, rdd: RDD, parents: list[RDD], prefix: str) -> list[str]:
        shuffle = _kind(rdd) == _SHUFFLED
        out = []
        for i, parent in enumerate(parents):
            last = i == len(parents) - 1
            out += self._shuffled(parent, prefix, last) if shuffle else self._narrow(parent, prefix)
        return out

    def _narrow(self, rdd: RDD, prefix: str) -> list[str]:
        lines, parents = self._self(rdd)
        return [prefix + line for line in lines] + self._children(rdd, parents, prefix)

    def _shuffled(self, rdd: RDD, prefix: str, last: bool) -> list[str]:
        count = f"({rdd.getNumPartitions()})"
        offset = (len(count) - 1) // 2
        this = re.sub(r"\|\s+$", "", prefix)
        nested = this + ("  " if last else "| ") + " " * offset + "|" + " " * (len(count) - offset)
        lines, parents = self._self(rdd)
        out = [f"{this}+-{count} {lines[0]}"] + [nested + line for line in lines[1:]]
        return out + self._children(rdd, parents, nested)

    def first(self, rdd: RDD) -> list[str]:
        count = f"({rdd.getNumPartitions()})"
        offset = (len(count) - 1) // 2
        nested = " " * offset + "|" + " " * (len(count) - offset)
        lines, parents = self._self(rdd)
        out = [f"{count} {lines[0]}"] + [f"{nested} {line}" for line in lines[1:]]
        return out + self._children(rdd, parents, nested)


def debug_string(rdd: RDD) -> str:
    """Implements :meth:`RDD.toDebugString` (as text)."""
    return "\n".join(_Printer(rdd).first(rdd))
