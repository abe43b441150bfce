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
"""

from __future__ import annotations

import logging
import queue
import socket
import ssl
import threading
from typing import Any

import numpy as np

from daskdist.collective.mailbox import Abort, Mailbox, Tag
from daskdist.collective.transport.base import SendHandle, Transport, remaining
from daskdist.collective.transport.framing import HEADER, decode, describe_payload, encode, pack_header, unpack_header
from daskdist.exceptions import CollectiveTimeoutError, ReplicaLostError

__all__ = ["SocketTransport"]

logger = logging.getLogger(__name__)

_HELLO = b"daskdist-socket-1"


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


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        view = view[n:]


class SocketTransport(Transport):
    """Sends to peers over direct TCP (optionally TLS) connections.

    Parameters
    ----------
    host
        The interface to listen on (the worker's host).
    server_context, client_context
        TLS contexts (``None`` for plain TCP).
    """

    name = "socket"

    def __init__(self, rank: int, addresses: list[str], mailbox: Mailbox, group_id: str, host: str,
                 server_context: ssl.SSLContext | None = None, client_context: ssl.SSLContext | None = None):
        super().__init__(rank, addresses, mailbox)
        self.group_id = group_id
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
        try:
            if self._server_context is not None:
                conn = self._server_context.wrap_socket(conn, server_side=True)
            with self._lock:
                self._connections.append(conn)
            hello = bytearray(len(_HELLO) + len(self.group_id.encode()))
            _recv_exactly(conn, memoryview(hello))
            if bytes(hello) != _HELLO + self.group_id.encode():
                logger.warning("Rejected a TCP connection that is not from this replica group")
                return
            header = bytearray(HEADER.size)
            while not self._closed:
                _recv_exactly(conn, memoryview(header))
                tag, kind, dtype, shape, total, _, _ = unpack_header(header)
                data = np.empty(total, np.uint8)
                _recv_exactly(conn, memoryview(data))
                self.mailbox.put(tag, decode(kind, dtype, shape, data))
        except (OSError, ConnectionError, ssl.SSLError) as e:
            if not self._closed:
                logger.debug("TCP reader of replica %d stopped: %s", self.rank, e)
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
        sock = socket.create_connection(address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._client_context is not None:
            sock = self._client_context.wrap_socket(sock, server_hostname=address[0])
        sock.sendall(_HELLO + self.group_id.encode())
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
            except BaseException as e:
                handle.error = e
            handle.done.set()

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
