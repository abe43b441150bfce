"""In-memory stand-ins for unit-testing collective algorithms without a cluster.

``InMemoryGroup(n)`` builds ``n`` communicators whose transports deliver
straight into each other's mailboxes; ``run_ranks`` runs one function per
rank in threads, as replicas would, and returns results or exceptions.
Each communicator's stall watch is a thread (started at its first collective);
``close`` stops them, and ``tests/conftest.py`` closes every group a test left
open (``OPEN``), so that no test's threads outlive it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from collections.abc import Callable
from typing import Any

from daskdist.collective.core.communicator import Algorithm, Communicator
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

    def abort_peers(self, attempt: int, abort: Abort) -> None:
        for r, mailbox in enumerate(self.group.mailboxes):
            if r != self.rank:
                mailbox.abort_attempt(attempt, abort)

    def probe(self, rank: int, timeout: float) -> dict | None:
        comm = self.group.comms[rank]
        return {"state": self.group.states[rank], "attempt": comm.attempt, "run_id": comm.run_id,
                "collective": comm.seq}


#: The groups not closed yet, closed after each test by tests/conftest.py.
OPEN: weakref.WeakSet[InMemoryGroup] = weakref.WeakSet()


class InMemoryGroup:
    def __init__(self, size: int, algorithm: Algorithm | None = None, options: CommunicationOptions | None = None,
                 hosts: list[str] | None = None):
        self.size = size
        self.mailboxes = [Mailbox() for _ in range(size)]
        self.states = ["idle"] * size
        self.failed_runs = 0  # the attempt of the next run, as the client counts it
        self.comms = [
            Communicator(r, size, InMemoryTransport(r, self), InMemoryControl(r, self), algorithm, options,
                         hosts=hosts)
            for r in range(size)
        ]
        OPEN.add(self)

    def close(self) -> None:
        """Stop the communicators' stall watches (each a thread polling several times a second)."""
        for comm in self.comms:
            comm.close()
        OPEN.discard(self)

    def run_ranks(self, fn: Callable[[Communicator], Any], run_id: int = 1, timeout: float = 30) -> list[Any]:
        """Run ``fn(comm)`` on every rank in its own thread; exceptions are returned, not raised.

        As the replica runtime does with a client command: the attempt is the
        number of earlier runs that failed (numbering goes on across runs
        that succeed).
        """
        barrier = threading.Barrier(self.size)
        attempt = self.failed_runs

        def body(rank: int) -> Any:
            comm = self.comms[rank]
            self.states[rank] = "running"
            comm.begin_attempt(attempt)
            comm.begin_command(run_id)
            barrier.wait()
            try:
                return fn(comm)
            except Exception as e:
                comm.abort_attempt(e)
                return e
            finally:
                self.states[rank] = "idle"

        with concurrent.futures.ThreadPoolExecutor(self.size) as pool:
            futures = [pool.submit(body, r) for r in range(self.size)]
            results = [f.result(timeout=timeout) for f in futures]
        if any(isinstance(r, Exception) for r in results):
            self.failed_runs += 1
        return results
