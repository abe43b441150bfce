"""The socket transport's peer-loss reporting, on real sockets in one process (no root needed).

A connection that fails without being closed (reset, or silent past the
heartbeat deadline: see the namespace-host test for a real link cut) reports
its peer lost; a peer that closes its transport normally does not.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np

from daskdist.collective.mailbox import Mailbox
from daskdist.collective.transport.socket import SocketTransport

ADDRESSES = ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]


def _pair(lost: list, event: threading.Event) -> tuple[SocketTransport, SocketTransport]:
    def on_lost(peer, message):
        lost.append((peer, message))
        event.set()

    receiver = SocketTransport(0, ADDRESSES, Mailbox(), "g", "127.0.0.1", on_peer_lost=on_lost)
    sender = SocketTransport(1, ADDRESSES, Mailbox(), "g", "127.0.0.1")
    sender.set_peer_addresses({0: receiver.listen_address})
    return receiver, sender


def test_a_reset_connection_reports_its_peer_lost_and_heartbeats_are_set():
    lost, event = [], threading.Event()
    receiver, sender = _pair(lost, event)
    try:
        sender.send(0, (1, 1, 1, "x"), np.ones(3)).wait(time.monotonic() + 10)
        assert receiver.mailbox.take((1, 1, 1, "x"), time.monotonic() + 10).tolist() == [1.0, 1.0, 1.0]
        assert sender.sent_bytes[0] > 24
        conn = sender.peer_socket(0)
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 5000
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # an RST, as a host that drops the connection sends
        assert event.wait(10)
        peer, message = lost[0]
        assert peer == 1 and "replica 1 (tcp://127.0.0.1:2) is unreachable from replica 0" in message
        assert "heartbeat-timeout = 5s" in message
    finally:
        sender.close()
        receiver.close()


def test_a_peer_closing_its_transport_is_not_a_loss():
    lost, event = [], threading.Event()
    receiver, sender = _pair(lost, event)
    try:
        sender.send(0, (1, 1, 1, "x"), np.ones(3)).wait(time.monotonic() + 10)
        receiver.mailbox.take((1, 1, 1, "x"), time.monotonic() + 10)
        sender.close()
        assert not event.wait(1.0) and lost == []
    finally:
        receiver.close()
