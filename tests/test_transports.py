"""Transports on real clusters: shared memory, Dask comms, and the per-pair routing between them."""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import platform
import threading
import time

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist.collective.mailbox import Mailbox
from daskdist.collective.transport import shm as shm_module
from daskdist.collective.transport.base import PayloadMismatch
from daskdist.collective.transport.shm import ShmTransport
from daskdist.collective.transport.shm_channel import store_order_is_total
from daskdist.exceptions import DaskdistError, RendezvousError
from tests.support.killers import kill_the_awaited_peer
from tests.support.transports import check_all_reduce, group_routes

TRANSPORTS = {
    "shm": {"daskdist.collective.transport": "shm"},
    "dask": {"daskdist.collective.transport": "dask"},
    "socket": {"daskdist.collective.transport": "socket"},
    # every worker its own host: shared memory nowhere, the cross-host route everywhere
    "cross-host": {"daskdist.collective.transport": "auto", "daskdist.collective.hosts": "per-worker"},
    # two replicas per "host": shared memory inside, TCP between, hierarchical all-reduce
    "hierarchical": {"daskdist.collective.transport": "auto", "daskdist.collective.hosts": "blocks:2"},
}


def test_auto_uses_shared_memory_on_one_host_and_dask_across(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        routes = group_routes(threaded_client, strategy)
        assert routes == {0: {1: "shm", 2: "shm"}, 1: {0: "shm", 2: "shm"}, 2: {0: "shm", 1: "shm"}}
    with dask.config.set(TRANSPORTS["cross-host"]):
        with dd.MirroredStrategy(client=threaded_client) as strategy:
            routes = group_routes(threaded_client, strategy)
            assert routes == {0: {1: "socket", 2: "socket"}, 1: {0: "socket", 2: "socket"}, 2: {0: "socket", 1: "socket"}}


@pytest.mark.parametrize(("machine", "is_64bit", "total"), [
    ("x86_64", True, True), ("AMD64", True, True),  # Linux and Windows names of 64-bit x86
    ("x86_64", False, False),  # a 32-bit process: 8-byte counter stores may tear
    ("i686", False, False), ("aarch64", True, False), ("arm64", True, False),  # Arm reorders stores
    ("ppc64le", True, False), ("riscv64", True, False), ("s390x", True, False),
])
def test_shared_memory_slots_are_published_without_a_fence_only_where_stores_stay_in_order(machine, is_64bit, total):
    assert store_order_is_total(machine, is_64bit) is total


def test_off_x86_the_group_talks_over_sockets_and_an_explicit_shm_request_is_refused(threaded_client, monkeypatch,
                                                                                      caplog):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(DaskdistError, match="aarch64"):
        ShmTransport(0, ["a", "b"], Mailbox(), [1], "daskdist-t-refused", 1 << 12)
    monkeypatch.setattr(shm_module, "_logged_unsupported", False)  # logged once per process: log it again
    caplog.set_level(logging.WARNING, logger=shm_module.__name__)
    shm_logger = logging.getLogger(shm_module.__name__)
    monkeypatch.setattr(shm_logger, "handlers", [caplog.handler])  # whatever the cluster's logging config does
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        routes = group_routes(threaded_client, strategy)
        assert routes == {0: {1: "socket", 2: "socket"}, 1: {0: "socket", 2: "socket"}, 2: {0: "socket", 1: "socket"}}

        def fn():
            ctx = dd.get_replica_context()
            return ctx.all_reduce("SUM", np.full(1000, ctx.replica_id_in_sync_group + 1.0, np.float32))

        for result in strategy.experimental_local_results(strategy.run(fn)):
            assert result.tolist() == [6.0] * 1000
    assert "not used on this machine (aarch64)" in caplog.text
    with dask.config.set(TRANSPORTS["shm"]), pytest.raises(RendezvousError, match="64-bit x86"):
        with dd.MirroredStrategy(client=threaded_client):
            pass


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("replicas", [2, 3])
def test_results_equal_numpy_on_every_transport(threaded_client, transport, replicas):
    with dask.config.set(TRANSPORTS[transport]):
        devices = [f"/cpu:{i}" for i in range(replicas)]
        for ops in (None, dd.ReductionToOneDevice(), dd.HierarchicalCopyAllReduce()):
            with dd.MirroredStrategy(devices=devices, client=threaded_client, cross_device_ops=ops) as strategy:
                check_all_reduce(strategy, seed=replicas)


@pytest.mark.parametrize("transport", ["shm", "socket", "dask", "hierarchical"])
def test_four_replicas_in_processes(make_cluster, transport):
    client = make_cluster(4, processes=True)
    with dask.config.set(TRANSPORTS[transport]):
        with dd.MirroredStrategy(client=client) as strategy:
            assert strategy.num_replicas_in_sync == 4
            check_all_reduce(strategy, seed=4)


def _resident_kib() -> int:
    """This process's current resident set (not its peak), in KiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def test_soak_random_sizes_and_dtypes_holds_no_memory_in_the_replicas(process_client):
    """Thousands of all-reduces of random sizes and dtypes, checked against numpy; no memory kept.

    Each replica is its own worker process: after a warm-up quarter, its resident set (current, not the peak)
    must not grow with the iterations. A result kept per all-reduce (about 45 KiB on average here, 900 times)
    grows it by about 40 MiB; what distributed itself keeps meanwhile (its profiler, its event loop) is
    a few MiB.
    """

    def soak(iterations, keep):
        ctx = dd.get_replica_context()
        n, rank = ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group
        dtypes = ["float32", "float64", "int32", "int64", "float16", "uint8"]
        kept, start, bad = [], 0, 0
        for i in range(iterations):
            shared = np.random.default_rng(i)
            dtype = dtypes[shared.integers(len(dtypes))]
            size = int(shared.choice([0, 1, 3, 17, 1000, 4099, 70_001]))
            inputs = [np.random.default_rng([i, r]).integers(0, 3, size).astype(dtype) for r in range(n)]
            got = ctx.all_reduce("SUM", {"x": inputs[rank], "y": [inputs[rank][:1]]})
            want = np.sum(inputs, axis=0, dtype=dtype)
            bad += int(not np.array_equal(got["x"], want) or got["y"][0].tolist() != want[:1].tolist())
            if keep:
                kept.append(got)  # the leak the check must see
            if i == iterations // 4:
                start = _resident_kib()
        return bad, _resident_kib() - start

    with dd.MirroredStrategy(client=process_client) as strategy:
        bad, growth_kib = strategy.run(soak, args=(1200, False))  # a tuple of PerReplica (TF's regroup)
        assert bad == 0  # 0 on every replica: TF's regroup returns that 0 itself, else a PerReplica of counts
        assert max(strategy.experimental_local_results(growth_kib)) < 16 * 1024, growth_kib


def _segments(group_id):
    """The group's segments of every membership generation (named ``daskdist-<id>g<generation>-<src>-<dst>``)."""
    return glob.glob(f"/dev/shm/daskdist-{group_id.rsplit('-', 1)[-1]}g*-*")


def test_no_segment_is_left_after_close(process_client):
    strategy = dd.MirroredStrategy(client=process_client)
    token = strategy.extended.group.group_id
    assert len(_segments(token)) == 2  # one channel per direction
    strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(10)))
    strategy.close()
    assert _segments(token) == []


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "socket", "dask", pytest.param("ucx", marks=pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="needs ucxx (the ucx extra: make test-ucx)"))])
def test_a_killed_peer_wakes_replicas_blocked_in_the_transport(make_cluster, transport, tmp_path):
    client = make_cluster(3, processes=True)
    with dask.config.set(TRANSPORTS.get(transport, {"daskdist.collective.transport": transport})):
        strategy = dd.MirroredStrategy(client=client)
    token = strategy.extended.group.group_id
    # 12 MB: ranks 0 and 1 block inside the transport (shared memory: in pieces), waiting for rank 2's data
    lines = kill_the_awaited_peer(client, strategy, tmp_path, 3_000_000)
    assert lines == ["0 ReplicaLostError", "1 ReplicaLostError"]
    strategy.close()
    if transport == "shm":
        assert _segments(token) == []  # the dead replica's segments were removed by its neighbours


class TestShmChannels:
    """The shared-memory transport alone, two ranks in threads."""

    def _pair(self, slot_bytes=1 << 12):
        boxes = [Mailbox(), Mailbox()]
        for box in boxes:
            box.begin_attempt(1)
        name = f"daskdist-t{os.getpid()}{int(time.monotonic() * 1e6) % 10**8}"
        return [ShmTransport(r, ["a", "b"], boxes[r], [1 - r], name, slot_bytes) for r in range(2)]

    def test_large_messages_go_in_pieces_and_arrive_whole(self):
        t0, t1 = self._pair()
        data = np.arange(100_000, dtype=np.float64)  # 800 kB through 4 KiB slots
        result = {}

        def receive():
            out = np.ones_like(data)
            t1.recv_into(0, (1, 1, 0, "x"), time.monotonic() + 20, out, lambda a, b, base: np.add(a, b, out=a))
            result["sum"] = out
            result["obj"] = t1.recv(0, (1, 1, 0, "o"), time.monotonic() + 20)

        thread = threading.Thread(target=receive)
        thread.start()
        t0.send(1, (1, 1, 0, "x"), data).wait(time.monotonic() + 20)
        t0.send(1, (1, 1, 0, "o"), ["objects", data[:10]]).wait(time.monotonic() + 20)
        thread.join(20)
        np.testing.assert_array_equal(result["sum"], data + 1)
        assert result["obj"][0] == "objects" and result["obj"][1].tolist() == data[:10].tolist()
        for t in (t0, t1):
            t.close()

    def test_out_of_order_and_wrong_size(self):
        t0, t1 = self._pair()
        t0.send(1, (1, 1, 0, "a"), np.ones(3)).wait(time.monotonic() + 5)
        t0.send(1, (1, 1, 0, "b"), np.full(4, 2.0)).wait(time.monotonic() + 5)
        assert t1.recv(0, (1, 1, 0, "b"), time.monotonic() + 5).tolist() == [2.0] * 4  # "a" is stashed
        with pytest.raises(PayloadMismatch):
            t1.recv_into(0, (1, 1, 0, "a"), time.monotonic() + 5, np.zeros(5), None)
        for t in (t0, t1):
            t.close()
        assert not glob.glob(f"/dev/shm/{t0.group_id}*")
