"""The socket transport's small-message path and its wire hello, on real sockets in one process.

Small messages are written by the calling thread (no sender thread, one
``sendmsg``), large ones by a per-peer sender thread, and one thread's
messages to a peer arrive in the order it sent them either way. A replica
waiting for a peer's message reads that peer's connection itself. A connection
must present the group's secret and generation (``daskdist.wire``).
"""

from __future__ import annotations

import logging
import threading
import time
from unittest import mock

import dask
import numpy as np
import pytest

from daskdist.collective.mailbox import Mailbox
from daskdist.collective.transport.base import CompletedSend
from daskdist.collective.transport.framing import SignedArrayFrames
from daskdist.collective.transport.socket import SocketTransport, busy_poll_seconds
from daskdist.group.membership import Generation, GroupId, Member, Membership
from daskdist.group.spec import GroupSpec
from daskdist.replica.wiring import make_transport

ADDRESSES = ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]


class RecordingMailbox(Mailbox):
    """A mailbox that also records the order messages were delivered in."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list = []

    def put(self, tag, value) -> None:
        self.order.append(tag)
        super().put(tag, value)


def _pair(receiver_secret="s", sender_secret="s", receiver_group="g/0", sender_group="g/0"):
    receiver = SocketTransport(0, ADDRESSES, RecordingMailbox(), receiver_group, "127.0.0.1", secret=receiver_secret)
    sender = SocketTransport(1, ADDRESSES, Mailbox(), sender_group, "127.0.0.1", secret=sender_secret)
    sender.set_peer_addresses({0: receiver.listen_address})
    return receiver, sender


def _sender_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("daskdist-tcp-send-")]


def test_small_messages_are_written_by_the_calling_thread_and_one_threads_order_holds():
    receiver, sender = _pair()
    try:
        deadline = time.monotonic() + 30
        assert isinstance(sender.send(0, (1, 0, 1, "a"), np.arange(10.0)), CompletedSend)
        assert _sender_threads() == []  # nothing handed to another thread
        big = np.arange(sender.inline_bytes // 8 + 1000, dtype=np.float64)
        handles = [sender.send(0, (1, 1, 1, "b"), big)]  # large: the sender thread writes it
        handles += [sender.send(0, (1, i, 1, "c"), np.full(3, i)) for i in range(2, 6)]  # queued behind it
        for handle in handles:
            handle.wait(deadline)
        assert _sender_threads() == ["daskdist-tcp-send-1-0"]
        assert sender.send(0, (1, 6, 1, "d"), "text") is not None
        np.testing.assert_array_equal(receiver.mailbox.take((1, 1, 1, "b"), deadline), big)
        assert receiver.mailbox.take((1, 6, 1, "d"), deadline) == "text"
        assert receiver.mailbox.order == [(1, 0, 1, "a"), (1, 1, 1, "b"), *[(1, i, 1, "c") for i in range(2, 6)],
                                          (1, 6, 1, "d")]
        assert receiver.mailbox.take((1, 5, 1, "c"), deadline).tolist() == [5, 5, 5]
    finally:
        sender.close()
        receiver.close()


def test_a_ddp_buckets_ring_chunk_is_written_by_the_calling_thread():
    """The CNN's DDP bucket (1.39 MB) across two hosts is one ring chunk of 0.7 MB per step: written by the
    calling thread (no hand-off to the sender thread, about 0.45 ms of a 2.5-3 ms all-reduce at 10 Gbit/s,
    BENCHMARKS 14). Failed with the earlier 64 KiB default."""
    receiver, sender = _pair()
    try:
        deadline = time.monotonic() + 30
        chunk = np.ones(1_390_000 // 8, np.float32)
        assert isinstance(sender.send(0, (1, 0, 1, "rs0.0"), chunk), CompletedSend)
        assert _sender_threads() == []
        np.testing.assert_array_equal(receiver.mailbox.take((1, 0, 1, "rs0.0"), deadline), chunk)
    finally:
        sender.close()
        receiver.close()


def test_many_small_frames_in_one_read_arrive_whole():
    receiver, sender = _pair()
    try:
        deadline = time.monotonic() + 30
        sizes = [0, 1, 7, 100, 5000, 20_000, 3, 60_000, 300_000]  # the last larger than a read buffer
        def frame(i, n):  # every byte depends on the frame and its place in it: a shifted or mixed frame shows
            return ((np.arange(n) * 7 + i) % 251).astype(np.uint8)

        for i, n in enumerate(sizes * 20):
            sender.send(0, (2, i, 1, "x"), frame(i, n))
        for i, n in enumerate(sizes * 20):
            got = receiver.mailbox.take((2, i, 1, "x"), deadline)
            assert got.dtype == np.uint8
            np.testing.assert_array_equal(got, frame(i, n))  # the whole frame, not its shape and first byte
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("on_caller", [True, False])
def test_a_replica_waiting_for_a_peer_reads_its_connection_itself(on_caller):
    """receive-on-caller: the waiting thread reads the frame it waits for (it never passes through the mailbox);
    off, the reader thread delivers it to the mailbox and the waiting thread takes it from there."""
    with dask.config.set({"daskdist.collective.socket.receive-on-caller": on_caller}):
        receiver, sender = _pair()
    try:
        sender.send(0, (1, 0, 1, "warm"), np.ones(1))  # opens the connection: the receiver knows the peer
        assert receiver.recv(1, (1, 0, 1, "warm"), time.monotonic() + 30).tolist() == [1.0]
        for i in range(1, 20):
            got: dict = {}

            def wait_for(tag, into=got):
                into["v"] = receiver.recv(1, tag, time.monotonic() + 30)

            waiter = threading.Thread(target=wait_for, args=((1, i, 1, "a"),))
            waiter.start()
            time.sleep(0.01)  # the waiter is (most likely) blocked on the connection by now; either way it works
            sender.send(0, (1, i, 1, "a"), np.full(4, float(i)))
            waiter.join(30)
            assert got["v"].tolist() == [float(i)] * 4
        through_mailbox = [tag for tag in receiver.mailbox.order if tag[3] == "a"]
        if on_caller:
            assert len(through_mailbox) <= 2  # the reader thread may win a race now and then, not every time
        else:
            assert len(through_mailbox) == 19
    finally:
        sender.close()
        receiver.close()


def test_frames_read_by_the_waiting_thread_for_other_tags_reach_the_mailbox_in_any_order_and_size():
    """The waiting thread reads whatever comes first: frames of other tags (small ones several per recv, large
    ones from the sender thread) go to the mailbox, and receiving them in reverse order still gets each whole."""
    receiver, sender = _pair()
    try:
        deadline = time.monotonic() + 60
        sizes = [0, 3, 100, 5000, sender.inline_bytes // 8 + 10, 7, 60_000, 1]
        payloads = [np.full(n, i, np.float64) for i, n in enumerate(sizes * 6)]
        handles = [sender.send(0, (3, i, 1, "x"), p) for i, p in enumerate(payloads)]
        for i in reversed(range(len(payloads))):
            np.testing.assert_array_equal(receiver.recv(1, (3, i, 1, "x"), deadline), payloads[i])
        for handle in handles:
            handle.wait(deadline)
    finally:
        sender.close()
        receiver.close()


def _posted_then_sent(receiver, sender, tag, payload, receive):
    """Run ``receive()`` on a thread, send ``payload`` under ``tag`` once that receive is posted; its result."""
    got: dict = {}

    def run():
        try:
            got["v"] = receive()
        except Exception as e:  # raised here, on the test's thread
            got["error"] = e

    waiter = threading.Thread(target=run)
    waiter.start()
    until = time.monotonic() + 2  # sent anyway after that: a receive that does not post still gets it
    while receiver.posted_receives == 0 and time.monotonic() < until:
        time.sleep(0.001)
    sender.send(0, tag, payload)
    waiter.join(30)
    assert not waiter.is_alive()
    if "error" in got:
        raise got["error"]
    return got.get("v")


@pytest.mark.parametrize("n", [1024, 300_000, 2_000_000])  # in one read, larger than a read buffer, a sender thread
def test_posted_receives_land_in_place_without_allocating(n):
    """A copy (``combine`` None) lands in the collective's own output, a reduction in a reused scratch buffer:
    after the first scratch buffer the receive path allocates nothing (``receive_allocations``). Failed with the
    posted receive taken out of ``recv_into`` (every message in a fresh buffer: one allocation each)."""
    receiver, sender = _pair()
    try:
        sender.send(0, (1, 0, 1, "warm"), np.ones(1))  # opens the connection (one fresh buffer: not posted)
        receiver.recv(1, (1, 0, 1, "warm"), time.monotonic() + 30)
        before = receiver.receive_allocations
        out = np.zeros(n, np.float32)
        acc = np.ones(n, np.float32)

        def add(acc_part, incoming, base):
            np.add(acc_part if base is None else base, incoming, out=acc_part)

        for i in range(1, 9):
            copy_tag, sum_tag = (1, i, 1, "copy"), (1, i, 1, "sum")
            payload = np.full(n, float(i), np.float32)
            _posted_then_sent(receiver, sender, copy_tag, payload,
                              lambda t=copy_tag: receiver.recv_into(1, t, time.monotonic() + 30, out, None))
            np.testing.assert_array_equal(out, payload)
            _posted_then_sent(receiver, sender, sum_tag, payload,
                              lambda t=sum_tag: receiver.recv_into(1, t, time.monotonic() + 30, acc, add))
        np.testing.assert_array_equal(acc, np.full(n, 1 + sum(range(1, 9)), np.float32))
        assert receiver.receive_allocations - before == 1  # the scratch buffer, made once and reused
        assert receiver.posted_receives == 0 and len(receiver.mailbox) == 0
    finally:
        sender.close()
        receiver.close()


def test_signed_frames_arrive_as_the_general_sends_and_the_signature_needs_no_receive_buffer():
    """``send_signed`` writes what ``send_many`` of the signature and the array would (tags renumbered per send);
    the signature text is decoded where it lies in the read buffer, and the array lands in its posted receive:
    nothing allocated on the receive path. Failed with text frames read into a fresh buffer (one each)."""
    receiver, sender = _pair()
    try:
        sender.send(0, (1, 0, 1, "warm"), np.ones(1))  # opens the connection (one fresh buffer: not posted)
        receiver.recv(1, (1, 0, 1, "warm"), time.monotonic() + 30)
        before = receiver.receive_allocations
        frames = SignedArrayFrames((0, 0, 1, "sig"), "the signature", (0, 0, 1, "data"), np.dtype(np.float32), (3, 2))
        out = np.zeros((3, 2), np.float32)
        for seq in range(1, 6):
            posted = receiver.post_receive((1, seq, 1, "data"), out, None)
            handles = sender.send_signed(0, frames, 1, seq, np.full((3, 2), seq, np.float32))
            assert receiver.recv(1, (1, seq, 1, "sig"), time.monotonic() + 30) == "the signature"
            receiver.complete_receive(posted, 1, (1, seq, 1, "data"), time.monotonic() + 30, out, None)
            for handle in handles:
                handle.wait(time.monotonic() + 30)
            np.testing.assert_array_equal(out, np.full((3, 2), seq, np.float32))
        assert receiver.receive_allocations == before
        assert receiver.posted_receives == 0 and len(receiver.mailbox) == 0
        assert receiver.mailbox.order[-2:] == [(1, 5, 1, "sig"), (1, 5, 1, "data")]
    finally:
        sender.close()
        receiver.close()


def test_a_message_that_does_not_fit_its_posted_receive_raises_and_one_sent_early_still_arrives():
    """A posted receive of another size or dtype is not written into: the receive raises ``PayloadMismatch``
    and ``out`` keeps its bytes; a message that came before its receive was posted is copied from its buffer."""
    from daskdist.collective.transport.base import PayloadMismatch

    receiver, sender = _pair()
    try:
        out = np.arange(8, dtype=np.float32)
        for i, wrong in enumerate([np.ones(9, np.float32), np.ones(8, np.float64)]):
            with pytest.raises(PayloadMismatch):
                _posted_then_sent(receiver, sender, (1, i, 1, "x"), wrong,
                                  lambda t=(1, i, 1, "x"): receiver.recv_into(1, t, time.monotonic() + 30, out, None))
            np.testing.assert_array_equal(out, np.arange(8, dtype=np.float32))
        sender.send(0, (1, 5, 1, "early"), np.full(8, 3.0, np.float32))
        time.sleep(0.05)
        receiver.recv_into(1, (1, 5, 1, "early"), time.monotonic() + 30, out, None)
        np.testing.assert_array_equal(out, np.full(8, 3.0, np.float32))
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("secret, group", [("wrong", "g/0"), ("s", "g/1")])
def test_a_connection_without_the_groups_secret_or_from_another_generation_is_rejected(secret, group, caplog):
    receiver, sender = _pair(sender_secret=secret, sender_group=group)
    try:
        with caplog.at_level(logging.WARNING, logger="daskdist.wire.connection"):
            sender.send(0, (1, 0, 1, "a"), np.ones(3))
            deadline = time.monotonic() + 10
            while "Rejected a connection" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
        assert "did not present this channel's secret" in caplog.text
        assert len(receiver.mailbox) == 0
    finally:
        sender.close()
        receiver.close()


def test_busy_poll_is_off_by_default_and_set_by_config():
    # auto: off whatever the cores (the spinning thread would hold the GIL the reader thread delivers with)
    with mock.patch("os.sched_getaffinity", return_value=set(range(64))):
        assert busy_poll_seconds() == 0.0
        receiver, sender = _pair()
        try:
            assert receiver.busy_poll == 0.0
        finally:
            sender.close()
            receiver.close()
    with dask.config.set({"daskdist.collective.socket.busy-poll": "100us"}):
        assert busy_poll_seconds() == pytest.approx(1e-4)
        receiver, sender = _pair()
        try:
            assert receiver.busy_poll == pytest.approx(1e-4)
            sender.send(0, (1, 0, 1, "a"), np.ones(3))
            assert receiver.recv(1, (1, 0, 1, "a"), time.monotonic() + 30).tolist() == [1.0, 1.0, 1.0]
        finally:
            sender.close()
            receiver.close()
    with dask.config.set({"daskdist.collective.socket.busy-poll": 0}):
        assert busy_poll_seconds() == 0.0


class _Worker:
    """What ``make_transport`` reads of a Dask worker on the socket path: its address and ``Security``."""

    address = "tcp://127.0.0.1:1"
    security = None


@pytest.mark.parametrize("transport", ["auto", "socket"])
def test_a_gpu_groups_control_traffic_goes_over_sockets_to_every_peer_even_on_one_host(transport):
    members = tuple(Member(f"tcp://127.0.0.1:{i + 1}", f"/job:worker/replica:0/task:{i}/device:GPU:0", "127.0.0.1")
                    for i in range(3))
    membership = Membership(GroupId("daskdist-test"), Generation(0), members)
    spec = GroupSpec(membership, "token", transport=transport, secret="s")
    routed = make_transport(0, membership, spec, Mailbox(), _Worker())
    try:
        assert {peer: route.name for peer, route in routed.routes_by_peer().items()} == {1: "socket", 2: "socket"}
    finally:
        routed.close()
