"""The interface every transport implements: tagged, non-blocking sends to peers.

A transport moves payloads (arrays, lists of arrays, small strings) from this
replica to a peer's mailbox. Receives always go through the replica's
``Mailbox``, so aborts and deadlines behave the same on every transport.
Transports are chosen per group by ``daskdist.collective.transport``; faster
ones (shared memory, sockets, NCCL, UCX) implement the same two methods.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from daskdist.arrays import namespace
from daskdist.collective.mailbox import Mailbox, Tag
from daskdist.exceptions import PayloadMismatch

#: ``combine(out_part, incoming_part, base_part)``: ``out_part = (base_part or out_part) op incoming_part``.
Combine = Callable[[Any, Any, Any], None]

__all__ = ["Combine", "CompletedSend", "PayloadMismatch", "SendHandle", "Transport", "apply_payload", "remaining"]


class SendHandle(ABC):
    """A send in flight; ``wait`` returns once the payload may be reused."""

    @abstractmethod
    def wait(self, deadline: float) -> None:
        """Block until the send completed; raise ``ReplicaLostError`` if the peer is gone."""


class CompletedSend(SendHandle):
    """A send that completed synchronously."""

    def wait(self, deadline: float) -> None:
        return None


class Transport(ABC):
    """Moves payloads between the replicas of one group.

    Parameters
    ----------
    rank
        This replica's rank.
    addresses
        The worker address of every rank.
    mailbox
        This replica's mailbox, where peers' payloads arrive.
    """

    name: ClassVar[str]

    def __init__(self, rank: int, addresses: list[str], mailbox: Mailbox):
        self.rank = rank
        self.addresses = addresses
        self.mailbox = mailbox

    @property
    def size(self) -> int:
        return len(self.addresses)

    @abstractmethod
    def send(self, dst: int, tag: Tag, payload: Any) -> SendHandle:
        """Start sending ``payload`` to rank ``dst`` under ``tag``; do not block on the peer."""

    def send_many(self, dst: int, messages: Sequence[tuple[Tag, Any]]) -> list[SendHandle]:
        """Send several ``(tag, payload)`` messages to ``dst``, in order: one handle each.

        Transports that can write them together (one system call for a
        collective's signature and its first data) override it.
        """
        return [self.send(dst, tag, payload) for tag, payload in messages]

    def recv(self, src: int, tag: Tag, deadline: float) -> Any:
        """Wait for the payload ``src`` sent under ``tag`` (``deadline``: ``time.monotonic()``).

        The payload may be a view into transport memory that stays valid only
        until the next receive from ``src``; copy what must outlive that.
        """
        return self.mailbox.take(tag, deadline)

    def recv_into(self, src: int, tag: Tag, deadline: float, out: Any, combine: Combine | None,
                  base: Any = None) -> None:
        """Receive an array from ``src`` straight into ``out``: ``combine(out_part, incoming_part, base_part)``, or a copy.

        ``base``: an array shaped like ``out`` whose parts ``combine`` reads
        instead of ``out``'s (out-of-place reduction: ``out = base op
        incoming``); ``None`` combines in place. Transports that move large
        messages in pieces (shared memory) combine each piece as it arrives,
        so nothing is copied twice.

        Raises
        ------
        PayloadMismatch
            The incoming array has a different number of bytes than ``out``.
        """
        apply_payload(self.recv(src, tag, deadline), out, combine, base)

    def sendrecv(self, dst: int, send_tag: Tag, payload: Any, src: int, recv_tag: Tag, deadline: float, out: Any,
                 combine: Combine | None, base: Any = None) -> None:
        """Send ``payload`` to ``dst`` while receiving ``src``'s array into ``out`` (as ``recv_into``).

        Returns once both are done. The ring's step; transports that can
        interleave the two in one thread (shared memory) override it.
        """
        handle = self.send(dst, send_tag, payload)
        self.recv_into(src, recv_tag, deadline, out, combine, base)
        handle.wait(deadline)

    def local_info(self) -> dict[str, Any]:
        """What a peer needs to reach this transport (a listening address), sent through the rendezvous.

        msgpack-able; the default (nothing) suits transports that need no
        wiring (shared memory names its segments from the group's wire id,
        Dask comms use the worker addresses).
        """
        return {}

    def connect(self, peer_infos: dict[int, dict[str, Any]], membership: Any) -> None:
        """Reach the peers of ``membership`` from their ``local_info()`` (rank -> info), once per generation.

        Optional: a transport that needs no connection (it reaches its peers through Dask) keeps this default.
        """
        return None

    def routes_by_peer(self) -> dict[int, Transport]:
        """The transport that carries each peer's messages (this one for every peer unless it routes)."""
        return {peer: self for peer in range(self.size) if peer != self.rank}

    def group_aborted(self) -> None:
        """The group is lost for good: release shared resources now (called from the event loop).

        Optional: a transport that holds nothing shared keeps this default, which does nothing.
        """
        return None

    def close(self) -> None:
        """Release what the transport holds (connections, segments).

        Optional: a transport that holds nothing keeps this default, which does nothing.
        """
        return None


_T = TypeVar("_T", bound="Transport")


def sole_route(transport: Transport, size: int, rank: int, kind: type[_T]) -> _T | None:
    """The one transport of class ``kind`` that carries every peer's messages, or ``None`` (one replica, or some
    peer reached otherwise): what a lane that writes straight into one transport asks before it takes a group."""
    if size < 2:
        return None
    routes = transport.routes_by_peer()
    if len(routes) != size - 1:
        return None
    first = routes.get((rank + 1) % size)
    if isinstance(first, kind) and all(t is first for t in routes.values()):
        return first
    return None


def apply_payload(payload: Any, out: Any, combine: Combine | None, base: Any = None) -> None:
    """Copy (``combine=None``) or combine a received array into ``out``; ``PayloadMismatch`` if it does not fit."""
    if getattr(payload, "nbytes", None) != out.nbytes or getattr(payload, "dtype", None) != out.dtype:
        raise PayloadMismatch(getattr(payload, "size", None), out.size)
    if combine is None:
        namespace(out).copyto(out, payload.reshape(out.shape))
    else:
        combine(out, payload.reshape(out.shape), base)


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (never negative)."""
    return max(0.0, deadline - time.monotonic())
