"""Whether the ``distributed.Client`` a strategy uses is still open, and the error that says it is not.

A closed client cannot reach the scheduler or the workers: a strategy built on
it would fail deep inside Dask (``RuntimeError: IOLoop is closed``), and a
strategy whose client was closed under it has lost its replicas (the scheduler
closes a client's groups when the client leaves). Both say so plainly with
``ClientClosedError``. Used by every strategy's constructor (SPMD, parameter
server, central storage) and by the group handle before each command.
"""

from __future__ import annotations

from typing import Any

from daskdist.exceptions import ClientClosedError

__all__ = ["check_client_open", "client_is_closed"]

_CLOSED = ("closing", "closed")


def client_is_closed(client: Any) -> bool:
    """``True`` when ``client`` is a ``distributed.Client`` that was closed (or is closing)."""
    return str(getattr(client, "status", "")) in _CLOSED


def check_client_open(client: Any, what: str, then: str = "") -> None:
    """Raise ``ClientClosedError`` when ``client`` is closed.

    Parameters
    ----------
    client
        The ``distributed.Client`` (``None`` passes: no client given).
    what
        What needs it, for the message (``"MirroredStrategy"``, ``"This strategy"``).
    then
        What else to do, appended to the message's advice.
    """
    if client is not None and client_is_closed(client):
        raise ClientClosedError(
            f"{what} needs an open Dask client, but the distributed.Client {getattr(client, 'id', '')} is "
            f"closed (client.close() was called, or its `with` block ended): create a new Client{then}"
        )
