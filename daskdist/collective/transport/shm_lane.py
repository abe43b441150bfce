"""The latency lane's access to the shared-memory transport (``ShmTransport.lane()``).

The small all-reduce (``daskdist.collective.core.engines.lane``) writes a whole
array into one slot of each peer's channel and reduces the peers' arrays
straight from their slots. ``ShmLane`` is the only way it touches the
transport: one-piece writes with a header written once per slot, views of the
oldest unread slot, and the slow path that waits, keeps out-of-order messages
and reports what a mismatching peer passed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from daskdist.collective.mailbox import Mailbox, Tag
from daskdist.collective.transport.base import SendHandle
from daskdist.collective.transport.framing import TEXT, decode
from daskdist.collective.transport.shm_channel import ShmChannel, backoff_wait
from daskdist.exceptions import LaneMismatch

__all__ = ["LaneMismatch", "ShmLane"]


class _Source(Protocol):
    """The parts of ``ShmTransport`` a lane uses."""

    mailbox: Mailbox
    slot_bytes: int
    spin_seconds: float
    oversubscribed: bool

    def send(self, dst: int, tag: Tag, payload: Any, extra: bytes = b"") -> SendHandle: ...

    def try_send_lane(self, dst: int, header: bytes, attempt: int, seq: int, value: np.ndarray,
                      key: tuple[Any, ...]) -> bool: ...

    def inbound(self, src: int) -> ShmChannel: ...

    def outbound(self, dst: int) -> ShmChannel: ...

    @property
    def queued(self) -> dict[int, int]: ...

    def take_stashed(self, src: int, tag: Tag) -> Any: ...

    def stash_message(self, src: int, header: tuple[Any, ...], data: np.ndarray) -> None: ...


class ShmLane:
    """One-piece messages through a shared-memory transport's channels, read in place.

    Parameters
    ----------
    transport
        The ``ShmTransport`` (which makes this with ``lane()``).
    peers
        The ranks it reaches.

    Attributes
    ----------
    peek
        Per source rank: ``peek(prefix, key)``, the oldest unread slot as an
        array of ``key = (dtype, shape)`` if its header starts with
        ``prefix = (attempt, seq, src, name field)``, else ``None``; a view,
        valid until that source's ``release``.
    release
        Per source rank: free the oldest unread slot.
    try_write
        ``try_write(dst, header, attempt, seq, value, key)``: write ``value``
        (``key = (dtype, shape)``) into one slot of ``dst``'s channel now, with
        ``header`` from ``lane_header`` (a slot that already holds it only
        gets the new attempt and sequence numbers); ``False`` (nothing written)
        when the channel is full or earlier sends to ``dst`` are still queued:
        then ``send_queued``.
    queued
        Sends per destination still queued with the transport's sender thread
        (the transport's own dict, updated in place).
    """

    def __init__(self, transport: _Source, peers: list[int]):
        self._transport = transport
        self.mailbox = transport.mailbox
        self.slot_bytes = transport.slot_bytes
        self.oversubscribed = transport.oversubscribed
        self._channels = {src: transport.inbound(src) for src in peers}
        self.peek: dict[int, Callable[[tuple[Any, ...], tuple[Any, ...]], np.ndarray | None]] = {
            src: channel.peek_lane for src, channel in self._channels.items()}
        self.release: dict[int, Callable[[], None]] = {src: channel.release for src, channel in self._channels.items()}
        self.try_write: Callable[[int, bytes, int, int, np.ndarray, tuple[Any, ...]], bool] = transport.try_send_lane
        self.queued: dict[int, int] = transport.queued
        self._peers = list(peers)

    def writers(self) -> dict[int, tuple[Callable[[], bool], Callable[..., None]]]:
        """Per destination rank, ``(can_write, write)``: the bound methods ``try_write`` calls.

        ``ShmChannel.can_write`` and ``write_lane`` of the channel to ``dst``,
        for a caller that binds them once per generation (call it once the
        transport is connected: the peers' channels exist then). Before
        ``write`` the caller checks ``can_write()`` and that ``queued`` holds
        no send for ``dst``, as ``try_write`` does.
        """
        out = {}
        for dst in self._peers:
            channel = self._transport.outbound(dst)
            out[dst] = (channel.can_write, channel.write_lane)
        return out

    def send_queued(self, dst: int, tag: Tag, value: np.ndarray, extra: bytes) -> SendHandle:
        """Send ``value`` to ``dst`` through the transport's queue, when ``try_write`` had no room."""
        return self._transport.send(dst, tag, value, extra)

    def receive(self, src: int, attempt: int, seq: int, name: str, name_field: bytes, nbytes: int, dtype: Any,
                shape: tuple[Any, ...], deadline: float) -> tuple[np.ndarray, Callable[[], None] | None]:
        """``src``'s array of collective ``(attempt, seq)`` and how to free its slot (``None``: nothing to free).

        Waits until it arrives (``MailboxTimeout`` at ``deadline``; aborts
        raise), keeping other messages aside and dropping those of aborted
        runs. Raises ``LaneMismatch`` when ``src``'s message of this
        collective has another name (another signature).
        """
        transport = self._transport
        stashed = transport.take_stashed(src, (attempt, seq, src, name))
        if stashed is not None:
            if getattr(stashed, "nbytes", None) != nbytes:
                raise LaneMismatch("a different payload")
            return stashed.view(dtype).reshape(shape), None
        channel = self._channels[src]
        mailbox = self.mailbox
        while True:
            if not channel.can_read():
                backoff_wait(channel.can_read, deadline, lambda: mailbox.check(attempt), transport.spin_seconds)
            fields, start = channel.peek_fields()
            if fields[0] == attempt and fields[1] == seq and fields[2] == src:
                if fields[3] == name_field:
                    return channel.data(start, nbytes).view(dtype).reshape(shape), channel.release
                raise LaneMismatch(_peer_signature(channel, fields, start))
            if fields[0] < mailbox.current_attempt:
                channel.release()  # left over from an aborted attempt
                continue
            header, data = channel.peek()
            transport.stash_message(src, header, data)


def _peer_signature(channel: ShmChannel, fields: tuple[Any, ...], start: int) -> str:
    """What the peer passed, from its message of the same collective."""
    name = fields[3].rstrip(b"\0").decode()
    if name == "sig" and fields[4] == TEXT and fields[7] == fields[5]:
        return str(decode(TEXT, "", (), channel.data(start, fields[7])))
    text = channel.extra().decode(errors="replace")
    return text or f"a different collective ({name})"
