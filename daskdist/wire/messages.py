"""One object per frame: pickle protocol 5, buffers out of band.

A frame is a fixed header (body bytes, pickle bytes, buffer count), then the
body: the buffers' lengths, the pickle, and each buffer as it lies in memory
(numpy arrays, ``pickle.PickleBuffer``), written with the header in one
``sendmsg`` (no copy into the pickle on the sending side). The reader takes
the body in one read into one buffer and unpickles over views of it.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

from daskdist.wire.frames import Buffer, recv_exactly, recv_into, send_parts

__all__ = ["HEADER", "recv_message", "send_message"]

#: body bytes, pickle bytes, buffers
HEADER = struct.Struct("<QQI")


def send_message(sock: socket.socket, obj: Any) -> int:
    """Send ``obj`` as one frame; return the bytes written."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    lengths = struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws))
    body = len(lengths) + len(data) + sum(r.nbytes for r in raws)
    parts: list[Buffer] = [HEADER.pack(body, len(data), len(raws)), lengths, data, *raws]
    return send_parts(sock, parts)


def recv_message(sock: socket.socket) -> Any:
    """Read one frame written by ``send_message`` and return its object."""
    body_bytes, n_data, n_buffers = HEADER.unpack(recv_exactly(sock, HEADER.size))
    body = bytearray(body_bytes)
    view = memoryview(body)
    recv_into(sock, view)
    offset = 8 * n_buffers
    lengths = struct.unpack_from(f"<{n_buffers}Q", body) if n_buffers else ()
    data = view[offset : offset + n_data]
    offset += n_data
    buffers = []
    for n in lengths:
        buffers.append(view[offset : offset + n])
        offset += n
    return pickle.loads(data, buffers=buffers)
