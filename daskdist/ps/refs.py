"""Reaching a parameter store (``daskdist.ps.store``) from a replica thread or from the client.

A ``StoreRef`` names one store (the worker that holds it and the strategy's
store id) and pickles as those strings. From a replica thread, the store of
the replica's own worker (found in that worker's extensions, so nothing is
shared between workers or clusters of one process) is called directly (no
serialization; the store copies what it hands out); any other store over its
direct channel when it has one, else through the worker's Dask comms, worker
to worker. From the client, through
the client's connection pool. Requests and replies are Dask-serialized
objects (``ToPickle``: pickle protocol 5, each numpy buffer a frame of its
own, written to the socket without being copied into one pickle).
``exchange_from_replica`` (a parameter-server worker's batch) sends one
request to each of several stores at once: the replica's own worker's
store is called directly (no copy), one with a direct channel gets it there
(``daskdist.ps.channel``), any other through Dask's comms. A store that cannot be
reached raises ``ReplicaLostError`` naming it.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed.core import CommClosedError, send_recv
from distributed.protocol.serialize import ToPickle
from distributed.utils import sync

from daskdist import config, serialization
from daskdist.exceptions import ReplicaLostError
from daskdist.ps.channel import DIRECT_OPS, direct_exchange
from daskdist.ps.store import HANDLER, STORE_EXTENSION, ParameterStore, unwrap
from daskdist.wire.tls import worker_contexts

if TYPE_CHECKING:
    from distributed import Client

    from daskdist.group.service import ReplicaService

__all__ = ["RoundCounter", "StoreRef", "exchange_from_replica"]


class RoundCounter:
    """Round ids that every replica of one command computes alike: (the command's run id, n-th round in it).

    Each command the client sends has one run id on every replica, so the
    replicas agree on round ids even after an earlier command failed half way
    (a counter kept across commands would drift apart and never meet again).
    """

    def __init__(self) -> None:
        self._run: int | None = None
        self._n = 0

    def next(self, run_id: int) -> int:
        if run_id != self._run:
            self._run, self._n = run_id, 0
        self._n += 1
        return (int(run_id) << 32) | self._n

    def __getstate__(self) -> dict[str, Any]:
        return {"_run": None, "_n": 0}


@dataclass(frozen=True)
class StoreRef:
    """One parameter store: the Dask worker holding it and the id its strategy's variables are kept under."""

    address: str
    store_id: str
    direct: tuple[str, int, str] | None = None  # the store's direct channel: host, port, secret (``daskdist.ps.channel``)

    # -- from a replica thread ---------------------------------------------------------

    def call_from_replica(self, service: ReplicaService, op: str, **kwargs: Any) -> Any:
        """Run ``op`` on the store from a replica thread (``service``: the replica it runs on).

        A worker's variable and trainable-parameter traffic and synchronous
        rounds (``daskdist.ps.channel.DIRECT_OPS``) go without the event loop: the
        store of the replica's own worker is called directly (a round's wait
        then blocks this thread), one with a direct channel gets it there. The rest
        (functions, update rules, a round's contribution carrying the
        update rule) goes through the worker's event loop.
        """
        worker = service.worker
        if op in DIRECT_OPS and not _carries_objects(op, kwargs):  # no event loop on the way: own worker, else the channel
            held = _own_store(worker, self.address)
            if held is not None:
                return held.run_sync(op, {**kwargs, "store_id": self.store_id})
            if self.direct is not None:
                return direct_exchange({self: (op, {**kwargs, "store_id": self.store_id})},
                                       tls=functools.partial(_client_context, worker))[self]
        return sync(worker.loop, self._call_on_loop, worker, op, kwargs)

    async def _call_on_loop(self, worker: Any, op: str, kwargs: dict[str, Any]) -> Any:
        """``op`` on the store, from ``worker``'s event loop: a direct call in the same worker, else a request."""
        kwargs["store_id"] = self.store_id
        if worker.address == self.address:
            store = worker.extensions.get(STORE_EXTENSION)
            if store is None:
                raise ReplicaLostError(f"the parameter store on {self.address} is gone", worker=self.address)
            return await store.run(op, kwargs)
        try:
            response = await _call(worker.rpc, self.address, ToPickle((op, kwargs)))
        except (OSError, CommClosedError) as e:
            raise ReplicaLostError(f"the parameter store on {self.address} cannot be reached: {e}",
                                   worker=self.address) from e
        return _result(response)

    def round_from_replica(self, runtime: ReplicaService, kind: str, key: str, round_id: int, payload: Any) -> Any:
        """Contribute ``payload`` to a synchronous round; the round's result once every replica has.

        Waits in slices of at most 0.5 s, checking the run's and the group's
        aborts between them (a lost replica fails the wait within seconds),
        up to ``daskdist.collective.timeout``.

        Raises
        ------
        CollectiveTimeoutError
            The round did not complete within ``daskdist.collective.timeout``.
        """
        from daskdist.exceptions import CollectiveTimeoutError

        deadline = time.monotonic() + config.get_seconds("collective.timeout")
        has_payload = True
        while True:
            runtime.mailbox.check(runtime.communicator.attempt)  # aborts are per process-group attempt
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeoutError(
                    f"round {round_id} of {key!r} at the parameter store on {self.address} did not complete "
                    f"within daskdist.collective.timeout"
                )
            response = self.call_from_replica(
                runtime, "contribute", key=key, round_id=round_id, rank=runtime.rank, size=runtime.size, kind=kind,
                has_payload=has_payload, payload=payload if has_payload else None, wait=min(0.5, remaining),
            )
            has_payload = False
            if response["status"] == "OK":
                return response["result"]

    # -- from the client ---------------------------------------------------------------------

    def call_from_client(self, client: Client, op: str, **kwargs: Any) -> Any:
        """Run ``op`` on the store from the client."""
        kwargs["store_id"] = self.store_id
        try:
            response = client.sync(_call, client.rpc, self.address, ToPickle((op, kwargs)))  # type: ignore[no-untyped-call]
        except (OSError, CommClosedError) as e:
            raise ReplicaLostError(f"the parameter store on {self.address} cannot be reached: {e}",
                                   worker=self.address) from e
        return _result(response)


def exchange_from_replica(service: ReplicaService, requests: dict[StoreRef, dict[str, Any]]) -> dict[StoreRef, Any]:
    """One ``exchange`` per store, all sent at once from a replica thread; each store's reply.

    ``requests``: ``{store: exchange arguments}``. The requests go out
    concurrently (one round trip for all the stores, not one per store); the
    first error (e.g. ``ReplicaLostError`` of a lost store) is raised once
    every request finished.
    """
    if not requests:
        return {}
    worker = service.worker
    held = {s: own for s in requests if (own := _own_store(worker, s.address)) is not None}  # called directly
    direct = [s for s in requests if s not in held and s.direct is not None]
    through_dask = [s for s in requests if s not in held and s.direct is None]
    replies: dict[StoreRef, Any] = {}
    errors: list[BaseException] = []
    if direct:
        try:  # sent first: the stores work while this thread serves the rest
            replies.update(direct_exchange({s: ("exchange", {**requests[s], "store_id": s.store_id})
                                            for s in direct}, tls=functools.partial(_client_context, worker)))
        except Exception as e:  # noqa: BLE001 - raised after the others were answered
            errors.append(e)
    if through_dask:

        async def all_of() -> list[Any]:
            return list(await asyncio.gather(
                *(s._call_on_loop(worker, "exchange", dict(requests[s])) for s in through_dask),
                return_exceptions=True))

        for store, result in zip(through_dask, sync(worker.loop, all_of)):
            if isinstance(result, BaseException):
                errors.append(result)
            else:
                replies[store] = result
    for ref, local in held.items():  # the replica's own worker's store: called directly, no copy (it takes its lock)
        try:
            replies[ref] = local.run_sync("exchange", {**requests[ref], "store_id": ref.store_id})
        except Exception as e:  # noqa: BLE001 - raised after the others were answered
            errors.append(e)
    if errors:
        raise errors[0]
    return replies


def _client_context(worker: Any) -> ssl.SSLContext | None:
    """The TLS context ``worker`` connects to other workers with (``None`` on ``tcp://``): made when a channel opens."""
    return worker_contexts(worker)[1]


def _own_store(worker: Any, address: str) -> ParameterStore | None:
    """The store held by ``worker`` if ``address`` is that worker's (a replica's own worker), else ``None``.

    Looked up in the worker's own extensions: a store of another worker, even
    one in this process (a threaded cluster), is reached over its channel or
    Dask's comms, so stores of two clusters in one process never mix.
    """
    if worker is None or worker.address != address:
        return None
    store = worker.extensions.get(STORE_EXTENSION)
    return store if isinstance(store, ParameterStore) else None


def _carries_objects(op: str, kwargs: dict[str, Any]) -> bool:
    """Whether a ``contribute`` carries more than arrays and numbers (the first gradient round: the update rule)."""
    payload = kwargs.get("payload") if op == "contribute" else None
    return isinstance(payload, dict) and payload.get("init") is not None


async def _call(pool: Any, address: str, payload: Any) -> dict[str, Any]:
    """One request to the store's handler; connecting gives up after ``daskdist.parameter-store.connect-timeout``.

    Dask retries a refused connection until ``distributed.comm.timeouts.connect``
    (30 s by default); a parameter store whose worker died must be reported sooner.
    """
    comm = await pool.connect(address, timeout=config.get_seconds("parameter-store.connect-timeout"))
    try:
        response = await send_recv(comm, op=HANDLER, payload=payload)
    except BaseException:
        comm.abort()
        raise
    pool.reuse(address, comm)
    return dict(response)


def _result(response: dict[str, Any]) -> Any:
    if response.get("status") != "OK":
        raise serialization.exception_from_message(response)
    return unwrap(response["result"])
