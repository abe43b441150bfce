"""The direct all-reduce engine: one hop, every replica sends its pack to every other.

Latency-optimal (one message delay), ``size - 1`` times the ring's bytes: the
group's algorithm when it is ``direct``, and AUTO's choice for packs of at most
``daskdist.collective.small-message-bytes``. Also holds ``EmptyEngine``, which
answers empty packs without a message.
"""

from __future__ import annotations

from typing import Any

from daskdist.arrays import namespace
from daskdist.collective.core import algorithms
from daskdist.collective.core.call import Call
from daskdist.collective.core.engines.base import PackPlan

__all__ = ["DirectEngine", "EmptyEngine", "copy_of"]


def copy_of(array: Any) -> Any:
    """A copy of ``array`` in its own array library."""
    return namespace(array).array(array, copy=True)


class DirectEngine:
    """``algorithms.allreduce_direct``; with ``max_bytes`` only for packs of at most that many bytes.

    Parameters
    ----------
    max_bytes
        ``None``: every pack (the group asked for ``direct``); else AUTO's
        limit, and never when the ring is forced.
    """

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = max_bytes

    def accepts(self, plan: PackPlan) -> bool:
        if self.max_bytes is None:
            return True
        return not plan.forced_ring and plan.buffer.nbytes <= self.max_bytes

    def run(self, call: Call, plan: PackPlan) -> Any:
        return algorithms.allreduce_direct(call, plan.buffer, plan.op)  # reads the pack, writes a new array


class EmptyEngine:
    """An empty pack needs no message: it is its own result."""

    def accepts(self, plan: PackPlan) -> bool:
        return bool(plan.buffer.size == 0)

    def run(self, call: Call, plan: PackPlan) -> Any:
        return copy_of(plan.buffer) if plan.borrowed else plan.buffer
