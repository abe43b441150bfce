"""The hierarchical all-reduce engine: within each host, then across hosts, then back.

Inside a host the replicas use shared memory. Across hosts, where every host
has the same number of replicas (``collective.hierarchical-senders: all``,
the default), each of a host's replicas owns one slice of the buffer and
carries it across on its own connection; otherwise (or with ``first``) only
each host's first replica sends across, one connection per host pair.
Pipelined piece by piece (``engines.pipeline``), so the in-host reduce and
broadcast run under the cross-host transfers. The group's algorithm when it
is ``hierarchical`` (``HierarchicalCopyAllReduce``), and AUTO's choice for
packs above ``small-message-bytes`` when the ranks span several hosts and
some share one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from daskdist import config
from daskdist.collective.core import algorithms
from daskdist.collective.core.buffers import BufferPool
from daskdist.collective.core.call import Call
from daskdist.collective.core.engines.base import PackPlan
from daskdist.collective.core.engines.direct import copy_of
from daskdist.collective.core.engines.pipeline import PieceSize, allreduce_hierarchical_pipelined, slice_width

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
    all_senders
        Every replica of a host carries a slice across hosts (where the hosts' replica counts allow);
        ``None``: ``collective.hierarchical-senders`` is ``all``.
    """

    def __init__(self, hosts: Sequence[str], automatic: bool = False, buffers: BufferPool | None = None,
                 pieces: PieceSize | None = None, all_senders: bool | None = None):
        self.hosts = list(hosts)
        self.automatic = automatic
        self.buffers = buffers or BufferPool()
        self.pieces = pieces or PieceSize(8 << 20)
        self.ring_size = len(set(self.hosts))  # the cross-host ring: one member per host
        if all_senders is None:
            senders = str(config.get("collective.hierarchical-senders"))
            if senders not in ("all", "first"):
                raise ValueError(f"daskdist.collective.hierarchical-senders must be 'all' or 'first', not {senders!r}")
            all_senders = senders == "all"
        self.slice_width = slice_width(self.hosts) if all_senders else 1  # slices per buffer, each host alike

    def accepts(self, plan: PackPlan) -> bool:
        return not (self.automatic and plan.forced_ring)

    def run(self, call: Call, plan: PackPlan) -> Any:
        buf = plan.buffer
        if isinstance(buf, np.ndarray):
            out = self.buffers.empty_like(buf) if plan.borrowed else None
            slices = self.slice_width if len(buf) >= self.slice_width * self.ring_size else 1
            piece = self.pieces.elements(-(-len(buf) // slices), self.ring_size, buf.itemsize)
            lead = self.pieces.lead(piece, buf.itemsize)
            return allreduce_hierarchical_pipelined(call, buf, plan.op, self.hosts, piece, out, lead, slices)
        buf = copy_of(buf) if plan.borrowed else buf
        return algorithms.allreduce_hierarchical(call, buf, plan.op, self.hosts)
