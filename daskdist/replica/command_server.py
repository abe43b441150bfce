"""The replica's end of the direct command channel: where the replica thread waits for its next command.

The client keeps one TCP connection (TLS on ``tls://`` clusters) to each
replica and sends commands on it, so a command reaches the replica thread
without passing through the client's event loop, Dask's RPC layer or the
worker's event loop (the ``daskdist_call`` handler path, which stays for
``ReplicaGroup.submit`` and for clients that cannot reach the port). The
replica thread itself waits in ``select`` on these connections and on a
wake-up pipe that the event-loop side pokes when it queues a command.
The listener lives as long as the replica, across membership generations.
"""

from __future__ import annotations

import logging
import os
import pickle
import selectors
import socket
import ssl
from typing import Any

from daskdist import wire
from daskdist.group.channel import PROTOCOL, REQUEST

__all__ = ["CommandServer", "Request"]

logger = logging.getLogger(__name__)

#: One command as read: run id, generation, the client's new settings (or ``None``), the pickled command.
Request = tuple[int, int, "dict[str, Any] | None", memoryview]


def read_request(sock: socket.socket) -> Request:
    """Read one command sent by ``daskdist.group.channel.send_request`` (two reads: header, then body)."""
    run_id, generation, n_settings, n_payload = REQUEST.unpack(wire.recv_exactly(sock, REQUEST.size))
    body = memoryview(wire.recv_exactly(sock, n_settings + n_payload))
    settings: dict[str, Any] | None = pickle.loads(body[:n_settings]) if n_settings else None
    return run_id, generation, settings, body[n_settings:]


class CommandServer:
    """Listens for the client's command connections and reads their requests on the replica thread.

    Parameters
    ----------
    host
        The interface to listen on (the worker's host).
    secret
        What a client must present in its wire hello (the group's secret, known only to its client).
    ssl_context
        The server's TLS context, or ``None`` for plain TCP.
    """

    def __init__(self, host: str, secret: str, ssl_context: ssl.SSLContext | None = None):
        self._secret = secret
        self._ssl_context = ssl_context
        self._listener = wire.listen(host)
        self._listener.setblocking(False)
        self.address = (host, self._listener.getsockname()[1])
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._connections: dict[int, socket.socket] = {}  # by file descriptor
        self._closed = False

    def local_info(self) -> dict[str, Any]:
        return {"command": list(self.address)}

    def wake(self) -> None:
        """Make ``wait`` return (any thread): a command was queued by the other path, or the replica stops."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # the pipe is full (already woken) or closed
            pass

    def wait(self, timeout: float | None = None) -> list[tuple[socket.socket, Request]]:
        """Block until requests arrive or ``wake`` is called; return the requests read (maybe none)."""
        requests = []
        for key, _ in self._selector.select(timeout):
            if key.data == "wake":
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            elif key.data == "accept":
                self._accept()
            else:
                conn = self._connections[key.fd]
                while True:
                    try:
                        requests.append((conn, read_request(conn)))
                    except (OSError, ssl.SSLError, EOFError, pickle.UnpicklingError) as e:
                        logger.debug("Command connection closed: %s", e)
                        self._drop(conn)
                        break
                    # TLS may hold a whole further request in its buffer, invisible to select
                    if not (isinstance(conn, ssl.SSLSocket) and conn.pending()):
                        break
        return requests

    def reply(self, conn: socket.socket, response: dict[str, Any]) -> None:
        try:
            wire.send_message(conn, response)
        except (OSError, ssl.SSLError) as e:  # the client went away; it sees the connection fail
            logger.debug("Could not answer on a command connection: %s", e)
            self._drop(conn)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, OSError):
            return
        try:  # on the replica thread: bounded by the hello timeout; a rejected one is logged by wire.accept
            conn, _ = wire.accept(conn, PROTOCOL, self._secret, ssl_context=self._ssl_context)
        except (OSError, ssl.SSLError):
            return
        self._connections[conn.fileno()] = conn
        self._selector.register(conn, selectors.EVENT_READ, "request")

    def _drop(self, conn: socket.socket) -> None:
        self._connections.pop(conn.fileno(), None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()
        self._selector.close()
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
