"""The greeting every connection starts with: protocol name, secret, and a fixed-size tail.

``greeting(protocol, secret, tail)`` is what the connecting side writes; the
accepting side reads it with ``read_greeting`` and compares the secret in
constant time (``hmac.compare_digest``). A connection that names another
protocol or presents another secret raises ``WireRejected`` and is closed by
the caller. The tail is the protocol's own (the socket transport sends its
rank); its size is fixed per protocol.
"""

from __future__ import annotations

import hmac
import socket
import struct

from daskdist.wire.frames import recv_exactly

__all__ = ["MAX_SECRET_BYTES", "WireRejected", "greeting", "read_greeting"]

_FIXED = struct.Struct("<24sH")  # protocol name, secret bytes
MAX_SECRET_BYTES = 1024


class WireRejected(ConnectionError):
    """A connection's greeting named another protocol or presented a wrong secret."""


def greeting(protocol: str, secret: str, tail: bytes = b"") -> bytes:
    """What a connecting side writes first."""
    key = secret.encode()
    if len(key) > MAX_SECRET_BYTES:
        raise ValueError(f"a wire secret is at most {MAX_SECRET_BYTES} bytes")
    return _FIXED.pack(protocol.encode(), len(key)) + key + tail


def read_greeting(sock: socket.socket, protocol: str, secret: str, tail_bytes: int = 0) -> bytes:
    """Read and check a greeting; return its tail.

    Raises
    ------
    WireRejected
        The greeting named another protocol or presented another secret.
    """
    name, n_secret = _FIXED.unpack(recv_exactly(sock, _FIXED.size))
    if name.rstrip(b"\0") != protocol.encode() or n_secret > MAX_SECRET_BYTES:
        raise WireRejected(f"not a {protocol} connection")
    presented = bytes(recv_exactly(sock, n_secret))
    tail = bytes(recv_exactly(sock, tail_bytes)) if tail_bytes else b""
    if not hmac.compare_digest(presented, secret.encode()):
        raise WireRejected(f"a {protocol} connection did not present this channel's secret")
    return tail
