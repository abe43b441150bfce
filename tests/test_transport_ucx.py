"""The UCX transport (``ucxx``, the optional ``ucx`` extra) on real clusters, and alone between two threads.

Skipped where ucxx is not installed, except the check that asking for it then
fails with a clear message.
"""

from __future__ import annotations

import sys
import threading
import time

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist.collective.mailbox import Mailbox, MailboxTimeout
from daskdist.collective.transport.base import PayloadMismatch
from tests.support.transports import check_all_reduce, group_routes

UCX = {"daskdist.collective.transport": "ucx"}


@pytest.fixture
def ucxx():
    return pytest.importorskip("ucxx")


def test_results_equal_numpy_over_ucx(threaded_client, ucxx):
    with dask.config.set(UCX):
        for replicas in (2, 3):
            devices = [f"/cpu:{i}" for i in range(replicas)]
            for ops in (None, dd.ReductionToOneDevice(), dd.HierarchicalCopyAllReduce()):
                with dd.MirroredStrategy(devices=devices, client=threaded_client, cross_device_ops=ops) as strategy:
                    if ops is None:
                        routes = group_routes(threaded_client, strategy)
                        assert routes == {r: {p: "ucx" for p in range(replicas) if p != r} for r in range(replicas)}
                    check_all_reduce(strategy, seed=replicas)


def test_replicas_in_processes_and_large_messages(process_client, ucxx):
    """Worker processes; messages from inline-sized to many MiB, reduced and copied, many times in a row."""

    def fn():
        ctx = dd.get_replica_context()
        n, rank = ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group
        bad = []
        for size in (0, 1, 1015, 1016, 1017, 2048, 65_537, 1 << 20, 5_000_001):
            x = np.arange(size, dtype=np.float32) % 7 + rank
            if not np.array_equal(ctx.all_reduce("SUM", x), (np.arange(size, dtype=np.float32) % 7) * n + n * (n - 1) / 2):
                bad.append(size)
        for i in range(200):
            if ctx.all_reduce("MAX", np.full(17, rank + i)).tolist() != [n - 1 + i] * 17:
                bad.append(("loop", i))
        if ctx.broadcast(np.arange(3_000_000) * (rank == 0), root=0)[-1] != 2_999_999:
            bad.append("broadcast")
        return repr(bad)

    with dask.config.set(UCX), dd.MirroredStrategy(client=process_client) as strategy:
        assert strategy.experimental_local_results(strategy.run(fn)) == ("[]", "[]")


def test_auto_never_picks_ucx(threaded_client, ucxx):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        routes = group_routes(threaded_client, strategy)
        assert all("ucx" not in peers.values() for peers in routes.values())


def test_asking_for_ucx_without_ucxx_is_a_clear_error(threaded_client, monkeypatch):
    """The replicas (threads of this process here) cannot import ucxx: they fail at start, saying what to install."""
    from daskdist.collective.transport.ucx import import_ucxx

    for name in [m for m in sys.modules if m == "ucxx" or m.startswith("ucxx.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ucxx", None)
    with pytest.raises(ImportError, match=r"pip install 'daskdist\[ucx\]'"):
        import_ucxx()
    with dask.config.set(UCX), pytest.raises(dd.RendezvousError, match="failed to start"):
        dd.MirroredStrategy(client=threaded_client)


class TestUcxPair:
    """Two UCX transports in one process, each rank driven from its own thread as replicas are."""

    @pytest.fixture
    def pair(self, ucxx):
        from daskdist.collective.transport.ucx import UcxTransport

        boxes = [Mailbox(), Mailbox()]
        for box in boxes:
            box.begin_attempt(1)
        transports = [UcxTransport(r, ["a", "b"], boxes[r], "test") for r in range(2)]
        addresses = {r: t.address for r, t in enumerate(transports)}
        for t in transports:
            t.set_peer_addresses(addresses)
        yield transports
        for t in transports:
            t.close()

    @staticmethod
    def _deadline(seconds=20):
        return time.monotonic() + seconds

    def test_sizes_reduce_in_place_out_of_place_and_copy(self, pair):
        t0, t1 = pair

        def add(out, incoming, base):
            np.add(out if base is None else base, incoming, out=out)

        for i, size in enumerate([0, 1, 1000, 1016, 1017, 300_000]):
            data = np.arange(size, dtype=np.float64)
            for j, (combine, base) in enumerate([(None, None), (add, None), (add, np.full(size, 5.0))]):
                tag = (1, i, 0, f"x{j}")
                handle = t0.send(1, tag, data)
                out = np.ones(size)
                t1.recv_into(0, tag, self._deadline(), out, combine, base)
                handle.wait(self._deadline())
                want = data if combine is None else data + (1 if base is None else 5)
                np.testing.assert_array_equal(out, want)
        # both directions at once, as a ring step
        outs = [np.zeros(2_000_000), np.zeros(2_000_000)]
        peer = threading.Thread(target=t1.sendrecv, args=(0, (1, 9, 1, "r"), np.full(2_000_000, 1.0), 0,
                                                          (1, 9, 0, "r"), self._deadline(), outs[1], None))
        peer.start()
        t0.sendrecv(1, (1, 9, 0, "r"), np.full(2_000_000, 2.0), 1, (1, 9, 1, "r"), self._deadline(), outs[0], None)
        peer.join(20)
        assert outs[0][-1] == 1.0 and outs[1][-1] == 2.0

    def test_objects_0d_out_of_order_and_wrong_size(self, pair):
        t0, t1 = pair
        t0.send(1, (1, 1, 0, "a"), np.ones(3))
        t0.send(1, (1, 1, 0, "big"), {"w": np.arange(500_000.0)})
        t0.send(1, (1, 1, 0, "text"), "hello")
        t0.send(1, (1, 1, 0, "0d"), np.array(2.5))
        t0.send(1, (1, 1, 0, "empty"), np.zeros((0, 3), np.int8))
        assert t1.recv(0, (1, 1, 0, "text"), self._deadline()) == "hello"  # the two before it are kept
        assert t1.recv(0, (1, 1, 0, "big"), self._deadline())["w"][-1] == 499_999.0
        zero_d = np.zeros(())
        t1.recv_into(0, (1, 1, 0, "0d"), self._deadline(), zero_d, None)
        assert zero_d == 2.5
        assert t1.recv(0, (1, 1, 0, "empty"), self._deadline()).shape == (0, 3)
        with pytest.raises(PayloadMismatch):
            t1.recv_into(0, (1, 1, 0, "a"), self._deadline(), np.zeros(5), None)
        # the stream is still in step after the mismatch
        t0.send(1, (1, 2, 0, "after"), np.full(4, 7))
        assert t1.recv(0, (1, 2, 0, "after"), self._deadline()).tolist() == [7] * 4

    def test_deadline_abort_and_leftovers_of_aborted_runs(self, pair):
        t0, t1 = pair
        start = time.monotonic()
        with pytest.raises(MailboxTimeout):
            t1.recv(0, (1, 5, 0, "never"), time.monotonic() + 0.3)
        assert time.monotonic() - start < 2
        # a send from run 1 that nobody reads, then run 2 starts: the leftover is dropped
        t0.send(1, (1, 6, 0, "stale"), np.ones(100_000))
        for box in (t0.mailbox, t1.mailbox):
            box.begin_attempt(2)
        handle = t0.send(1, (2, 1, 0, "fresh"), np.full(100_000, 3.0))
        assert t1.recv(0, (2, 1, 0, "fresh"), self._deadline())[0] == 3.0
        handle.wait(self._deadline())
        # an abort wakes a blocked receive at once
        from daskdist.collective.mailbox import Abort

        threading.Timer(0.3, t1.mailbox.abort_attempt, args=(2, Abort("lost", "peer gone", 0))).start()
        start = time.monotonic()
        with pytest.raises(dd.ReplicaLostError, match="peer gone"):
            t1.recv(0, (2, 2, 0, "blocked"), self._deadline(60))
        assert time.monotonic() - start < 5

    def test_close_releases_everything(self, ucxx):
        from daskdist.collective.transport.ucx import UcxTransport

        threads = threading.active_count()
        for _ in range(3):
            boxes = [Mailbox(), Mailbox()]
            pair = [UcxTransport(r, ["a", "b"], boxes[r], "test") for r in range(2)]
            addresses = {r: t.address for r, t in enumerate(pair)}
            for t in pair:
                t.set_peer_addresses(addresses)
            pair[0].send(1, (0, 1, 0, "x"), np.ones(1_000_000))  # never received: cancelled by close
            for t in pair:
                t.close()
                t.close()  # twice is harmless
        assert threading.active_count() <= threads  # the progress threads are gone
