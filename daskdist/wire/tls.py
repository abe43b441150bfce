"""TLS from the cluster's ``distributed.Security``: the contexts Dask's own ``tls://`` comms use.

On a ``tls://`` cluster every daskdist connection is TLS with the same
certificates as Dask's comms; on ``tcp://`` clusters these return ``None``
and connections are plain TCP (the secret in the hello still guards them).
"""

from __future__ import annotations

import ssl
from typing import Any

__all__ = ["client_context", "worker_contexts"]


def worker_contexts(worker: Any) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """A worker's ``(server, client)`` contexts, or ``(None, None)`` on plain TCP clusters."""
    if not str(getattr(worker, "address", "")).startswith("tls://"):
        return None, None
    server: ssl.SSLContext | None = worker.security.get_listen_args("worker").get("ssl_context")
    client: ssl.SSLContext | None = worker.security.get_connection_args("worker").get("ssl_context")
    return server, client


def client_context(client: Any) -> ssl.SSLContext | None:
    """A Dask client's context for connecting to workers, or ``None`` on plain TCP clusters."""
    address = getattr(getattr(client, "scheduler", None), "address", "") or ""
    if not str(address).startswith("tls://"):
        return None
    context: ssl.SSLContext | None = client.security.get_connection_args("client").get("ssl_context")
    return context
