"""In-memory stand-ins for unit-testing collective algorithms without a cluster.

``InMemoryGroup(n)`` builds ``n`` communicators whose transports deliver
straight into each other's mailboxes; ``run_ranks`` runs one function per
rank in threads, as replicas would, and returns results or exceptions.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from daskdist.collective.communicator import Algorithm, Communicator
from daskdist.collective.mailbox import Abort, Mailbox
from daskdist.collective.transport.base import CompletedSend, Transport
from daskdist.ops import CommunicationOptions


class InMemoryTransport(Transport):
    name = "memory"

    def __init__(self, rank: int, group: InMemoryGroup):
        super().__init__(rank, [f"mem://{r}" for r in range(group.size)], group.mailboxes[rank])
        self.group = group

    def send(self, dst, tag, payload):
        copy = payload.copy() if hasattr(payload, "copy") and hasattr(payload, "dtype") else payload
        self.group.mailboxes[dst].put(tag, copy)
        return CompletedSend()


class InMemoryControl:
    def __init__(self, rank: int, group: InMemoryGroup):
        self.rank = rank
        self.group = group

    def abort_peers(self, run_id: int, abort: Abort) -> None:
        for r, mailbox in enumerate(self.group.mailboxes):
            if r != self.rank:
                mailbox.abort_run(run_id, abort)

    def probe(self, rank: int, timeout: float) -> dict | None:
        comm = self.group.comms[rank]
        return {"run_id": comm.run_id, "collective": comm.seq, "state": self.group.states[rank]}


class InMemoryGroup:
    def __init__(self, size: int, algorithm: Algorithm | None = None, options: CommunicationOptions | None = None,
                 hosts: list[str] | None = None):
        self.size = size
        self.mailboxes = [Mailbox() for _ in range(size)]
        self.states = ["idle"] * size
        self.comms = [
            Communicator(r, size, InMemoryTransport(r, self), InMemoryControl(r, self), algorithm, options,
                         hosts=hosts)
            for r in range(size)
        ]

    def run_ranks(self, fn: Callable[[Communicator], Any], run_id: int = 1, timeout: float = 30) -> list[Any]:
        """Run ``fn(comm)`` on every rank in its own thread; exceptions are returned, not raised."""
        barrier = threading.Barrier(self.size)

        def body(rank: int) -> Any:
            comm = self.comms[rank]
            comm.begin_run(run_id)
            self.states[rank] = "running"
            barrier.wait()
            try:
                return fn(comm)
            except Exception as e:
                comm.abort_run(e)
                return e
            finally:
                self.states[rank] = "idle"

        with concurrent.futures.ThreadPoolExecutor(self.size) as pool:
            futures = [pool.submit(body, r) for r in range(self.size)]
            return [f.result(timeout=timeout) for f in futures]
