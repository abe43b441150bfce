"""The scheduler's view of the cluster asked now: its identity and workers, never the client's cached copy.

``Client.scheduler_info(n_workers=-1)`` fetches the identity with every
worker into the client's cache and then returns the cache; the client's
periodic refresh (``distributed.client.scheduler-info-interval``, 2 s) writes
the same cache with an identity that lists no workers (``n_workers=0``). When
the refresh lands between the fetch and the return (a loaded machine, where
the calling thread waits for the GIL while the event loop runs), the caller
reads ``"workers": {}`` as if every worker had left: a ``ClusterCoordinator``
took it for the loss of all its workers and its next ``fit`` failed
(``benchmarks/parameter_server.py`` at load 29). The functions here return
the reply of the scheduler's ``identity`` call itself.
"""

from __future__ import annotations

from typing import Any

__all__ = ["scheduler_identity", "scheduler_identity_from_worker", "scheduler_workers"]


def scheduler_identity(client: Any) -> dict[str, Any]:
    """The scheduler's identity (address, ``workers``: address -> info) with every worker, asked now.

    Parameters
    ----------
    client
        A synchronous ``distributed.Client``.
    """
    return dict(client.sync(client.scheduler.identity, n_workers=-1))


def scheduler_identity_from_worker(worker: Any) -> dict[str, Any]:
    """The scheduler's identity with every worker, asked now from inside a Dask ``worker`` (its scheduler rpc)."""
    from distributed.utils import sync

    return dict(sync(worker.loop, worker.scheduler.identity, n_workers=-1))


def scheduler_workers(client: Any) -> dict[str, Any]:
    """The workers the scheduler knows now: address -> their info (``name``, ``host``, ...)."""
    return dict(scheduler_identity(client)["workers"])
