"""The engine chooser: which engine runs each collective, decided from what every replica's signature says.

All-reduce (``all_reduce_engine``): a plan whose leaves a device engine takes
(``plan.nccl``, set by ``device_engine_for``) goes to the device all-reduce,
everything else to the packed path and its pack engines (the latency lane is
tried before, on its own cached plans). All-gather, reduce-scatter and
broadcast (``moving_engine_for``): the device engine when it takes every leaf
(and, for a reduction, reduces every dtype), else the generic engine. The
engine's ``tag`` goes into the signature, so replicas that would choose
differently raise ``CollectiveMismatchError`` before any data moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from daskdist.collective.core.engines.base import AllReducePlan, DeviceEngine, MovingEngine
from daskdist.collective.core.engines.generic import GENERIC
from daskdist.ops import CommunicationImplementation, CommunicationOptions, ReduceOp

__all__ = ["all_reduce_engine", "device_engine_for", "moving_engine_for"]


def device_engine_for(device: DeviceEngine | None, leaves: Sequence[Any], options: CommunicationOptions,
                      algorithm_allows: bool = True) -> DeviceEngine | None:
    """``device`` when a collective of ``leaves`` takes it, else ``None``.

    It takes every collective whose leaves are all arrays it accepts, unless
    the call asks for ``RING`` or the group's algorithm is not one the device
    library has (hierarchical, reduce-to-one and direct keep the generic
    engines).
    """
    if (device is None or not algorithm_allows or not leaves
            or options.implementation is CommunicationImplementation.RING):
        return None
    return device if all(device.accepts(leaf) for leaf in leaves) else None


def moving_engine_for(device: DeviceEngine | None, leaves: Sequence[Any], options: CommunicationOptions,
                      op: ReduceOp | None = None) -> MovingEngine:
    """The engine for an all-gather, broadcast or (with ``op``) reduce-scatter of ``leaves``."""
    chosen = device_engine_for(device, leaves, options)
    if chosen is None or (op is not None and not all(chosen.reduces(leaf.dtype) for leaf in leaves)):
        return GENERIC
    return chosen


def all_reduce_engine(plan: AllReducePlan, on_device: Any, packed: Any) -> Any:
    """``on_device`` (the device all-reduce) when ``plan.nccl`` is set, else ``packed`` (the pack engines)."""
    return on_device if plan.nccl is not None else packed
