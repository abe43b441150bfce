"""The latency path: all-reduce of one small array among replicas that share a host.

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
"""

from __future__ import annotations

import time
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist.collective.mailbox import MailboxTimeout
from daskdist.collective.packing import signature
from daskdist.collective.reduction import check_dtype, finalize
from daskdist.collective.transport.framing import ARRAY, MAX_NDIM, TEXT, decode, dtype_text
from daskdist.collective.transport.shm import ShmTransport, backoff_wait, lane_header
from daskdist.exceptions import CollectiveMismatchError, CollectiveTimeoutError
from daskdist.ops import CommunicationImplementation, CommunicationOptions, ReduceOp

if TYPE_CHECKING:
    from daskdist.collective.communicator import Communicator

__all__ = ["SmallAllReduce", "shared_memory_route"]

_UFUNC_NAMES = {ReduceOp.SUM: "add", ReduceOp.MEAN: "add", ReduceOp.MAX: "maximum", ReduceOp.MIN: "minimum",
                ReduceOp.PRODUCT: "multiply"}
_PLANS_KEPT = 1024


def shared_memory_route(transport: Any, size: int, rank: int) -> ShmTransport | None:
    """The shared-memory transport that reaches every peer, or ``None`` if some peer is reached otherwise."""
    routes = getattr(transport, "routes", None)
    if isinstance(transport, ShmTransport):
        return transport
    if not routes or len(routes) != size - 1:
        return None
    first = routes.get((rank + 1) % size)
    if isinstance(first, ShmTransport) and all(t is first for t in routes.values()):
        return first
    return None


class _Plan:
    """Everything about one (op, shape, dtype) that does not change between calls."""

    __slots__ = ("op", "sig", "sig_bytes", "name", "name_field", "header", "key", "ufunc", "nbytes", "sent_bytes",
                 "dtype", "shape", "timeout", "send_order", "new_out", "mean")

    def __init__(self, op: ReduceOp, sig: str, rank: int, value: np.ndarray, size: int, timeout: float | None,
                 pooled_bytes: int):
        self.op = op
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
        self.send_order = [(rank + k) % size for k in range(1, size)]
        # the result goes into a fresh array the ufunc allocates, except for 0-d values (a ufunc
        # would give a scalar) and large ones (reused buffers)
        self.new_out = value.ndim == 0 or value.nbytes >= pooled_bytes
        self.mean = op is ReduceOp.MEAN


class _LaneCall:
    """What timeouts, stall warnings and status probes need to know about a collective in progress."""

    __slots__ = ("kind", "nbytes", "run_id", "seq", "timeout")

    def __init__(self, run_id: int, seq: int, timeout: float, nbytes: int):
        self.kind = "all_reduce"
        self.run_id = run_id
        self.seq = seq
        self.timeout = timeout
        self.nbytes = nbytes


class SmallAllReduce:
    """The one-hop shared-memory all-reduce of one small array (see the module docstring).

    Parameters
    ----------
    comm
        The replica's communicator (rank, size, run and collective numbers, aborts).
    shm
        The shared-memory transport that reaches every peer.
    """

    def __init__(self, comm: Communicator, shm: ShmTransport):
        self.comm = comm
        self.shm = shm
        # Between two replicas the one-hop exchange moves the same bytes as the ring, in one step
        # instead of two: it takes everything that fits in one channel slot. With more replicas than
        # cores every ring step waits for descheduled peers, so one hop wins up to half a slot.
        self.limit = comm.small_message_bytes
        if comm.size == 2:
            self.limit = max(self.limit, shm.slot_bytes)
        elif getattr(shm, "oversubscribed", False):
            self.limit = max(self.limit, shm.slot_bytes // 2)
        self.limit = min(self.limit, shm.slot_bytes)  # the lane reads each array whole from one slot
        self._plans: dict[tuple, _Plan | None] = {}
        self._call: _LaneCall | None = None  # the collective in progress, once it had to wait
        self._inbound = {src: shm.inbound(src) for src in range(comm.size) if src != comm.rank}

    def plan(self, op: Any, value: np.ndarray, options: CommunicationOptions | None) -> _Plan | None:
        """The plan for ``value``, or ``None`` when the general path must take it.

        Whether this lane is taken depends only on what the signature says
        (op, shape, dtype, options, the group's algorithm), so replicas that
        agree on the signature agree on the lane.
        """
        key = (op, value.shape, value.dtype, options)
        try:
            return self._plans[key]
        except KeyError:
            pass
        plan = self._make_plan(op, value, options)
        if len(self._plans) >= _PLANS_KEPT:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def plan_for_pack(self, op: Any, buffer: np.ndarray, options: CommunicationOptions | None,
                      sig: str) -> _Plan | None:
        """The plan for a structure fused into the one flat ``buffer`` (a list of gradients), or ``None``.

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
        if sig is None:
            detail = (f"{reduce_op.name} packs={options.bytes_per_pack}/{comm.algorithm.num_packs} "
                      f"{options.implementation.name}")
            sig = signature("all_reduce", detail, [value], _SINGLE_LEAF)
        return _Plan(reduce_op, sig, comm.rank, value, comm.size, options.timeout_seconds, comm.buffers.min_bytes)

    def run(self, plan: _Plan, value: np.ndarray) -> np.ndarray:
        """All-reduce ``value`` with ``plan``; the result is a new array.

        The common case costs a handful of calls: the array is written into
        each peer's channel (a slot whose header already names this
        collective's signature only gets the new numbers), and the peers'
        arrays are combined from typed views of the slots. The collective is
        only registered for status probes and the stall watch once it has to
        wait; any failure aborts the run on every replica, as on the general path.
        """
        comm = self.comm
        run_id = comm.run_id
        self.shm.mailbox.check(run_id)
        comm.seq = seq = comm.seq + 1
        start = time.monotonic()
        try:
            result = self._exchange(plan, value, run_id, seq, start)
        except Exception as e:
            comm.abort_run(e)
            raise
        finally:
            if self._call is not None:
                comm.end_tracking()
                self._call = None
        if comm.on_collective is not None:
            comm.on_collective("all_reduce", time.monotonic() - start, plan.sent_bytes)
        return result

    def _slow(self, plan: _Plan, run_id: int, seq: int, start: float) -> tuple[_LaneCall, float]:
        """The collective as timeouts and probes see it, registered with the communicator; and its deadline."""
        if self._call is None:
            timeout = plan.timeout or self.comm.default_timeout
            self._call = _LaneCall(run_id, seq, timeout, plan.sent_bytes)
            self.comm.begin_tracking("all_reduce", self._call, start)
        return self._call, start + self._call.timeout

    def _exchange(self, plan: _Plan, value: np.ndarray, run_id: int, seq: int, start: float) -> np.ndarray:
        shm = self.shm
        rank = self.comm.rank
        handles = []
        for dst in plan.send_order:
            if not shm.try_send_lane(dst, plan.header, run_id, seq, value, plan.key):
                handles.append(shm.send(dst, (run_id, seq, rank, plan.name), value, plan.sig_bytes))
        ufunc = plan.ufunc
        result: np.ndarray | None = None
        first: np.ndarray | None = None  # rank 0's array, until rank 1's is combined with it
        first_release = None
        for r in range(self.comm.size):
            if r == rank:
                incoming, release = value, None
            else:
                incoming, release = self._take(plan, r, run_id, seq, start)
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
            finalize(plan.op, result, self.comm.size)
        if handles:
            _call, deadline = self._slow(plan, run_id, seq, start)
            for handle in handles:
                handle.wait(deadline)
        return result

    def _new_out(self, plan: _Plan) -> np.ndarray:
        if plan.nbytes >= self.comm.buffers.min_bytes:
            return self.comm.buffers.empty(plan.shape, plan.dtype)
        return np.empty(plan.shape, plan.dtype)

    def _take(self, plan: _Plan, src: int, run_id: int, seq: int, start: float) -> tuple[np.ndarray, Any]:
        """``src``'s array (a view into its channel) and how to free the slot; waits as long as it must."""
        channel = self._inbound[src]
        incoming = channel.peek_lane((run_id, seq, src, plan.name_field), plan.key)
        if incoming is not None:  # the message itself: nothing of this tag can be stashed
            return incoming, channel.release
        call, deadline = self._slow(plan, run_id, seq, start)
        return self._receive(plan, src, deadline, call)

    def _receive(self, plan: _Plan, src: int, deadline: float, call: _LaneCall) -> tuple[np.ndarray, Any]:
        """``src``'s array for collective ``call`` (a view into its channel) and how to free the slot."""
        shm = self.shm
        run_id, seq = call.run_id, call.seq
        stashed = shm.take_stashed(src, (run_id, seq, src, plan.name))
        if stashed is not None:
            if getattr(stashed, "nbytes", None) != plan.nbytes:
                self._mismatch(call, src, plan, "a different payload")
            return stashed.view(plan.dtype).reshape(plan.shape), None
        channel = shm.inbound(src)
        mailbox = shm.mailbox
        while True:
            if not channel.can_read():
                try:
                    backoff_wait(channel.can_read, deadline, lambda: mailbox.check(run_id), shm.spin_seconds)
                except MailboxTimeout:
                    raise CollectiveTimeoutError(self.comm.describe_timeout(call, src)) from None
            fields, start = channel.peek_fields()
            if fields[0] == run_id and fields[1] == seq and fields[2] == src:
                if fields[3] == plan.name_field:
                    data = channel.data(start, plan.nbytes)
                    return data.view(plan.dtype).reshape(plan.shape), channel.release
                self._mismatch(call, src, plan, self._peer_signature(channel, fields, start))
            if fields[0] < mailbox.current_run:
                channel.release()  # left over from an aborted run
                continue
            header, data = channel.peek()
            shm.stash_message(src, header, data)

    @staticmethod
    def _peer_signature(channel: Any, fields: tuple, start: int) -> str:
        """What the peer passed, from its message of the same collective."""
        name = fields[3].rstrip(b"\0").decode()
        if name == "sig" and fields[4] == TEXT and fields[7] == fields[5]:
            return decode(TEXT, "", (), channel.data(start, fields[7]))
        text = channel.extra().decode(errors="replace")
        return text or f"a different collective ({name})"

    def _mismatch(self, call: _LaneCall, src: int, plan: _Plan, peer_sig: str) -> None:
        raise CollectiveMismatchError(
            f"all_reduce #{call.seq} of run {call.run_id}: the replicas passed different values; "
            f"replica {src} passed {peer_sig!r} but replica {self.comm.rank} passed {plan.sig!r}"
        )


def _single_leaf_treedef() -> Any:
    import optree

    return optree.tree_flatten(np.zeros(0), none_is_leaf=False)[1]


_SINGLE_LEAF = _single_leaf_treedef()
