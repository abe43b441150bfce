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
from typing import Any, ClassVar

from daskdist.collective.mailbox import Mailbox, Tag

__all__ = ["SendHandle", "Transport"]


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

    def recv(self, src: int, tag: Tag, deadline: float) -> Any:
        """Wait for the payload ``src`` sent under ``tag`` (``deadline``: ``time.monotonic()``)."""
        return self.mailbox.take(tag, deadline)

    def close(self) -> None:
        """Release what the transport holds (connections, segments)."""


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (never negative)."""
    return max(0.0, deadline - time.monotonic())
