"""Direct TCP between replicas, for replicas on different hosts (TLS when the cluster uses it).

Each replica listens on its worker's host at a free port; the address is
exchanged at the rendezvous. Connections are ``daskdist.wire`` connections:
the hello carries the group's secret and the generation's wire id (a
connection from another group or generation is rejected) and the sender's
rank; TLS comes from the cluster's ``Security`` on ``tls://`` clusters, and
every connection has the wire heartbeat. A replica opens one connection per
peer it sends to; every frame is a fixed binary header (``framing``)
followed by the payload bytes.

Small messages (up to ``daskdist.collective.socket.inline-bytes``) are
written by the calling thread itself, header and payload in one ``sendmsg``:
no hand-off to another thread on the critical path. Larger ones go to a
per-peer sender thread so that sending and receiving overlap (the ring's
step). Each incoming connection is read by whichever thread holds its read
lock: a reader thread per connection, which waits for the connection to
become readable without the lock, delivers what arrives to the replica's
mailbox; with ``daskdist.collective.socket.receive-on-caller`` a replica
waiting for a message from that peer reads the connection itself (the
kernel wakes the waiting thread, no hand-off through another thread). That
is off by default: inside a Dask worker process the reader thread, woken
by the same data, competes for the GIL, and it measured no faster
(BENCHMARKS section 6). Either reads into the
connection's buffer, so a small frame (header and payload) costs one
``recv``.

Receives into place: an engine's ``recv_into`` (and the ring's
``sendrecv``) posts its destination before it waits: the collective's own
output where the message is copied, else a scratch buffer the transport
keeps and reuses (``ScratchPool``), which the engine then combines from.
The reader that meets the posted tag reads the payload straight into it
(``recv_into`` for what is not yet in the connection's buffer), so the
receive path allocates nothing and copies a large payload once, from the
kernel. A message that arrives before its receive is posted (or any plain
``recv``) is received into a fresh buffer, as before; ``receive_allocations``
counts those buffers.
A replica waiting on the mailbox may spin
``daskdist.collective.socket.busy-poll`` before it sleeps (``auto``: never:
the spinning thread would hold the GIL that its reader thread needs to
deliver the message).

Heartbeats (``daskdist.wire.heartbeat``, from
``daskdist.collective.socket.heartbeat-timeout``): a peer that goes silent
without closing (its host's link is down: no FIN, no RST) fails the
connection within about that long, whether data is in flight or not. The
transport then reports the peer lost (``on_peer_lost``), and every replica's
waits raise ``ReplicaLostError`` instead of running to the collective's
deadline. A peer that closes its connection (its process ended) is left to
the scheduler, which sees its worker leave.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from dask.utils import parse_bytes

from daskdist import config, wire
from daskdist.collective.mailbox import Abort, Mailbox, MailboxTimeout, Tag
from daskdist.collective.transport.base import (
    Combine,
    CompletedSend,
    SendHandle,
    Transport,
    apply_payload,
    remaining,
)
from daskdist.collective.transport.framing import (
    HEADER,
    SignedArrayFrames,
    describe_payload,
    dtype_text,
    encode,
    pack_header,
)
from daskdist.collective.transport.socket_inbound import Inbound, Posted, ScratchPool
from daskdist.exceptions import CollectiveTimeoutError, ReplicaLostError
from daskdist.wire.frames import Buffer
from daskdist.wire.heartbeat import failed_without_close

__all__ = ["PROTOCOL", "SocketTransport", "busy_poll_seconds"]

logger = logging.getLogger(__name__)

#: The transport's name in the wire hello (``daskdist.wire.hello``).
PROTOCOL = "daskdist-socket-3"
_RANK = struct.Struct("!i")  # the connecting replica's rank: the hello's tail


def busy_poll_seconds() -> float:
    """``daskdist.collective.socket.busy-poll`` in seconds; ``auto``: off.

    The message a waiting replica spins for is delivered by a reader thread
    of its own process, which needs the GIL the spinning thread holds (a
    waiting thread takes it only after the 5 ms switch interval): a spin
    delays the delivery it waits for (BENCHMARKS section 24). A set value
    still spins, for a transport whose delivery does not need this process.
    """
    value = config.get("collective.socket.busy-poll", "auto")
    if value == "auto":
        return 0.0
    return config.get_seconds("collective.socket.busy-poll") if value else 0.0


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


#: One frame to write: its tag, payload kind, payload bytes, dtype and shape (``framing.encode``, ``describe_payload``).
_Frame = tuple[Tag, int, np.ndarray, str, tuple[int, ...]]


class _Peer:
    """One peer's outgoing connection: written by the calling thread (small) or the sender thread (large)."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.write_lock = threading.Lock()  # one writer of the socket at a time
        self.guard = threading.Lock()  # guards pending
        self.pending = 0  # messages queued to the sender thread, not yet written (keeps one thread's order)
        self.jobs: queue.Queue[tuple[Tag, int, np.ndarray, str, tuple[int, ...], _Send] | None] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.headers: list[bytearray] = [bytearray(HEADER.size)]  # frame headers packed for one write


_NOTHING = object()
#: How long a replica reading its peer's connection waits in one ``poll`` before it checks for aborts.
_POLL_SLICE = 0.05


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
    secret
        The group's secret (``GroupSpec.secret``), presented with ``group_id`` in every hello.

    Attributes
    ----------
    sent_bytes
        Bytes written to each peer's connection (frame headers included).
    receive_allocations
        Buffers allocated on the receive path: messages that arrived before
        their receive was posted (or were received by plain ``recv``), and
        scratch buffers made because none kept was free. Zero in the steady
        state of a collective that posts its receives.
    """

    name = "socket"

    def __init__(self, rank: int, addresses: list[str], mailbox: Mailbox, group_id: str, host: str,
                 server_context: ssl.SSLContext | None = None, client_context: ssl.SSLContext | None = None,
                 on_peer_lost: Callable[[int | None, str], None] | None = None, secret: str = ""):
        super().__init__(rank, addresses, mailbox)
        self.group_id = group_id
        self.heartbeat_timeout = config.get_seconds("collective.socket.heartbeat-timeout")
        self.inline_bytes = int(parse_bytes(config.get("collective.socket.inline-bytes", "1MiB")))
        self.busy_poll = busy_poll_seconds()
        self.receive_on_caller = bool(config.get("collective.socket.receive-on-caller", False))
        self._inbound: dict[int, Inbound] = {}
        self.sent_bytes: dict[int, int] = {}
        self._posted: dict[Tag, Posted] = {}
        self._posted_lock = threading.Lock()
        self._scratch = ScratchPool()
        self._fresh_buffers = 0
        self._on_peer_lost = on_peer_lost
        self._client_context = client_context
        self._key = f"{secret}/{group_id}"  # the hello's secret: this group and generation only
        self._peer_addresses: dict[int, tuple[str, int]] = {}
        self._peers: dict[int, _Peer] = {}
        self._peers_lock = threading.Lock()
        self._closed = False
        self._acceptor = wire.Acceptor(host, PROTOCOL, self._key, self._read_loop, tail_bytes=_RANK.size,
                                       ssl_context=server_context, heartbeat=self.heartbeat_timeout,
                                       name=f"daskdist-tcp-read-{rank}")
        self.listen_address = self._acceptor.endpoint

    def local_info(self) -> dict[str, Any]:
        return {"socket": list(self.listen_address)}

    def connect(self, peer_infos: dict[int, dict[str, Any]], membership: Any) -> None:
        self.set_peer_addresses({r: tuple(i["socket"]) for r, i in peer_infos.items() if i.get("socket")})

    def set_peer_addresses(self, addresses: dict[int, tuple[str, int]]) -> None:
        """Where each peer listens (from the rendezvous)."""
        self._peer_addresses = {int(rank): (host, int(port)) for rank, (host, port) in addresses.items()}

    def peer_socket(self, dst: int) -> socket.socket | None:
        """The connection this replica writes to ``dst`` on, once one was opened."""
        peer = self._peers.get(dst)
        return peer.sock if peer is not None else None

    # -- receiving -----------------------------------------------------------------

    def _read_loop(self, conn: socket.socket, tail: bytes) -> None:
        """Deliver frames of one greeted connection to the mailbox (on the acceptor's connection thread).

        The only reader (``receive-on-caller`` off): blocks in ``recv``, no
        ``poll`` or lock per frame. Otherwise it waits for the connection to
        become readable without its read lock, then reads every whole frame
        there is under the lock; a replica waiting for this peer may have
        read them itself meanwhile.
        """
        peer: int = _RANK.unpack(tail)[0]
        inbound = Inbound(conn, peer, self._claim, self._allocated)
        try:
            if not self.receive_on_caller:
                while not self._closed:
                    self.mailbox.put(*inbound.read_frame())
                return
            self._inbound[peer] = inbound
            waiting = select.poll()
            waiting.register(conn, select.POLLIN)
            while not self._closed and not inbound.done:
                if not inbound.buffered():
                    waiting.poll()
                with inbound.lock:
                    while not self._closed and not inbound.done and inbound.readable(0):
                        self.mailbox.put(*inbound.read_frame())
        except Exception as e:
            self._reading_failed(inbound, e)
        finally:
            if self._inbound.get(peer) is inbound:
                del self._inbound[peer]

    def _reading_failed(self, inbound: Inbound, error: BaseException) -> None:
        """Reading ``inbound`` raised ``error`` (either thread): report it once, as a lost peer where it is one."""
        if inbound.done:
            return
        inbound.done = True
        peer = inbound.peer
        if isinstance(error, wire.PeerClosed):
            if self._closed:
                pass
            elif failed_without_close(inbound.conn):  # TLS reads a heartbeat-failed connection as end of stream
                self._peer_lost(peer, "receiving from it failed: the TLS connection failed: no answer within the "
                                      "heartbeat timeout, or reset")
            else:
                logger.debug("TCP reader of replica %d stopped: %s", self.rank, error)
        elif isinstance(error, (OSError, ssl.SSLError)):
            if not self._closed:
                self._peer_lost(peer, f"receiving from it failed: {error!r}")
        else:  # a frame we cannot decode: fail the run loudly instead of waiting forever
            logger.error("TCP reader of replica %d failed", self.rank, exc_info=error)
            self.mailbox.abort_attempt(
                self.mailbox.current_attempt,
                Abort("aborted", f"replica {self.rank} could not read a TCP frame: {error!r}", self.rank),
            )

    @property
    def receive_allocations(self) -> int:
        return self._fresh_buffers + self._scratch.allocations

    @property
    def posted_receives(self) -> int:
        """Receives posted and not yet claimed by a reader (for tests and diagnostics)."""
        with self._posted_lock:
            return sum(1 for p in self._posted.values() if not p.claimed)

    def _allocated(self) -> None:
        self._fresh_buffers += 1  # only reader threads count, one per peer; a lost increment only under-counts

    def _claim(self, tag: Tag) -> Posted | None:
        """The receive posted for ``tag``, claimed by the calling reader (``None``: none is posted)."""
        if not self._posted:
            return None
        with self._posted_lock:
            posted = self._posted.get(tag)
            if posted is None or posted.claimed:
                return None
            posted.claimed = True
            return posted

    def post_receive(self, tag: Tag, out: Any, combine: Combine | None) -> Posted | None:
        """Post the receive of ``tag`` into ``out`` (``combine`` ``None``) or a scratch buffer; ``None``: not a numpy
        array this transport can receive into (the message then arrives in a fresh buffer).

        Every posted receive ends with ``complete_receive`` or ``drop_receive``.
        """
        if self.receive_on_caller or not isinstance(out, np.ndarray) or out.dtype.kind == "O":
            return None
        in_place = combine is None and out.flags.c_contiguous
        target = out.reshape(-1).view(np.uint8) if in_place else self._scratch.borrow(out.nbytes)
        posted = Posted(target, dtype_text(out.dtype), in_place)
        with self._posted_lock:
            self._posted[tag] = posted
        return posted

    def complete_receive(self, posted: Posted | None, src: int, tag: Tag, deadline: float, out: Any,
                         combine: Combine | None, base: Any = None) -> None:
        """Wait for ``tag`` and combine or copy it into ``out``, in place where ``post_receive`` posted it."""
        into_scratch = posted is not None and not posted.in_place
        done = False
        try:
            payload = self.recv(src, tag, deadline)
            if payload is posted:
                assert posted is not None
                if into_scratch:
                    incoming = posted.target.view(out.dtype).reshape(out.shape)
                    if combine is None:
                        np.copyto(out, incoming)
                    else:
                        combine(out, incoming, base)
            else:
                apply_payload(payload, out, combine, base)
            done = True
        finally:
            if posted is not None:
                self.drop_receive(posted, tag, done)

    def drop_receive(self, posted: Posted, tag: Tag, done: bool = False) -> None:
        """Withdraw the receive ``post_receive`` posted for ``tag`` (``done``: its message was used)."""
        with self._posted_lock:
            self._posted.pop(tag, None)
        # a scratch buffer a reader still fills (the wait failed mid-frame) is left to it, not reused
        if not posted.in_place and (done or not posted.claimed):
            self._scratch.give_back(posted.target)

    def recv_into(self, src: int, tag: Tag, deadline: float, out: Any, combine: Combine | None,
                  base: Any = None) -> None:
        posted = self.post_receive(tag, out, combine)
        self.complete_receive(posted, src, tag, deadline, out, combine, base)

    def sendrecv(self, dst: int, send_tag: Tag, payload: Any, src: int, recv_tag: Tag, deadline: float, out: Any,
                 combine: Combine | None, base: Any = None) -> None:
        posted = self.post_receive(recv_tag, out, combine)  # before sending: the peer's answer finds it posted
        handle = self.send(dst, send_tag, payload)
        self.complete_receive(posted, src, recv_tag, deadline, out, combine, base)
        handle.wait(deadline)

    def recv(self, src: int, tag: Tag, deadline: float) -> Any:
        if self.receive_on_caller:
            inbound = self._inbound.get(src)
            if inbound is not None:
                value = self._receive_on_caller(inbound, tag, deadline)
                if value is not _NOTHING:
                    return value
        if self.busy_poll:  # spin a little before sleeping on the mailbox: no wake-up when the message is close
            until = time.monotonic() + self.busy_poll
            while time.monotonic() < until:
                try:
                    return self.mailbox.take(tag, 0.0)
                except MailboxTimeout:
                    pass
        return self.mailbox.take(tag, deadline)

    def _receive_on_caller(self, inbound: Inbound, tag: Tag, deadline: float) -> Any:
        """Read ``src``'s connection on this thread until ``tag`` arrives; ``_NOTHING``: wait on the mailbox instead.

        Frames with other tags go to the mailbox. Gives up (``_NOTHING``)
        when the connection ended or failed (reported as the reader would),
        when the deadline passed (the mailbox then raises the timeout), and
        checks the mailbox, aborts included, between ``poll`` slices.
        """
        mailbox = self.mailbox
        while True:
            try:
                return mailbox.take(tag, 0.0)
            except MailboxTimeout:
                pass
            left = deadline - time.monotonic()
            if inbound.done or left <= 0:
                return _NOTHING
            if not inbound.lock.acquire(timeout=min(left, _POLL_SLICE)):
                continue  # the reader thread is reading a frame: it goes to the mailbox, checked above
            try:
                try:
                    return mailbox.take(tag, 0.0)  # the reader may have delivered it before we took the lock
                except MailboxTimeout:
                    pass
                if inbound.done:
                    return _NOTHING
                if inbound.readable(min(left, _POLL_SLICE)):
                    got, value = inbound.read_frame()
                    if got == tag:
                        return value
                    mailbox.put(got, value)
            except Exception as e:
                self._reading_failed(inbound, e)
                return _NOTHING
            finally:
                inbound.lock.release()

    # -- sending -------------------------------------------------------------------

    def send(self, dst: int, tag: Tag, payload: Any) -> SendHandle:
        kind, data = encode(payload)
        dtype, shape = describe_payload(kind, payload)
        peer = self._peer(dst)
        with peer.guard:
            inline = data.nbytes <= self.inline_bytes and peer.pending == 0
            if not inline:
                peer.pending += 1
        if not inline:
            handle = _Send(dst, str(self._peer_addresses.get(dst)))
            self._sender(dst, peer).put((tag, kind, data, dtype, shape, handle))
            return handle
        with peer.write_lock:  # the calling thread writes: nothing queued for this peer before it
            error = self._write(dst, peer, [(tag, kind, data, dtype, shape)])
        return self._written(dst, error)

    def send_many(self, dst: int, messages: Sequence[tuple[Tag, Any]]) -> list[SendHandle]:
        """Small messages together (up to ``inline-bytes`` in all): one ``sendmsg`` of every header and payload."""
        frames = []
        for tag, payload in messages:
            kind, data = encode(payload)
            dtype, shape = describe_payload(kind, payload)
            frames.append((tag, kind, data, dtype, shape))
        peer = self._peer(dst)
        with peer.guard:
            inline = sum(frame[2].nbytes for frame in frames) <= self.inline_bytes and peer.pending == 0
        if not inline:
            return super().send_many(dst, messages)
        with peer.write_lock:
            error = self._write(dst, peer, frames)
        handle = self._written(dst, error)
        return [handle] * len(frames)

    def send_signed(self, dst: int, frames: SignedArrayFrames, attempt: int, seq: int,
                    array: np.ndarray) -> list[SendHandle]:
        """A collective's signature and ``array`` (``frames``' dtype and shape), numbered ``(attempt, seq)``.

        The calling thread writes both frames in one ``sendmsg`` from headers
        packed once; behind queued large messages to ``dst`` (one thread's
        order holds) they go as ``send_many`` sends them.
        """
        peer = self._peer(dst)
        with peer.guard:
            inline = frames.nbytes <= self.inline_bytes and peer.pending == 0
        if not inline:
            return self.send_many(dst, [((attempt, seq, *frames.sig_tag[2:]), frames.sig),
                                        ((attempt, seq, *frames.data_tag[2:]), array)])
        data = array.reshape(-1).view(np.uint8).data
        with peer.write_lock:  # the headers are shared by this peer's sends of the same shape: renumbered under it
            frames.renumber(attempt, seq)
            error = self._write_parts(dst, peer, [frames.prefix, data])
        return [self._written(dst, error)]

    def _written(self, dst: int, error: BaseException | None) -> SendHandle:
        """The handle of a write the calling thread made: completed, or failed with ``error``."""
        if error is None:
            return CompletedSend()
        self._send_failed(dst, error)
        failed = _Send(dst, str(self._peer_addresses.get(dst)))
        failed.error = error
        failed.done.set()
        return failed

    def _peer(self, dst: int) -> _Peer:
        peer = self._peers.get(dst)
        if peer is None:
            with self._peers_lock:
                peer = self._peers.setdefault(dst, _Peer())
        return peer

    def _sender(self, dst: int, peer: _Peer) -> queue.Queue[Any]:
        if peer.thread is None:
            with self._peers_lock:
                if peer.thread is None:
                    peer.thread = threading.Thread(target=self._send_loop, args=(dst, peer), daemon=True,
                                                   name=f"daskdist-tcp-send-{self.rank}-{dst}")
                    peer.thread.start()
        return peer.jobs

    def _connect(self, dst: int) -> socket.socket:
        address = self._peer_addresses.get(dst)
        if address is None:
            raise ConnectionError(f"no TCP address for replica {dst} (rendezvous did not provide one)")
        return wire.connect(address, PROTOCOL, self._key, tail=_RANK.pack(self.rank), ssl_context=self._client_context,
                            heartbeat=self.heartbeat_timeout, timeout=self.heartbeat_timeout or None)

    def _write(self, dst: int, peer: _Peer, frames: list[_Frame]) -> BaseException | None:
        """Write frames, every header and payload in one ``sendmsg`` (the caller holds ``peer.write_lock``); the
        error, if it failed."""
        while len(peer.headers) < len(frames):
            peer.headers.append(bytearray(HEADER.size))
        parts: list[Buffer] = []
        for header, (tag, kind, data, dtype, shape) in zip(peer.headers, frames):
            pack_header(header, 0, tag, kind, dtype, shape, data.nbytes, 0, data.nbytes)
            parts.append(header)
            if data.nbytes:
                parts.append(data.reshape(-1).view(np.uint8).data)
        return self._write_parts(dst, peer, parts)

    def _write_parts(self, dst: int, peer: _Peer, parts: list[Buffer]) -> BaseException | None:
        """Write ``parts`` in one ``sendmsg``, connecting first if needed (hold ``peer.write_lock``); the error."""
        try:
            if peer.sock is None:
                peer.sock = self._connect(dst)
            self.sent_bytes[dst] = self.sent_bytes.get(dst, 0) + wire.send_parts(peer.sock, parts)
        except BaseException as e:
            return e
        return None

    def _send_failed(self, dst: int, error: BaseException) -> None:
        """A write to ``dst`` failed (called without ``write_lock``): a connection that failed without being
        closed reports its peer lost."""
        if not self._closed and isinstance(error, (OSError, ssl.SSLError)) and not isinstance(error, wire.PeerClosed):
            self._peer_lost(dst, f"sending to it failed: {error!r}")

    def _send_loop(self, dst: int, peer: _Peer) -> None:
        while True:
            job = peer.jobs.get()
            if job is None:
                return
            tag, kind, data, dtype, shape, handle = job
            with peer.write_lock:
                handle.error = self._write(dst, peer, [(tag, kind, data, dtype, shape)])
                with peer.guard:
                    peer.pending -= 1
            if handle.error is not None:
                self._send_failed(dst, handle.error)
            handle.done.set()

    # -- heartbeats ----------------------------------------------------------------

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

    # -- closing -------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True
        peers = list(self._peers.values())
        for peer in peers:
            if peer.thread is not None:
                peer.jobs.put(None)
        for peer in peers:
            if peer.thread is not None:
                peer.thread.join(5)
        self._acceptor.close()
        for peer in peers:  # not under write_lock: shutting down also wakes a writer blocked on a full connection
            sock = peer.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
