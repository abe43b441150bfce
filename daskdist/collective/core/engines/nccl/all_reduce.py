"""The NCCL all-reduce engine: all-reduces whose leaves are all GPU arrays, when the group has NCCL.

The ``NcclEngine`` (``engines.nccl.engine``) exists on every replica or on
none, set after the rendezvous; the chooser (``engines.choice``) decides
whether a plan takes it. Packs of a dtype NCCL cannot reduce go to the pack
engines.
"""

from __future__ import annotations

from typing import Any

from daskdist.collective.core.call import CollectiveCall
from daskdist.collective.core.engines.base import AllReducePlan, PackPlan
from daskdist.collective.core.engines.packed import PackedAllReduce

__all__ = ["NcclAllReduce"]


class NcclAllReduce:
    """All-reduce of a plan whose ``nccl`` is set: NCCL for the packs it reduces, the pack engines for the rest.

    Parameters
    ----------
    packed
        The pack engines, for packs of dtypes NCCL does not reduce.
    """

    def __init__(self, packed: PackedAllReduce):
        self.packed = packed

    def accepts(self, plan: AllReducePlan) -> bool:
        return plan.nccl is not None

    def run(self, call: CollectiveCall, plan: AllReducePlan) -> Any:
        nccl = plan.nccl
        assert nccl is not None, "run only after accepts"
        packed = plan.packed
        forced_ring = PackPlan.forces_ring(self.packed.algorithm_name, plan.options)
        on_nccl = []
        for index, p in enumerate(packed.packs):
            if nccl.reduces(p.buffer.dtype):
                on_nccl.append(p)
            else:
                self.packed.reduce_pack(call, index, p, PackPlan(p.buffer, plan.op, p.borrowed, forced_ring))
        if on_nccl:
            nccl.all_reduce(call, on_nccl, plan.op)
        return packed.unpack()
