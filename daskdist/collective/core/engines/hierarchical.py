"""The hierarchical all-reduce engine: within each host, then across hosts' first replicas, then back.

Only one replica per host sends across the network, on one connection per
host pair; inside a host the replicas use shared memory. Pipelined piece by
piece (``engines.pipeline``), so the in-host reduce and broadcast run under
the cross-host transfers. The group's algorithm when it is ``hierarchical``
(``HierarchicalCopyAllReduce``), and AUTO's choice for packs above
``small-message-bytes`` when the ranks span several hosts and some share one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from daskdist.collective.core import algorithms
from daskdist.collective.core.buffers import BufferPool
from daskdist.collective.core.call import Call
from daskdist.collective.core.engines.base import PackPlan
from daskdist.collective.core.engines.direct import copy_of
from daskdist.collective.core.engines.pipeline import PieceSize, allreduce_hierarchical_pipelined

__all__ = ["HierarchicalEngine"]


class HierarchicalEngine:
    """``allreduce_hierarchical_pipelined`` for numpy packs (a borrowed one is only read), else the plain one.

    Parameters
    ----------
    hosts
        The host of each rank.
    automatic
        ``True``: AUTO's choice, not taken when the ring is forced;
        ``False``: the group asked for it, every pack.
    buffers
        Where results of borrowed numpy packs go.
    pieces
        The piece size (``PieceSize``: ``collective.pipeline-bytes``, ``-pieces``, ``-min-bytes``);
        ``None``: pieces of 8 MiB.
    """

    def __init__(self, hosts: Sequence[str], automatic: bool = False, buffers: BufferPool | None = None,
                 pieces: PieceSize | None = None):
        self.hosts = list(hosts)
        self.automatic = automatic
        self.buffers = buffers or BufferPool()
        self.pieces = pieces or PieceSize(8 << 20)
        self.ring_size = len(set(self.hosts))  # the cross-host ring: one member per host

    def accepts(self, plan: PackPlan) -> bool:
        return not (self.automatic and plan.forced_ring)

    def run(self, call: Call, plan: PackPlan) -> Any:
        buf = plan.buffer
        if isinstance(buf, np.ndarray):
            out = self.buffers.empty_like(buf) if plan.borrowed else None
            piece = self.pieces.elements(len(buf), self.ring_size, buf.itemsize)
            lead = self.pieces.lead(piece, buf.itemsize)
            return allreduce_hierarchical_pipelined(call, buf, plan.op, self.hosts, piece, out, lead)
        buf = copy_of(buf) if plan.borrowed else buf
        return algorithms.allreduce_hierarchical(call, buf, plan.op, self.hosts)
