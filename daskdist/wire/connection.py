"""Listening, connecting and accepting: the hello, TLS and heartbeats of every daskdist TCP channel.

``connect`` opens a connection, sets ``TCP_NODELAY`` and the heartbeat,
wraps it in TLS and writes the hello; ``accept`` does the same for an
accepted socket and checks the hello (within ``hello_timeout``). Both return
a blocking socket. ``Acceptor`` runs an accept loop on a thread and hands
each greeted connection to a callback; a server that waits in ``selectors``
calls ``accept`` itself.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable

from daskdist.wire.frames import PeerClosed
from daskdist.wire.heartbeat import set_heartbeat
from daskdist.wire.hello import WireRejected, greeting, read_greeting

__all__ = ["HELLO_TIMEOUT", "Acceptor", "accept", "connect", "listen"]

logger = logging.getLogger(__name__)

#: How long an accepted connection has for its TLS handshake and hello.
HELLO_TIMEOUT = 5.0


def listen(host: str) -> socket.socket:
    """A listening socket on ``host`` at a free port."""
    return socket.create_server((host, 0))


def connect(endpoint: tuple[str, int], protocol: str, secret: str, *, tail: bytes = b"",
            ssl_context: ssl.SSLContext | None = None, heartbeat: float = 0, timeout: float | None = 10) -> socket.socket:
    """Connect to ``endpoint`` and greet it; a blocking socket (TLS with ``ssl_context``).

    ``timeout`` bounds the connection and the handshake; ``heartbeat``: see ``set_heartbeat``.
    """
    sock = socket.create_connection((endpoint[0], int(endpoint[1])), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_heartbeat(sock, heartbeat)
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(sock, server_hostname=endpoint[0])
        sock.sendall(greeting(protocol, secret, tail))
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock


def accept(conn: socket.socket, protocol: str, secret: str, *, tail_bytes: int = 0,
           ssl_context: ssl.SSLContext | None = None, heartbeat: float = 0,
           hello_timeout: float = HELLO_TIMEOUT) -> tuple[socket.socket, bytes]:
    """Greet an accepted connection: ``(socket, the hello's tail)``; closed and re-raised on failure.

    Raises
    ------
    WireRejected
        Another protocol, or a wrong secret (logged as a warning).
    OSError, ssl.SSLError
        The handshake or the hello failed (logged at debug level).
    """
    try:
        conn.setblocking(True)
        conn.settimeout(hello_timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_heartbeat(conn, heartbeat)
        if ssl_context is not None:
            conn = ssl_context.wrap_socket(conn, server_side=True)
        tail = read_greeting(conn, protocol, secret, tail_bytes)
        conn.settimeout(None)
    except WireRejected as e:
        logger.warning("Rejected a connection: %s", e)
        conn.close()
        raise
    except (OSError, ssl.SSLError) as e:
        logger.debug("A %s connection failed its greeting: %r", protocol, e)
        conn.close()
        raise
    return conn, tail


class Acceptor:
    """Accepts connections on a thread, greets each on a thread of its own and hands it to ``on_connection``.

    Parameters
    ----------
    host
        The interface to listen on.
    protocol, secret, tail_bytes, ssl_context, heartbeat
        As ``accept``.
    on_connection
        Called as ``on_connection(sock, tail)`` on the connection's thread; the
        socket is closed when it returns.
    name
        The threads' name.
    """

    def __init__(self, host: str, protocol: str, secret: str, on_connection: Callable[[socket.socket, bytes], None], *,
                 tail_bytes: int = 0, ssl_context: ssl.SSLContext | None = None, heartbeat: float = 0,
                 name: str = "daskdist-wire"):
        self._listener = listen(host)
        self.endpoint: tuple[str, int] = (host, int(self._listener.getsockname()[1]))
        self._protocol, self._secret, self._tail_bytes = protocol, secret, tail_bytes
        self._ssl_context, self._heartbeat = ssl_context, heartbeat
        self._on_connection = on_connection
        self._name = name
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self.closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name=f"{name}-accept")
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True, name=self._name)
            with self._lock:
                if self.closed:
                    conn.close()
                    return
                self._connections.add(conn)
                self._threads.append(thread)
            thread.start()

    def _serve(self, raw: socket.socket) -> None:
        conn = raw
        try:
            conn, tail = accept(raw, self._protocol, self._secret, tail_bytes=self._tail_bytes,
                                ssl_context=self._ssl_context, heartbeat=self._heartbeat)
            with self._lock:
                self._connections.discard(raw)
                if self.closed:
                    return
                self._connections.add(conn)
            self._on_connection(conn, tail)
        except (WireRejected, PeerClosed, OSError, ssl.SSLError):
            pass  # logged by accept, or the peer went
        finally:
            with self._lock:
                self._connections.discard(conn)
                self._connections.discard(raw)
            conn.close()

    def close(self, join: float = 5) -> None:
        """Stop accepting, shut every connection down and wait up to ``join`` seconds for the threads."""
        with self._lock:
            self.closed = True
            connections, self._connections = list(self._connections), set()
            threads = list(self._threads)
        for sock in (self._listener, *connections):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() or recv()
            sock.close()
        self._thread.join(join)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(join)
