"""Parameter stores as members of a group: role ``ps``, hosted by the worker plugin, watched by the scheduler plugin.

A strategy's stores form one group (``ps-<strategy token>``) registered with
the scheduler plugin like a replica group: each store is a ``Member`` with
role ``ps``, generation 0, membership policy ``fixed``. So the scheduler's
bookkeeping covers them as it covers replicas:

* Dask's downscaling never retires a worker holding a live store
  (``valid_workers_downscaling``);
* a worker holding a store that leaves the cluster fails the group
  (``remove_worker``): the loss is logged as a ``failed`` event, the other
  stores are told, and ``daskdist_group_status`` answers ``failed`` with the
  reason, which the coordinator turns into ``ParameterServerLostError``;
* a client that disconnects closes the group: each store drops its data.

On the worker, the worker plugin (``daskdist_host_member``) calls
``start_store_member`` (sent by reference, pickled): it installs the
worker's ``ParameterStore`` extension once (one per worker, shared by every
strategy that places variables there, keyed by store id), and then the
member meets the others at the group's rendezvous, carrying its direct
channel's endpoint (``daskdist.ps.channel``) as its rendezvous info.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING, Any

from daskdist import config, serialization
from daskdist.cluster.identity import scheduler_workers
from daskdist.group.membership import Generation, GroupId, Member, Membership, Role
from daskdist.group.scheduler_plugin import DaskdistSchedulerPlugin
from daskdist.ps.refs import StoreRef
from daskdist.ps.store import HANDLER, STORE_EXTENSION, ParameterStore

if TYPE_CHECKING:
    from distributed import Client, Worker

__all__ = ["StoreGroup", "StoreMember", "start_store_member"]

logger = logging.getLogger(__name__)

ROLE: Role = "ps"


class StoreMember:
    """This worker's member of a strategy's store group: its part of the worker's ``ParameterStore``.

    Parameters
    ----------
    store
        The worker's store (``worker.extensions["daskdist-ps"]``).
    store_id
        The id the strategy's variables are kept under.
    """

    def __init__(self, store: ParameterStore, store_id: str):
        self.store = store
        self.store_id = store_id
        self.stopped = False

    def info(self) -> dict[str, Any]:
        """What peers and the client need to reach the store: ``{"direct": (host, port, secret) or None}``."""
        server = self.store.server
        return {"direct": None if server is None else [*server.endpoint, server.secret]}

    def abort_group(self, message: str) -> None:
        """Another member was lost: the group failed (the client raises ``ParameterServerLostError``)."""
        logger.info("Parameter store group of %s failed: %s", self.store_id, message)

    def stop(self) -> None:
        """The strategy closed, or its client went away: drop the variables held for it (idempotent)."""
        if self.stopped:
            return
        self.stopped = True
        self.store.run_sync("drop", {"store_id": self.store_id})


def start_store_member(worker: Worker, store_id: str) -> StoreMember:
    """Make ``worker`` hold parameters for ``store_id``: its store installed once, its direct channel opened.

    Called on the worker by the worker plugin's ``daskdist_host_member``. The
    direct channel is opened on ``tcp://`` workers, and on ``tls://`` workers
    with the cluster's TLS (``daskdist.wire.tls``); workers of other protocols
    (``inproc://``) are reached through Dask's comms.
    """
    store = worker.extensions.get(STORE_EXTENSION)
    if store is None:
        store = ParameterStore(worker)
        worker.extensions[STORE_EXTENSION] = store
        worker.handlers[HANDLER] = store.handle
        logger.debug("Parameter store installed on %s", worker.address)
    if store.server is None and worker.address.startswith(("tcp://", "tls://")):
        from distributed.comm import get_address_host

        from daskdist.ps.channel import StoreServer
        from daskdist.wire.tls import worker_contexts

        store.server = StoreServer(store, get_address_host(worker.address), ssl_context=worker_contexts(worker)[0])
    return StoreMember(store, store_id)


class StoreGroup:
    """The client's handle on a strategy's stores: one group of members with role ``ps``.

    Parameters
    ----------
    client
        The strategy's client.
    token
        The strategy's token (the store id and the group's metrics key).
    addresses
        The workers to hold the stores, in order (a variable's store index is its position).
    devices
        The TF device name of each store.
    """

    def __init__(self, client: Client, token: str, addresses: list[str], devices: list[str]):
        self.client = client
        self.token = token
        self.group_id = GroupId(f"ps-{token}")
        self.addresses = list(addresses)
        self.membership = Membership(self.group_id, Generation(0),
                                     tuple(Member(a, d, a, ROLE) for a, d in zip(addresses, devices)))
        self.refs: list[StoreRef] = []
        self._closed = False

    def start(self) -> list[StoreRef]:
        """Register the group and start a store member on every address; the stores' references.

        Raises
        ------
        ValueError
            An address that is not a worker of the cluster.
        ReplicaLostError, TimeoutError
            A store did not start within ``daskdist.rendezvous.timeout`` (the group is closed).
        """
        self.client.register_plugin(DaskdistSchedulerPlugin(), name="daskdist")
        answer = self._ask("daskdist_register_group", group_id=self.group_id, workers=self.addresses,
                           client=self.client.id, membership=self.membership.to_msg(), policy="fixed",
                           strategy_token=self.token)
        if answer.get("status") != "OK":
            raise ValueError(answer.get("message"))
        factory = serialization.dumps(functools.partial(start_store_member, store_id=self.token))
        timeout = config.get_seconds("rendezvous.timeout")

        async def host_all() -> list[Any]:
            calls = [self.client.rpc(address).daskdist_host_member(
                group_id=self.group_id, rank=rank, role=ROLE, factory=factory, generation=0)
                for rank, address in enumerate(self.addresses)]
            return list(await asyncio.wait_for(asyncio.gather(*calls), timeout))

        try:
            answers = self.client.sync(host_all)  # type: ignore[no-untyped-call]
            for answer in answers:
                if answer.get("status") != "OK":
                    raise serialization.exception_from_message(answer)
        except BaseException:
            self.close()
            raise
        use_direct = config.get("parameter-store.direct-channel", True)
        for address, answer in zip(self.addresses, answers):
            direct = answer["info"].get("direct") if use_direct else None
            self.refs.append(StoreRef(address, self.token, tuple(direct) if direct else None))
        return list(self.refs)

    def status(self) -> tuple[str, str]:
        """``(status, reason)`` of the group at the scheduler: ``running``, ``failed`` (a store was lost), ..."""
        answer = self._ask("daskdist_group_status", group_id=self.group_id)
        return str(answer.get("status")), str(answer.get("reason", ""))

    def close(self) -> None:
        """Stop the members still in the cluster (each drops its variables) and forget the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            workers = scheduler_workers(self.client)
        except Exception:  # noqa: BLE001 - the client is closing: try them all
            workers = dict.fromkeys(self.addresses)
        for rank, address in enumerate(self.addresses):
            if address not in workers:
                continue
            try:
                self.client.sync(self.client.rpc(address).daskdist_stop,  # type: ignore[no-untyped-call]
                                 group_id=self.group_id, rank=rank)
            except Exception as e:  # noqa: BLE001 - a lost ps
                logger.debug("Could not stop the parameter store on %s: %s", address, e)
        try:
            self._ask("daskdist_close_group", group_id=self.group_id)
        except Exception as e:  # noqa: BLE001 - the scheduler may be gone
            logger.debug("Could not close store group %s: %s", self.group_id, e)

    def _ask(self, handler: str, **kwargs: Any) -> dict[str, Any]:
        scheduler: Any = self.client.scheduler
        answer: dict[str, Any] = self.client.sync(getattr(scheduler, handler), **kwargs)  # type: ignore[no-untyped-call]
        return answer
