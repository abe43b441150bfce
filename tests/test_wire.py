"""daskdist.wire on real sockets in one process: hello and secret, framed messages, TLS, heartbeats, the acceptor.

The three channels built on it (command channel, socket transport, PS
channel) are tested through their own modules; these tests pin the shared
layer: what a wrong greeting gets, that buffers travel out of band and arrive
whole past the socket buffers, and that TLS from the cluster's ``Security``
carries the same frames.
"""

from __future__ import annotations

import pickle
import socket
import ssl
import threading
import time

import numpy as np
import pytest

from daskdist import wire
from daskdist.wire.hello import WireRejected, greeting, read_greeting
from daskdist.wire.tls import client_context, worker_contexts


def _served(handler, **kwargs):
    """An acceptor whose connections are handled by ``handler(sock, tail)``; returns it and what it saw."""
    seen: list = []

    def on_connection(sock, tail):
        seen.append(tail)
        handler(sock, tail)

    return wire.Acceptor("127.0.0.1", "test-proto", "s3cret", on_connection, **kwargs), seen


def _closed_by_peer(sock) -> bool:
    """Whether the other end closed ``sock`` (end of stream, or a reset when it left our bytes unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _echo(sock, tail):
    while True:
        wire.send_message(sock, wire.recv_message(sock))


def test_hello_checks_protocol_and_secret_and_returns_the_tail():
    left, right = socket.socketpair()
    with left, right:
        left.sendall(greeting("p", "key", b"\x01\x02"))
        assert read_greeting(right, "p", "key", 2) == b"\x01\x02"
        left.sendall(greeting("p", "other"))
        with pytest.raises(WireRejected, match="secret"):
            read_greeting(right, "p", "key")
        left.sendall(greeting("q", "key"))
        with pytest.raises(WireRejected, match="not a p connection"):
            read_greeting(right, "p", "key")


def test_a_wrong_secret_or_protocol_is_closed_before_its_handler_runs():
    acceptor, seen = _served(_echo)
    try:
        for protocol, secret in (("test-proto", "wrong!"), ("other", "s3cret")):
            with socket.create_connection(acceptor.endpoint, timeout=10) as sock:
                sock.sendall(greeting(protocol, secret))
                assert _closed_by_peer(sock)
        with wire.connect(acceptor.endpoint, "test-proto", "s3cret") as sock:
            wire.send_message(sock, {"n": 1})
            assert wire.recv_message(sock) == {"n": 1}
        assert seen == [b""]
    finally:
        acceptor.close()


def test_messages_carry_buffers_out_of_band_and_arrive_whole_past_the_socket_buffers():
    left, right = socket.socketpair()
    big = np.arange(3_000_000, dtype=np.float32)  # 12 MB: many sendmsg and recv calls
    message = {"big": big, "strided": np.ones((5, 2))[:, 0], "raw": pickle.PickleBuffer(b"abc"), "n": 7}
    received = []
    reader = threading.Thread(target=lambda: received.append(wire.recv_message(right)))
    reader.start()
    written = wire.send_message(left, message)
    reader.join(30)
    left.close()
    right.close()
    got = received[0]
    assert written > big.nbytes and got["n"] == 7
    np.testing.assert_array_equal(got["big"], big)
    got["big"][0] = -1  # received into a buffer of its own: writable
    np.testing.assert_array_equal(got["strided"], np.ones(5))  # a strided array travels in the pickle
    assert bytes(got["raw"]) == b"abc"


def test_send_parts_writes_every_part_in_order_when_the_kernel_takes_part_of_them():
    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    parts = [b"head", np.arange(200_000, dtype=np.uint8).data, bytearray(b"tail")]
    expected = b"".join(bytes(p) for p in parts)
    received = []
    reader = threading.Thread(target=lambda: received.append(wire.recv_exactly(right, len(expected))))
    reader.start()
    assert wire.send_parts(left, parts) == len(expected)
    reader.join(30)
    assert bytes(received[0]) == expected
    left.close()
    with pytest.raises(wire.PeerClosed):
        wire.recv_exactly(right, 1)
    right.close()


def _heartbeat_options(sock) -> tuple[int, int, int]:
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE))


def test_heartbeat_is_set_on_both_ends():
    accepted: list = []

    def note_then_echo(sock, tail):
        accepted.append(_heartbeat_options(sock))
        _echo(sock, tail)

    acceptor, _ = _served(note_then_echo, heartbeat=6)
    try:
        with wire.connect(acceptor.endpoint, "test-proto", "s3cret", heartbeat=6) as sock:
            assert _heartbeat_options(sock) == (1, 6000, 2)
            wire.send_message(sock, "x")
            assert wire.recv_message(sock) == "x"  # the accepted end has noted its options by now
        assert accepted == [(1, 6000, 2)]
    finally:
        acceptor.close()


class _Worker:
    """What ``worker_contexts`` reads of a Dask worker: its address and its ``Security``."""

    def __init__(self, address, security):
        self.address, self.security = address, security


class _Client:
    """What ``client_context`` reads of a Dask client: the scheduler's address and its ``Security``."""

    def __init__(self, address, security):
        self.scheduler = _Worker(address, None)
        self.security = security


def test_tls_from_the_clusters_security_carries_the_same_frames_and_refuses_plain_tcp():
    pytest.importorskip("cryptography")
    from distributed.security import Security

    security = Security.temporary()
    server, client = worker_contexts(_Worker("tls://127.0.0.1:1", security))
    assert isinstance(server, ssl.SSLContext) and isinstance(client, ssl.SSLContext)
    assert isinstance(client_context(_Client("tls://127.0.0.1:2", security)), ssl.SSLContext)
    assert worker_contexts(_Worker("tcp://127.0.0.1:1", security)) == (None, None)
    assert client_context(_Client("tcp://127.0.0.1:2", security)) is None

    acceptor, seen = _served(_echo, ssl_context=server, tail_bytes=4)
    try:
        with wire.connect(acceptor.endpoint, "test-proto", "s3cret", tail=b"rank", ssl_context=client) as sock:
            assert isinstance(sock, ssl.SSLSocket)
            payload = {"a": np.arange(100_000.0)}
            wire.send_message(sock, payload)
            np.testing.assert_array_equal(wire.recv_message(sock)["a"], payload["a"])
        with socket.create_connection(acceptor.endpoint, timeout=10) as sock:  # no TLS: the handshake fails
            sock.sendall(greeting("test-proto", "s3cret", b"rank"))
            assert _closed_by_peer(sock)
        assert seen == [b"rank"]
    finally:
        acceptor.close()


def test_closing_the_acceptor_ends_its_connections_and_threads():
    acceptor, _ = _served(_echo)
    sock = wire.connect(acceptor.endpoint, "test-proto", "s3cret")
    wire.send_message(sock, 1)
    assert wire.recv_message(sock) == 1
    acceptor.close()
    sock.settimeout(10)
    with pytest.raises((wire.PeerClosed, ConnectionResetError)):  # closed (not a timeout: that is an OSError too)
        wire.recv_message(sock)
    sock.close()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("daskdist-wire") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name.startswith("daskdist-wire") for t in threading.enumerate())
    with pytest.raises(OSError):
        wire.connect(acceptor.endpoint, "test-proto", "s3cret", timeout=2)
