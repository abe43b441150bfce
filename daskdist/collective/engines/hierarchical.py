"""The hierarchical all-reduce engine: within each host, then across hosts' first replicas, then back.

Only one replica per host sends across the network. The group's algorithm
when it is ``hierarchical`` (``HierarchicalCopyAllReduce``), and AUTO's choice
for packs above ``small-message-bytes`` when the ranks span several hosts and
some share one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from daskdist.collective import algorithms
from daskdist.collective.call import Call
from daskdist.collective.engines.base import PackPlan
from daskdist.collective.engines.direct import copy_of

__all__ = ["HierarchicalEngine"]


class HierarchicalEngine:
    """``algorithms.allreduce_hierarchical`` (in place: a borrowed pack is copied first).

    Parameters
    ----------
    hosts
        The host of each rank.
    automatic
        ``True``: AUTO's choice, not taken when the ring is forced;
        ``False``: the group asked for it, every pack.
    """

    def __init__(self, hosts: Sequence[str], automatic: bool = False):
        self.hosts = list(hosts)
        self.automatic = automatic

    def accepts(self, plan: PackPlan) -> bool:
        return not (self.automatic and plan.forced_ring)

    def run(self, call: Call, plan: PackPlan) -> Any:
        buf = copy_of(plan.buffer) if plan.borrowed else plan.buffer
        return algorithms.allreduce_hierarchical(call, buf, plan.op, self.hosts)
