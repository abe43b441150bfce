"""The ring all-reduce engine: reduce-scatter then all-gather around the ring.

Each replica sends ``2 (size - 1) / size`` of the pack: bandwidth-optimal, and
the engine that takes every pack no other engine took. A borrowed pack (the
caller's array) is only read; the result goes to a buffer of the
communicator's pool. In a group that spans hosts the ring is pipelined
(``engines.pipeline``): chunks move in pieces (at most ``pipeline-bytes``,
at least ``pipeline-pieces`` per chunk), each reduced and forwarded while the
next is on the wire.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskdist.arrays import namespace
from daskdist.collective.core import algorithms
from daskdist.collective.core.buffers import BufferPool
from daskdist.collective.core.call import Call
from daskdist.collective.core.engines.base import PackPlan
from daskdist.collective.core.engines.pipeline import PieceSize, allreduce_ring_pipelined

__all__ = ["RingEngine"]


class RingEngine:
    """``algorithms.allreduce_ring``, into a pooled buffer when the pack is borrowed.

    Parameters
    ----------
    buffers
        Where results of borrowed numpy packs go (reused once the caller drops them).
    pieces
        The piece size of the pipelined ring (``PieceSize``), used for numpy
        packs when the group spans hosts; ``None``: the plain ring (one
        message per step).
    """

    def __init__(self, buffers: BufferPool, pieces: PieceSize | None = None):
        self.buffers = buffers
        self.pieces = pieces

    def accepts(self, plan: PackPlan) -> bool:
        return True

    def output_for(self, plan: PackPlan) -> Any:
        """Where the result goes: ``None`` (in place) unless the pack is borrowed."""
        if not plan.borrowed:
            return None
        buf = plan.buffer
        return self.buffers.empty_like(buf) if isinstance(buf, np.ndarray) else namespace(buf).empty_like(buf)

    def run(self, call: Call, plan: PackPlan) -> Any:
        out = self.output_for(plan)
        buf = plan.buffer
        if self.pieces is not None and isinstance(buf, np.ndarray):
            piece = self.pieces.elements(len(buf), call.size, buf.itemsize)
            return allreduce_ring_pipelined(call, buf, buf if out is None else out, plan.op, piece)
        return algorithms.allreduce_ring(call, buf, plan.op, out)
