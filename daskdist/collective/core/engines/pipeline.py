"""The pipelined ring all-reduce and the pipelined hierarchical all-reduce (groups that span hosts).

The plain ring (``algorithms.allreduce_ring``) moves a whole chunk per step:
over TCP the reader thread receives all of it, and only then does the
replica's thread reduce it and send it on, so the sum and the copies run
between transfers. Here every chunk goes in pieces of
``daskdist.collective.pipeline-bytes``, each its own message, and each piece
is forwarded as soon as it is reduced: while the replica reduces piece ``i``,
the transport's reader receives piece ``i + 1`` and its sender sends piece
``i - 1``, in both directions of the ring at once. Every element is still
reduced once, in the ring's fixed order, so every replica ends with the same
bits as the plain ring.

The hierarchical all-reduce keeps a host's replicas on shared memory: each
non-first replica sends its pieces to its host's first replica, which sums
each piece (out of place, into its result) just before the ring across the
hosts' first replicas needs it, then sends each finished piece back. So the
in-host reduce and broadcast overlap the cross-host ring, which runs on one
connection per host pair. There each chunk's pieces grow from
``collective.pipeline-min-bytes`` (doubling up to the piece size): nothing
crosses the hosts until the first piece is summed inside its host, so a
small first piece starts the link sooner; they shrink back to it at the end,
so the last piece a host's first replica sends down after the link is done
is small too. Where every host has as many replicas
(``collective.hierarchical-senders: all``, the default), each of them does
this for its own slice of the buffer, on its own connection across
(``_allreduce_host_slices``).

The order of pieces (``RingSchedule``) is computed alike on every replica, so
the pieces travel through each shared-memory channel in the order they are
read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from daskdist import fault_points
from daskdist.collective.core.algorithms import SubCall, host_groups
from daskdist.collective.core.call import Call
from daskdist.collective.core.reduction import finalize
from daskdist.ops import ReduceOp

__all__ = ["PieceSize", "RingSchedule", "allreduce_hierarchical_pipelined", "allreduce_ring_pipelined", "slice_width"]

Span = tuple[int, int]


class PieceSize:
    """How many elements each message of a pipelined all-reduce carries.

    At most ``max_bytes`` (``collective.pipeline-bytes``), and small enough
    that each chunk of the ring goes in at least ``pieces`` messages
    (``collective.pipeline-pieces``), but not below ``min_bytes``
    (``collective.pipeline-min-bytes``). A chunk sent as one message stalls
    both directions of a link: nothing can be reduced and sent back until the
    whole chunk has arrived. A DDP bucket of 16.8 MB across two hosts is one
    chunk of 8.4 MB, so with 8 MiB pieces every step waited for it whole
    (BENCHMARKS section 14, "Across hosts").

    Parameters
    ----------
    max_bytes
        The largest piece.
    pieces
        The fewest pieces per chunk (1: the chunk is cut only by ``max_bytes``).
    min_bytes
        The smallest piece that ``pieces`` may ask for (one message costs a hand-off on each side).
    """

    def __init__(self, max_bytes: int, pieces: int = 1, min_bytes: int = 0):
        self.max_bytes = max(1, int(max_bytes))
        self.pieces = max(1, int(pieces))
        self.min_bytes = max(1, int(min_bytes))

    def elements(self, n: int, size: int, itemsize: int) -> int:
        """Elements per piece for a flat buffer of ``n`` elements of ``itemsize`` bytes around a ring of ``size``."""
        chunk = -(-n // max(1, size))  # the largest chunk's elements
        wanted = max(-(-chunk // self.pieces), self.min_bytes // itemsize)
        return max(1, min(wanted, self.max_bytes // itemsize))

    def lead(self, piece: int, itemsize: int) -> int:
        """Elements of each chunk's first piece when the ring waits for an in-host reduce (``RingSchedule``'s ``lead``).

        ``min_bytes``, at most ``piece``; ``piece`` (no ramp) when ``min_bytes`` was not given.
        """
        if self.min_bytes <= 1:
            return piece
        return max(1, min(piece, self.min_bytes // itemsize))

    def __repr__(self) -> str:
        return f"PieceSize(max_bytes={self.max_bytes}, pieces={self.pieces}, min_bytes={self.min_bytes})"


def _cut(lo: int, hi: int, piece: int, lead: int) -> list[Span]:
    """``[lo, hi)`` in pieces: growing from ``lead`` (doubling while under ``piece``), then even pieces of at most
    ``piece``, then shrinking back to ``lead`` through the lengths up to half a ``piece`` as long as at least
    ``piece`` elements stay between;
    ``lead >= piece``: pieces of ``piece``, the last one shorter."""
    if lead >= piece:
        return [(start, min(start + piece, hi)) for start in range(lo, hi, piece)]
    ramp = []
    grow = lead
    while grow < piece:
        ramp.append(grow)
        grow *= 2
    spans: list[Span] = []
    for length in ramp:
        if lo >= hi:
            break
        spans.append((lo, min(lo + length, hi)))
        lo += length
    lo = min(lo, hi)
    tail: list[Span] = []
    for length in ramp:
        if 2 * length > piece or hi - lo < length + piece:  # no smaller than the middle's: no gain
            break
        tail.append((hi - length, hi))
        hi -= length
    if lo < hi:
        count = -(-(hi - lo) // piece)
        each = -(-(hi - lo) // count)
        spans.extend((start, min(start + each, hi)) for start in range(lo, hi, each))
    return spans + tail[::-1]


class RingSchedule:
    """Where the chunks and pieces of a ring of ``size`` over ``n`` elements lie, seen from ``rank``.

    Chunks are ``numpy.array_split``'s (the plain ring's); each chunk is cut
    into pieces of at most ``piece`` elements, the first ``lead`` elements
    long and each next one twice the last until ``piece``, and the last ones
    those lengths up to half a ``piece`` in reverse (the last ``lead`` long),
    where the chunk leaves a whole ``piece`` between.

    Parameters
    ----------
    n
        Elements of the flat buffer.
    size, rank
        The ring's size and this member's place in it.
    piece
        Elements per piece (at least 1).
    lead
        Elements of each chunk's first piece (``None``: ``piece``, every piece alike).
    limit
        Clip every piece to ``[0, limit)`` (``None``: ``n``), keeping the pieces that become empty: slices of one
        buffer a few elements shorter than ``n`` get the same number of pieces, in the same order, as ``n``'s.
    """

    def __init__(self, n: int, size: int, rank: int, piece: int, lead: int | None = None, limit: int | None = None):
        self.size = size
        self.rank = rank
        base, extra = divmod(n, size)
        starts = [c * base + min(c, extra) for c in range(size + 1)]
        piece = max(1, piece)
        lead = piece if lead is None else max(1, lead)
        self.pieces: list[list[Span]] = [_cut(starts[c], starts[c + 1], piece, lead) for c in range(size)]
        if limit is not None and limit < n:
            self.pieces = [[(min(lo, limit), min(hi, limit)) for lo, hi in chunk] for chunk in self.pieces]

    def chunk(self, index: int) -> list[Span]:
        """The pieces of chunk ``index % size``."""
        return self.pieces[index % self.size]

    def needed(self) -> list[Span]:
        """Every piece in the order the ring first reads it: the first send, then each reduce-scatter receive."""
        return [span for k in range(self.size) for span in self.chunk(self.rank - k)]

    def finished(self) -> list[Span]:
        """Every piece in the order it is final here: the chunk reduced here, then each all-gather receive."""
        return [span for k in range(self.size) for span in self.chunk(self.rank + 1 - k)]


def allreduce_ring_pipelined(
    call: Call,
    source: Any,
    target: Any,
    op: ReduceOp,
    piece: int,
    divisor: int | None = None,
    prepare: Callable[[int, int], None] | None = None,
    finished: Callable[[int, int], None] | None = None,
    lead: int | None = None,
    schedule: RingSchedule | None = None,
) -> Any:
    """Ring all-reduce of the flat ``source`` into ``target`` (may be ``source``), piece by piece.

    Parameters
    ----------
    call
        The ring's members (a ``Call`` or ``algorithms.SubCall``).
    source, target
        Flat arrays of one length. ``source`` is only read (the first send and
        the base of the first reduction of each element); ``target`` gets the
        result.
    op
        The element-wise reduction (``MEAN`` divides by ``divisor`` at the end).
    piece
        Elements per message.
    divisor
        What ``MEAN`` divides by (default: the ring's size).
    prepare
        ``prepare(lo, hi)`` makes ``target[lo:hi]`` this member's contribution
        just before the ring first reads it (the in-host reduce); ``source`` is
        then ignored.
    finished
        ``finished(lo, hi)`` is called once ``target[lo:hi]`` is final here.
    lead
        Elements of each chunk's first piece (``RingSchedule``; ``None``: ``piece``).
    schedule
        The pieces (``None``: ``RingSchedule(len(target), ...)``). Empty pieces send nothing, but ``prepare`` and
        ``finished`` are still called for them, in their places.
    """
    size, rank = call.size, call.rank
    schedule = schedule or RingSchedule(len(target), size, rank, piece, lead)
    divisor = size if divisor is None else divisor
    if prepare is not None:
        source = target
    if size == 1:
        for lo, hi in schedule.chunk(0):
            if prepare is not None:
                prepare(lo, hi)
            elif target is not source:
                target[lo:hi] = source[lo:hi]
            finalize(op, target[lo:hi], divisor)
            if finished is not None:
                finished(lo, hi)
        return target
    right, left = (rank + 1) % size, (rank - 1) % size
    in_place = source is target
    handles = []
    for k, (lo, hi) in enumerate(schedule.chunk(rank)):  # the first reduce-scatter step's sends
        if prepare is not None:
            prepare(lo, hi)
        if lo < hi:
            handles.append(call.send(right, f"rs0.{k}", source[lo:hi]))
    for step in range(size - 1):  # reduce-scatter: reduce each incoming piece, forward it at once
        last = step == size - 2
        forward = "ag0" if last else f"rs{step + 1}"
        for k, (lo, hi) in enumerate(schedule.chunk(rank - step - 1)):
            if prepare is not None:
                prepare(lo, hi)
            part = target[lo:hi]
            if lo < hi:
                call.recv_into(left, f"rs{step}.{k}", part, op, None if in_place else source[lo:hi])
            if last:
                finalize(op, part, divisor)
                if finished is not None:
                    finished(lo, hi)
            if lo < hi:
                handles.append(call.send(right, f"{forward}.{k}", part))
        if step == 0 and fault_points.ARMED:  # a test's fault point (``daskdist.testing.pause-at``)
            fault_points.reached("reduce-scatter")
    for step in range(size - 1):  # all-gather: copy each incoming piece, forward it unless it is the last step
        for k, (lo, hi) in enumerate(schedule.chunk(rank - step)):
            part = target[lo:hi]
            if lo < hi:
                call.recv_into(left, f"ag{step}.{k}", part, None)
            if finished is not None:
                finished(lo, hi)
            if step < size - 2 and lo < hi:
                handles.append(call.send(right, f"ag{step + 1}.{k}", part))
        if step == 0 and fault_points.ARMED:
            fault_points.reached("all-gather")
    for handle in handles:
        call.wait(handle)
    return target


def allreduce_hierarchical_pipelined(call: Call, buf: Any, op: ReduceOp, hosts: Sequence[str], piece: int,
                                     out: Any = None, lead: int | None = None, slices: int = 1) -> Any:
    """Reduce within each host onto its first replica, ring across those, send back: pipelined piece by piece.

    Parameters
    ----------
    call
        The whole group.
    buf
        This replica's flat pack (only read when ``out`` is given).
    op
        The reduction (``MEAN`` divides by the group's size).
    hosts
        The host of each rank.
    piece
        Elements per message.
    out
        Where the result goes (``None``: in place in ``buf``).
    lead
        Elements of each chunk's first piece, so that the first cross-host send waits only for a small in-host
        reduce (``None``: ``piece``). Taken only when some host has more than one replica, by every rank alike.
    slices
        Above 1: every replica of a host carries one of ``slices`` slices across (``_allreduce_host_slices``);
        ``slice_width(hosts)``, for a buffer of at least that many elements per host; 1: only each host's first
        replica does.
    """
    target = buf if out is None else out
    base_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
    groups = host_groups(hosts)
    local = next(g for g in groups if call.rank in g)
    if slices > 1:
        return _allreduce_host_slices(call, buf, target, op, groups, local, piece, lead)
    leader, leaders = local[0], [g[0] for g in groups]
    if len(leaders) == call.size:
        lead = None  # one replica per host: no in-host reduce to wait for
    schedule = RingSchedule(len(buf), len(leaders), leaders.index(leader), piece, lead)
    if call.rank != leader:
        handles = [call.send(leader, f"h-up{lo}", buf[lo:hi]) for lo, hi in schedule.needed()]
        for lo, hi in schedule.finished():
            call.recv_into(leader, f"h-down{lo}", target[lo:hi], None)
        for handle in handles:
            call.wait(handle)
        return target
    ring = SubCall(call, leaders, "hx-")
    if len(local) == 1:  # alone on its host: the ring reads ``buf`` itself
        return allreduce_ring_pipelined(ring, buf, target, op, piece, divisor=call.size, lead=lead)
    down: list[Any] = []

    def prepare(lo: int, hi: int) -> None:
        base = None if out is None else buf[lo:hi]
        for r in local[1:]:
            call.recv_into(r, f"h-up{lo}", target[lo:hi], base_op, base)
            base = None

    def send_down(lo: int, hi: int) -> None:
        down.extend(call.send(r, f"h-down{lo}", target[lo:hi]) for r in local[1:])

    allreduce_ring_pipelined(ring, target, target, op, piece, divisor=call.size, prepare=prepare,
                             finished=send_down, lead=lead)
    for handle in down:
        call.wait(handle)
    return target


def slice_width(hosts: Sequence[str]) -> int:
    """Into how many slices ``_allreduce_host_slices`` cuts a buffer for ``hosts`` (each host's replica count);
    1: it does not apply (one host, one replica a host, or hosts of unequal replica counts). Take it only for a
    buffer of at least that many elements per host, so that every slice's ring chunk holds one.
    """
    groups = host_groups(hosts)
    width = len(groups[0])
    if len(groups) < 2 or width < 2 or any(len(g) != width for g in groups):
        return 1
    return width


def _allreduce_host_slices(call: Call, buf: Any, target: Any, op: ReduceOp, groups: list[list[int]],
                           local: list[int], piece: int, lead: int | None) -> Any:
    """Every replica of a host owns one slice: sums it in-host, rings it across hosts, sends it back down.

    Slice ``j`` belongs to each host's ``j``-th replica; those replicas run a
    pipelined ring across the hosts on it (``allreduce_ring_pipelined``), one
    connection per slice, so a host's link carries as many streams as it has
    replicas and each replica sums and receives only its share. Every slice
    is cut alike (the longest slice's ``RingSchedule``, clipped), so every
    replica reaches the ring's in-host points in one order: at each ``prepare``
    it first sends its pieces of the other slices to their owners, then sums
    its own slice's from the others; at each ``finished`` it sends its
    finished piece down, then receives the others' finished pieces. Every
    in-host channel thus carries its messages in the order they are read.
    """
    width, me = len(local), local.index(call.rank)
    host = next(i for i, g in enumerate(groups) if g is local)
    n = len(buf)
    length = -(-n // width)
    starts = [min(j * length, n) for j in range(width + 1)]
    schedules = [RingSchedule(length, len(groups), host, piece, lead, limit=starts[j + 1] - starts[j])
                 for j in range(width)]
    needed = [[(starts[j] + lo, starts[j] + hi) for lo, hi in schedules[j].needed()] for j in range(width)]
    final = [[(starts[j] + lo, starts[j] + hi) for lo, hi in schedules[j].finished()] for j in range(width)]
    others = [j for j in range(width) if j != me]
    base_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
    in_place = target is buf
    own = starts[me]
    handles: list[Any] = []
    counters = [0, 0]  # the ring's prepare and finished points passed so far

    def prepare(lo: int, hi: int) -> None:
        point = counters[0]
        counters[0] += 1
        for j in others:
            a, b = needed[j][point]
            if a < b:
                handles.append(call.send(local[j], f"h-up{a}", buf[a:b]))
        if lo < hi:
            base = None if in_place else buf[own + lo : own + hi]
            for j in others:
                call.recv_into(local[j], f"h-up{own + lo}", target[own + lo : own + hi], base_op, base)
                base = None

    def finished(lo: int, hi: int) -> None:
        point = counters[1]
        counters[1] += 1
        if lo < hi:
            handles.extend(call.send(local[j], f"h-down{own + lo}", target[own + lo : own + hi]) for j in others)
        for j in others:
            a, b = final[j][point]
            if a < b:
                call.recv_into(local[j], f"h-down{a}", target[a:b], None)

    ring = SubCall(call, [g[me] for g in groups], f"hx{me}-")
    mine = target[starts[me] : starts[me + 1]]
    allreduce_ring_pipelined(ring, mine, mine, op, piece, divisor=call.size, prepare=prepare, finished=finished,
                             schedule=schedules[me])
    for handle in handles:
        call.wait(handle)
    return target
