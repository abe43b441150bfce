"""The generic engine for the collectives that move leaves whole, over any transport.

All-gather and broadcast are direct exchanges (``algorithms.allgather_direct``,
``algorithms.broadcast_direct``); reduce-scatter is the ring's first half
(``algorithms.reducescatter_ring``) on each leaf, split along its axis as
``numpy.array_split`` splits. The chooser (``engines.choice``) gives these
collectives to this engine whenever no device engine takes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from daskdist.arrays import namespace
from daskdist.collective.core import algorithms
from daskdist.collective.core.call import CollectiveCall
from daskdist.ops import ReduceOp

__all__ = ["GENERIC", "GenericMoving"]


class GenericMoving:
    """All-gather, reduce-scatter and broadcast with the generic algorithms (any array library, any transport)."""

    tag = ""  # the generic path adds nothing to a signature

    def all_gather(self, call: CollectiveCall, leaves: Sequence[Any], axes: Sequence[int]) -> list[Any]:
        """Each leaf concatenated from all replicas along its axis (rank order)."""
        gathered = algorithms.allgather_direct(call, list(leaves))
        return [namespace(leaf).concatenate([part[i] for part in gathered], axis=axis)
                for i, (leaf, axis) in enumerate(zip(leaves, axes))]

    def reduce_scatter(self, call: CollectiveCall, leaves: Sequence[Any], op: ReduceOp, axis: int) -> list[Any]:
        """Each leaf reduced across replicas over the ring; this replica's part along ``axis``."""
        size, rank = call.size, call.rank
        out = []
        for index, leaf in enumerate(leaves):
            call.part = f"l{index}/"
            xp = namespace(leaf)
            moved = xp.moveaxis(leaf, axis, 0)
            rows = moved.shape[0]
            starts = [0]
            for length in (len(part) for part in xp.array_split(xp.empty(rows), size)):
                starts.append(starts[-1] + length)
            row_size = int(moved[0].size) if rows else 0
            buf = xp.ascontiguousarray(moved).reshape(-1).copy()
            mine = algorithms.reducescatter_ring(call, buf, op, [s * row_size for s in starts])
            part = mine.reshape((starts[rank + 1] - starts[rank],) + moved.shape[1:])
            out.append(xp.moveaxis(part, 0, axis))
        return out

    def broadcast(self, call: CollectiveCall, leaves: Sequence[Any], root: int) -> list[Any]:
        """``root``'s leaves on every replica (a direct send from ``root``)."""
        return list(algorithms.broadcast_direct(call, list(leaves), root))


#: The one generic engine (it holds no state).
GENERIC = GenericMoving()
