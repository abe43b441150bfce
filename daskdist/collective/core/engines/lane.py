"""The latency lane engine: all-reduce of one small array among replicas that share a host.

A training step's small all-reduces (a loss, a metric, a batch-norm
statistic) are dominated by per-call work, not by bytes. When every peer of
a replica is reached through shared memory and the value is one array of at
most ``daskdist.collective.small-message-bytes`` (with two replicas: at most
one channel slot, ``collective.shm.slot-bytes``, since then the one-hop
exchange moves as many bytes as the ring, in one step; with more replicas
than cores: half a slot, since every ring step waits for descheduled peers),
``all_reduce`` takes this lane instead of the general machinery (flatten, pack, a separate
signature message, a ``CollectiveCall``):

* a plan per (op, shape, dtype) is built once and holds the signature, the
  ready header fields and the ufunc;
* each replica writes its array once into each peer's channel, with its
  signature beside the header (no separate signature message), and reduces
  the peers' arrays straight from the channel slots in rank order, so every
  replica gets bit-identical results, exactly as ``allreduce_direct``;
* a peer that passed something else is detected from the first message of
  the same collective (its signature, or the general path's signature
  message), and every replica raises ``CollectiveMismatchError``; timeouts,
  aborts and stall warnings behave as on the general path.

A structure whose leaves fuse into a single pack (a list of gradients of one
dtype) takes the lane too, with the pack as its array and the structure's
signature.

Both lanes give the same results; replicas that disagree about the lane
disagree about the signature, which is what the mismatch check catches.

The lane reaches the transport only through ``ShmTransport.lane()``
(``ShmLane``), and the communicator only through ``LaneHost``: it takes its
collective number from ``next_collective`` and registers with
``begin_tracking`` only once it has to wait.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import optree

from daskdist.collective.core.buffers import BufferPool
from daskdist.collective.core.engines.base import AllReducePlan
from daskdist.collective.core.packing import signature
from daskdist.collective.core.reduction import check_dtype, finalize
from daskdist.collective.mailbox import MailboxTimeout
from daskdist.collective.transport.framing import ARRAY, MAX_NDIM, dtype_text
from daskdist.collective.transport.shm import lane_header
from daskdist.collective.transport.shm_lane import LaneMismatch, ShmLane
from daskdist.exceptions import CollectiveMismatchError, CollectiveTimeoutError
from daskdist.ops import CommunicationImplementation, CommunicationOptions, ReduceOp, timeout_of

__all__ = ["LaneCall", "LaneEngine", "LaneHost"]

_UFUNC_NAMES = {ReduceOp.SUM: "add", ReduceOp.MEAN: "add", ReduceOp.MAX: "maximum", ReduceOp.MIN: "minimum",
                ReduceOp.PRODUCT: "multiply"}
_PLANS_KEPT = 1024
_monotonic = time.monotonic  # bound once: the lane's whole call costs about 12 µs


class LaneHost(Protocol):
    """What the lane needs of the communicator."""

    rank: int
    size: int
    attempt: int
    run_id: int
    small_message_bytes: int
    default_timeout: float
    options: CommunicationOptions
    algorithm: Any
    buffers: BufferPool
    on_collective: Callable[[str, float, int], None] | None

    def next_collective(self) -> int: ...

    def begin_tracking(self, kind: str, call: Any, since: float) -> None: ...

    def end_tracking(self, call: Any = None) -> None: ...

    def abort_attempt(self, error: BaseException) -> None: ...

    def describe_timeout(self, call: Any, waiting_for: int) -> str: ...


class _Plan:
    """Everything about one (op, shape, dtype) that does not change between calls."""

    __slots__ = (
        "dtype",
        "for_pack",
        "header",
        "key",
        "mean",
        "name",
        "name_field",
        "nbytes",
        "new_out",
        "op",
        "sent_bytes",
        "shape",
        "sig",
        "sig_bytes",
        "timeout",
        "ufunc",
    )

    def __init__(self, op: ReduceOp, sig: str, rank: int, value: np.ndarray, size: int, timeout: float | None,
                 pooled_bytes: int, for_pack: bool = False):
        self.op = op
        self.for_pack = for_pack  # a structure's single pack, not an array of its own
        self.timeout = timeout
        self.sig = sig
        self.sig_bytes = sig.encode()
        self.name = f"small#{zlib.crc32(self.sig_bytes):08x}"
        self.name_field = self.name.encode().ljust(40, b"\0")
        dims = tuple(value.shape) + (0,) * (MAX_NDIM - value.ndim)
        self.nbytes = value.nbytes
        self.sent_bytes = value.nbytes * (size - 1)
        self.header = lane_header((rank, self.name_field, ARRAY, value.nbytes, 0, value.nbytes, value.ndim, *dims,
                                   dtype_text(value.dtype).encode()), self.sig_bytes)
        if value.dtype.kind == "b" and op in (ReduceOp.SUM, ReduceOp.PRODUCT):
            self.ufunc = np.logical_or if op is ReduceOp.SUM else np.logical_and
        else:
            self.ufunc = getattr(np, _UFUNC_NAMES[op])
        self.dtype = value.dtype
        self.shape = value.shape
        self.key = (value.dtype, value.shape)
        # the result goes into a fresh array the ufunc allocates, except for 0-d values (a ufunc
        # would give a scalar) and large ones (reused buffers)
        self.new_out = value.ndim == 0 or value.nbytes >= pooled_bytes
        self.mean = op is ReduceOp.MEAN


class LaneCall:
    """What timeouts, stall warnings and status probes need to know about a lane's collective in progress (both
    lanes: shared memory here, sockets in ``socket_lane``)."""

    __slots__ = ("attempt", "kind", "nbytes", "run_id", "seq", "timeout")

    def __init__(self, attempt: int, run_id: int, seq: int, timeout: float, nbytes: int):
        self.kind = "all_reduce"
        self.attempt = attempt
        self.run_id = run_id
        self.seq = seq
        self.timeout = timeout
        self.nbytes = nbytes


class LaneEngine:
    """The one-hop shared-memory all-reduce of one small array (see the module docstring).

    Parameters
    ----------
    comm
        The replica's communicator (rank, size, attempt and collective numbers, aborts).
    lane
        The shared-memory transport's lane (``ShmTransport.lane()``) that reaches every peer.
    """

    def __init__(self, comm: LaneHost, lane: ShmLane):
        self.comm = comm
        self.lane = lane
        # Between two replicas the one-hop exchange moves the same bytes as the ring, in one step
        # instead of two: it takes everything that fits in one channel slot. With more replicas than
        # cores every ring step waits for descheduled peers, so one hop wins up to half a slot.
        self.limit = comm.small_message_bytes
        if comm.size == 2:
            self.limit = max(self.limit, lane.slot_bytes)
        elif lane.oversubscribed:
            self.limit = max(self.limit, lane.slot_bytes // 2)
        self.limit = min(self.limit, lane.slot_bytes)  # the lane reads each array whole from one slot
        self._plans: dict[tuple[Any, ...], _Plan | None] = {}
        self._call: LaneCall | None = None  # the collective in progress, once it had to wait
        # bound once per generation (this engine lives as long as its communicator): the ranks in reduction
        # order with each peer's peek and release, and (at the first exchange, once the transport is
        # connected) each destination's can_write and write_lane, so a call does no per-peer lookups
        self._rank = comm.rank
        self._size = comm.size
        self._sources = [(r, None, None) if r == comm.rank else (r, lane.peek[r], lane.release[r])
                         for r in range(comm.size)]
        self._send_order = [(comm.rank + k) % comm.size for k in range(1, comm.size)]
        self._senders: list[tuple[int, Callable[[], bool], Callable[..., None]]] | None = None
        self._queued = lane.queued
        self._next_collective = comm.next_collective

    def plan(self, op: Any, value: np.ndarray, options: CommunicationOptions | None) -> _Plan | None:
        """The plan for ``value``, or ``None`` when another engine must take it.

        Whether this lane is taken depends only on what the signature says
        (op, shape, dtype, options, the group's algorithm), so replicas that
        agree on the signature agree on the lane. Plans are cached: for a bare
        numpy array, this lookup is all the communicator does before ``run``.
        """
        # a ReduceOp member is keyed by its id (members live as long as the class): hashing an Enum member
        # is a Python-level call, a noticeable part of a 12 µs all-reduce
        key = (id(op) if type(op) is ReduceOp else op, value.shape, value.dtype, options)
        try:
            return self._plans[key]
        except KeyError:
            pass
        plan = self._make_plan(op, value, options)
        if len(self._plans) >= _PLANS_KEPT:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def accepts(self, plan: AllReducePlan) -> _Plan | None:
        """The lane's plan for a validated all-reduce that is not a bare numpy array, or ``None``.

        One array (a number, a numpy scalar, a CPU DLPack tensor) is planned
        as itself; any other structure that fuses into a single flat numpy
        pack (a list of gradients of one dtype) is planned as that pack, under
        the structure's signature.
        """
        if plan.bare_array:
            return None  # ``plan`` already said no to the array itself; the packed path takes it
        if plan.single_leaf() and isinstance(plan.leaves[0], np.ndarray):
            lane_plan = self.plan(plan.op, plan.leaves[0], plan.call_options)
            if lane_plan is not None:
                return lane_plan
        packs = plan.packed.packs
        if len(packs) != 1 or not isinstance(packs[0].buffer, np.ndarray):
            return None
        return self._plan_for_pack(plan.op, packs[0].buffer, plan.call_options, plan.sig)

    def run_plan(self, plan: AllReducePlan, lane_plan: _Plan) -> Any:
        """All-reduce a validated ``plan`` that ``accepts`` gave ``lane_plan`` for; the caller's structure back."""
        if not lane_plan.for_pack:
            return optree.tree_unflatten(plan.treedef, [plan.restore[0](self.run(lane_plan, plan.leaves[0]))])
        packed = plan.packed
        packed.packs[0].buffer = self.run(lane_plan, packed.packs[0].buffer)
        return packed.unpack()

    def _plan_for_pack(self, op: ReduceOp, buffer: np.ndarray, options: CommunicationOptions | None,
                       sig: str) -> _Plan | None:
        """The plan for a structure fused into the one flat ``buffer``, or ``None``.

        ``sig`` is the structure's signature: replicas agree on it, hence on
        the pack, hence on the lane.
        """
        key = ("pack", op, sig, options)
        try:
            return self._plans[key]
        except KeyError:
            pass
        plan = self._make_plan(op, buffer, options, sig)
        if len(self._plans) >= _PLANS_KEPT:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _make_plan(self, op: Any, value: np.ndarray, call_options: CommunicationOptions | None,
                   sig: str | None = None) -> _Plan | None:
        comm = self.comm
        if not (0 < value.nbytes <= self.limit) or value.ndim > MAX_NDIM or value.dtype.hasobject:
            return None
        try:
            options = comm.options.merge(call_options)
            reduce_op = ReduceOp.from_any(op)
            check_dtype(reduce_op, value.dtype)
        except (TypeError, ValueError, KeyError, AttributeError):
            return None  # the general path raises the error
        algorithm = comm.algorithm.name
        if algorithm not in ("auto", "direct"):
            return None
        if options.implementation is not CommunicationImplementation.AUTO and algorithm != "direct":
            return None
        for_pack = sig is not None
        if sig is None:
            detail = (f"{reduce_op.name} packs={options.bytes_per_pack}/{comm.algorithm.num_packs} "
                      f"{options.implementation.name}")
            sig = signature("all_reduce", detail, [value], _SINGLE_LEAF)
        return _Plan(reduce_op, sig, comm.rank, value, comm.size, options.timeout_seconds, comm.buffers.min_bytes,
                     for_pack)

    def run(self, plan: _Plan, value: np.ndarray) -> np.ndarray:
        """All-reduce ``value`` with ``plan``; the result is a new array.

        The common case costs a handful of calls: the array is written into
        each peer's channel (a slot whose header already names this
        collective's signature only gets the new numbers), and the peers'
        arrays are combined from typed views of the slots. The collective is
        only registered for status probes and the stall watch once it has to
        wait; any failure aborts the attempt on every replica, as on the general path.
        """
        comm = self.comm
        seq = self._next_collective()
        attempt = comm.attempt
        start = _monotonic()
        try:
            result = self._exchange(plan, value, attempt, seq, start)
        except Exception as e:
            comm.abort_attempt(e)
            raise
        finally:
            if self._call is not None:
                comm.end_tracking()
                self._call = None
        on_collective = comm.on_collective
        if on_collective is not None:
            on_collective("all_reduce", _monotonic() - start, plan.sent_bytes)
        return result

    def _slow(self, plan: _Plan, attempt: int, seq: int, start: float) -> tuple[LaneCall, float]:
        """The collective as timeouts and probes see it, registered with the communicator; and its deadline."""
        if self._call is None:
            timeout = timeout_of(plan.timeout, self.comm.default_timeout)
            self._call = LaneCall(attempt, self.comm.run_id, seq, timeout, plan.sent_bytes)
            self.comm.begin_tracking("all_reduce", self._call, start)
        return self._call, start + self._call.timeout

    def _exchange(self, plan: _Plan, value: np.ndarray, attempt: int, seq: int, start: float) -> np.ndarray:
        senders = self._senders
        if senders is None:
            writers = self.lane.writers()
            senders = self._senders = [(dst, *writers[dst]) for dst in self._send_order]
        queued = self._queued
        handles = []
        header, key = plan.header, plan.key
        for dst, can_write, write in senders:
            if not queued.get(dst) and can_write():
                write(header, attempt, seq, value, key)
            else:
                handles.append(self.lane.send_queued(dst, (attempt, seq, self._rank, plan.name), value,
                                                     plan.sig_bytes))
        ufunc = plan.ufunc
        result: Any = None  # set when rank 1's array is combined with rank 0's
        first: np.ndarray | None = None  # rank 0's array, until rank 1's is combined with it
        first_release = None
        incoming: np.ndarray | None
        for r, peek, release in self._sources:
            if peek is None:
                incoming = value
            else:
                incoming = peek((attempt, seq, r, plan.name_field), key)
                if incoming is None:  # not there yet (or something else first): wait for it
                    incoming, release = self._take(plan, r, attempt, seq, start)
            if r == 0:
                first, first_release = incoming, release
                continue
            if first is not None:
                if plan.new_out:
                    result = ufunc(first, incoming, out=self._new_out(plan))
                else:
                    result = ufunc(first, incoming)
                if first_release is not None:
                    first_release()
                first = None
            else:
                ufunc(result, incoming, out=result)
            if release is not None:
                release()
        if plan.mean:
            finalize(plan.op, result, self._size)
        if handles:
            _call, deadline = self._slow(plan, attempt, seq, start)
            for handle in handles:
                handle.wait(deadline)
        reduced: np.ndarray = result
        return reduced

    def _new_out(self, plan: _Plan) -> np.ndarray:
        if plan.nbytes >= self.comm.buffers.min_bytes:
            return self.comm.buffers.empty(plan.shape, plan.dtype)
        return np.empty(plan.shape, plan.dtype)

    def _take(self, plan: _Plan, src: int, attempt: int, seq: int, start: float) -> tuple[np.ndarray, Any]:
        """``src``'s array (a view into its channel) and how to free the slot, once the first peek missed.

        Waits as long as it must.
        """
        call, deadline = self._slow(plan, attempt, seq, start)
        try:
            return self.lane.receive(src, attempt, seq, plan.name, plan.name_field, plan.nbytes, plan.dtype,
                                     plan.shape, deadline)
        except MailboxTimeout:
            raise CollectiveTimeoutError(self.comm.describe_timeout(call, src)) from None
        except LaneMismatch as e:
            raise CollectiveMismatchError(
                f"all_reduce #{call.seq} (run {call.run_id}): the replicas passed different values; "
                f"replica {src} passed {e.peer_signature!r} but replica {self.comm.rank} passed {plan.sig!r}"
            ) from None


def _single_leaf_treedef() -> Any:
    leaf: Any = np.zeros(0)
    return optree.tree_flatten(leaf, none_is_leaf=False)[1]


_SINGLE_LEAF = _single_leaf_treedef()
