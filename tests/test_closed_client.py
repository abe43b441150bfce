"""A closed Dask client: every strategy says so, at construction and at ``run``; ``close()`` stays quiet.

Real Dask workers (threads of this process: the client, not a worker, is what closes).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers

TWO = ["/cpu:0", "/cpu:1"]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0",
                      silence_logs=logging.ERROR) as cluster:
        yield cluster


@pytest.fixture
def closed_client(cluster):
    client = Client(cluster, set_as_default=False)
    workers = sorted(scheduler_workers(client))
    client.close()
    return client, workers


def _spec_resolver(workers):
    return dd.cluster_resolver.SimpleClusterResolver(
        dd.cluster_resolver.ClusterSpec({"ps": workers[:1], "worker": workers[1:]}))


STRATEGIES = {
    "MirroredStrategy": lambda c, w: dd.MirroredStrategy(TWO, client=c),
    "MultiWorkerMirroredStrategy": lambda c, w: dd.MultiWorkerMirroredStrategy(client=c),
    "OneDeviceStrategy": lambda c, w: dd.OneDeviceStrategy("/cpu:0", client=c),
    "CentralStorageStrategy": lambda c, w: dd.experimental.CentralStorageStrategy(TWO, client=c),
    "ParameterServerStrategy": lambda c, w: dd.ParameterServerStrategy(_spec_resolver(w), client=c),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_strategy_on_a_closed_client_says_the_client_is_closed(closed_client, name):
    client, workers = closed_client
    with pytest.raises(dd.ClientClosedError, match=r"needs an open Dask client.*is closed") as info:
        STRATEGIES[name](client, workers)
    assert name in str(info.value)
    assert isinstance(info.value, dd.StrategyClosedError)  # what code catching a dead strategy already catches


@pytest.mark.parametrize("name", ["MirroredStrategy", "MultiWorkerMirroredStrategy"])
def test_run_after_client_close_says_the_client_is_closed_and_close_stays_quiet(cluster, caplog, name):
    client = Client(cluster, set_as_default=False)
    strategy = STRATEGIES[name](client, None)
    with strategy.scope():
        v = dd.Variable(np.zeros(2, np.float32), aggregation="MEAN")
    ids = strategy.run(lambda: dd.get_replica_context().replica_id_in_sync_group)
    assert strategy.experimental_local_results(ids) == tuple(range(strategy.num_replicas_in_sync))
    client.close()
    with pytest.raises(dd.ClientClosedError, match=r"This strategy needs an open Dask client.*a new strategy"):
        strategy.run(lambda: 1)
    with pytest.raises(dd.ClientClosedError):  # every command, not only the first
        strategy.run(lambda: v.assign_add(np.ones(2, np.float32)))
    with caplog.at_level(logging.INFO, logger="daskdist"):
        strategy.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "did not all stop cleanly" not in caplog.text
    with pytest.raises(dd.StrategyClosedError, match="closed"):
        strategy.run(lambda: 1)


def test_a_live_client_still_runs_after_another_client_closed(cluster):
    """Only the closed client's strategy is affected."""
    live = Client(cluster, set_as_default=False)
    other = Client(cluster, set_as_default=False)
    try:
        with dd.MirroredStrategy(TWO, client=live) as strategy:
            other.close()
            assert strategy.reduce("SUM", strategy.run(lambda: np.float32(1.0)), axis=None) == 2
    finally:
        live.close()
