"""Who sends an update to whom: every node to every peer ("plain"), or along a tree that bounds each
node's fan-out ("mesh"), the two mesh build modes of DL4J's gradient sharing.

In a mesh, the tree is laid over the sorted live nodes (node ``i``'s parent is ``(i - 1) // fanout``,
its children ``i * fanout + 1`` to ``i * fanout + fanout``); an update leaves its origin for the
origin's tree neighbours and every node passes it on to its neighbours but the one it came from, so
it reaches each node once, over ``O(log_fanout(n))`` hops.
"""

from __future__ import annotations

from collections.abc import Sequence

MODES = ("plain", "mesh")


def neighbours(nodes: Sequence[str], me: str, mode: str, fanout: int) -> list[str]:
    """The nodes ``me`` exchanges updates with directly."""
    if mode == "plain":
        return [n for n in nodes if n != me]
    order = sorted(nodes)
    i = order.index(me)
    near = [order[(i - 1) // fanout]] if i else []
    return near + order[i * fanout + 1 : i * fanout + fanout + 1]


def targets(nodes: Sequence[str], me: str, mode: str, fanout: int, came_from: str | None) -> list[str]:
    """Where ``me`` sends an update it made (``came_from`` None) or received from ``came_from``."""
    if came_from is None:
        return neighbours(nodes, me, mode, fanout)
    if mode == "plain":
        return []  # the origin sent it to everyone
    return [n for n in neighbours(nodes, me, mode, fanout) if n != came_from]


class Seen:
    """The sequence numbers seen from one origin, in bounded memory: everything up to a watermark,
    and the few above it that arrived early (after a change of tree, an update can arrive twice)."""

    def __init__(self) -> None:
        self.watermark = -1
        self._above: set[int] = set()

    def add(self, seq: int) -> bool:
        """Record ``seq``; False if it was seen before."""
        if seq <= self.watermark or seq in self._above:
            return False
        self._above.add(seq)
        while self.watermark + 1 in self._above:
            self.watermark += 1
            self._above.discard(self.watermark)
        return True

    def __len__(self) -> int:
        return self.watermark + 1 + len(self._above)
