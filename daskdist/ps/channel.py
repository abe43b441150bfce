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

Messages are pickled with protocol 5; numpy buffers travel out of band, each
a part of one ``sendmsg`` (no copy into the pickle on the sending side).
A connection starts with ``HELLO`` and the store's secret (made when the
store was installed; it reaches workers inside the strategy's pickled
``StoreRef``s, as the group secret reaches replicas). Clusters on ``tls://``
do not get the channel (the stores are reached through Dask's comms, TLS
included), nor does anything when ``daskdist.parameter-store.direct-channel``
is false.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import pickle
import secrets
import socket
import struct
import threading
from typing import Any, Protocol, TypeVar

from daskdist import config, serialization
from daskdist.exceptions import ReplicaLostError
from daskdist.group.frames import recv_exactly

__all__ = ["DIRECT_OPS", "StoreServer", "direct_exchange", "recv_message", "send_message"]

logger = logging.getLogger(__name__)

HELLO = b"daskdist-ps-1:"
#: What the channel serves: a worker's variable and trainable-parameter traffic, and CentralStorage's rounds
#: (arrays and numbers; never functions or update rules: no cloudpickle on the way in; a round's first
#: contribution carrying the update rule goes through Dask's comms, ``daskdist.ps.refs``).
DIRECT_OPS = frozenset({"exchange", "read", "gather", "update", "scatter", "params_pull", "params_push", "contribute"})
_HEADER = struct.Struct("<QI")  # pickle bytes, out-of-band buffers
_HELLO_TIMEOUT = 5.0


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


def send_message(sock: socket.socket, obj: Any) -> None:
    """Send ``obj``: header, buffer lengths, pickle, then each numpy buffer as it lies in memory."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    parts: list[Any] = [_HEADER.pack(len(data), len(raws)),
                        struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws)), data, *raws]
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def recv_message(sock: socket.socket) -> Any:
    """Read what ``send_message`` sent (each buffer received into its own bytearray, then unpickled over it)."""
    n_data, n_buffers = _HEADER.unpack(recv_exactly(sock, _HEADER.size))
    lengths = struct.unpack(f"<{n_buffers}Q", recv_exactly(sock, 8 * n_buffers)) if n_buffers else ()
    data = recv_exactly(sock, n_data)
    buffers = [recv_exactly(sock, n) for n in lengths]
    return pickle.loads(data, buffers=buffers)


class StoreServer:
    """Serves one ps worker's store on a TCP port of its host: a thread per connection, the store's lock per request.

    Parameters
    ----------
    store
        The worker's ``ParameterStore``.
    host
        The interface to listen on (the worker's host).
    """

    def __init__(self, store: ServedStore, host: str):
        self._store = store
        self.secret = secrets.token_hex(16)
        self._listener = socket.create_server((host, 0))
        self.endpoint = (host, int(self._listener.getsockname()[1]))
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="daskdist-ps-accept").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="daskdist-ps-serve").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(_HELLO_TIMEOUT)
            greeting = recv_exactly(conn, len(HELLO) + len(self.secret))
            if not hmac.compare_digest(bytes(greeting), HELLO + self.secret.encode()):
                logger.warning("A connection to the parameter store channel gave a wrong greeting; closed")
                return
            conn.settimeout(None)
            while not self._closed:
                op, kwargs = recv_message(conn)
                send_message(conn, self._answer(op, kwargs))
        except (OSError, EOFError, ConnectionError):
            pass  # the worker went, or the server closes
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _answer(self, op: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            if op not in DIRECT_OPS:
                raise ValueError(f"the parameter store channel does not serve {op!r}")
            return {"status": "OK", "result": self._store.run_sync(op, kwargs)}
        except Exception as e:  # noqa: BLE001 - answered with the error, never raised across the wire
            address = self._store.worker.address if self._store.worker is not None else ""
            return serialization.error_message(e, -1, address)

    def close(self) -> None:
        """Stop listening and close every connection (their threads end)."""
        with self._lock:
            self._closed = True
            connections, self._connections = list(self._connections), set()
        for sock in (self._listener, *connections):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


_local = threading.local()  # each replica thread's connections: {(host, port): socket}


def _connection(store: DirectStore) -> socket.socket:
    connections: dict[tuple[str, int], socket.socket] = getattr(_local, "connections", None) or {}
    _local.connections = connections
    assert store.direct is not None
    host, port, secret = store.direct
    sock = connections.get((host, port))
    if sock is None:
        sock = socket.create_connection((host, port), timeout=config.get_seconds("parameter-store.connect-timeout"))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(config.get_seconds("collective.timeout"))
        sock.sendall(HELLO + secret.encode())
        connections[(host, port)] = sock
    return sock


def _drop(store: DirectStore) -> None:
    connections: dict[tuple[str, int], socket.socket] = getattr(_local, "connections", None) or {}
    if store.direct is not None:
        sock = connections.pop((store.direct[0], store.direct[1]), None)
        if sock is not None:
            sock.close()


def direct_exchange(requests: dict[_S, tuple[str, dict[str, Any]]]) -> dict[_S, Any]:
    """Send every request first, then read the replies: the stores work on them at the same time.

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
            send_message(_connection(store), message)
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
