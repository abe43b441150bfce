"""Direct TCP between replicas, for replicas on different hosts (TLS when the cluster uses it).

Each replica listens on its worker's host at a free port; the address is
exchanged at the rendezvous. A replica opens one connection per peer it
sends to; every frame is a fixed binary header (``framing``) followed by
the payload bytes, written from a per-peer sender thread so that sending
and receiving overlap. A reader thread per incoming connection receives
arrays straight into fresh numpy buffers (``recv_into``, no intermediate
copy) and delivers them to the replica's mailbox.

When the cluster's ``Security`` requires encryption (``tls://`` comms), the
listener and the connections use the cluster's TLS contexts.

Heartbeats: every connection has TCP keepalive and ``TCP_USER_TIMEOUT`` set
from ``daskdist.collective.socket.heartbeat-timeout``, so a peer that goes
silent without closing (its host's link is down: no FIN, no RST) fails the
connection within about that long, whether data is in flight or not. The
transport then reports the peer lost (``on_peer_lost``), and every replica's
waits raise ``ReplicaLostError`` instead of running to the collective's
deadline. A peer that closes its connection (its process ended) is left to
the scheduler, which sees its worker leave.
"""

from __future__ import annotations

import logging
import queue
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from daskdist import config
from daskdist.collective.mailbox import Abort, Mailbox, Tag
from daskdist.collective.transport.base import SendHandle, Transport, remaining
from daskdist.collective.transport.framing import HEADER, decode, describe_payload, encode, pack_header, unpack_header
from daskdist.exceptions import CollectiveTimeoutError, ReplicaLostError

__all__ = ["SocketTransport"]

logger = logging.getLogger(__name__)

_HELLO = b"daskdist-socket-2"
_RANK = struct.Struct("!i")  # the connecting replica's rank, after the hello and the group id


class _PeerClosed(ConnectionError):
    """The peer closed the connection (end of stream): its process ended or closed the transport."""


class _Send(SendHandle):
    def __init__(self, dst: int, address: str) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.dst = dst
        self.address = address

    def wait(self, deadline: float) -> None:
        if not self.done.wait(remaining(deadline)):
            raise CollectiveTimeoutError(f"sending to replica {self.dst} over TCP did not complete before the deadline")
        if self.error is not None:
            raise ReplicaLostError(
                f"lost the TCP connection to replica {self.dst} ({self.address}): {self.error}", worker=self.address
            ) from self.error


_TCP_CLOSE = 7  # Linux tcp_states.h: the connection failed (timed out or reset); the peer's FIN leaves CLOSE_WAIT


def _failed_without_close(sock: socket.socket) -> bool:
    """Whether a TLS connection that read end-of-stream was failed by the kernel rather than closed by the peer.

    A TLS socket reports a connection that ``TCP_USER_TIMEOUT`` or keepalive
    failed (the heartbeat) as an unexpected end of stream, which ``ssl``
    turns into an empty read: the TCP state tells the two apart.
    """
    if not isinstance(sock, ssl.SSLSocket) or not hasattr(socket, "TCP_INFO"):
        return False
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_CLOSE
    except OSError:
        return False


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            if _failed_without_close(sock):
                raise ConnectionError("the TLS connection failed: no answer within the heartbeat timeout, or reset")
            raise _PeerClosed("connection closed by the peer")
        view = view[n:]


class SocketTransport(Transport):
    """Sends to peers over direct TCP (optionally TLS) connections.

    Parameters
    ----------
    host
        The interface to listen on (the worker's host).
    server_context, client_context
        TLS contexts (``None`` for plain TCP).
    on_peer_lost
        Called as ``on_peer_lost(rank, message)`` (``rank`` ``None`` when not
        yet known) when a connection to a peer fails without being closed: the
        heartbeat deadline passed, or the peer's host reset it. ``None``: abort
        this replica's mailbox for good.

    Attributes
    ----------
    sent_bytes
        Bytes written to each peer's connection (frame headers included).
    """

    name = "socket"

    def __init__(self, rank: int, addresses: list[str], mailbox: Mailbox, group_id: str, host: str,
                 server_context: ssl.SSLContext | None = None, client_context: ssl.SSLContext | None = None,
                 on_peer_lost: Callable[[int | None, str], None] | None = None):
        super().__init__(rank, addresses, mailbox)
        self.group_id = group_id
        self.heartbeat_timeout = config.get_seconds("collective.socket.heartbeat-timeout")
        self.sent_bytes: dict[int, int] = {}
        self._on_peer_lost = on_peer_lost
        self._server_context = server_context
        self._client_context = client_context
        self._listener = socket.create_server((host, 0))
        self.listen_address = (host, self._listener.getsockname()[1])
        self._peer_addresses: dict[int, tuple[str, int]] = {}
        self._senders: dict[int, tuple[queue.Queue, threading.Thread]] = {}
        self._readers: list[threading.Thread] = []
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"daskdist-tcp-accept-{rank}", daemon=True)
        self._acceptor.start()

    def local_info(self) -> dict[str, Any]:
        return {"socket": list(self.listen_address)}

    def connect(self, peer_infos: dict[int, dict[str, Any]], membership: Any) -> None:
        self.set_peer_addresses({r: tuple(i["socket"]) for r, i in peer_infos.items() if i.get("socket")})

    def set_peer_addresses(self, addresses: dict[int, tuple[str, int]]) -> None:
        """Where each peer listens (from the rendezvous)."""
        self._peer_addresses = {int(rank): (host, int(port)) for rank, (host, port) in addresses.items()}

    # -- receiving -----------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._read_loop, args=(conn,), daemon=True,
                                      name=f"daskdist-tcp-read-{self.rank}")
            with self._lock:
                self._readers.append(thread)
            thread.start()

    def _read_loop(self, conn: socket.socket) -> None:
        peer: int | None = None
        try:
            self._set_heartbeat(conn)
            if self._server_context is not None:
                conn = self._server_context.wrap_socket(conn, server_side=True)
            with self._lock:
                self._connections.append(conn)
            hello = bytearray(len(_HELLO) + len(self.group_id.encode()) + _RANK.size)
            _recv_exactly(conn, memoryview(hello))
            if bytes(hello[:-_RANK.size]) != _HELLO + self.group_id.encode():
                logger.warning("Rejected a TCP connection that is not from this replica group")
                return
            peer = _RANK.unpack(hello[-_RANK.size:])[0]
            header = bytearray(HEADER.size)
            while not self._closed:
                _recv_exactly(conn, memoryview(header))
                tag, kind, dtype, shape, total, _, _ = unpack_header(header)
                data = np.empty(total, np.uint8)
                _recv_exactly(conn, memoryview(data))
                self.mailbox.put(tag, decode(kind, dtype, shape, data))
        except _PeerClosed as e:
            if not self._closed:
                logger.debug("TCP reader of replica %d stopped: %s", self.rank, e)
        except (OSError, ssl.SSLError) as e:
            if not self._closed:
                self._peer_lost(peer, f"receiving from it failed: {e!r}")
        except Exception as e:  # a frame we cannot decode: fail the run loudly instead of waiting forever
            logger.exception("TCP reader of replica %d failed", self.rank)
            self.mailbox.abort_run(
                self.mailbox.current_run, Abort("aborted", f"replica {self.rank} could not read a TCP frame: {e!r}", self.rank)
            )
        finally:
            conn.close()

    # -- sending -------------------------------------------------------------------

    def _sender(self, dst: int) -> queue.Queue:
        entry = self._senders.get(dst)
        if entry is None:
            jobs: queue.Queue = queue.Queue()
            thread = threading.Thread(target=self._send_loop, args=(dst, jobs), daemon=True,
                                      name=f"daskdist-tcp-send-{self.rank}-{dst}")
            entry = self._senders[dst] = (jobs, thread)
            thread.start()
        return entry[0]

    def _connect(self, dst: int) -> socket.socket:
        address = self._peer_addresses.get(dst)
        if address is None:
            raise ConnectionError(f"no TCP address for replica {dst} (rendezvous did not provide one)")
        sock = socket.create_connection(address, timeout=self.heartbeat_timeout or None)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._set_heartbeat(sock)
        if self._client_context is not None:
            sock = self._client_context.wrap_socket(sock, server_hostname=address[0])
        sock.sendall(_HELLO + self.group_id.encode() + _RANK.pack(self.rank))
        with self._lock:
            self._connections.append(sock)
        return sock

    def _send_loop(self, dst: int, jobs: queue.Queue) -> None:
        sock: socket.socket | None = None
        header = bytearray(HEADER.size)
        while True:
            job = jobs.get()
            if job is None:
                return
            tag, payload, handle = job
            try:
                if sock is None:
                    sock = self._connect(dst)
                kind, data = encode(payload)
                dtype, shape = describe_payload(kind, payload)
                pack_header(header, 0, tag, kind, dtype, shape, data.nbytes, 0, data.nbytes)
                sock.sendall(header)
                if data.nbytes:
                    sock.sendall(memoryview(data.reshape(-1).view(np.uint8)))
                self.sent_bytes[dst] = self.sent_bytes.get(dst, 0) + len(header) + data.nbytes
            except BaseException as e:
                handle.error = e
                if not self._closed and isinstance(e, (OSError, ssl.SSLError)) and not isinstance(e, _PeerClosed):
                    self._peer_lost(dst, f"sending to it failed: {e!r}")
            handle.done.set()

    # -- heartbeats ----------------------------------------------------------------

    def _set_heartbeat(self, sock: socket.socket) -> None:
        """Keepalive probes and a user timeout: a silent peer fails the connection within the heartbeat deadline."""
        timeout = self.heartbeat_timeout
        if not timeout or not hasattr(socket, "TCP_USER_TIMEOUT"):
            return
        interval = max(1, int(timeout / 3))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(timeout * 1000))

    def _peer_lost(self, peer: int | None, detail: str) -> None:
        who = f"replica {peer} ({self.addresses[peer]})" if peer is not None else "a peer replica"
        message = (f"{who} is unreachable from replica {self.rank}: its TCP connection failed without being closed "
                   f"(no answer within daskdist.collective.socket.heartbeat-timeout = {self.heartbeat_timeout:g}s, "
                   f"or reset); {detail}")
        if self._on_peer_lost is not None:
            self._on_peer_lost(peer, message)
        else:
            logger.warning("%s", message)
            self.mailbox.abort_group(Abort("lost", message, self.rank))

    def send(self, dst: int, tag: Tag, payload: Any) -> SendHandle:
        handle = _Send(dst, str(self._peer_addresses.get(dst)))
        self._sender(dst).put((tag, payload, handle))
        return handle

    # -- closing -------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True
        for jobs, thread in self._senders.values():
            jobs.put(None)
        for _, thread in self._senders.values():
            thread.join(5)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self._acceptor.join(5)
        for thread in self._readers:
            thread.join(5)
