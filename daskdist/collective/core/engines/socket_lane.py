"""The socket lane: all-reduce of one small array among replicas that reach each other over TCP.

Across hosts a small all-reduce is a handful of microseconds on the wire and
tens of microseconds of Python on each side; the Python also delays the
replica's own reader thread, which needs the GIL to take the peer's message.
This lane does what the general path would do for a bare numpy array the
direct engine takes (one hop: every replica sends its array to every other
and reduces them in rank order), with the general path's steps computed once:

* a plan per (op, shape, dtype, options) holds the signature, exactly as the
  general path computes it (an ``AllReducePlan`` built once, and taken only
  when its one pack would go to the direct engine), and for each peer the
  signature frame and the array frame with their headers packed
  (``SignedArrayFrames``): a send only renumbers them and writes both in one
  ``sendmsg``;
* every receive is posted before the first send (``post_receive``): the
  peer's array is read from its connection straight into the result (rank
  0's) or a reused scratch buffer the reduction reads from.

On the wire it is the general path: the same tags, the same signature
message, the same data messages; so a peer that passed something else (and
took the general path) is detected by the signature check, and every
replica raises ``CollectiveMismatchError``. Timeouts, aborts, a lost peer
(``ReplicaLostError``) and stall warnings behave as on the general path: the
waits are the transport's, the collective is registered with the
communicator while it runs, and any failure aborts the attempt on every
replica.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from daskdist.collective.core.engines.base import AllReducePlan, PackPlan
from daskdist.collective.core.engines.direct import DirectEngine
from daskdist.collective.core.engines.lane import LaneCall, LaneHost
from daskdist.collective.core.reduction import combine_into, finalize
from daskdist.collective.mailbox import MailboxTimeout
from daskdist.collective.transport.framing import MAX_NDIM, SignedArrayFrames
from daskdist.collective.transport.socket import SocketTransport
from daskdist.exceptions import CollectiveMismatchError, CollectiveTimeoutError
from daskdist.ops import CommunicationOptions, ReduceOp, timeout_of

__all__ = ["SocketLaneEngine", "SocketLaneHost"]

_PLANS_KEPT = 1024
_monotonic = time.monotonic
#: The general path's names: the first pack's part and the direct engine's message (``CollectiveCall._tag``).
_DATA_NAME = "p0/d"


class SocketLaneHost(LaneHost, Protocol):
    """What the socket lane needs of the communicator: the shared-memory lane's host, and the packed path (its
    plans are checked against it), the device engine and the timeout's description."""

    packed: Any
    nccl: Any

    def describe_timeout(self, call: Any, waiting_for: int) -> str: ...


class _Plan:
    """Everything about one (op, shape, dtype, options) that does not change between calls."""

    __slots__ = ("data_name", "dtype", "frames", "op", "sent_bytes", "shape", "sig", "timeout")

    def __init__(self, op: ReduceOp, sig: str, timeout: float | None, value: np.ndarray, rank: int,
                 size: int) -> None:
        self.op = op
        self.sig = sig
        self.timeout = timeout
        self.dtype = value.dtype
        self.shape = value.shape
        self.sent_bytes = value.nbytes * (size - 1)
        # the general path's data name: the pack's part, the direct engine's name, the signature's hash
        self.data_name = f"{_DATA_NAME}#{zlib.crc32(sig.encode()):08x}"
        # the right neighbour gets the signature with the array (numbered per send)
        self.frames = SignedArrayFrames((0, 0, rank, "sig"), sig, (0, 0, rank, self.data_name), value.dtype,
                                        value.shape)


class SocketLaneEngine:
    """The one-hop all-reduce of one small bare numpy array over the socket transport (see the module docstring).

    Parameters
    ----------
    comm
        The replica's communicator.
    sockets
        The socket transport that reaches every peer (``transport.base.sole_route``).
    """

    def __init__(self, comm: SocketLaneHost, sockets: SocketTransport):
        self.comm = comm
        self.sockets = sockets
        self.limit = comm.small_message_bytes
        self._plans: dict[tuple[Any, ...], _Plan | None] = {}
        self._rank = comm.rank
        self._size = comm.size
        # the general path's send order: the right neighbour first (it gets the signature), then the others
        self._right = (comm.rank + 1) % comm.size
        self._others = [(comm.rank + k) % comm.size for k in range(2, comm.size)]
        self._left = (comm.rank - 1) % comm.size
        self._sources = [r for r in range(comm.size) if r != comm.rank]
        self._next_collective = comm.next_collective

    def plan(self, op: Any, value: np.ndarray, options: CommunicationOptions | None) -> _Plan | None:
        """The plan for ``value``, or ``None`` when the general path must take it (cached)."""
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

    def _make_plan(self, op: Any, value: np.ndarray, call_options: CommunicationOptions | None) -> _Plan | None:
        """A plan when the general path would send ``value`` as one pack through the direct engine, else ``None``.

        The decision is the general path's own (the same ``AllReducePlan``,
        the same pack engines), so it depends only on the signature.
        """
        comm = self.comm
        if not (0 < value.nbytes <= self.limit) or value.ndim > MAX_NDIM or value.dtype.hasobject:
            return None
        try:
            general = AllReducePlan(op, value, comm.options.merge(call_options), call_options,
                                    comm.algorithm.num_packs, comm.buffers.empty)
            packs = general.packed.packs
        except (TypeError, ValueError, KeyError, AttributeError):
            return None  # the general path raises the error
        if len(packs) != 1 or not isinstance(packs[0].buffer, np.ndarray) or packs[0].buffer.size != value.size:
            return None
        forced_ring = PackPlan.forces_ring(comm.algorithm.name, general.options)
        pack_plan = PackPlan(packs[0].buffer, general.op, packs[0].borrowed, forced_ring)
        if not isinstance(comm.packed.choose(pack_plan), DirectEngine):
            return None
        return _Plan(general.op, general.sig, general.options.timeout_seconds, value, self._rank, self._size)

    def run(self, plan: _Plan, value: np.ndarray) -> np.ndarray:
        """All-reduce ``value`` with ``plan``; the result is a new array. Any failure aborts the attempt everywhere."""
        comm = self.comm
        seq = self._next_collective()
        attempt = comm.attempt
        start = _monotonic()
        timeout = timeout_of(plan.timeout, comm.default_timeout)
        call = LaneCall(attempt, comm.run_id, seq, timeout, plan.sent_bytes)
        comm.begin_tracking("all_reduce", call, start)
        try:
            result = self._exchange(plan, value, call, start + timeout)
        except Exception as e:
            comm.abort_attempt(e)
            raise
        finally:
            comm.end_tracking(call)
        on_collective = comm.on_collective
        if on_collective is not None:
            on_collective("all_reduce", _monotonic() - start, plan.sent_bytes)
        return result

    def _exchange(self, plan: _Plan, value: np.ndarray, call: LaneCall, deadline: float) -> np.ndarray:
        sockets, rank, op = self.sockets, self._rank, plan.op
        attempt, seq = call.attempt, call.seq
        result = np.empty(plan.shape, plan.dtype)
        # every receive posted before the first send: rank 0's array lands in the result, the others in scratch
        # buffers the reduction reads from, in rank order (as the direct engine: bit-identical everywhere)
        pending = []
        for src in self._sources:
            tag = (attempt, seq, src, plan.data_name)
            combine = None if src == 0 else _combiner(op)
            pending.append((src, tag, combine, sockets.post_receive(tag, result, combine)))
        try:
            handles = sockets.send_signed(self._right, plan.frames, attempt, seq, value)
            for dst in self._others:  # more than two replicas: the other peers get the array alone
                handles.append(sockets.send(dst, (attempt, seq, rank, plan.data_name), value))
            self._check_signature(plan, call, deadline)
            if rank == 0:
                np.copyto(result, value)
            while pending:
                src, tag, combine, posted = pending[0]
                if src == rank + 1 and rank != 0:
                    combine_into(op, result, value)  # our own array, in rank order
                del pending[0]
                try:
                    sockets.complete_receive(posted, src, tag, deadline, result, combine)
                except MailboxTimeout:
                    raise CollectiveTimeoutError(self.comm.describe_timeout(call, src)) from None
            if rank == self._size - 1 and rank != 0:
                combine_into(op, result, value)
        finally:
            for _, tag, _, posted in pending:  # not reached: a failure on the way
                if posted is not None:
                    sockets.drop_receive(posted, tag)
        finalize(op, result, self._size)
        for handle in handles:
            handle.wait(deadline)
        return result

    def _check_signature(self, plan: _Plan, call: LaneCall, deadline: float) -> None:
        """Compare the left neighbour's signature with ours; ``CollectiveMismatchError`` if they differ."""
        left = self._left
        try:
            left_sig = self.sockets.recv(left, (call.attempt, call.seq, left, "sig"), deadline)
        except MailboxTimeout:
            raise CollectiveTimeoutError(self.comm.describe_timeout(call, left)) from None
        if left_sig != plan.sig:
            raise CollectiveMismatchError(
                f"all_reduce #{call.seq} (run {call.run_id}): the replicas passed different values; "
                f"replica {left} passed {left_sig!r} but replica {self._rank} passed {plan.sig!r}")


_COMBINERS: dict[ReduceOp, Callable[[Any, Any, Any], None]] = {}


def _combiner(op: ReduceOp) -> Callable[[Any, Any, Any], None]:
    """The transport's ``combine`` for ``op`` (one per op, made once)."""
    combine = _COMBINERS.get(op)
    if combine is None:
        combine = _COMBINERS[op] = lambda acc, part, base: combine_into(op, acc, part, base)
    return combine
