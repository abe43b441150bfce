"""The always-available transport: Dask's own comms between workers.

Payloads travel as ``to_serialize`` frames over the worker's connection pool,
so it works wherever the cluster works (``tcp://``, ``tls://`` with the
cluster's ``Security``, ``ucx://``), with no extra ports or setup. It needs
no ``Worker``: an RPC callable (``worker.rpc``, a ``ConnectionPool``, a
client's ``rpc``) and the event loop it runs on are enough. Sends are
fire-and-forget messages (``reply=False``) delivered by the peer worker's
``daskdist_message`` handler straight into the peer replica's mailbox.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from distributed.comm.core import CommClosedError
from distributed.protocol.serialize import to_serialize

from daskdist.collective.mailbox import Mailbox, Tag
from daskdist.collective.transport.base import SendHandle, Transport, remaining
from daskdist.exceptions import CollectiveTimeoutError, ReplicaLostError

__all__ = ["DaskTransport"]

logger = logging.getLogger(__name__)


class _FutureSend(SendHandle):
    def __init__(self, future: concurrent.futures.Future[None], dst: int, address: str):
        self._future = future
        self._dst = dst
        self._address = address

    def wait(self, deadline: float) -> None:
        try:
            self._future.result(timeout=remaining(deadline))
        except concurrent.futures.TimeoutError:
            raise CollectiveTimeoutError(
                f"sending to replica {self._dst} on {self._address} did not complete before the deadline"
            ) from None
        except (CommClosedError, OSError) as e:
            raise ReplicaLostError(
                f"lost the connection to replica {self._dst} on worker {self._address}: {e}",
                worker=self._address,
            ) from e


class DaskTransport(Transport):
    """Sends through a Dask connection pool.

    Parameters
    ----------
    rpc
        ``rpc(address)`` gives a Dask RPC handle to a worker (``worker.rpc``).
    loop
        The asyncio loop ``rpc``'s connections run on (``worker.loop.asyncio_loop``).
    group_id
        The replica group, so peers deliver to the right mailbox.
    generation
        The group's membership generation: a peer of another generation drops the message.
    """

    name = "dask"

    def __init__(self, rank: int, addresses: list[str], mailbox: Mailbox, rpc: Callable[[str], Any],
                 loop: asyncio.AbstractEventLoop, group_id: str, generation: int = 0):
        super().__init__(rank, addresses, mailbox)
        self._rpc = rpc
        self._group_id = group_id
        self._generation = generation
        self._loop = loop

    def send(self, dst: int, tag: Tag, payload: Any) -> SendHandle:
        address = self.addresses[dst]
        coro = self._send(address, dst, tag, payload)
        return _FutureSend(asyncio.run_coroutine_threadsafe(coro, self._loop), dst, address)

    async def _send(self, address: str, dst: int, tag: Tag, payload: Any) -> None:
        await self._rpc(address).daskdist_message(
            group_id=self._group_id,
            generation=self._generation,
            rank=dst,
            tag=list(tag),
            payload=to_serialize(payload),  # type: ignore[no-untyped-call]  # distributed leaves Serialize untyped
            reply=False,
        )
