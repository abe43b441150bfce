"""Whole reads and scatter/gather writes on a blocking socket.

``send_parts`` writes a frame's header and payload with one ``sendmsg`` (no
join, no second system call unless the kernel takes part of it); TLS sockets
have no ``sendmsg`` and get one ``sendall`` of the joined parts. ``recv_into``
and ``recv_exactly`` read until the view is full and raise ``PeerClosed`` at
end of stream.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence

__all__ = ["Buffer", "PeerClosed", "recv_exactly", "recv_into", "send_parts"]

Buffer = bytes | bytearray | memoryview


class PeerClosed(ConnectionError):
    """The peer closed the connection (end of stream): its process ended or it closed the channel."""


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` (a byte view) from ``sock``."""
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise PeerClosed("connection closed by the peer")
        view = view[n:]


def recv_exactly(sock: socket.socket, n: int) -> bytearray:
    """Read exactly ``n`` bytes."""
    buffer = bytearray(n)
    recv_into(sock, memoryview(buffer))
    return buffer


def send_parts(sock: socket.socket, parts: Sequence[Buffer]) -> int:
    """Write ``parts`` in order, as one ``sendmsg`` where the kernel takes it all; return the bytes written."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    total = sum(v.nbytes for v in views)
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg on TLS sockets
        sock.sendall(b"".join(views))
        return total
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
    return total
