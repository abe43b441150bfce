"""The NCCL all-reduce engine: collectives whose leaves are all GPU arrays, when the group has NCCL.

The ``NcclEngine`` (``daskdist.collective.nccl``) exists on every replica or on
none, set after the rendezvous. A collective takes it when every leaf is a GPU
array it accepts and the implementation is ``AUTO`` or ``NCCL``; ``RING`` and
the algorithms that are not NCCL's (hierarchical, reduce-to-one, direct) keep
the generic engines. The choice is written into the signature, so replicas
that would take different paths raise ``CollectiveMismatchError`` before any
data moves. Packs of a dtype NCCL cannot reduce go to the pack engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from daskdist.collective.call import CollectiveCall
from daskdist.collective.engines.base import AllReducePlan, PackPlan
from daskdist.collective.engines.packed import PackedAllReduce
from daskdist.collective.nccl import NcclEngine
from daskdist.ops import CommunicationImplementation, CommunicationOptions

__all__ = ["NcclAllReduce", "nccl_for"]


def nccl_for(nccl: NcclEngine | None, leaves: Sequence[Any], options: CommunicationOptions,
             algorithm_allows: bool = True) -> NcclEngine | None:
    """``nccl`` (an ``NcclEngine``) when a collective of ``leaves`` takes it, else ``None``."""
    if (nccl is None or not algorithm_allows or not leaves
            or options.implementation is CommunicationImplementation.RING):
        return None
    return nccl if all(nccl.accepts(leaf) for leaf in leaves) else None


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
