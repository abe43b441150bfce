"""Collective algorithms over a ``Call`` (tagged send/recv among the ranks).

Each function works on one flat 1-D buffer (a pack) or a list of arrays and
is deterministic: every replica ends with bit-identical results, because each
element is reduced in one fixed order (rank order, or once on its owner in
the ring) and then copied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from daskdist import fault_points
from daskdist.arrays import namespace
from daskdist.collective.core.call import Call
from daskdist.collective.core.reduction import combine_into, finalize
from daskdist.ops import ReduceOp

__all__ = [
    "SubCall",
    "allreduce_hierarchical",
    "host_groups",
    "reducescatter_ring",
    "allgather_direct",
    "allreduce_direct",
    "allreduce_reduce_to_one",
    "allreduce_ring",
    "broadcast_direct",
]


def _peers(call: Call) -> list[int]:
    """Other ranks, starting with the right neighbour (sends) — receives walk them in reverse."""
    return [(call.rank + k) % call.size for k in range(1, call.size)]


def allreduce_direct(call: Call, buf: Any, op: ReduceOp) -> Any:
    """One hop: every rank sends its buffer to every other and reduces all of them in rank order.

    Latency-optimal for small messages (one message delay), ``size - 1`` times
    the bandwidth of the ring, so AUTO uses it only below
    ``daskdist.collective.small-message-bytes``.
    """
    handles = [call.send(peer, "d", buf) for peer in _peers(call)]
    xp = namespace(buf)
    result = xp.empty_like(buf)
    for r in range(call.size):
        if r == call.rank:
            if r == 0:
                xp.copyto(result, buf)
            else:
                combine_into(op, result, buf)
        else:
            call.recv_into(r, "d", result, None if r == 0 else op)
    finalize(op, result, call.size)
    for h in handles:
        call.wait(h)
    return result


def allreduce_ring(call: Call, buf: Any, op: ReduceOp, out: Any = None) -> Any:
    """Ring reduce-scatter then ring all-gather, in place in ``buf`` or into ``out``.

    Each rank sends ``2 (size - 1) / size`` of the buffer: bandwidth-optimal for
    large messages. Chunk ``(rank + 1) % size`` is finished on ``rank``, then
    circulated, so all ranks hold identical bits. Incoming chunks are reduced
    piece by piece as the transport delivers them, each step sending and
    receiving at once (``sendrecv``).

    With ``out`` (same shape as ``buf``), ``buf`` is only read: the first step
    sends from it and every chunk's first reduction writes ``buf op incoming``
    into ``out``, so the caller's array needs no copy.
    """
    size, rank = call.size, call.rank
    xp = namespace(buf)
    target = buf if out is None else out
    chunks = xp.array_split(target, size)
    sources = chunks if out is None else xp.array_split(buf, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        send_index, recv_index = (rank - step) % size, (rank - step - 1) % size
        outgoing = sources[send_index] if step == 0 else chunks[send_index]
        call.sendrecv(right, outgoing, left, f"rs{step}", chunks[recv_index], op,
                      None if out is None else sources[recv_index])
        if step == 0 and fault_points.ARMED:  # a test's fault point (``daskdist.testing.pause-at``)
            fault_points.reached("reduce-scatter")
    finalize(op, chunks[(rank + 1) % size], size)
    for step in range(size - 1):
        send_index, recv_index = (rank + 1 - step) % size, (rank - step) % size
        call.sendrecv(right, chunks[send_index], left, f"ag{step}", chunks[recv_index], None)
        if step == 0 and fault_points.ARMED:
            fault_points.reached("all-gather")
    return target


def reducescatter_ring(call: Call, buf: Any, op: ReduceOp, bounds: Sequence[int]) -> Any:
    """Ring reduce-scatter: chunk ``r`` (``buf[bounds[r]:bounds[r + 1]]``) ends fully reduced on rank ``r``.

    Returns that chunk (a view into ``buf``).
    """
    size, rank = call.size, call.rank
    chunks = [buf[bounds[i] : bounds[i + 1]] for i in range(size)]
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        send_index, recv_index = (rank - step - 1) % size, (rank - step - 2) % size
        call.sendrecv(right, chunks[send_index], left, f"rsc{step}", chunks[recv_index], op)
    finalize(op, chunks[rank], size)
    return chunks[rank]


class SubCall:
    """The ranks ``ranks`` of a collective, renumbered ``0 .. len(ranks) - 1``, with their own message names."""

    def __init__(self, call: Any, ranks: Sequence[int], prefix: str):
        self.call = call
        self.ranks = list(ranks)
        self.rank = self.ranks.index(call.rank)
        self.size = len(self.ranks)
        self.prefix = prefix

    def send(self, dst: int, name: str, payload: Any) -> Any:
        return self.call.send(self.ranks[dst], self.prefix + name, payload)

    def recv(self, src: int, name: str, expect: int | None = None) -> Any:
        return self.call.recv(self.ranks[src], self.prefix + name, expect)

    def recv_into(self, src: int, name: str, out: Any, op: ReduceOp | None, base: Any = None) -> None:
        self.call.recv_into(self.ranks[src], self.prefix + name, out, op, base)

    def sendrecv(self, dst: int, payload: Any, src: int, name: str, out: Any, op: ReduceOp | None,
                 base: Any = None) -> None:
        self.call.sendrecv(self.ranks[dst], payload, self.ranks[src], self.prefix + name, out, op, base)

    def wait(self, handle: Any) -> None:
        self.call.wait(handle)

    def mismatch(self, detail: str) -> None:
        self.call.mismatch(detail)


def host_groups(hosts: Sequence[str]) -> list[list[int]]:
    """Ranks grouped by host, hosts in order of their first rank."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    return list(groups.values())


def allreduce_hierarchical(call: Call, buf: Any, op: ReduceOp, hosts: Sequence[str]) -> Any:
    """Reduce within each host onto its first replica, ring across hosts' first replicas, copy back.

    Only one replica per host sends across the network, so inter-host traffic
    is that of a ring over hosts, not over replicas; within a host the
    transport is shared memory.
    """
    base_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
    groups = host_groups(hosts)
    local = next(g for g in groups if call.rank in g)
    leader, leaders = local[0], [g[0] for g in groups]
    if call.rank != leader:
        call.wait(call.send(leader, "h-up", buf))
        call.recv_into(leader, "h-down", buf, None)
        return buf
    for r in local[1:]:
        call.recv_into(r, "h-up", buf, base_op)
    if len(leaders) > 1:
        allreduce_ring(SubCall(call, leaders, "hx-"), buf, base_op)
    finalize(op, buf, call.size)
    handles = [call.send(r, "h-down", buf) for r in local[1:]]
    for h in handles:
        call.wait(h)
    return buf


def allreduce_reduce_to_one(
    call: Call,
    buf: Any,
    op: ReduceOp,
    root: int = 0,
    accumulation_fn: Callable[[Sequence[Any]], Any] | None = None,
) -> Any:
    """Gather every buffer on ``root``, reduce there, send the result back (``ReductionToOneDevice``).

    ``accumulation_fn`` (TF's argument) receives the list of buffers in rank
    order and returns their sum; the default adds them in rank order.
    """
    xp = namespace(buf)
    if call.rank != root:
        call.wait(call.send(root, "up", buf))
        call.recv_into(root, "down", buf, None)
        return buf
    if accumulation_fn is not None and op in (ReduceOp.SUM, ReduceOp.MEAN):
        parts = []
        for r in range(call.size):
            part = buf if r == root else xp.empty_like(buf)
            if r != root:
                call.recv_into(r, "up", part, None)
            parts.append(part)
        result = xp.asarray(accumulation_fn(parts)).astype(buf.dtype, copy=True).reshape(buf.shape)
    else:
        result = xp.empty_like(buf)
        for r in range(call.size):
            if r == root:
                xp.copyto(result, buf) if r == 0 else combine_into(op, result, buf)
            else:
                call.recv_into(r, "up", result, None if r == 0 else op)
    finalize(op, result, call.size)
    handles = [call.send(r, "down", result) for r in range(call.size) if r != root]
    for h in handles:
        call.wait(h)
    return result


def allgather_direct(call: Call, leaves: list[Any]) -> list[list[Any]]:
    """Every rank sends its list of arrays to every other; returns the lists in rank order."""
    handles = [call.send(peer, "g", leaves) for peer in _peers(call)]
    gathered: dict[int, list[Any]] = {call.rank: leaves}
    for peer in reversed(_peers(call)):
        received = call.recv(peer, "g")
        if not isinstance(received, list) or len(received) != len(leaves):
            call.mismatch(f"replica {peer} sent {type(received).__name__} with a different number of leaves")
        gathered[peer] = received
    for h in handles:
        call.wait(h)
    return [gathered[r] for r in range(call.size)]


def broadcast_direct(call: Call, payload: Any, root: int) -> Any:
    """``root`` sends ``payload`` to every other rank; every rank returns it.

    The others first tell the root they are ready (under the signature's
    tag), and the root sends only once all are: so a replica that passed
    something else blocks everyone until the mismatch aborts the run, and no
    replica finishes a broadcast that another one failed.
    """
    if call.rank == root:
        for peer in _peers(call):
            call.recv(peer, "ready")
        handles = [call.send(peer, "b", payload) for peer in _peers(call)]
        for h in handles:
            call.wait(h)
        return payload
    call.wait(call.send(root, "ready", b""))
    return call.recv(root, "b")
