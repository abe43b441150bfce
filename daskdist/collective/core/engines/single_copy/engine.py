"""The single-copy all-reduce engine: replicas on one host read each other's packs in place.

AUTO's choice for numpy packs of at least ``collective.single-copy-bytes`` when
every peer shares the replica's host (``daskdist.collective.core.engines.single_copy.all_reduce``).
Whether every replica can read every other is probed once, together, on the
first candidate pack; where it cannot, the ring takes the pack.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskdist.collective.core import algorithms
from daskdist.collective.core.call import Call
from daskdist.collective.core.engines.base import PackPlan
from daskdist.collective.core.engines.ring import RingEngine
from daskdist.collective.core.engines.single_copy.all_reduce import SingleCopyAllReduce

__all__ = ["SingleCopyEngine"]


class SingleCopyEngine:
    """``SingleCopyAllReduce`` for large numpy packs, falling back to ``ring`` where the probe says no.

    Parameters
    ----------
    single_copy
        The communicator's single-copy all-reduce (probe state, scratch buffers).
    ring
        The ring engine: where the result goes, and the fallback.
    """

    def __init__(self, single_copy: SingleCopyAllReduce, ring: RingEngine):
        self.single_copy = single_copy
        self.ring = ring

    def accepts(self, plan: PackPlan) -> bool:
        return (not plan.forced_ring and isinstance(plan.buffer, np.ndarray)
                and self.single_copy.wants(plan.buffer.nbytes))

    def run(self, call: Call, plan: PackPlan) -> Any:
        single = self.single_copy
        buf = plan.buffer
        out = self.ring.output_for(plan)
        if single.probe(call) and buf.nbytes >= single.min_bytes:
            return single.allreduce(call, buf, plan.op, out)
        return algorithms.allreduce_ring(call, buf, plan.op, out)
