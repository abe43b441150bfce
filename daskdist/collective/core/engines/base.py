"""What the all-reduce engines share: the plans they are chosen by and the ``Engine`` protocol.

``Communicator.all_reduce`` follows TensorFlow's ``reduce`` →
``reduce_implementation`` shape: it validates the value into an
``AllReducePlan`` (flattened leaves, checked dtypes, merged options), returns
a copy when the group has one replica, and otherwise hands the plan to the
first engine that accepts it:

* the latency lane (``engines.lane``): one small CPU array among replicas that
  share a host, written once into each peer's shared-memory channel;
* the NCCL engine (``engines.nccl.all_reduce``): GPU arrays, when the whole group has NCCL;
* the packed path (``engines.packed``): everything else, pack by pack, each
  pack going to the first pack engine (``PackPlan``) that accepts it: direct,
  ring, hierarchical, reduce-to-one or single-copy.

An engine's choice depends only on what every replica's signature says (op,
structure, shapes, dtypes, options, the group's algorithm), so replicas that
agree on the signature agree on the engine, and replicas that do not raise
``CollectiveMismatchError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from daskdist.collective.core.packing import PackedStructure, flatten, pack, signature
from daskdist.collective.core.reduction import check_dtype
from daskdist.ops import CommunicationImplementation, CommunicationOptions, ReduceOp

__all__ = ["AllReducePlan", "DeviceEngine", "Engine", "MovingEngine", "PackPlan"]


class MovingEngine(Protocol):
    """An engine for the collectives that move leaves whole: all-gather, reduce-scatter, broadcast.

    Each returns the result leaves in the order of ``leaves`` (the caller
    restores the structure). ``tag`` is what the engine adds to the
    collective's signature, so replicas that would take different engines
    disagree before any data moves.
    """

    tag: str

    def all_gather(self, call: Any, leaves: Sequence[Any], axes: Sequence[int]) -> list[Any]:
        """Each leaf concatenated from all replicas along its axis (rank order)."""

    def reduce_scatter(self, call: Any, leaves: Sequence[Any], op: ReduceOp, axis: int) -> list[Any]:
        """Each leaf reduced across replicas; this replica's part along ``axis``."""

    def broadcast(self, call: Any, leaves: Sequence[Any], root: int) -> list[Any]:
        """``root``'s leaves on every replica."""


class DeviceEngine(MovingEngine, Protocol):
    """A device library's engine for GPU arrays (NCCL's ``NcclEngine``): the moving collectives and all-reduce."""

    def accepts(self, array: Any) -> bool:
        """Whether ``array`` can go through this engine (it is an array of its device)."""

    def reduces(self, dtype: Any) -> bool:
        """Whether this engine can reduce ``dtype`` (else the generic algorithms do)."""

    def all_reduce(self, call: Any, packs: Sequence[Any], op: ReduceOp) -> None:
        """All-reduce each pack; each pack's ``buffer`` becomes its result."""

    def set_attempt(self, attempt: int) -> None:
        """The group's ``attempt`` (failed commands so far) starts."""

    def close(self) -> None:
        """Release the device library's communicator (local; never waits for peers)."""


class AllReducePlan:
    """One validated all-reduce: its op, options, leaves and (computed once, when asked) signature and packs.

    Parameters
    ----------
    op
        The reduction.
    value
        What the caller passed (any structure of arrays).
    options
        The group's options merged with the call's.
    call_options
        The call's own options (the lane caches its plans by them).
    num_packs
        Packs per dtype (the group's ``Algorithm.num_packs``).
    allocate
        How packs get their memory (the communicator's buffer pool).
    in_place
        The result may go into ``value``'s own memory (a contiguous array that
        is a pack by itself is reduced where it lies; see ``packing.pack``).
    """

    __slots__ = ("_packed", "_sig", "allocate", "bare_array", "call_options", "in_place", "leaves", "nccl",
                 "num_packs", "op", "options", "restore", "treedef")

    def __init__(self, op: ReduceOp | str, value: Any, options: CommunicationOptions,
                 call_options: CommunicationOptions | None, num_packs: int,
                 allocate: Callable[..., Any] | None = None, in_place: bool = False):
        self.op = ReduceOp.from_any(op)
        self.in_place = in_place
        self.options = options
        self.call_options = call_options
        self.num_packs = num_packs
        self.allocate = allocate
        self.bare_array = False  # the value was one bare numpy array (the lane already looked at it)
        self.leaves, self.treedef, self.restore = flatten(value)
        for leaf in self.leaves:
            check_dtype(self.op, leaf.dtype)
        self.nccl: DeviceEngine | None = None  # when this collective goes over NCCL (named in the signature)
        self._sig: str | None = None
        self._packed: PackedStructure | None = None

    @property
    def sig(self) -> str:
        """The signature every replica must pass (computed once)."""
        if self._sig is None:
            options = self.options
            detail = f"{self.op.name} packs={options.bytes_per_pack}/{self.num_packs} {options.implementation.name}"
            if self.nccl is not None:
                detail += " nccl"  # replicas that would take different paths disagree before any data moves
            self._sig = signature("all_reduce", detail, self.leaves, self.treedef)
        return self._sig

    @property
    def packed(self) -> PackedStructure:
        """The leaves fused into flat packs (a single leaf is borrowed, not copied; computed once)."""
        if self._packed is None:
            self._packed = pack(self.leaves, self.treedef, self.restore, self.options.bytes_per_pack,
                                self.num_packs, borrow=True, allocate=self.allocate, in_place=self.in_place)
        return self._packed

    def single_leaf(self) -> bool:
        """Whether the value is one array (a number, a numpy scalar, a CPU DLPack tensor, an array)."""
        return self.treedef.num_nodes == 1 and len(self.leaves) == 1


class PackPlan:
    """One flat pack of an all-reduce, as the pack engines see it.

    Parameters
    ----------
    buffer
        The flat 1-D pack.
    op
        The reduction.
    borrowed
        ``buffer`` is the caller's memory: an engine reads it and writes its
        result elsewhere.
    forced_ring
        The group's algorithm is ``ring``, or the call's implementation is not
        ``AUTO``: the automatic choices (direct for small packs, hierarchical,
        single-copy) are off.
    """

    __slots__ = ("borrowed", "buffer", "forced_ring", "op")

    def __init__(self, buffer: Any, op: ReduceOp, borrowed: bool, forced_ring: bool):
        self.buffer = buffer
        self.op = op
        self.borrowed = borrowed
        self.forced_ring = forced_ring

    @staticmethod
    def forces_ring(algorithm_name: str, options: CommunicationOptions) -> bool:
        return algorithm_name == "ring" or options.implementation is not CommunicationImplementation.AUTO


class Engine(Protocol):
    """An all-reduce engine for packs: ``accepts`` decides from the plan alone, ``run`` reduces it."""

    def accepts(self, plan: PackPlan) -> bool:
        """Whether this engine takes ``plan`` (decided alike on every replica)."""

    def run(self, call: Any, plan: PackPlan) -> Any:
        """All-reduce ``plan.buffer`` within ``call``; returns the result (``plan.buffer`` or a new array)."""
