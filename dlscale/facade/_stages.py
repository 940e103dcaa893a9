"""A job's stages as Spark's DAG scheduler cuts them, for the status tracker and ``TaskContext.stageId``.

Dask runs an action's whole graph at once, but Spark runs a job as stages, cut at every shuffle in the
lineage of the RDD the action computes: each shuffle's map side (the RDDs computed before it, up to the
shuffles before those) is a shuffle map stage, and the rest is the result stage, the last. An RDD made
by a shuffle (``partitionBy``, and so ``reduceByKey``, ``groupByKey``, ``join`` ... unless the RDD is
already partitioned alike, and ``repartition``) marks the cut: its map side is the stage before, its
read side belongs to the stage that uses it. As in Spark, a checkpointed RDD ends the lineage, and a
persisted one does not (Spark lists the stages before it, which it skips).

A stage's tasks are told by the graph layers they compute: each RDD's layer (its bag's name), and a
shuffle's split and pick layers, which belong to its map stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dlscale.facade.rdd import RDD

SPLIT_SUFFIXES = ("-split", "-pick")  # a shuffle's map-side layers: its name and these (see _graph.shuffle)


@dataclass
class StagePlan:
    """A job's stages, the result stage last: ``names`` by stage, and ``layers``, the stage of each graph
    layer computed in a stage before the result stage (every other layer is the result stage's)."""

    names: list[str]
    layers: dict[str, int] = field(default_factory=dict)


class _Planner:
    def __init__(self) -> None:
        self.names: list[str] = []
        self.layers: dict[str, int] = {}
        self.map_stages: dict[int, int] = {}  # id() of a shuffled RDD -> the stage of its map side

    def stage(self, tops: list[RDD], name: str) -> int:
        """The stage that computes ``tops`` (after the stages it reads from, whose numbers are lower)."""
        members: list[RDD] = []
        shuffled: list[RDD] = []
        stack, seen = list(tops), set()
        while stack:
            rdd = stack.pop()
            if id(rdd) in seen:
                continue
            seen.add(id(rdd))
            members.append(rdd)
            if rdd._checkpointed:  # read from its checkpoint (a local one too, whose lineage Spark drops)
                continue
            if rdd._shuffle_site is not None:
                shuffled.append(rdd)  # read here; its map side is a stage of its own
            else:
                stack.extend(rdd._parents)
        for rdd in shuffled:
            if id(rdd) not in self.map_stages:
                index = self.map_stages[id(rdd)] = self.stage(list(rdd._parents), rdd._shuffle_site)
                for suffix in SPLIT_SUFFIXES:
                    self.layers.setdefault(rdd._plan.name + suffix, index)
        index = len(self.names)
        self.names.append(name)
        for rdd in members:
            self.layers.setdefault(rdd._plan.name, index)  # a layer two stages share is computed once, in the first
        return index


def plan(rdd: RDD | None, name: str) -> StagePlan:
    """The stages of a job that computes ``rdd``, its result stage named ``name`` (one stage without an RDD)."""
    if rdd is None:
        return StagePlan([name])
    planner = _Planner()
    result = planner.stage([rdd], name)
    return StagePlan(planner.names, {layer: s for layer, s in planner.layers.items() if s != result})
