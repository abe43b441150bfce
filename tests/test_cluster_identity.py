"""The scheduler's workers as daskdist reads them: asked now, never the client's cache that its refresh empties.

``Client.scheduler_info(n_workers=-1)`` returns the client's cached identity,
which the client's periodic refresh (``distributed.client.scheduler-info-interval``)
overwrites with one that lists no workers: a caller could read an empty
cluster. A refresh every millisecond makes the race frequent (89 of 500 calls
read no workers with ``scheduler_info``).
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import dask
import pytest
from distributed import Client, LocalCluster

import daskdist as dd
from daskdist.cluster.identity import scheduler_identity, scheduler_workers
from daskdist.exceptions import ReplicaLostError

pytestmark = pytest.mark.timeout(300)

PACKAGE = Path(dd.__file__).resolve().parent


@pytest.fixture
def fast_refreshing_client():
    """A threaded cluster of 3 workers and a client whose cached identity is refreshed (emptied) every 1 ms."""
    with dask.config.set({"distributed.client.scheduler-info-interval": "1ms"}):
        with LocalCluster(n_workers=3, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
                Client(cluster, set_as_default=False) as client:
            client.wait_for_workers(3)
            yield client


def test_every_call_sees_every_worker_while_the_clients_refresh_runs(fast_refreshing_client):
    client = fast_refreshing_client
    seen = [len(scheduler_workers(client)) for _ in range(300)]
    assert seen == [3] * 300
    identity = scheduler_identity(client)
    assert identity["address"] == client.scheduler.address and len(identity["workers"]) == 3


def test_no_module_reads_the_clients_cached_scheduler_info():
    calls = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "scheduler_info":
                calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert calls == []  # use daskdist.cluster.identity.scheduler_workers / scheduler_identity


def test_a_coordinator_keeps_its_workers_while_the_clients_refresh_runs(fast_refreshing_client):
    client = fast_refreshing_client
    resolver = dd.cluster_resolver.DaskClusterResolver(client, num_ps=1)
    with dd.ParameterServerStrategy(resolver) as strategy:
        coordinator = dd.experimental.coordinator.ClusterCoordinator(strategy)
        workers = coordinator.live_workers
        assert len(workers) == 2
        for _ in range(100):  # every closure wakes the coordinator's watch, which asks the scheduler for workers
            coordinator.schedule(lambda: None)
        coordinator.join()
        assert coordinator.live_workers == workers


def test_a_per_worker_dataset_with_every_worker_lost_says_so():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as client:
        client.wait_for_workers(3)
        resolver = dd.cluster_resolver.DaskClusterResolver(client, num_ps=1)
        with dd.ParameterServerStrategy(resolver) as strategy:
            coordinator = dd.experimental.coordinator.ClusterCoordinator(strategy)
            client.retire_workers(workers=list(coordinator.live_workers), close_workers=True)
            deadline = time.monotonic() + 60
            while coordinator.live_workers and time.monotonic() < deadline:
                time.sleep(0.05)
            assert coordinator.live_workers == ()
            with pytest.raises(ReplicaLostError, match="every worker of the ParameterServerStrategy is lost"):
                coordinator.create_per_worker_dataset(
                    lambda ctx: dd.data.Dataset.range(8).shard(ctx.num_input_pipelines, ctx.input_pipeline_id))


def test_only_the_identity_module_asks_the_scheduler_for_its_identity():
    # one place reads the workers (a second copy drifts: data/placement.py had one until the contract let data
    # import daskdist.cluster.identity)
    asks = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "identity" and \
                    isinstance(node.value, ast.Attribute) and node.value.attr == "scheduler":
                asks.append(str(path.relative_to(PACKAGE)))
    assert sorted(set(asks)) == ["cluster/identity.py"]
