"""One collective in progress (``CollectiveCall``) and what the engines see of it.

Every collective gets a number within its group's current attempt (see
``communicator``); its messages are tagged ``(attempt, number, src, name)``. A call starts by sending a short signature
(kind, op, structure, shapes, dtypes) to the right neighbour and checks the
left neighbour's before it uses any data, so replicas that disagree all raise
``CollectiveMismatchError`` instead of exchanging garbage or waiting forever.

The engines and algorithms (``algorithms``, ``engines``, ``single_copy``,
``nccl``) only know the ``Call`` protocol and, for timeouts, the ``CallHost``
protocol; neither names the ``Communicator``, so ``collective/`` has no import
cycle.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, Protocol

from daskdist.collective.core.reduction import combine_into
from daskdist.collective.mailbox import MailboxTimeout
from daskdist.collective.transport.base import PayloadMismatch, SendHandle, Transport
from daskdist.exceptions import CollectiveMismatchError, CollectiveTimeoutError
from daskdist.ops import ReduceOp

__all__ = ["Call", "CallHost", "CollectiveCall", "combiner"]


class Call(Protocol):
    """What an algorithm needs of a collective: ranks and tagged point-to-point messages."""

    rank: int
    size: int

    def send(self, dst: int, name: str, payload: Any) -> Any: ...

    def recv(self, src: int, name: str, expect: int | None = None) -> Any: ...

    def recv_into(self, src: int, name: str, out: Any, op: ReduceOp | None, base: Any = None) -> None: ...

    def sendrecv(self, dst: int, payload: Any, src: int, name: str, out: Any, op: ReduceOp | None,
                 base: Any = None) -> None: ...

    def wait(self, handle: Any) -> None: ...

    def mismatch(self, detail: str) -> None: ...


class CallHost(Protocol):
    """What a ``CollectiveCall`` needs of the communicator that made it."""

    rank: int
    size: int
    attempt: int
    run_id: int
    seq: int
    transport: Transport

    def describe_timeout(self, call: Any, waiting_for: int) -> str:
        """Explain why ``call`` timed out while waiting for ``waiting_for``."""


class CollectiveCall:
    """One collective in progress: tagged send/recv, signature check, deadline.

    Algorithms only see ``rank``, ``size``, ``send``, ``recv``, ``recv_into``,
    ``sendrecv``, ``wait`` and ``mismatch`` (the ``Call`` protocol).

    Parameters
    ----------
    comm
        The communicator (its rank, size, attempt, command and collective number, transport).
    kind
        ``"all_reduce"``, ``"broadcast"``, ...: named in errors and timings.
    sig
        The signature every replica must have passed.
    deadline, timeout
        When the call times out (monotonic) and the timeout it was given.
    """

    def __init__(self, comm: CallHost, kind: str, sig: str, deadline: float, timeout: float,
                 seq: int | None = None):
        self.comm = comm
        self.kind = kind
        self.sig = sig
        self.deadline = deadline
        self.timeout = timeout
        self.rank = comm.rank
        self.size = comm.size
        self.seq = comm.seq if seq is None else seq  # the number it was given (at issue, for async work in a window)
        self.attempt = comm.attempt
        self.run_id = comm.run_id  # the client command, for messages only
        self.nbytes = 0
        self.part = ""  # distinguishes the messages of successive packs within one collective
        # Data tags carry a hash of the signature: a replica can never consume data from a peer
        # that passed something else; it waits until the replica that saw the mismatch aborts the attempt.
        self._data_suffix = f"#{zlib.crc32(sig.encode()):08x}"
        self._sig_checked = False
        self._transport = comm.transport
        # our signature goes to the right neighbour with the first data we send it (one write), or on its own
        # before this replica first blocks (a receive, a wait), whichever comes first
        self._sig_handle: SendHandle | None = None

    @property
    def _right(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def _left(self) -> int:
        return (self.rank - 1) % self.size

    def _tag(self, src: int, name: str) -> tuple[Any, ...]:
        return (self.attempt, self.seq, src, name + self._data_suffix)

    def _sig_tag(self, src: int) -> tuple[Any, ...]:
        return (self.attempt, self.seq, src, "sig")

    def send(self, dst: int, name: str, payload: Any) -> SendHandle:
        self.nbytes += getattr(payload, "nbytes", 0)
        tag = self._tag(self.rank, self.part + name)
        if self._sig_handle is None and dst == self._right:
            self._sig_handle, handle = self._transport.send_many(
                dst, [(self._sig_tag(self.rank), self.sig), (tag, payload)])
            return handle
        return self._transport.send(dst, tag, payload)

    def _send_signature(self) -> None:
        """Send our signature to the right neighbour if no data took it along yet."""
        if self._sig_handle is None:
            self._sig_handle = self._transport.send(self._right, self._sig_tag(self.rank), self.sig)

    def recv(self, src: int, name: str, expect: int | None = None) -> Any:
        self.check_signature()
        payload = self._take(src, self.part + name)
        if expect is not None and getattr(payload, "size", None) != expect:
            self.mismatch(
                f"replica {src} sent {getattr(payload, 'size', type(payload).__name__)} elements "
                f"where replica {self.rank} expected {expect}"
            )
        return payload

    def recv_into(self, src: int, name: str, out: Any, op: ReduceOp | None, base: Any = None) -> None:
        """Receive ``src``'s array and combine it into ``out`` with ``op`` (``None``: copy).

        ``base``: combine out of place, ``out = base op incoming``.
        """
        self.check_signature()
        try:
            self._transport.recv_into(src, self._tag(src, self.part + name), self.deadline, out, combiner(op), base)
        except PayloadMismatch as e:
            self.mismatch(f"replica {src} sent {e.got} elements where replica {self.rank} expected {e.expected}")
        except MailboxTimeout:
            raise CollectiveTimeoutError(self.comm.describe_timeout(self, src)) from None

    def sendrecv(self, dst: int, payload: Any, src: int, name: str, out: Any, op: ReduceOp | None,
                 base: Any = None) -> None:
        """Send ``payload`` to ``dst`` and receive ``src``'s array into ``out`` (as ``recv_into``), both under ``name``."""
        self.check_signature()
        self.nbytes += getattr(payload, "nbytes", 0)
        try:
            self._transport.sendrecv(dst, self._tag(self.rank, self.part + name), payload, src,
                                     self._tag(src, self.part + name), self.deadline, out, combiner(op), base)
        except PayloadMismatch as e:
            self.mismatch(f"replica {src} sent {e.got} elements where replica {self.rank} expected {e.expected}")
        except MailboxTimeout:
            raise CollectiveTimeoutError(self.comm.describe_timeout(self, src)) from None

    def wait(self, handle: SendHandle) -> None:
        self._send_signature()
        handle.wait(self.deadline)

    def check_signature(self) -> None:
        """Compare the left neighbour's signature with ours (once); raise ``CollectiveMismatchError`` if they differ."""
        self._send_signature()
        if self._sig_checked:
            return
        left_sig = self._take_tag(self._left, self._sig_tag(self._left))
        self._sig_checked = True
        if left_sig != self.sig:
            self.mismatch(
                f"replica {self._left} passed {left_sig!r} but replica {self.rank} passed {self.sig!r}"
            )

    def mismatch(self, detail: str) -> None:
        raise CollectiveMismatchError(
            f"{self.kind} #{self.seq} (run {self.run_id}): the replicas passed different values; {detail}"
        )

    def _take(self, src: int, name: str) -> Any:
        return self._take_tag(src, self._tag(src, name))

    def _take_tag(self, src: int, tag: tuple[Any, ...]) -> Any:
        try:
            return self._transport.recv(src, tag, self.deadline)
        except MailboxTimeout:
            raise CollectiveTimeoutError(self.comm.describe_timeout(self, src)) from None

    def finish(self) -> None:
        """Check the signature (if no data was received) and wait for our signature to be sent."""
        self.check_signature()
        assert self._sig_handle is not None  # sent by check_signature at the latest
        self._sig_handle.wait(self.deadline)


def combiner(op: ReduceOp | None) -> Callable[[Any, Any, Any], None] | None:
    """The transport's ``combine`` for ``op`` (``None``: copy)."""
    if op is None:
        return None
    return lambda acc, part, base: combine_into(op, acc, part, base)
