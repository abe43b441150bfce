"""One generation's wiring of a replica: mailbox, transports connected to the membership, process group.

Everything that knows the peers (transport connections, shared-memory
segments, the latency lane's channels, the NCCL communicator, the process
group with its subgroups and async thread) is built here
for one membership generation and closed before the next is built, so nothing
that caches peers outlives its generation. Shared-memory segments and TCP
greetings are named with ``Membership.wire_id`` (group and generation).
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed.comm.addressing import get_address_host

from daskdist.collective.core.communicator import Communicator
from daskdist.collective.mailbox import Mailbox
from daskdist.collective.process_group import ProcessGroup, build_process_group
from daskdist.collective.transport.base import Transport
from daskdist.collective.transport.dask import DaskTransport
from daskdist.collective.transport.routed import RoutedTransport
from daskdist.collective.transport.shm import ShmTransport, shm_supported
from daskdist.collective.transport.socket import SocketTransport
from daskdist.group.membership import Membership
from daskdist.group.spec import TRANSPORTS, GroupSpec
from daskdist.wire.tls import worker_contexts

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["Wiring", "make_transport", "wire"]


@dataclass
class Wiring:
    """What one replica built for one generation; ``close`` releases all of it."""

    membership: Membership
    rank: int
    mailbox: Mailbox
    transport: Transport
    communicator: Communicator
    group: ProcessGroup

    def close(self) -> None:
        self.group.close()
        self.communicator.close()
        self.transport.close()


def make_transport(rank: int, membership: Membership, spec: GroupSpec, mailbox: Mailbox, worker: Worker,
                   on_peer_lost: Callable[[int | None, str], None] | None = None) -> Transport:
    """The transport of one replica in one generation, chosen per peer.

    ``spec.transport``: ``"auto"`` (shared memory to same-host peers, direct
    TCP to the others), ``"shm"`` (every peer must share the host),
    ``"socket"`` (TCP to every peer), ``"dask"`` (Dask comms) or ``"ucx"``
    (UCX to every peer; needs ucxx, never picked by ``"auto"``). A GPU group's
    control traffic (signatures, objects, and the arrays NCCL does not carry,
    ``daskdist.collective.nccl``) goes over the socket transport to every peer
    under ``"auto"``: beside NCCL, off the workers' event loops; GPU arrays
    travel pickled (a host copy each way), so the same-host shared-memory and
    single-copy paths, which read host memory, are never used for them.
    """
    if spec.transport not in TRANSPORTS:
        raise ValueError(f"Unknown transport {spec.transport!r} (daskdist.collective.transport): {', '.join(TRANSPORTS)}")
    addresses, hosts, size = membership.addresses, membership.hosts, membership.size
    wire_id = membership.wire_id
    peers = [r for r in range(size) if r != rank]
    same_host = [r for r in peers if hosts[r] == hosts[rank]] if spec.transport in ("auto", "shm") else []
    if same_host and not shm_supported():  # logged; off x86-64 the shm slots would need a fence
        if spec.transport == "shm":
            raise ValueError(f"the shm transport needs a 64-bit x86 machine; this one is {platform.machine()}")
        same_host = []
    on_gpu = any("GPU" in d for d in membership.devices)
    if spec.transport == "shm" and (len(same_host) != len(peers) or on_gpu):
        raise ValueError("the shm transport needs every replica on one host, with CPU devices")
    if on_gpu and spec.transport == "auto":
        same_host = []  # host-memory paths never see GPU arrays: TCP to every peer, same host or not
    if spec.transport == "dask" or not peers:
        loop = worker.loop.asyncio_loop  # type: ignore[attr-defined]
        return DaskTransport(rank, addresses, mailbox, worker.rpc, loop, membership.group_id, int(membership.generation))
    routes: dict[int, Transport] = {}
    if spec.transport == "ucx":
        from daskdist.collective.transport.ucx import UcxTransport  # imports ucxx: only when asked for

        ucx = UcxTransport(rank, addresses, mailbox, wire_id, peers)
        return RoutedTransport(rank, addresses, mailbox, dict.fromkeys(peers, ucx))
    if same_host:
        shm = ShmTransport(rank, addresses, mailbox, same_host, wire_id, spec.shm_slot_bytes)
        routes.update({r: shm for r in same_host})
    remote = [r for r in peers if r not in routes]
    if remote:
        tcp = SocketTransport(rank, addresses, mailbox, wire_id, get_address_host(worker.address),
                              *worker_contexts(worker), on_peer_lost=on_peer_lost, secret=spec.secret)
        routes.update({r: tcp for r in remote})
    return RoutedTransport(rank, addresses, mailbox, routes)


def wire(rank: int, membership: Membership, spec: GroupSpec, worker: Worker, control: Any,
         on_collective: Callable[[str, float, int], None], on_stall: Callable[[dict[str, Any]], None],
         on_peer_lost: Callable[[int | None, str], None] | None = None) -> Wiring:
    """Build a generation's mailbox, transport, communicator and process group (not yet connected: see
    ``Transport.connect``)."""
    mailbox = Mailbox()
    transport = make_transport(rank, membership, spec, mailbox, worker, on_peer_lost)
    try:
        communicator = Communicator(
            rank, membership.size, transport, control=control, algorithm=spec.algorithm,
            options=spec.options, on_collective=on_collective, hosts=membership.hosts,
            on_stall=on_stall, single_copy_bytes=spec.single_copy_bytes,
        )
    except BaseException:
        transport.close()
        raise
    group = build_process_group(communicator, f"{membership.group_id}/{membership.generation}",
                                int(membership.generation))
    return Wiring(membership, rank, mailbox, transport, communicator, group)
