"""Large all-reduces across real separate hosts over TLS: the pipelined hierarchical and ring engines.

Two network-namespace hosts with two Dask workers each (``tests/netns.py``),
on a ``tls://`` cluster, so the replicas' cross-host connections use TLS and
the group's hello. Pieces of 256 KiB, so an 8 MiB all-reduce moves each chunk
in 16 messages. Select with ``-m netns`` (root and iproute2; skipped
elsewhere). The figures: ``benchmarks/multihost_allreduce.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist import context
from daskdist.cluster.identity import scheduler_workers
from daskdist.replica import commands
from tests.netns import wait_until_hosts_reach_each_other
from tests.support.killers import json_records

pytestmark = pytest.mark.netns

# pieces of 256 KiB, each chunk's first 64 KiB long (the hierarchical ramp), then 128 KiB, then 256 KiB
PIECE = {"daskdist.collective.pipeline-bytes": "256KiB", "daskdist.collective.pipeline-min-bytes": "64KiB"}
N = 1 << 20  # float64: 8 MiB, well above the one-hop size


def _each_replica(strategy, fn, *args) -> list:
    return strategy.extended.group.call(commands.run_function, (fn, args, {}))


def _input(rank: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(N)


def _reduce_both_ways():
    """Replica function: the AUTO all-reduce (hierarchical at 2 x 2) and the forced flat ring, and the routes."""
    ctx = dd.get_replica_context()
    x = _input(ctx.replica_id_in_sync_group)
    ring = dd.CommunicationOptions(implementation="RING")
    return {"auto": ctx.all_reduce("SUM", x), "ring": ctx.all_reduce("SUM", x, options=ring),
            "mean": ctx.all_reduce("MEAN", x), "input_kept": bool(np.array_equal(x, _input(ctx.replica_id_in_sync_group))),
            "routes": context.current_runtime().transport.describe()}


def test_pipelined_hierarchical_and_ring_equal_the_sum_over_tls_hosts(netns_tls_hosts):
    hosts, client = netns_tls_hosts
    want = np.sum([_input(r) for r in range(4)], axis=0)
    with dask.config.set(PIECE), dd.MultiWorkerMirroredStrategy(client=client) as strategy:
        assert all(a.startswith("tls://") for a in strategy.extended.worker_addresses)
        out = _each_replica(strategy, _reduce_both_ways)
    assert [o["routes"] for o in out] == [{1: "shm", 2: "socket", 3: "socket"}, {0: "shm", 2: "socket", 3: "socket"},
                                          {0: "socket", 1: "socket", 3: "shm"}, {0: "socket", 1: "socket", 2: "shm"}]
    for o in out:
        np.testing.assert_allclose(o["auto"], want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(o["ring"], want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(o["mean"], want / 4, rtol=1e-12, atol=1e-12)
        assert o["input_kept"]
        for key in ("auto", "ring", "mean"):  # every replica holds the same bits
            assert np.array_equal(o[key], out[0][key])


def _all_reduce_until_failure(record_dir: str):
    """Replica function: 8 MiB all-reduces until one fails; says when it is under way, records the failure."""
    ctx = dd.get_replica_context()
    rank = ctx.replica_id_in_sync_group
    x = np.ones(N)
    start, done = time.time(), 0
    try:
        while time.time() - start < 120:
            ctx.all_reduce("SUM", x)
            done += 1
            if done == 3:
                open(os.path.join(record_dir, f"rank-{rank}.started"), "w").close()
    except Exception as e:
        with open(os.path.join(record_dir, f"rank-{rank}.json"), "w") as f:
            json.dump({"error": type(e).__name__, "at": time.time(), "message": str(e)}, f)
        raise
    return "finished"


def _start(strategy, record_dir):
    """Run the loop on every replica from a client thread; return once every replica is past its third call."""
    outcome: dict = {}

    def target():
        try:
            outcome["result"] = strategy.run(_all_reduce_until_failure, args=(str(record_dir),))
        except BaseException as e:  # noqa: BLE001  (the test inspects whatever the call raised)
            outcome["error"] = e
        outcome["at"] = time.time()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not all((record_dir / f"rank-{r}.started").exists() for r in range(4)):
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.05)
    return thread, outcome


def test_kill_9_of_the_other_hosts_ring_member_mid_pipeline_fails_every_replica_within_10_seconds(
        netns_tls_hosts, tmp_path):
    hosts, client = netns_tls_hosts  # a worker dies: the fixture starts fresh hosts for the next test
    with dask.config.set(PIECE):
        strategy = dd.MultiWorkerMirroredStrategy(client=client)
    try:
        victim = hosts.hosts[1].workers[0]  # h2's first worker: rank 2, the one that carries h2's cross-host ring
        assert victim.pid in client.run(os.getpid).values()
        thread, outcome = _start(strategy, tmp_path)
        killed = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        thread.join(20)
        assert not thread.is_alive(), "the client's call hung after a worker was killed"
        assert isinstance(outcome.get("error"), dd.ReplicaLostError), outcome
        assert outcome["at"] - killed < 10
        survivors = json_records(tmp_path, [0, 1, 3], wait=10)
        assert sorted(survivors) == [0, 1, 3]
        for rank, record in survivors.items():
            assert record["error"] == "ReplicaLostError" and record["at"] - killed < 10, (rank, record)
    finally:
        strategy.close()


def test_a_cut_link_mid_pipeline_is_detected_within_10_seconds_on_every_replica(netns_tls_hosts, tmp_path):
    hosts, client = netns_tls_hosts
    with dask.config.set(PIECE):
        strategy = dd.MultiWorkerMirroredStrategy(client=client)
    try:
        thread, outcome = _start(strategy, tmp_path)
        cut = time.time()
        hosts.link_down(1)  # h2 drops off the network: no FIN, no RST
        try:
            thread.join(20)
            assert not thread.is_alive(), "the client's call hung after the link went down"
            assert isinstance(outcome.get("error"), dd.ReplicaLostError), outcome
            assert outcome["at"] - cut < 10
            on_h1 = json_records(tmp_path, [0, 1], wait=10)
        finally:
            hosts.link_up(1)
        on_h2 = json_records(tmp_path, [2, 3], wait=10)
        for rank, record in {**on_h1, **on_h2}.items():
            assert record["error"] == "ReplicaLostError", (rank, record)
            assert record["at"] - cut < 10, (rank, record["at"] - cut)
        assert sorted({**on_h1, **on_h2}) == [0, 1, 2, 3]
    finally:
        closing = time.monotonic()
        strategy.close()
        assert time.monotonic() - closing < 30
    assert len(scheduler_workers(client)) == 4  # Dask kept the workers: only the group failed
    wait_until_hosts_reach_each_other(client, hosts)


def _receive_from_the_other_host(record_dir: str):
    """Replica function: one all-reduce (connections up), then a broadcast from rank 2 that rank 2 starts only
    once the test has cut the link: h1's replicas wait to receive with nothing of theirs in flight."""
    ctx = dd.get_replica_context()
    rank = ctx.replica_id_in_sync_group
    ctx.all_reduce("SUM", np.ones(N))
    try:
        if rank == 2:
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(record_dir, "cut")) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            open(os.path.join(record_dir, f"rank-{rank}.entered"), "w").close()
        got = ctx.broadcast(np.full(4, 2.0) if rank == 2 else np.zeros(4), root=2)
    except Exception as e:
        with open(os.path.join(record_dir, f"rank-{rank}.json"), "w") as f:
            json.dump({"error": type(e).__name__, "at": time.time(), "message": str(e)}, f)
        raise
    with open(os.path.join(record_dir, f"rank-{rank}.json"), "w") as f:
        json.dump({"error": None, "at": time.time(), "message": "finished", "got": got.tolist()}, f)
    return "finished"


def _unsent_or_unacked(host, peer_address: str) -> int:
    """Bytes queued or unacknowledged on ``host``'s TCP connections to ``peer_address`` (``ss``'s Send-Q)."""
    done = subprocess.run(["ip", "netns", "exec", host.namespace, "ss", "-tnH", "state", "established", "dst",
                           peer_address], capture_output=True, text=True, check=True, timeout=30)
    return sum(int(line.split()[1]) for line in done.stdout.splitlines() if line.strip())


def test_a_cut_link_is_detected_over_tls_by_replicas_that_only_wait_to_receive(netns_tls_hosts, tmp_path):
    """TLS reads a connection that the heartbeat failed as an end of stream: it must still count as lost."""
    hosts, client = netns_tls_hosts
    strategy = dd.MultiWorkerMirroredStrategy(client=client)
    outcome: dict = {}

    def target():
        try:
            outcome["result"] = strategy.run(_receive_from_the_other_host, args=(str(tmp_path),))
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = e
        outcome["at"] = time.time()

    thread = threading.Thread(target=target, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 60
        h1, h2 = hosts.hosts
        while not (all((tmp_path / f"rank-{r}.entered").exists() for r in (0, 1, 3))
                   and _unsent_or_unacked(h1, h2.address) == 0):
            assert time.monotonic() < deadline and thread.is_alive(), outcome
            time.sleep(0.05)
        cut = time.time()
        hosts.link_down(1)
        (tmp_path / "cut").touch()
        try:
            thread.join(20)
            assert not thread.is_alive(), "the client's call hung after the link went down"
            assert isinstance(outcome.get("error"), dd.ReplicaLostError), outcome
            on_h1 = json_records(tmp_path, [0, 1], wait=10)
        finally:
            hosts.link_up(1)
        on_h2 = json_records(tmp_path, [2, 3], wait=10)
        records = {**on_h1, **on_h2}
        assert sorted(records) == [0, 1, 2, 3]  # every replica came back: none hangs
        for rank, record in records.items():
            assert record["at"] - cut < 10, (rank, record["at"] - cut)
            if rank == 3 and record["error"] is None:
                # rank 3 shares h2 with the root: it may get rank 2's data over shared memory before rank 2's
                # send to h1 fails (a broadcast cannot be atomic across a cut); then it holds the root's value
                assert record["got"] == [2.0] * 4, record
            else:
                assert record["error"] == "ReplicaLostError", (rank, record)
    finally:
        strategy.close()
    wait_until_hosts_reach_each_other(client, hosts)
