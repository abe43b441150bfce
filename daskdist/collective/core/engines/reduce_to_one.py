"""The reduce-to-one all-reduce engine (``ReductionToOneDevice``): gather on a root, reduce, send back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from daskdist.collective.core import algorithms
from daskdist.collective.core.call import Call
from daskdist.collective.core.engines.base import PackPlan
from daskdist.collective.core.engines.direct import copy_of

__all__ = ["ReduceToOneEngine"]


class ReduceToOneEngine:
    """``algorithms.allreduce_reduce_to_one``: takes every pack, empty ones included (in place: borrowed packs are copied).

    Parameters
    ----------
    root
        The rank that reduces.
    accumulation_fn
        Optional sum of a list of arrays (TF's argument).
    """

    def __init__(self, root: int = 0, accumulation_fn: Callable[[Sequence[Any]], Any] | None = None):
        self.root = root
        self.accumulation_fn = accumulation_fn

    def accepts(self, plan: PackPlan) -> bool:
        return True

    def run(self, call: Call, plan: PackPlan) -> Any:
        buf = copy_of(plan.buffer) if plan.borrowed else plan.buffer
        return algorithms.allreduce_reduce_to_one(call, buf, plan.op, self.root, self.accumulation_fn)
