"""Framing of the direct command channel between the client and a replica (both ends import it).

A request is one fixed header (run id, generation, settings length, payload
length) followed by the pickled settings (empty when unchanged) and the
command payload; a response is a length followed by the pickled response
message. Plain blocking sockets, optionally TLS; nothing here knows replicas.
"""

from __future__ import annotations

import pickle
import socket
import ssl
import struct
from typing import Any

__all__ = ["HELLO", "REQUEST", "read_request", "read_response", "recv_exactly", "send_request", "send_response"]

#: Greeting a client sends first, followed by the group's secret (``GroupSpec.secret``).
HELLO = b"daskdist-command-1:"
#: run id, generation, settings bytes, payload bytes.
REQUEST = struct.Struct("<qqQQ")
_LENGTH = struct.Struct("<Q")


def recv_exactly(sock: socket.socket, n: int) -> bytearray:
    """Read exactly ``n`` bytes; ``ConnectionError`` if the peer closes first."""
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        count = sock.recv_into(view[got:], n - got)
        if count == 0:
            raise ConnectionError("the peer closed the command channel")
        got += count
    return buffer


def _send_parts(sock: socket.socket, parts: list[bytes | bytearray | memoryview]) -> None:
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg on TLS sockets
        sock.sendall(b"".join(parts))
        return
    total = sum(len(p) for p in parts)
    sent = sock.sendmsg(parts)
    if sent < total:  # rare: the kernel took part of it
        sock.sendall(b"".join(parts)[sent:])


def send_request(sock: socket.socket, run_id: int, generation: int, settings: bytes, payload: bytes) -> None:
    """Send one command (``settings``: pickled new settings, or empty)."""
    _send_parts(sock, [REQUEST.pack(run_id, generation, len(settings), len(payload)), settings, payload])


def read_request(sock: socket.socket) -> tuple[int, int, dict[str, Any] | None, bytes]:
    """Read one command: ``(run_id, generation, settings or None, payload)``."""
    run_id, generation, n_settings, n_payload = REQUEST.unpack(recv_exactly(sock, REQUEST.size))
    body = recv_exactly(sock, n_settings + n_payload)
    settings: dict[str, Any] | None = pickle.loads(body[:n_settings]) if n_settings else None
    return run_id, generation, settings, bytes(memoryview(body)[n_settings:])


def send_response(sock: socket.socket, response: dict[str, Any]) -> None:
    data = pickle.dumps(response, protocol=pickle.HIGHEST_PROTOCOL)
    _send_parts(sock, [_LENGTH.pack(len(data)), data])


def read_response(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LENGTH.unpack(recv_exactly(sock, _LENGTH.size))
    response: dict[str, Any] = pickle.loads(recv_exactly(sock, n))
    return response
