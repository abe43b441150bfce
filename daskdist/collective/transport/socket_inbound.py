"""The receiving side of the socket transport: one peer's connection and the receives posted before data came.

``Inbound`` reads whole frames from a peer's connection into its read
buffer (a small frame, header and payload, costs one ``recv``). When a
frame's tag has a ``Posted`` receive, the payload goes straight into that
receive's bytes (the collective's own output, or a ``ScratchPool`` buffer
the receive combines from); else into a fresh buffer. A text or object
payload (a collective's signature) already whole in the read buffer is
decoded where it lies, with no buffer of its own.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from daskdist import wire
from daskdist.collective.mailbox import Tag
from daskdist.collective.transport.framing import ARRAY, HEADER, decode, unpack_header

__all__ = ["Inbound", "Posted", "ScratchPool"]

_READ_BUFFER = 256 * 1024  # each reader's buffer: small frames arrive whole in one recv


class Posted:
    """A receive posted before its message arrived: the bytes it lands in, claimed by the reader that meets its tag.

    ``target`` is the receive's own output (``in_place``) or a scratch
    buffer the receive combines from; ``claimed``: a reader met the tag and
    reads (or read) the payload into ``target``.
    """

    __slots__ = ("claimed", "dtype", "in_place", "target")

    def __init__(self, target: np.ndarray, dtype: str, in_place: bool) -> None:
        self.target = target  # uint8, C-contiguous, exactly the payload's bytes
        self.dtype = dtype
        self.in_place = in_place
        self.claimed = False

    def fits(self, kind: int, dtype: str, total: int) -> bool:
        return kind == ARRAY and dtype == self.dtype and total == self.target.nbytes


class ScratchPool:
    """Reused receive buffers for receives that combine (a reduction reads the incoming bytes, then drops them)."""

    def __init__(self, keep: int = 4) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._keep = keep
        self.allocations = 0

    def borrow(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of ``nbytes`` (a view of a kept buffer at least that large, else a new one)."""
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.nbytes >= nbytes:
                    return self._free.pop(i)[:nbytes]
            self.allocations += 1
        return np.empty(nbytes, np.uint8)

    def give_back(self, buffer: np.ndarray) -> None:
        whole = buffer.base if isinstance(buffer.base, np.ndarray) else buffer
        with self._lock:
            self._free.append(whole)
            self._free.sort(key=lambda b: b.nbytes)
            while len(self._free) > self._keep:
                self._free.pop(0)


class Inbound:
    """One peer's incoming connection and its read buffer; read only by the holder of ``lock``.

    The reader thread waits for the connection to become readable without
    the lock and then reads under it; a replica thread waiting for a message
    from this peer takes the lock and reads the connection itself.
    """

    def __init__(self, conn: socket.socket, peer: int, claim: Callable[[Tag], Posted | None] | None = None,
                 on_allocate: Callable[[], None] | None = None) -> None:
        self.conn = conn
        self.peer = peer
        self._claim = claim
        self._on_allocate = on_allocate
        self.lock = threading.Lock()
        self.buf = bytearray(_READ_BUFFER)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        self.done = False  # the connection failed or ended (reported once, by the thread that saw it)
        self._tls = isinstance(conn, ssl.SSLSocket)
        self._poll = select.poll()  # used under ``lock`` only
        self._poll.register(conn, select.POLLIN)

    def buffered(self) -> bool:
        """Whether bytes are already read (into this buffer, or decrypted inside TLS) but not yet consumed."""
        return self.end > self.start or (self._tls and self.conn.pending() > 0)  # type: ignore[attr-defined]

    def readable(self, timeout: float) -> bool:
        """Whether a frame can be read now, waiting up to ``timeout`` seconds (hold ``lock``)."""
        return self.buffered() or bool(self._poll.poll(max(0, int(timeout * 1000))))

    def read_frame(self) -> tuple[Tag, Any]:
        """Read one whole frame: ``(tag, decoded payload)`` (hold ``lock``)."""
        conn, buf, view = self.conn, self.buf, self.view
        start, end = self.start, self.end
        if end - start < HEADER.size:  # too little for a header: move what is left to the front, read on
            if start:
                buf[: end - start] = buf[start:end]
                end, start = end - start, 0
            while end < HEADER.size:
                n = conn.recv_into(view[end:])
                if n == 0:
                    self.start, self.end = start, end
                    raise wire.PeerClosed("connection closed by the peer")
                end += n
        tag, kind, dtype, shape, total, _, _ = unpack_header(buf, start)
        start += HEADER.size
        if kind != ARRAY and end - start >= total:  # a signature or an object, all read: decoded where it lies
            value = decode(kind, dtype, shape, view[start : start + total])
            start += total
            if start == end:
                start = end = 0
            self.start, self.end = start, end
            return tag, value
        posted = self._claim(tag) if self._claim is not None else None
        if posted is not None and not posted.fits(kind, dtype, total):
            posted.claimed = False  # not what the receive expects: delivered as it is, the receive raises
            posted = None
        if posted is not None:
            data = posted.target
        else:
            data = np.empty(total, np.uint8)
            if self._on_allocate is not None:
                self._on_allocate()
        have = min(total, end - start)
        if have:
            data.data[:have] = view[start : start + have]
            start += have
        if start == end:
            start = end = 0
        self.start, self.end = start, end
        if have < total:
            wire.recv_into(conn, data[have:].data)
        if posted is not None:
            return tag, posted
        return tag, decode(kind, dtype, shape, data)
