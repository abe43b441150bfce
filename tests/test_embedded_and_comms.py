"""The embedded default cluster, the default client, and clusters on TLS comms."""

from __future__ import annotations

import logging

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers


def _sum_of_ranks(strategy):
    out = strategy.run(
        lambda: dd.get_replica_context().all_reduce("SUM", np.array([dd.get_replica_context().replica_id_in_sync_group]))
    )
    return strategy.experimental_local_results(out)[0].tolist()


def test_embedded_default_starts_and_closes_a_local_cluster():
    with dd.MirroredStrategy() as strategy:
        n = strategy.num_replicas_in_sync
        assert n >= 2  # one replica per core, at least 2
        assert _sum_of_ranks(strategy) == [n * (n - 1) // 2]
        client = strategy.client
        cluster = strategy.extended._cluster
        assert len(cluster.workers) == n
    assert client.status == "closed"
    assert cluster.status.name == "closed"


def _trim_threshold() -> str | None:
    import os

    return os.environ.get("MALLOC_TRIM_THRESHOLD_")


@pytest.mark.parametrize("setting, expected", [(None, None), (1 << 20, str(1 << 20))])
def test_embedded_workers_do_not_get_dask_s_malloc_trim_threshold(monkeypatch, setting, expected):
    """Dask's nanny would set 65536, which makes every large temporary of a training step a fresh mapping."""
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    with dask.config.set({"daskdist.embedded.malloc-trim-threshold": setting}), dd.MirroredStrategy() as strategy:
        seen = set(strategy.client.run(_trim_threshold).values())
    assert seen == {expected}


def test_embedded_with_explicit_cpu_devices():
    strategy = dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1", "/cpu:2"])
    try:
        assert strategy.num_replicas_in_sync == 3
        assert strategy.extended.worker_devices[2] == "/job:localhost/replica:0/task:0/device:CPU:2"
        assert _sum_of_ranks(strategy) == [3]
        assert "MirroredStrategy" in strategy._repr_html_() and strategy.dashboard_link
    finally:
        strategy.close()


def test_a_default_client_is_used_instead_of_starting_a_cluster():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0",
                      silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        with dd.MirroredStrategy() as strategy:
            assert strategy.client is client
            assert strategy.extended._cluster is None
            assert _sum_of_ranks(strategy) == [1]
        assert client.status == "running"  # the strategy does not close what it did not start


@pytest.mark.parametrize("hosts", ["auto", "per-worker"])  # per-worker: replicas talk over direct TLS sockets
def test_tls_cluster(hosts):
    pytest.importorskip("cryptography")
    from distributed.security import Security

    security = Security.temporary()
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0",
                      protocol="tls://", security=security, silence_logs=logging.ERROR) as cluster, \
            Client(cluster, security=security, set_as_default=False) as client:
        assert client.scheduler.address.startswith("tls://")
        with dask.config.set({"daskdist.collective.hosts": hosts}), dd.MirroredStrategy(client=client) as strategy:
            assert all(a.startswith("tls://") for a in strategy.extended.worker_addresses)
            assert strategy.extended.group.command_path == "direct"  # commands too go over TLS, on their channel
            out = strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(100_000)))
            assert strategy.experimental_local_results(out)[1][0] == 2.0


def _affinity() -> str:
    import os

    return ",".join(map(str, sorted(os.sched_getaffinity(0))))  # a string: strategy.run regroups lists


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_replica_threads_are_bound_to_their_own_cores_and_released(process_client):
    import os

    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    with dd.MirroredStrategy(client=process_client) as strategy:
        pinned = strategy.experimental_local_results(strategy.run(_affinity))
    if len(os.sched_getaffinity(0)) >= 2:  # one core each, all different
        assert all("," not in p for p in pinned) and len(set(pinned)) == len(pinned), pinned
    # the worker threads that served the replicas go back to the pool unbound
    after = process_client.gather([process_client.submit(_affinity, pure=False, workers=[w])
                                   for w in scheduler_workers(process_client) for _ in range(2)])
    assert all(a == cores for a in after), after
    with dask.config.set({"daskdist.replica.pin-cores": False}), dd.MirroredStrategy(client=process_client) as strategy:
        assert all(p == cores for p in strategy.experimental_local_results(strategy.run(_affinity)))
