"""The direct channel to a parameter store: a worker's replica thread and a server thread on the ps, over TCP.

A parameter-server closure's exchange with a store (``daskdist.ps.session``) is one
request and one reply. Through Dask's comms it passes the worker's event loop
twice and the ps's event loop once, each a thread that must be woken, plus
Dask's message protocol. Here the replica thread writes the request on its own
blocking TCP connection and a thread of the ps (one per connection) answers
it, holding the store's lock; nothing else is woken. Measured on the 2-core
development machine under load (``benchmarks/parameter_server.py`` prints the
A/B): a 2.5 KiB exchange took 2.4-8 ms through Dask comms and 0.08-0.24 ms on
a plain socket between threads.

Messages are ``daskdist.wire`` messages (pickle protocol 5, numpy buffers
out of band, each a part of one ``sendmsg``). A connection starts with the
wire hello carrying the store's secret (made when the store was installed; it
reaches workers inside the strategy's pickled ``StoreRef``s, as the group
secret reaches replicas). On a ``tls://`` cluster the connection is TLS with
the cluster's ``distributed.Security`` (``daskdist.wire.tls``: the ps
worker's server context, the calling worker's client context), as the
command channel and the socket transport are; the secret is checked inside
it. Workers on other protocols (``inproc://`` of a threaded cluster) get no
channel (their stores are reached through Dask's comms), nor does anything
when ``daskdist.parameter-store.direct-channel`` is false.
"""

from __future__ import annotations

import logging
import pickle
import secrets
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from daskdist import config, serialization, wire
from daskdist.exceptions import ReplicaLostError
from daskdist.wire import recv_message, send_message

__all__ = ["DIRECT_OPS", "PROTOCOL", "StoreServer", "direct_exchange", "recv_message", "send_message"]

logger = logging.getLogger(__name__)

#: The channel's name in the wire hello (``daskdist.wire.hello``).
PROTOCOL = "daskdist-ps-2"
#: What the channel serves: a worker's variable and trainable-parameter traffic, and CentralStorage's rounds
#: (arrays and numbers; never functions or update rules: no cloudpickle on the way in; a round's first
#: contribution carrying the update rule goes through Dask's comms, ``daskdist.ps.refs``).
DIRECT_OPS = frozenset({"exchange", "read", "gather", "update", "scatter", "params_pull", "params_push", "contribute"})


class ServedStore(Protocol):
    """What the server needs of the store it serves (``daskdist.ps.store.ParameterStore``)."""

    worker: Any  # the Dask worker holding the store, or None

    def run_sync(self, op: str, kwargs: dict[str, Any]) -> Any: ...


class DirectStore(Protocol):
    """What a caller needs of a store it reaches directly (``daskdist.ps.refs.StoreRef``): hashable."""

    @property
    def address(self) -> str: ...

    @property
    def direct(self) -> tuple[str, int, str] | None: ...

    def __hash__(self) -> int: ...


_S = TypeVar("_S", bound=DirectStore)


class StoreServer:
    """Serves one ps worker's store on a TCP port of its host: a thread per connection, the store's lock per request.

    Parameters
    ----------
    store
        The worker's ``ParameterStore``.
    host
        The interface to listen on (the worker's host).
    ssl_context
        The server's TLS context on a ``tls://`` cluster (``daskdist.wire.tls.worker_contexts``):
        every connection is TLS with the cluster's certificates, its hello still carries the secret.

    Attributes
    ----------
    requests
        How many requests the channel answered (a store's traffic that did not go through Dask's comms).
    """

    def __init__(self, store: ServedStore, host: str, ssl_context: ssl.SSLContext | None = None):
        self._store = store
        self.secret = secrets.token_hex(16)
        self.requests = 0
        self._counting = threading.Lock()  # a thread per connection
        self._acceptor = wire.Acceptor(host, PROTOCOL, self.secret, self._serve, ssl_context=ssl_context,
                                       name="daskdist-ps-serve")
        self.endpoint = self._acceptor.endpoint
        self.tls = ssl_context is not None

    def _serve(self, conn: socket.socket, _tail: bytes) -> None:
        try:
            while not self._acceptor.closed:
                op, kwargs = recv_message(conn)
                send_message(conn, self._answer(op, kwargs))
        except (OSError, EOFError, pickle.UnpicklingError):
            pass  # the worker went, or the server closes

    def _answer(self, op: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        with self._counting:
            self.requests += 1
        try:
            if op not in DIRECT_OPS:
                raise ValueError(f"the parameter store channel does not serve {op!r}")
            return {"status": "OK", "result": self._store.run_sync(op, kwargs)}
        except Exception as e:  # noqa: BLE001 - answered with the error, never raised across the wire
            address = self._store.worker.address if self._store.worker is not None else ""
            return serialization.error_message(e, -1, address)

    def close(self) -> None:
        """Stop listening and close every connection (their threads end)."""
        self._acceptor.close(join=0)


_local = threading.local()  # each replica thread's connections: {(host, port): socket}


def _no_tls() -> ssl.SSLContext | None:
    return None


def _connection(store: DirectStore, tls: Callable[[], ssl.SSLContext | None] = _no_tls) -> socket.socket:
    connections: dict[tuple[str, int], socket.socket] = getattr(_local, "connections", None) or {}
    _local.connections = connections
    if store.direct is None:
        raise ValueError(f"the parameter store on {store.address} has no direct channel")
    host, port, secret = store.direct
    sock = connections.get((host, port))
    if sock is None:
        sock = wire.connect((host, port), PROTOCOL, secret, ssl_context=tls(),
                            timeout=config.get_seconds("parameter-store.connect-timeout"))
        sock.settimeout(config.get_seconds("collective.timeout"))
        connections[(host, port)] = sock
    return sock


def _drop(store: DirectStore) -> None:
    connections: dict[tuple[str, int], socket.socket] = getattr(_local, "connections", None) or {}
    if store.direct is not None:
        sock = connections.pop((store.direct[0], store.direct[1]), None)
        if sock is not None:
            sock.close()


def direct_exchange(requests: dict[_S, tuple[str, dict[str, Any]]],
                    tls: Callable[[], ssl.SSLContext | None] = _no_tls) -> dict[_S, Any]:
    """Send every request first, then read the replies: the stores work on them at the same time.

    ``tls`` makes the TLS context a new connection uses (on a ``tls://``
    cluster the caller's worker's, ``daskdist.wire.tls``), called only when
    this thread has no connection to a store yet.

    Raises
    ------
    ReplicaLostError
        A store that cannot be reached (connection refused, closed or timed
        out), naming its worker; raised after every other reply was read.
    """
    sent: list[_S] = []
    first_error: BaseException | None = None
    for store, message in requests.items():
        try:
            send_message(_connection(store, tls), message)
            sent.append(store)
        except OSError as e:
            _drop(store)
            first_error = first_error or ReplicaLostError(
                f"the parameter store on {store.address} cannot be reached: {e}", worker=store.address)
    replies: dict[_S, Any] = {}
    for store in sent:
        try:
            response = recv_message(_connection(store))
        except (OSError, EOFError) as e:
            _drop(store)
            first_error = first_error or ReplicaLostError(
                f"the parameter store on {store.address} was lost during a request: {e}", worker=store.address)
            continue
        if response.get("status") != "OK":
            first_error = first_error or serialization.exception_from_message(response)
            continue
        replies[store] = response["result"]
    if first_error is not None:
        raise first_error
    return replies
