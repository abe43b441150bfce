"""The collectives besides all-reduce: all-gather, reduce-scatter, broadcast, object gather, barrier.

Each validates its value, answers at once in a group of one, asks the engine
chooser (``engines.choice.moving_engine_for``) for its engine, writes a
signature (with the engine's ``tag``) and runs on the communicator as one
``CollectiveCall``: the device engine (NCCL) for GPU leaves when the group has
it, else the generic engine (``engines.generic``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, Protocol

import cloudpickle
import optree

from daskdist.arrays import describe
from daskdist.collective.core import algorithms
from daskdist.collective.core.call import CollectiveCall
from daskdist.collective.core.engines.base import DeviceEngine
from daskdist.collective.core.engines.choice import moving_engine_for
from daskdist.collective.core.engines.direct import copy_of
from daskdist.collective.core.packing import flatten, signature
from daskdist.collective.core.reduction import check_dtype
from daskdist.ops import CommunicationOptions, ReduceOp

__all__ = ["Host", "all_gather", "all_gather_objects", "barrier", "broadcast", "reduce_scatter"]


class Host(Protocol):
    """What these collectives need of the communicator."""

    rank: int
    size: int
    options: CommunicationOptions
    nccl: DeviceEngine | None

    def run_collective(self, kind: str, sig: str, options: CommunicationOptions,
                       body: Callable[[CollectiveCall], Any]) -> Any: ...


def all_gather(comm: Host, value: Any, axis: int, options: CommunicationOptions | None = None) -> Any:
    """Concatenate each leaf of ``value`` from all replicas along ``axis`` (rank order)."""
    options = comm.options.merge(options)
    leaves, treedef, restore = flatten(value)
    axes = []
    for leaf in leaves:
        if leaf.ndim == 0:
            raise ValueError("all_gather needs arrays with at least one dimension; got a 0-d array")
        if not -leaf.ndim <= axis < leaf.ndim:
            raise ValueError(f"all_gather axis {axis} is out of range for {describe(leaf)}")
        axes.append(axis % leaf.ndim)
    if comm.size == 1:
        return optree.tree_unflatten(treedef, [back(leaf) for leaf, back in zip(leaves, restore)])
    shapes = ", ".join(
        f"{leaf.dtype}[{','.join('*' if i == a else str(d) for i, d in enumerate(leaf.shape))}]"
        for leaf, a in zip(leaves, axes)
    )
    engine = moving_engine_for(comm.nccl, leaves, options)
    sig = f"all_gather axis={axis} | structure {treedef} | leaves [{shapes}]{engine.tag}"

    def run(call: CollectiveCall) -> Any:
        gathered = engine.all_gather(call, leaves, axes)
        return optree.tree_unflatten(treedef, [back(x) for x, back in zip(gathered, restore)])

    return comm.run_collective("all_gather", sig, options, run)

def reduce_scatter(comm: Host, op: ReduceOp | str, value: Any, axis: int = 0,
                   options: CommunicationOptions | None = None) -> Any:
    """Reduce ``value`` across replicas and return this replica's part of it along ``axis``.

    Each leaf is split along ``axis`` into ``num_replicas`` nearly equal
    parts, as ``numpy.array_split`` does; replica ``r`` gets part ``r``.
    """
    op = ReduceOp.from_any(op)
    options = comm.options.merge(options)
    leaves, treedef, restore = flatten(value)
    for leaf in leaves:
        check_dtype(op, leaf.dtype)
        if leaf.ndim == 0 or not -leaf.ndim <= axis < leaf.ndim:
            raise ValueError(f"reduce_scatter axis {axis} is out of range for {describe(leaf)}")
    if comm.size == 1:
        return optree.tree_unflatten(treedef, [back(copy_of(x)) for x, back in zip(leaves, restore)])
    engine = moving_engine_for(comm.nccl, leaves, options, op)
    sig = signature("reduce_scatter", f"{op.name} axis={axis}", leaves, treedef) + engine.tag

    def run(call: CollectiveCall) -> Any:
        parts = engine.reduce_scatter(call, leaves, op, axis)
        return optree.tree_unflatten(treedef, [back(x) for x, back in zip(parts, restore)])

    return comm.run_collective("reduce_scatter", sig, options, run)

def broadcast(comm: Host, value: Any, root: int = 0, options: CommunicationOptions | None = None) -> Any:
    """Return ``root``'s ``value`` on every replica (structures must match)."""
    options = comm.options.merge(options)
    leaves, treedef, restore = flatten(value)
    if comm.size == 1:
        return value
    engine = moving_engine_for(comm.nccl, leaves, options)
    sig = signature("broadcast", f"root={root}", leaves, treedef) + engine.tag

    def run(call: CollectiveCall) -> Any:
        received = engine.broadcast(call, leaves, root)
        return optree.tree_unflatten(treedef, [back(x) for x, back in zip(received, restore)])

    return comm.run_collective("broadcast", sig, options, run)

def all_gather_objects(comm: Host, obj: Any, options: CommunicationOptions | None = None) -> list[Any]:
    """Gather any picklable object from every replica, in rank order."""
    options = comm.options.merge(options)
    if comm.size == 1:
        return [obj]
    data = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    def run(call: CollectiveCall) -> list[Any]:
        gathered = algorithms.allgather_direct(call, [data])
        return [obj if r == comm.rank else pickle.loads(part[0]) for r, part in enumerate(gathered)]

    gathered: list[Any] = comm.run_collective("all_gather_objects", "all_gather_objects", options, run)
    return gathered

def barrier(comm: Host, options: CommunicationOptions | None = None) -> None:
    """Return once every replica has reached this barrier."""
    options = comm.options.merge(options)
    if comm.size == 1:
        return

    def run(call: CollectiveCall) -> None:
        algorithms.allgather_direct(call, [])

    comm.run_collective("barrier", "barrier", options, run)
