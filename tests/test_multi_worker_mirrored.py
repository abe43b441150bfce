"""MultiWorkerMirroredStrategy: TF's errors on a local cluster, then real separate hosts (network namespaces).

The ``netns`` tests run on two namespace hosts h1 and h2 with two Dask workers
each (``tests/netns.py``): own host names, private ``/dev/shm``, TCP over
veth links through a bridge. They skip where namespaces cannot be made (not
root, no iproute2); select them with ``-m netns``. A test that kills a worker
leaves fewer than 4: the ``netns_hosts`` fixture starts the hosts again for the next test, in any order.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist import context, distribute
from daskdist.cluster.identity import scheduler_workers
from daskdist.cluster_resolver import ClusterSpec, SimpleClusterResolver, TFConfigClusterResolver
from daskdist.replica import commands
from daskdist.strategy.multi_worker_mirrored import MultiWorkerMirroredStrategyExperimental
from tests.netns import wait_until_hosts_reach_each_other
from tests.support.killers import json_records


def _each_replica(strategy, fn, *args) -> list:
    """``fn(*args)`` on every replica, the results as a list in rank order (no regrouping of structures)."""
    return strategy.extended.group.call(commands.run_function, (fn, args, {}))


# -- TF's constructor errors (no hosts needed) --------------------------------------------------------


def test_wrong_classes_raise_tf_value_errors():
    with pytest.raises(ValueError, match="communication_options must be an instance of dd.CommunicationOptions"):
        dd.MultiWorkerMirroredStrategy(communication_options={"implementation": "RING"})
    with pytest.raises(ValueError, match="cluster_resolver must be an instance of dd.cluster_resolver.ClusterResolver"):
        dd.MultiWorkerMirroredStrategy(cluster_resolver=ClusterSpec({"worker": ["a:1"]}))


def test_tf_config_problems_raise_before_anything_starts(threaded_client, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1"]}, "task": ')
    with pytest.raises(ValueError, match="The TF_CONFIG environment variable is not valid JSON"):
        dd.MultiWorkerMirroredStrategy(client=threaded_client)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:1"]}}))
    with pytest.raises(ValueError, match="you must also specify `task_type` and `task_id`"):
        dd.MultiWorkerMirroredStrategy(client=threaded_client)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1"], "ps": ["p:1"]},
                                                "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ValueError, match="does not use parameter servers.*ParameterServerStrategy"):
        dd.MultiWorkerMirroredStrategy(client=threaded_client)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}))
    with pytest.raises(ValueError, match="The `task_id` 3 exceeds the maximum id of worker"):
        dd.MultiWorkerMirroredStrategy(client=threaded_client)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["nohost:2222"]},
                                                "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ValueError, match="entry 'nohost:2222' matches no Dask worker; the Dask workers are: inproc://"):
        dd.MultiWorkerMirroredStrategy(client=threaded_client)


def test_one_host_cluster_is_one_tf_worker_and_the_experimental_alias_passes_isinstance(threaded_client):
    assert distribute.experimental.MultiWorkerMirroredStrategy is MultiWorkerMirroredStrategyExperimental
    assert distribute.MultiWorkerMirroredStrategy is dd.MultiWorkerMirroredStrategy
    with pytest.warns(DeprecationWarning, match="use dd.MultiWorkerMirroredStrategy"):
        old = distribute.experimental.MultiWorkerMirroredStrategy("RING", client=threaded_client)
    with old, dd.MultiWorkerMirroredStrategy(client=threaded_client) as strategy:
        assert isinstance(strategy, MultiWorkerMirroredStrategyExperimental) and isinstance(old, dd.Strategy)
        assert not isinstance(dd.MirroredStrategy.__new__(dd.MirroredStrategy), MultiWorkerMirroredStrategyExperimental)
        assert strategy.num_replicas_in_sync == 3 and strategy.extended.num_hosts == 1
        assert strategy.cluster_resolver.cluster_spec().num_tasks("worker") == 1
        assert strategy.extended.should_checkpoint and strategy.extended.should_save_summary

        def identity():
            ctx = dd.get_replica_context()
            r = ctx.strategy.cluster_resolver
            return r.task_type, r.task_id, ctx.strategy.extended.should_checkpoint

        assert _each_replica(strategy, identity) == [("worker", 0, True), ("worker", 0, False), ("worker", 0, False)]
    with dd.MirroredStrategy(devices=["/cpu:0"], client=threaded_client) as mirrored:
        assert mirrored.cluster_resolver is None
        assert _each_replica(mirrored, lambda: (dd.get_replica_context().strategy.cluster_resolver,
                                                dd.get_replica_context().strategy.extended.should_checkpoint)) == [
            (None, True)]


# -- real separate hosts ----------------------------------------------------------------------------------

netns = pytest.mark.netns


def _identity():
    ctx = dd.get_replica_context()
    resolver = ctx.strategy.cluster_resolver
    return {"task": (resolver.task_type, resolver.task_id), "rank": ctx.replica_id_in_sync_group,
            "in_sync": ctx.num_replicas_in_sync, "chief_writer": ctx.strategy.extended.should_checkpoint,
            "host": socket.gethostname(), "spec": resolver.cluster_spec().as_dict(),
            "gpus": resolver.num_accelerators(), "shm": sorted(os.listdir("/dev/shm"))}


@netns
def test_replicas_see_their_host_as_the_tf_task_and_four_replicas_in_sync(netns_hosts):
    hosts, client = netns_hosts
    with dd.MultiWorkerMirroredStrategy(client=client) as strategy:
        addresses = [h.address for h in hosts.hosts]
        assert strategy.cluster_resolver.cluster_spec().as_dict() == {"worker": addresses}  # live, per host
        assert strategy.cluster_resolver.task_type is None and strategy.cluster_resolver.task_id is None
        assert strategy.cluster_resolver.master() == hosts.scheduler_address
        assert strategy.num_replicas_in_sync == 4 and strategy.extended.should_checkpoint
        seen = _each_replica(strategy, _identity)
    assert [s["task"] for s in seen] == [("worker", 0), ("worker", 0), ("worker", 1), ("worker", 1)]
    assert [s["host"] for s in seen] == ["h1", "h1", "h2", "h2"]
    assert [s["rank"] for s in seen] == [0, 1, 2, 3] and {s["in_sync"] for s in seen} == {4}
    assert [s["chief_writer"] for s in seen] == [True, False, False, False]
    assert all(s["spec"] == {"worker": addresses} and s["gpus"] == {} for s in seen)
    # each host has its own /dev/shm: the shared-memory segments of h1's pair are not visible on h2
    assert seen[0]["shm"] == seen[1]["shm"] and seen[2]["shm"] == seen[3]["shm"]
    assert seen[0]["shm"] and not set(seen[0]["shm"]) & set(seen[2]["shm"])


def _route_counters():
    runtime = context.current_runtime()
    routed = runtime.transport
    sockets = next((t for t in routed.routes_by_peer().values() if t.name == "socket"), None)
    return {"routes": routed.describe(),
            "sent": {f"{name}->{peer}": n for (name, peer), n in routed.sent_bytes.items()},
            "wire": dict(sockets.sent_bytes) if sockets is not None else {}}


def _all_reduce_1mib():
    dd.get_replica_context().all_reduce("SUM", np.ones(1 << 17))  # 1 MiB of float64: above the one-hop size


def _traffic(strategy) -> list[dict]:
    before = _each_replica(strategy, _route_counters)
    strategy.run(_all_reduce_1mib)
    after = _each_replica(strategy, _route_counters)
    out = []
    for b, a in zip(before, after):
        sent = {k: v - b["sent"].get(k, 0) for k, v in a["sent"].items() if v - b["sent"].get(k, 0) > 0}
        wire = {int(k): v - b["wire"].get(k, 0) for k, v in a["wire"].items() if v - b["wire"].get(k, 0) > 0}
        out.append({"routes": a["routes"], "sent": sent, "wire": wire})
    return out


@netns
def test_per_route_counters_show_shared_memory_inside_hosts_and_tcp_only_between_them(netns_hosts):
    _, client = netns_hosts
    mib = 1 << 20
    with dd.MultiWorkerMirroredStrategy(client=client) as strategy:
        traffic = _traffic(strategy)
    # routes: same-host peer through shared memory, the other host's replicas through TCP
    assert [t["routes"] for t in traffic] == [{1: "shm", 2: "socket", 3: "socket"}, {0: "shm", 2: "socket", 3: "socket"},
                                              {0: "socket", 1: "socket", 3: "shm"}, {0: "socket", 1: "socket", 2: "shm"}]
    # hierarchical, every replica sending (the default): each replica owns half the buffer; it sends the other
    # half up to its owner and its own half's result down (shared memory), and rings its own half across hosts
    # with its peer on the other host (a 2-host ring: half a MiB each way)
    peers = {0: 2, 1: 3, 2: 0, 3: 1}
    locals_ = {0: 1, 1: 0, 2: 3, 3: 2}
    for rank, t in enumerate(traffic):
        assert t["sent"] == {f"shm->{locals_[rank]}": mib, f"socket->{peers[rank]}": mib // 2}, (rank, t["sent"])
        assert t["wire"][peers[rank]] >= mib // 2
    with dask.config.set({"daskdist.collective.hierarchical-senders": "first"}), dd.MultiWorkerMirroredStrategy(
            client=client) as strategy:
        traffic = _traffic(strategy)
    with dd.MultiWorkerMirroredStrategy(
            communication_options=dd.CommunicationOptions(implementation="RING"), client=client) as strategy:
        ring = _traffic(strategy)
    # RING: one flat ring 0 -> 1 -> 2 -> 3 -> 0; it crosses hosts at 1 -> 2 and 3 -> 0
    ring_bytes = 2 * 3 * mib // 4  # reduce-scatter then all-gather, 3 of 4 parts each
    assert [t["sent"] for t in ring] == [{"shm->1": ring_bytes}, {"socket->2": ring_bytes}, {"shm->3": ring_bytes},
                                         {"socket->0": ring_bytes}]
    assert ring[1]["wire"][2] >= ring_bytes and ring[3]["wire"][0] >= ring_bytes
    assert ring[0]["wire"] == {} and ring[2]["wire"] == {}


B, STEPS = 16, 6


def _regression_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B * STEPS, 8))
    y = x @ rng.normal(size=8) + 0.1 * rng.normal(size=B * STEPS)
    return x, y


def _train(strategy) -> list[float]:
    """Linear regression by SGD on the same global batches; the loss of each step, before its update."""
    x, y = _regression_data()
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        w = dd.Variable(np.zeros(8), aggregation="SUM")

    def step(batch):
        xb, yb = batch
        err = xb @ w.value() - yb
        w.assign_sub(0.1 * 2 * xb.T @ err / B)  # SUM: the replicas' parts of the global gradient add up
        return float((err ** 2).sum() / B)

    losses = []
    for s in range(STEPS):
        xs, ys = x[s * B:(s + 1) * B], y[s * B:(s + 1) * B]
        batch = strategy.experimental_distribute_values_from_function(
            lambda ctx, xs=xs, ys=ys, part=B // n: (
                xs[ctx.replica_id_in_sync_group * part:(ctx.replica_id_in_sync_group + 1) * part],
                ys[ctx.replica_id_in_sync_group * part:(ctx.replica_id_in_sync_group + 1) * part]))
        losses.append(float(strategy.reduce("SUM", strategy.run(step, args=(batch,)), axis=None)))
    return losses


@netns
def test_training_under_mwms_gives_the_losses_of_mirrored_on_one_host(netns_hosts, caplog):
    hosts, client = netns_hosts
    with caplog.at_level(logging.WARNING, logger="daskdist.strategy.extended.contract"), \
            dd.MirroredStrategy(client=client) as mirrored:  # TF's meaning: one machine
        assert mirrored.num_replicas_in_sync == 2
        assert {a.split("//")[1].split(":")[0] for a in mirrored.extended.worker_addresses} == {hosts.hosts[0].address}
        one_host = _train(mirrored)
    assert "uses one machine, as in TensorFlow: the 2 worker(s) on host h1" in caplog.text
    with dd.MultiWorkerMirroredStrategy(client=client) as strategy:
        assert strategy.num_replicas_in_sync == 4
        two_hosts = _train(strategy)
    assert two_hosts[-1] < two_hosts[0] / 4  # it learns
    np.testing.assert_allclose(two_hosts, one_host, rtol=1e-9)


@netns
def test_keras_fit_with_distributed_input_runs_across_hosts(netns_hosts):
    from daskdist import keras
    from daskdist.training.commands import model_weights

    _, client = netns_hosts
    x, y = _regression_data()
    labels = (y > np.median(y)).astype(np.int64)
    with dd.MultiWorkerMirroredStrategy(client=client) as strategy:
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(16, activation="relu", input_shape=(8,)),
                                      keras.layers.Dense(2)])
            model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          optimizer=keras.optimizers.SGD(0.2))
        data = dd.data.Dataset.from_tensor_slices((x.astype(np.float32), labels), num_partitions=4).batch(16)
        losses = model.fit(data, epochs=4, verbose=0).history["loss"]
        weights = strategy.extended.group.call(model_weights, (model._model_id,))
    assert losses[-1] < losses[0]
    for replica in weights[1:]:  # the copies on both hosts stay identical
        for a, b in zip(weights[0], replica):
            np.testing.assert_array_equal(a, b)


@netns
def test_tf_config_selects_and_orders_hosts_and_names_what_it_cannot_match(netns_hosts, monkeypatch):
    hosts, client = netns_hosts
    h1, h2 = hosts.hosts
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["h2:2222", f"{h1.address}:2222"]},
                                                "task": {"type": "worker", "index": 0}}))
    with dd.MultiWorkerMirroredStrategy(client=client) as strategy:
        assert isinstance(strategy.cluster_resolver, TFConfigClusterResolver)  # TF's default resolver
        seen = _each_replica(strategy, _identity)
    assert [(s["host"], s["task"][1]) for s in seen] == [("h2", 0), ("h2", 0), ("h1", 1), ("h1", 1)]
    assert [s["chief_writer"] for s in seen] == [True, False, False, False]  # the chief is host h2 now
    one_of_h2 = next(a for a in scheduler_workers(client) if h2.address in a)
    spec = ClusterSpec({"chief": [one_of_h2], "worker": ["h1"]})  # an exact Dask address: that worker only
    with pytest.warns(UserWarning, match="hosts hold different numbers of replicas"):
        strategy = dd.MultiWorkerMirroredStrategy(SimpleClusterResolver(spec, task_type="chief", task_id=0),
                                                  client=client)
    with strategy:
        seen = _each_replica(strategy, _identity)
    assert [(s["host"], s["task"][1]) for s in seen] == [("h2", 0), ("h1", 1), ("h1", 1)]
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["h1:2222", "h3:2222"]},
                                                "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ValueError, match=r"'h3:2222' matches no Dask worker; the Dask workers are: "
                                         rf"tcp://{h1.address}:\d+ \(host h1\)"):
        dd.MultiWorkerMirroredStrategy(client=client)


def _all_reduce_until_failure(record_dir: str):
    """Replica function: all-reduce until something fails; record what and when, then re-raise."""
    ctx = dd.get_replica_context()
    rank = ctx.replica_id_in_sync_group
    start = time.time()
    try:
        while time.time() - start < 60:
            ctx.all_reduce("SUM", np.ones(1 << 15))
    except Exception as e:
        with open(os.path.join(record_dir, f"rank-{rank}.json"), "w") as f:
            json.dump({"error": type(e).__name__, "at": time.time(), "message": str(e)}, f)
        raise
    return "finished"


def _run_in_thread(strategy, record_dir):
    outcome: dict = {}

    def target():
        try:
            outcome["result"] = strategy.run(_all_reduce_until_failure, args=(str(record_dir),))
        except BaseException as e:  # noqa: BLE001  (the test inspects whatever the call raised)
            outcome["error"] = e
        outcome["at"] = time.time()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


@netns
def test_a_link_down_without_fin_or_rst_is_detected_within_10_seconds(netns_hosts, tmp_path):
    hosts, client = netns_hosts
    strategy = dd.MultiWorkerMirroredStrategy(client=client)
    try:
        strategy.run(_all_reduce_1mib)  # connections up
        thread, outcome = _run_in_thread(strategy, tmp_path)
        time.sleep(1.0)
        cut = time.time()
        hosts.link_down(1)  # h2 drops off the network: no FIN, no RST
        try:
            thread.join(20)
            assert not thread.is_alive(), "the client's call hung after the link went down"
            assert isinstance(outcome.get("error"), dd.ReplicaLostError), outcome
            assert outcome["at"] - cut < 10
            assert "heartbeat-timeout" in str(outcome["error"])
            on_h1 = json_records(tmp_path, [0, 1], wait=10)
        finally:
            hosts.link_up(1)
        on_h2 = json_records(tmp_path, [2, 3], wait=10)  # h2's replicas detected it too
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


@netns
def test_kill_9_of_one_hosts_worker_mid_all_reduce_fails_every_survivor_and_the_client_within_10_seconds(
        netns_hosts, tmp_path):
    hosts, client = netns_hosts  # this test kills a worker: the fixture starts fresh hosts for the next
    strategy = dd.MultiWorkerMirroredStrategy(client=client)
    try:
        strategy.run(_all_reduce_1mib)
        victim = hosts.hosts[1].workers[1]  # h2's second worker: rank 3
        pids = client.run(os.getpid)
        assert victim.pid in pids.values()
        thread, outcome = _run_in_thread(strategy, tmp_path)
        time.sleep(1.0)
        killed = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        thread.join(20)
        assert not thread.is_alive(), "the client's call hung after a worker was killed"
        assert isinstance(outcome.get("error"), dd.ReplicaLostError), outcome
        assert outcome["at"] - killed < 10
        survivors = json_records(tmp_path, [0, 1, 2], wait=10)
        assert sorted(survivors) == [0, 1, 2]
        for rank, record in survivors.items():
            assert record["error"] == "ReplicaLostError" and record["at"] - killed < 10, (rank, record)
    finally:
        strategy.close()
