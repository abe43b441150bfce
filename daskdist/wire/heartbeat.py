"""Heartbeats on a TCP connection: keepalive probes and ``TCP_USER_TIMEOUT``.

A peer whose host went silent (link down: no FIN, no RST) fails the
connection within about ``timeout`` seconds, whether data is in flight
(``TCP_USER_TIMEOUT``) or not (three keepalive probes a third of it apart).
The kernel sends and answers the probes: no thread of ours wakes for them.
"""

from __future__ import annotations

import socket
import ssl

__all__ = ["failed_without_close", "set_heartbeat"]


def set_heartbeat(sock: socket.socket, timeout: float) -> None:
    """Fail ``sock`` when its peer is silent ``timeout`` seconds (0: leave the kernel's defaults)."""
    if not timeout or not hasattr(socket, "TCP_USER_TIMEOUT"):
        return
    interval = max(1, int(timeout / 3))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(timeout * 1000))


_TCP_CLOSE = 7  # Linux tcp_states.h: the connection failed (timed out or reset); the peer's FIN leaves CLOSE_WAIT


def failed_without_close(sock: socket.socket) -> bool:
    """Whether a TLS connection that read end-of-stream was failed by the kernel rather than closed by the peer.

    A TLS socket reports a connection that ``TCP_USER_TIMEOUT`` or keepalive
    failed (the heartbeat) as an unexpected end of stream, which ``ssl``
    turns into an empty read: the TCP state tells the two apart.
    """
    if not isinstance(sock, ssl.SSLSocket) or not hasattr(socket, "TCP_INFO"):
        return False
    try:
        return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_CLOSE)
    except OSError:
        return False
