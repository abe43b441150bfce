"""Shared real clusters for the tests.

``threaded_client``: a LocalCluster whose 3 workers are threads of this
process (fast; real Dask workers, comms and scheduler). ``process_client``: 2
workers in their own processes, as users run them. Crash tests build their
own clusters.
"""

from __future__ import annotations

import logging
import os

import pytest
from distributed import Client, LocalCluster


def _cluster(n_workers: int, processes: bool, **kwargs) -> LocalCluster:
    return LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        processes=processes,
        dashboard_address=":0",
        silence_logs=logging.ERROR,
        **kwargs,
    )


@pytest.fixture(scope="module")
def threaded_client():
    with _cluster(3, processes=False) as cluster, Client(cluster, set_as_default=False) as client:
        yield client


@pytest.fixture(scope="module")
def process_client():
    with _cluster(2, processes=True) as cluster, Client(cluster, set_as_default=False) as client:
        yield client


@pytest.fixture
def make_cluster():
    """Build a fresh cluster (and client) that the test may break; closed afterwards."""
    made = []

    def make(n_workers: int = 2, processes: bool = True, **kwargs) -> Client:
        cluster = _cluster(n_workers, processes, **kwargs)
        client = Client(cluster, set_as_default=False)
        made.append((cluster, client))
        return client

    yield make
    for cluster, client in made:
        client.close()
        cluster.close()


@pytest.fixture(scope="module")
def netns_hosts():
    """Two namespace hosts (h1, h2) with 2 Dask workers each, a scheduler on the bridge, and a client.

    Skips with the reason where namespaces cannot be made (not root, no iproute2).
    Everything is removed afterwards, also when the test process gets SIGTERM.
    """
    import signal

    from tests.netns import start_hosts, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    hosts = start_hosts(2, 2, rate="10gbit")

    def on_sigterm(signum, frame):
        hosts.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with Client(hosts.scheduler_address, set_as_default=False) as client:
            client.wait_for_workers(4, timeout=60)
            yield hosts, client
    finally:
        signal.signal(signal.SIGTERM, previous)
        hosts.close()


@pytest.fixture(scope="session")
def warm_pool():
    """The session's pool of fresh ``dask worker`` sets, built ahead in the background."""
    from tests.support.processes import WarmPool, warm_pool_enabled

    pool = WarmPool(enabled=warm_pool_enabled())
    yield pool
    pool.close()


@pytest.fixture
def process_workers(warm_pool):
    """``make(n)``: ``n`` fresh ``dask worker`` processes (with nannies) and a client; all closed afterwards.

    Closing stops the test's kill watchers first, then sweeps the shared-memory segments of the replicas
    killed here (only those whose creator is gone).
    """
    from daskdist.collective.transport.shm_orphans import sweep_orphans

    made = []

    def make(n: int):
        made.append(warm_pool.take(n))
        return made[-1]

    yield make
    for workers in made:
        workers.close()
    sweep_orphans()
