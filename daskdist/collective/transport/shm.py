"""Shared-memory transport for replicas on the same host (CPU arrays).

Every ordered pair of replicas (src -> dst) on one host has a channel: a
POSIX shared-memory segment created and owned by the receiver, holding four
slots. The sender copies a message into a free slot (large messages go in
pieces of ``daskdist.collective.shm.slot-bytes``, written by a sender thread
so sending and receiving overlap); the receiver combines each piece straight
from the slot into its result and frees the slot. Waiting spins briefly and
then yields, checking the replica's mailbox for aborts, so a replica blocked
here still raises at once when a peer is lost or the run is aborted.

Segments are created without Python's resource tracker (which, shared by
a cluster's spawned workers, would mix up owners). Every replica unlinks
all the segments of its host's replicas in the group when it closes or when
the group is aborted, so a crashed replica's segments are removed by its
surviving neighbours; unlinking leaves existing mappings valid. Segments
record their creator, so those of a host whose replicas all died at once
are removed when replicas next start there (``shm_orphans``).
"""

from __future__ import annotations

import logging
import platform
import queue
import threading
import time
from typing import Any

import numpy as np

from daskdist.collective.mailbox import Mailbox, Tag
from daskdist.collective.transport.base import (
    Combine,
    CompletedSend,
    PayloadMismatch,
    SendHandle,
    Transport,
    apply_payload,
    remaining,
)
from daskdist.collective.transport.framing import ARRAY, decode, describe_payload, dtype_text, encode
from daskdist.collective.transport.shm_channel import (
    ShmChannel,
    _Spinner,
    backoff_wait,
    lane_header,
    spin_seconds_for,
    store_order_is_total,
    unlink_segment,
    usable_cores,
)
from daskdist.collective.transport.shm_lane import ShmLane
from daskdist.collective.transport.shm_orphans import sweep_orphans
from daskdist.exceptions import CollectiveTimeoutError, DaskdistError

__all__ = ["ShmChannel", "ShmLane", "ShmTransport", "backoff_wait", "lane_header", "segment_name",
           "shm_supported", "unlink_segment", "usable_cores"]

logger = logging.getLogger(__name__)


_UNSUPPORTED = (
    "the shared-memory transport is not used on this machine ({machine}): it publishes slots without a memory "
    "fence, which is correct only where stores become visible in program order (64-bit x86); replicas on one "
    "host talk over sockets instead"
)
_logged_unsupported = False


def shm_supported() -> bool:
    """Whether this machine may use the shared-memory transport (``store_order_is_total``); logs once if not."""
    global _logged_unsupported
    if store_order_is_total():
        return True
    if not _logged_unsupported:
        _logged_unsupported = True
        logger.warning("%s", _UNSUPPORTED.format(machine=platform.machine()))
    return False


def segment_name(group_id: str, src: int, dst: int) -> str:
    """Name of the channel segment ``src -> dst`` of a group (under ``/dev/shm``)."""
    return f"daskdist-{group_id.rsplit('-', 1)[-1]}-{src}-{dst}"


class _ThreadedSend(SendHandle):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, deadline: float) -> None:
        if not self.done.wait(remaining(deadline)):
            raise CollectiveTimeoutError("a shared-memory send did not complete before the deadline")
        if self.error is not None:
            raise self.error


class _Incoming:
    """One array message arriving piece by piece, copied or combined into ``out`` (``base``: out of place)."""

    def __init__(self, transport: ShmTransport, src: int, tag: Tag, out: Any, combine: Combine | None, base: Any):
        self.transport = transport
        self.channel = transport._inbound[src]
        self.src = src
        self.tag = tag
        self.out = out
        self.flat_out = out.reshape(-1)
        self.flat_base = None if base is None else base.reshape(-1)
        self.combine = combine
        self.itemsize = out.dtype.itemsize
        self.done = False
        self._checked = False

    def take(self, header: tuple[Any, ...], data: np.ndarray) -> None:
        """Use the piece ``(header, data)``, the channel's oldest, and free its slot."""
        _, kind, dtype, _shape, total, offset, nbytes = header
        out = self.out
        if not self._checked:
            if kind != ARRAY or total != out.nbytes or dtype != dtype_text(out.dtype):
                self.transport.stash_message(self.src, header, data)
                got = self.transport.take_stashed(self.src, self.tag)
                raise PayloadMismatch(getattr(got, "size", None), out.size)
            self._checked = True
        lo, hi = offset // self.itemsize, (offset + nbytes) // self.itemsize
        part = self.flat_out[lo:hi]
        incoming = data.view(out.dtype)
        if self.combine is None:
            np.copyto(part, incoming)
        else:
            self.combine(part, incoming, None if self.flat_base is None else self.flat_base[lo:hi])
        self.channel.release()
        self.done = offset + nbytes >= total


class ShmTransport(Transport):
    """Moves CPU arrays between replicas of one host through shared memory.

    Parameters
    ----------
    peers
        Ranks this transport talks to (the replicas on the same host).
    group_id
        Used to name the segments.
    slot_bytes
        Size of each of the four slots of a channel; larger messages go in pieces.
    """

    name = "shm"

    def __init__(self, rank: int, addresses: list[str], mailbox: Mailbox, peers: list[int], group_id: str,
                 slot_bytes: int):
        if not shm_supported():
            raise DaskdistError(_UNSUPPORTED.format(machine=platform.machine()))
        super().__init__(rank, addresses, mailbox)
        self.peers = peers
        self.group_id = group_id
        self.slot_bytes = slot_bytes
        self.spin_seconds = spin_seconds_for(len(peers) + 1)
        self.oversubscribed = len(peers) + 1 > usable_cores()  # more replicas here than cores
        sweep_orphans()  # segments of earlier groups whose replicas here were all killed at once
        self._inbound = {src: ShmChannel(segment_name(group_id, src, rank), slot_bytes, create=True) for src in peers}
        self._outbound: dict[int, ShmChannel] = {}
        self._stash: dict[tuple[int, Tag], Any] = {}
        self._sends: queue.Queue[tuple[int, Tag, Any, _ThreadedSend, int, bytes] | None] = queue.Queue()
        self._sender: threading.Thread | None = None
        self._queued: dict[int, int] = {}  # sends per destination still with the sender thread
        self._queued_lock = threading.Lock()
        self._closed = False

    # -- sending -------------------------------------------------------------------

    def _channel_to(self, dst: int) -> ShmChannel:
        channel = self._outbound.get(dst)
        if channel is None:
            channel = self._outbound[dst] = ShmChannel(segment_name(self.group_id, self.rank, dst), self.slot_bytes,
                                                       create=False)
        return channel

    def send(self, dst: int, tag: Tag, payload: Any, extra: bytes = b"") -> SendHandle:
        """Send ``payload`` to ``dst``; ``extra`` (a few hundred bytes) travels beside each piece's header."""
        channel = self._channel_to(dst)
        kind, data = encode(payload)
        # Write inline only when nothing for ``dst`` is still queued: one writer per channel, in order.
        if not self._queued.get(dst) and data.nbytes <= self.slot_bytes and channel.can_write():
            channel.write(tag, kind, *describe_payload(kind, payload), data.nbytes, 0, data, extra)
            return CompletedSend()
        handle = _ThreadedSend()
        with self._queued_lock:
            self._queued[dst] = self._queued.get(dst, 0) + 1
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, name=f"daskdist-shm-send-{self.rank}", daemon=True)
            self._sender.start()
        self._sends.put((dst, tag, payload, handle, tag[0], extra))
        return handle

    def try_send_lane(self, dst: int, header: bytes, attempt: int, seq: int, value: np.ndarray, key: tuple[Any, ...]) -> bool:
        """Write a one-piece lane message now (``ShmChannel.write_lane``), if ``dst``'s channel has room.

        Returns ``False`` (nothing written) when the channel is full or earlier
        sends to ``dst`` are still queued; the caller then uses ``send``.
        """
        channel = self._outbound.get(dst) or self._channel_to(dst)
        if self._queued.get(dst) or not channel.can_write():
            return False
        channel.write_lane(header, attempt, seq, value, key)
        return True

    def lane(self) -> ShmLane:
        """The latency lane's access to this transport (one-piece writes, reads in place)."""
        return ShmLane(self, list(self.peers))

    def _send_loop(self) -> None:
        while True:
            item = self._sends.get()
            if item is None:
                return
            dst, tag, payload, handle, attempt, extra = item
            try:
                self._write_pieces(self._outbound[dst], tag, payload, attempt, extra)
            except BaseException as e:
                handle.error = e
            finally:
                with self._queued_lock:
                    self._queued[dst] -= 1
            handle.done.set()

    def _write_pieces(self, channel: ShmChannel, tag: Tag, payload: Any, attempt: int, extra: bytes = b"") -> None:
        kind, data = encode(payload)
        total = data.nbytes
        flat = data.reshape(-1).view(np.uint8)
        offset = 0
        deadline = time.monotonic() + 24 * 3600  # the receiver's deadline governs; aborts end the wait

        def check() -> None:
            if self._closed:
                raise DaskdistError("transport closed")
            self.mailbox.check(attempt)

        dtype, shape = describe_payload(kind, payload)
        while True:
            piece = flat[offset : offset + self.slot_bytes]
            backoff_wait(channel.can_write, deadline, check, self.spin_seconds)
            channel.write(tag, kind, dtype, shape, total, offset, piece, extra)
            offset += piece.nbytes
            if offset >= total:
                return

    # -- receiving -----------------------------------------------------------------

    def _next_piece(self, src: int, deadline: float, attempt: int) -> tuple[tuple[Any, ...], np.ndarray]:
        channel = self._inbound[src]
        backoff_wait(channel.can_read, deadline, lambda: self.mailbox.check(attempt), self.spin_seconds)
        return channel.peek()

    def _find(self, src: int, tag: Tag, deadline: float) -> tuple[tuple[Any, ...], np.ndarray]:
        """Advance channel ``src`` to the first piece of ``tag``, stashing or dropping others."""
        channel = self._inbound[src]
        while True:
            header, data = self._next_piece(src, deadline, tag[0])
            piece_tag = tuple(header[0])
            if piece_tag == tag:
                return header, data
            if piece_tag[0] < self.mailbox.current_attempt:
                channel.release()  # left over from an aborted attempt
                continue
            self.stash_message(src, header, data)

    def outbound(self, dst: int) -> ShmChannel:
        """The channel from this replica to ``dst`` (opened on first use: ``dst`` created it)."""
        return self._channel_to(dst)

    @property
    def queued(self) -> dict[int, int]:
        """Sends per destination still with the sender thread (this dict is updated in place)."""
        return self._queued

    def inbound(self, src: int) -> ShmChannel:
        """The channel from ``src`` to this replica."""
        return self._inbound[src]

    def take_stashed(self, src: int, tag: Tag) -> Any:
        """The out-of-order message kept from ``src`` under ``tag`` (removed), or ``None``."""
        return self._stash.pop((src, tag), None) if self._stash else None

    def stash_message(self, src: int, header: tuple[Any, ...], data: np.ndarray) -> None:
        """Keep an out-of-order message (rare: only after a mismatch) as an owned copy."""
        channel = self._inbound[src]
        tag, kind, dtype, shape, total, offset, _ = header
        buffer = bytearray(total)
        while True:
            buffer[offset : offset + data.nbytes] = data.tobytes()
            channel.release()
            if offset + data.nbytes >= total:
                break
            header, data = self._next_piece(src, time.monotonic() + 60, tag[0])
            offset = header[5]
        self._stash[(src, tuple(tag))] = decode(kind, dtype, shape, memoryview(buffer))

    def recv(self, src: int, tag: Tag, deadline: float) -> Any:
        stashed = self._stash.pop((src, tag), None)
        if stashed is not None:
            return stashed
        header, data = self._find(src, tag, deadline)
        _, kind, dtype, shape, total, offset, nbytes = header
        channel = self._inbound[src]
        if nbytes == total:
            value = decode(kind, dtype, shape, data)
            value = value.copy() if isinstance(value, np.ndarray) else value
            channel.release()
            return value
        buffer = bytearray(total)
        while True:
            buffer[offset : offset + nbytes] = data.tobytes()
            channel.release()
            if offset + nbytes >= total:
                return decode(kind, dtype, shape, memoryview(buffer))
            header, data = self._next_piece(src, deadline, tag[0])
            offset, nbytes = header[5], header[6]

    def recv_into(self, src: int, tag: Tag, deadline: float, out: Any, combine: Combine | None,
                  base: Any = None) -> None:
        stashed = self._stash.pop((src, tag), None)
        if stashed is not None:
            return apply_payload(stashed, out, combine, base)
        header, data = self._find(src, tag, deadline)
        incoming = _Incoming(self, src, tag, out, combine, base)
        incoming.take(header, data)
        while not incoming.done:
            incoming.take(*self._next_piece(src, deadline, tag[0]))
        return None

    def sendrecv(self, dst: int, send_tag: Tag, payload: Any, src: int, recv_tag: Tag, deadline: float, out: Any,
                 combine: Combine | None, base: Any = None) -> None:
        """Send to ``dst`` and receive from ``src`` in this thread, a piece of either whenever its channel allows.

        No sender thread: on a host with few cores, one thread per replica
        moving memory beats two that compete for the same core.
        """
        if self._queued.get(dst) or (src, recv_tag) in self._stash or src not in self._inbound:
            return super().sendrecv(dst, send_tag, payload, src, recv_tag, deadline, out, combine, base)
        out_channel, in_channel = self._channel_to(dst), self._inbound[src]
        kind, data = encode(payload)
        dtype, shape = describe_payload(kind, payload)
        flat, total = data.reshape(-1).view(np.uint8), data.nbytes
        sent, send_done = 0, False
        incoming: _Incoming | None = None
        attempt = recv_tag[0]
        spinner = _Spinner(deadline, lambda: self.mailbox.check(attempt), self.spin_seconds)
        while True:
            progressed = False
            if not send_done and out_channel.can_write():
                piece = flat[sent : sent + self.slot_bytes]
                out_channel.write(send_tag, kind, dtype, shape, total, sent, piece)
                sent += piece.nbytes
                send_done = sent >= total
                progressed = True
            if (incoming is None or not incoming.done) and in_channel.can_read():
                header, piece_data = in_channel.peek()
                if incoming is not None:
                    incoming.take(header, piece_data)
                elif tuple(header[0]) == recv_tag:
                    incoming = _Incoming(self, src, recv_tag, out, combine, base)
                    incoming.take(header, piece_data)
                elif header[0][0] < self.mailbox.current_attempt:
                    in_channel.release()  # left over from an aborted attempt
                else:
                    self.stash_message(src, header, piece_data)
                progressed = True
            if send_done and incoming is not None and incoming.done:
                return None
            if progressed:
                spinner.progressed()
            else:
                spinner.idle()

    # -- closing -------------------------------------------------------------------

    def segment_names(self) -> list[str]:
        """Every channel segment among this host's replicas of the group (ours and our peers')."""
        ranks = sorted({self.rank, *self.peers})
        return [segment_name(self.group_id, s, d) for s in ranks for d in ranks if s != d]

    def group_aborted(self) -> None:
        self.unlink_all()

    def unlink_all(self) -> None:
        """Remove the group's segments on this host: also those of a crashed neighbour."""
        for name in self.segment_names():
            unlink_segment(name)

    def close(self) -> None:
        self._closed = True
        if self._sender is not None:
            self._sends.put(None)
            self._sender.join(5)
        for channel in [*self._inbound.values(), *self._outbound.values()]:
            channel.close()
        self.unlink_all()
        self._inbound.clear()
        self._outbound.clear()
        self._stash.clear()
