"""A parameter-server closure's traffic is batched: one request per ps per closure, with TF's read-after-write.

Real Dask workers (threads of this process: 2 ps and 1 worker), counting the
requests each ps served. The store's copy-on-write and batch deduplication
are unit-tested on a ``ParameterStore`` alone.
"""

from __future__ import annotations

import asyncio

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers
from daskdist.ps.store import ParameterStore
from daskdist.variables.distributed import VariableSpec

ClusterCoordinator = dd.experimental.coordinator.ClusterCoordinator

pytestmark = pytest.mark.timeout(120)


def _strategy(client, partitioner=None):
    info = scheduler_workers(client)
    ordered = sorted(info, key=lambda a: info[a]["name"])
    spec = dd.cluster_resolver.ClusterSpec({"ps": ordered[:2], "worker": ordered[2:]})
    return dd.ParameterServerStrategy(dd.cluster_resolver.SimpleClusterResolver(spec),
                                      variable_partitioner=partitioner, client=client)


def _requests(strategy):
    return [s.call_from_client(strategy.client, "requests") for s in strategy.extended.stores]


def _train_step(kernel, bias):
    def step():
        logits = np.ones((4, 8), np.float32) @ kernel.value() + bias.value()
        kernel.assign_sub(np.full((8, 3), 0.5, np.float32))
        bias.assign_add(logits.sum(axis=0) * 0)
    return step


@pytest.mark.parametrize(("pull_ahead", "per_closure"), [(True, 1), (False, 2)])
def test_a_closure_reading_and_updating_two_variables_sends_one_or_two_requests_per_ps(
        threaded_client, pull_ahead, per_closure):
    with dask.config.set({"daskdist.parameter-store.pull-ahead": pull_ahead}), _strategy(threaded_client) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            kernel = dd.Variable(np.zeros((8, 3), np.float32), name="kernel")  # ps 0
            bias = dd.Variable(np.zeros(3, np.float32), name="bias")  # ps 1
        step = _train_step(kernel, bias)
        for _ in range(3):  # the worker learns its working set
            coordinator.schedule(step)
        coordinator.join()
        before = _requests(strategy)
        for _ in range(20):
            coordinator.schedule(step)
        coordinator.join()
        assert [a - b for a, b in zip(_requests(strategy), before)] == [20 * per_closure, 20 * per_closure]
        np.testing.assert_allclose(kernel.numpy(), np.full((8, 3), -0.5 * 23, np.float32))  # every update applied once


def test_a_read_after_a_write_in_a_closure_sees_the_stores_value_after_it(threaded_client):
    with _strategy(threaded_client) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            counter = dd.Variable(np.zeros((), np.int64), name="counter")
            table = dd.Variable(np.zeros((6, 2), np.float32), name="table")

        def step():
            seen = int(counter.numpy())
            counter.assign_add(1)
            table.scatter_add(dd.IndexedSlices(np.ones((2, 2), np.float32), np.array([1, 1])))
            rows = dd.nn.embedding_lookup(table, np.array([1, 0]))  # the queued scatter is pushed first
            return seen, int(counter.numpy()), rows

        results = [coordinator.schedule(step).fetch() for _ in range(3)]
        assert [(seen, after) for seen, after, _ in results] == [(0, 1), (1, 2), (2, 3)]
        np.testing.assert_array_equal(results[-1][2], [[6.0, 6.0], [0.0, 0.0]])
        assert int(counter.numpy()) == 3


def test_a_client_write_between_closures_is_seen_by_the_next_closure(threaded_client):
    with _strategy(threaded_client) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            weight = dd.Variable(np.zeros(2, np.float32), name="weight")

        def read_and_step():
            value = weight.numpy().copy()
            weight.assign_add(np.ones(2, np.float32))
            return value

        assert coordinator.schedule(read_and_step).fetch().tolist() == [0.0, 0.0]
        assert coordinator.schedule(read_and_step).fetch().tolist() == [1.0, 1.0]  # pulled ahead by the first
        weight.assign(np.full(2, 100.0, np.float32))  # from the client: the values pulled ahead are dropped
        assert coordinator.schedule(read_and_step).fetch().tolist() == [100.0, 100.0]
        np.testing.assert_array_equal(weight.numpy(), [101.0, 101.0])


def test_updates_made_before_a_closures_error_are_applied_and_bad_updates_raise_in_the_closure(threaded_client):
    with _strategy(threaded_client) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            weight = dd.Variable(np.zeros(3, np.float32), name="weight")

        def fails_after_an_update():
            weight.assign_add(np.ones(3, np.float32))
            raise RuntimeError("the closure's own error")

        coordinator.schedule(fails_after_an_update)
        with pytest.raises(RuntimeError, match="the closure's own error"):
            coordinator.join()
        np.testing.assert_array_equal(weight.numpy(), [1.0, 1.0, 1.0])  # as TF's ops before the error

        def wrong_shape():
            weight.assign(np.ones(4, np.float32))

        coordinator.schedule(wrong_shape)
        with pytest.raises(ValueError, match=r"Cannot assign a value of shape \(4,\)"):
            coordinator.join()
        np.testing.assert_array_equal(weight.numpy(), [1.0, 1.0, 1.0])


def test_an_embedding_lookup_over_four_shards_on_two_ps_sends_one_request_per_ps(threaded_client):
    partitioner = dd.experimental.partitioners.FixedShardsPartitioner(4)  # 2 shards on each ps
    with _strategy(threaded_client, partitioner) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            embedding = dd.Variable(np.arange(40, dtype=np.float32).reshape(20, 2), name="embedding")
        ids = np.array([0, 19, 3, 12, 3])
        before = _requests(strategy)
        rows = coordinator.schedule(lambda: dd.nn.embedding_lookup(embedding, ids)).fetch()
        np.testing.assert_array_equal(rows, np.arange(40, dtype=np.float32).reshape(20, 2)[ids])
        assert [a - b for a, b in zip(_requests(strategy), before)] == [1, 1]


# -- the store alone -------------------------------------------------------------------------


def _store_with(value):
    store = ParameterStore()
    _, spec = VariableSpec.build(value)
    store._op_create("s", "v", value, spec)
    return store


def test_a_value_handed_out_without_a_copy_keeps_its_value_when_the_store_updates():
    store = _store_with(np.zeros((4, 2), np.float32))
    _, handed = store._op_read("s", "v")
    assert not handed.flags.writeable
    store._op_exchange("s", updates=[("update", "v", "assign_add", np.ones((4, 2), np.float32), None, None)])
    store._op_exchange("s", updates=[("scatter", "v", "add", np.array([0]), np.ones((1, 2), np.float32), None, None)])
    np.testing.assert_array_equal(handed, np.zeros((4, 2)))  # copy-on-write: what was handed out is unchanged
    _, now = store._op_read("s", "v")
    np.testing.assert_array_equal(now, [[2, 2], [1, 1], [1, 1], [1, 1]])


def test_a_batch_sent_again_with_the_same_keys_is_applied_once_and_reads_skip_unchanged_values():
    store = _store_with(np.zeros(3, np.float32))
    updates = [("update", "v", "assign_add", np.ones(3, np.float32), ("closure-1", 1), 0),
               ("update", "v", "assign_add", np.ones(3, np.float32), ("closure-1", 2), 0)]
    first = store._op_exchange("s", updates=updates, reads={"v": -1})
    again = store._op_exchange("s", updates=updates, reads={"v": 2})  # a closure run again after a failure
    assert first["versions"] == {"v": 2} and first["values"]["v"][0] == 2
    np.testing.assert_array_equal(first["values"]["v"][1], [2, 2, 2])
    assert again["values"] == {"v": (2, None)}  # unchanged since version 2: not sent
    assert store._op_duplicates("s") == 2
    assert store._op_staleness("s") == [0, 1]


def test_a_bad_update_in_a_batch_raises_and_keeps_the_updates_before_it():
    store = _store_with(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="Cannot assign a value of shape"):
        store._op_exchange("s", updates=[("update", "v", "assign_add", np.ones(3, np.float32), None, None),
                                         ("update", "v", "assign", np.ones(5, np.float32), None, None)])
    assert asyncio.run(store.run("read", {"store_id": "s", "var_id": "v"}))[0] == 1


def test_an_embedding_lookup_of_a_whole_stored_table_pulls_only_the_rows_asked_for(threaded_client):
    with _strategy(threaded_client) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            table = dd.Variable(np.arange(4000, dtype=np.float32).reshape(1000, 4), name="table")  # ps 0
        store = strategy.extended.stores[0]
        before = store.call_from_client(strategy.client, "bytes_served")
        ids = np.array([[7, 999], [7, 0]])
        rows = coordinator.schedule(lambda: dd.nn.embedding_lookup(table, ids)).fetch()
        np.testing.assert_array_equal(rows, np.arange(4000, dtype=np.float32).reshape(1000, 4)[ids])
        assert store.call_from_client(strategy.client, "bytes_served") - before == 3 * 4 * 4  # 3 distinct rows


# -- the direct channel ------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("direct_channel", [True, False])
def test_worker_processes_reach_the_ps_on_the_direct_channel_or_through_dask_comms(make_cluster, direct_channel):
    with dask.config.set({"daskdist.parameter-store.direct-channel": direct_channel}):
        client = make_cluster(3, processes=True)
        with _strategy(client) as strategy:
            assert all((s.direct is not None) == direct_channel for s in strategy.extended.stores)
            coordinator = ClusterCoordinator(strategy)
            with strategy.scope():
                kernel = dd.Variable(np.zeros((8, 3), np.float32), name="kernel")
                bias = dd.Variable(np.zeros(3, np.float32), name="bias")
            step = _train_step(kernel, bias)
            coordinator.schedule(step)  # the first closure pulls each variable at its first read, then pushes
            coordinator.join()
            assert _requests(strategy) == [2, 2]
            for _ in range(10):
                coordinator.schedule(step)
            coordinator.join()
            assert _requests(strategy) == [12, 12]  # then one exchange per closure per ps (pulled ahead)
            np.testing.assert_allclose(kernel.numpy(), np.full((8, 3), -5.5, np.float32))


def test_a_message_larger_than_the_socket_buffers_arrives_whole_with_its_arrays():
    import socket
    import threading

    from daskdist.ps.channel import recv_message, send_message

    left, right = socket.socketpair()
    message = ("exchange", {"values": [np.arange(3_000_000, dtype=np.float32), np.ones((5, 2))[:, 0]], "n": 7})
    received = []
    reader = threading.Thread(target=lambda: received.append(recv_message(right)))
    reader.start()
    send_message(left, message)
    reader.join(30)
    left.close()
    right.close()
    op, kwargs = received[0]
    assert op == "exchange" and kwargs["n"] == 7
    np.testing.assert_array_equal(kwargs["values"][0], message[1]["values"][0])
    np.testing.assert_array_equal(kwargs["values"][1], np.ones(5))  # a strided array travels in the pickle


def test_the_direct_channel_refuses_a_wrong_secret_and_serves_only_variable_traffic():
    import socket

    from daskdist.ps.channel import PROTOCOL, StoreServer, recv_message, send_message
    from daskdist.wire.hello import greeting

    store = _store_with(np.zeros(3, np.float32))
    server = StoreServer(store, "127.0.0.1")
    try:
        with socket.create_connection(server.endpoint[:2], timeout=10) as sock:
            sock.sendall(greeting(PROTOCOL, "x" * len(server.secret)))
            assert sock.recv(1) == b""  # closed by the server
        with socket.create_connection(server.endpoint[:2], timeout=10) as sock:
            sock.sendall(greeting(PROTOCOL, server.secret))
            send_message(sock, ("apply_fn", {"store_id": "s", "var_id": "v", "fn": print, "args": (), "kwargs": {}}))
            assert recv_message(sock)["status"] != "OK"
            send_message(sock, ("exchange", {"store_id": "s", "reads": {"v": -1},
                                             "updates": [("update", "v", "assign_add", np.ones(3), None, None)]}))
            reply = recv_message(sock)
            assert reply["status"] == "OK"
            np.testing.assert_array_equal(reply["result"]["values"]["v"][1], [1, 1, 1])
    finally:
        server.close()


@pytest.mark.timeout(180)
def test_on_a_tls_cluster_workers_reach_the_ps_on_a_tls_direct_channel_that_refuses_plain_tcp_and_a_wrong_secret():
    """The ps channel on ``tls://``: TLS with the cluster's certificates, the secret checked inside it.

    Shown failing: with ``start_store_member`` opening the channel on ``tcp://`` only (as before), the stores
    have no ``direct`` endpoint and the traffic goes through Dask's comms (the first assertion).
    """
    pytest.importorskip("cryptography")
    import contextlib
    import logging
    import socket

    from distributed import Client, LocalCluster
    from distributed.security import Security

    from daskdist import wire
    from daskdist.ps.channel import PROTOCOL
    from daskdist.ps.store import STORE_EXTENSION
    from daskdist.wire.hello import greeting

    security = Security.temporary()
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=False, dashboard_address=":0", protocol="tls://",
                      security=security, silence_logs=logging.ERROR) as cluster, \
            Client(cluster, security=security, set_as_default=False) as client, _strategy(client) as strategy:
        stores = strategy.extended.stores
        assert all(s.address.startswith("tls://") and s.direct is not None for s in stores)
        workers = {w.address: w for w in cluster.workers.values()}
        servers = [workers[s.address].extensions[STORE_EXTENSION].server for s in stores]
        assert all(server.tls for server in servers)
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            kernel = dd.Variable(np.zeros((8, 3), np.float32), name="kernel")  # ps 0
            bias = dd.Variable(np.zeros(3, np.float32), name="bias")  # ps 1
        step = _train_step(kernel, bias)
        for _ in range(11):
            coordinator.schedule(step)
        coordinator.join()
        served = _requests(strategy)
        assert served[0] >= 11 and served[1] >= 11
        assert [server.requests for server in servers] == served  # every request of the workers on the channel
        np.testing.assert_allclose(kernel.numpy(), np.full((8, 3), -5.5, np.float32))

        host, port, secret = stores[0].direct
        before = servers[0].requests
        with socket.create_connection((host, port), timeout=10) as plain:  # a plain TCP peer with the right secret
            with contextlib.suppress(OSError):  # the server may have closed already
                plain.sendall(greeting(PROTOCOL, secret))
                wire.send_message(plain, ("read", {"store_id": stores[0].store_id, "var_id": kernel.var_id}))
            _wait_closed(plain)  # the TLS handshake fails: closed, nothing served
        context = security.get_connection_args("worker")["ssl_context"]
        with wire.connect((host, port), PROTOCOL, "x" * len(secret), ssl_context=context) as wrong:
            with contextlib.suppress(OSError):
                wire.send_message(wrong, ("read", {"store_id": stores[0].store_id, "var_id": kernel.var_id}))
            _wait_closed(wrong)  # TLS with the wrong secret: closed after the hello, nothing served
        assert servers[0].requests == before
        before = servers[0].requests
        with wire.connect((host, port), PROTOCOL, secret, ssl_context=context) as right:  # the same over TLS: served
            wire.send_message(right, ("read", {"store_id": stores[0].store_id, "var_id": kernel.var_id}))
            reply = wire.recv_message(right)
        assert reply["status"] == "OK" and servers[0].requests == before + 1
        np.testing.assert_allclose(reply["result"][1], np.full((8, 3), -5.5, np.float32))


def _wait_closed(sock):
    """Read until the peer closes the connection (a TLS alert may come first); fails on a timeout."""
    import ssl

    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionResetError, ssl.SSLError):
        pass
