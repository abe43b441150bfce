"""One direction of shared memory between two replicas: a segment with a control block and four slots.

``ShmChannel`` is a single-producer single-consumer ring of four slots. The
sender writes a piece (header, then data) into the next free slot and then
bumps the "written" counter; the receiver reads the oldest piece and bumps
the "read" counter. The counter store must become visible only after the
slot's bytes: x86-64 keeps stores (and loads) in order, so a plain store is
enough there; weaker platforms (Arm) would need a fence, which Python cannot
issue without a compiled extension, so the transport refuses to run there
(``store_order_is_total``; the group falls back to sockets).

Waiting has no wake-up call: ``backoff_wait`` spins, then yields, then sleeps
a little (``_Spinner``), checking the replica's mailbox for aborts.
"""

from __future__ import annotations

import _posixshmem
import logging
import math
import mmap
import os
import platform
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from daskdist.collective.mailbox import MailboxTimeout, Tag
from daskdist.collective.transport.framing import HEADER, pack_header, unpack_header
from daskdist.collective.transport.shm_orphans import OWNER_OFFSET, owner_stamp

__all__ = ["ShmChannel", "backoff_wait", "lane_header", "spin_seconds_for", "store_order_is_total",
           "unlink_segment", "usable_cores"]

logger = logging.getLogger(__name__)

_SLOTS = 4
_CONTROL_BYTES = 128  # write counter at 0, read counter at 64 (separate cache lines)
_HEADER_BYTES = 1024
_EXTRA_OFFSET = 256  # within a slot's header area: optional extra bytes (a signature), length-prefixed
_EXTRA_MAX = _HEADER_BYTES - _EXTRA_OFFSET - 2
_ATTEMPT_SEQ = struct.Struct("<qq")  # the first two HEADER fields
_LANE_PREFIX = struct.Struct("<qqq40s")  # the first four HEADER fields: attempt, seq, src, name
_VIEWS_KEPT = 64  # typed views kept per slot (lane messages of different dtypes and shapes)

def unlink_segment(name: str) -> None:
    """Remove a segment name from ``/dev/shm`` (mappings stay valid); no error if it is gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass



def lane_header(fields: tuple[Any, ...], extra: bytes) -> bytes:
    """The header area of a lane message, written once per slot (``ShmChannel.write_lane``).

    ``fields`` are the ``HEADER`` fields after attempt and seq; ``extra`` is kept
    beside them (``ShmChannel.extra``).
    """
    extra = extra[:_EXTRA_MAX]
    head = HEADER.pack(0, 0, *fields)
    return head.ljust(_EXTRA_OFFSET, b"\0") + len(extra).to_bytes(2, "little") + extra


_TOTAL_STORE_ORDER = frozenset({"x86_64", "amd64"})


def store_order_is_total(machine: str | None = None, is_64bit: bool | None = None) -> bool:
    """Whether plain stores and loads are seen by other cores in program order here (x86-64's TSO).

    The channels publish a slot by storing its counter after its bytes, with
    no fence (Python has none without a compiled extension). That is correct
    only where the hardware keeps stores in order and loads in order, and
    where an aligned 8-byte store is atomic: a 64-bit process on x86-64. Arm
    (Graviton, Grace, Apple), POWER and RISC-V may reorder them, so a
    receiver could read a slot before its bytes arrive.

    Parameters
    ----------
    machine
        ``platform.machine()`` when ``None``.
    is_64bit
        Whether this is a 64-bit process; ``sys.maxsize > 2**32`` when ``None``.
    """
    machine = platform.machine() if machine is None else machine
    is_64bit = sys.maxsize > 2**32 if is_64bit is None else is_64bit
    return is_64bit and machine.lower() in _TOTAL_STORE_ORDER


class _Segment:
    """A POSIX shared-memory segment mapped into this process (no resource tracker)."""

    def __init__(self, name: str, size: int, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


class _Spinner:
    """Waiting without a wake-up call: spin, then yield the CPU, then sleep a little; ``check`` raises aborts.

    Spinning holds the GIL, so the worker's event-loop thread cannot take it
    in the middle of a collective; once ``spin_seconds`` have passed (short
    when the host has fewer cores than replicas: then the peer may need this
    core), each idle round yields (``sleep(0)``), and after ``_YIELD_SECONDS``
    it sleeps 0.2 ms per round.
    """

    __slots__ = ("check", "deadline", "spin_seconds", "spin_until", "spins", "yield_until")

    def __init__(self, deadline: float, check: Callable[[], None], spin_seconds: float = 50e-6):
        self.deadline = deadline
        self.check = check
        self.spin_seconds = spin_seconds
        self.spins = 0
        self.progressed()

    def idle(self) -> None:
        """Called each time there was nothing to do."""
        self.spins += 1
        if self.spins & 15:
            return
        now = time.monotonic()
        if now < self.spin_until and self.spins & 1023:
            return
        self.check()
        if now > self.deadline:
            raise MailboxTimeout()
        if now >= self.spin_until:
            if now < self.yield_until:
                os.sched_yield()  # let a peer that shares this core run (releases the GIL too)
            else:
                time.sleep(0.0002)

    def progressed(self) -> None:
        """Called after useful work: spin again before yielding."""
        now = time.monotonic()
        self.spin_until = now + self.spin_seconds
        self.yield_until = now + _YIELD_SECONDS


_YIELD_SECONDS = 0.005  # yield (sleep(0)) this long before sleeping 0.2 ms per round


def usable_cores() -> int:
    """How many cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def spin_seconds_for(replicas_on_host: int) -> float:
    """How long a waiting replica spins before yielding its core: 50 us, or 5 us when replicas outnumber cores."""
    return 50e-6 if replicas_on_host <= usable_cores() else 5e-6


def backoff_wait(ready: Callable[[], bool], deadline: float, check: Callable[[], None],
                  spin_seconds: float = 50e-6) -> None:
    """Wait until ``ready()`` (see ``_Spinner``)."""
    if ready():
        return
    spinner = _Spinner(deadline, check, spin_seconds)
    while not ready():
        spinner.idle()


class ShmChannel:
    """One direction between two replicas: a segment with a control block and four slots.

    Each slot holds one piece: a fixed binary header (``struct``) and up to
    ``slot_bytes`` of data. Two counters (messages written, messages read)
    on separate cache lines make it a single-producer single-consumer ring.
    """

    def __init__(self, name: str, slot_bytes: int, create: bool):
        self.name = name
        self.slot_bytes = slot_bytes
        self.slot_stride = _HEADER_BYTES + slot_bytes
        size = _CONTROL_BYTES + _SLOTS * self.slot_stride
        self.owner = create
        self.shm = _Segment(name, size, create)
        buf = self.shm.buf
        self._counters = buf[:_CONTROL_BYTES].cast("q")  # [0]: written, [8]: read
        if create:
            self._counters[0] = 0
            self._counters[8] = 0
            stamp = owner_stamp()  # who made it: removed by a later replica if every replica here died
            buf[OWNER_OFFSET : OWNER_OFFSET + len(stamp)] = stamp
        self._raw = buf[_CONTROL_BYTES:]
        self._data = np.ndarray((_SLOTS * self.slot_stride,), np.uint8, buf, _CONTROL_BYTES)
        self._lane_headers: list[bytes | None] = [None] * _SLOTS  # sender: lane header area last written per slot
        self._views: list[dict[tuple[Any, ...], np.ndarray]] = [{} for _ in range(_SLOTS)]  # typed views of each slot's data

    # -- sender side ---------------------------------------------------------------

    def can_write(self) -> bool:
        counters = self._counters
        return counters[0] - counters[8] < _SLOTS

    def write(self, tag: Tag, kind: int, dtype: str, shape: tuple[Any, ...], total: int, offset: int, piece: np.ndarray,
              extra: bytes = b"") -> None:
        """Write one piece into the next slot (the caller waited for ``can_write``).

        ``extra``: up to ``_EXTRA_MAX`` bytes kept beside the header (``extra`` reads them back).
        """
        index = self._counters[0] % _SLOTS
        base = index * self.slot_stride
        self._lane_headers[index] = None
        pack_header(self._raw, base, tag, kind, dtype, shape, total, offset, piece.nbytes)
        self._write_extra(base, extra)
        start = base + _HEADER_BYTES
        if piece.nbytes > 65536:
            np.copyto(self._data[start : start + piece.nbytes], piece.reshape(-1).view(np.uint8))
        elif piece.nbytes:
            self._raw[start : start + piece.nbytes] = piece.reshape(-1).view(np.uint8).data
        self._counters[0] += 1  # published after the piece: in order on x86-64 (store_order_is_total)

    def write_lane(self, header: bytes, attempt: int, seq: int, value: np.ndarray, key: tuple[Any, ...]) -> None:
        """Write a one-piece lane message (the small all-reduce): ``header`` from ``lane_header``, then ``value``.

        The caller waited for ``can_write``; ``value`` fits a slot and
        ``key`` is its ``(dtype, shape)``. A slot whose header area already
        holds ``header`` (the same collective signature as last time) only
        gets the new attempt and sequence numbers.
        """
        written = self._counters[0]
        index = written % _SLOTS
        base = index * self.slot_stride
        if self._lane_headers[index] is not header:
            self._raw[base : base + len(header)] = header
            self._lane_headers[index] = header
        _ATTEMPT_SEQ.pack_into(self._raw, base, attempt, seq)
        np.copyto(self.slot_view(index, key), value)
        self._counters[0] = written + 1  # published after the data: in order on x86-64 (store_order_is_total)

    def _write_extra(self, base: int, extra: bytes) -> None:
        at = base + _EXTRA_OFFSET
        length = min(len(extra), _EXTRA_MAX)
        self._raw[at : at + 2] = length.to_bytes(2, "little")
        if length:
            self._raw[at + 2 : at + 2 + length] = extra[:length]

    # -- receiver side -------------------------------------------------------------

    def peek_fields(self) -> tuple[tuple[Any, ...], int]:
        """The raw ``HEADER`` fields of the oldest unread piece and where its data starts in ``raw``."""
        base = (self._counters[8] % _SLOTS) * self.slot_stride
        return HEADER.unpack_from(self._raw, base), base + _HEADER_BYTES

    def peek_lane(self, prefix: tuple[Any, ...], key: tuple[Any, ...]) -> np.ndarray | None:
        """The oldest unread piece as an array of ``key = (dtype, shape)`` if its header starts with ``prefix``.

        ``prefix`` is ``(attempt, seq, src, name)`` with the name as the header's
        40 bytes; the array is a view, valid until ``release``. ``None``
        (nothing consumed) when there is no piece yet or it is something else.
        """
        counters = self._counters
        read = counters[8]
        if read >= counters[0]:
            return None
        index = read % _SLOTS
        if _LANE_PREFIX.unpack_from(self._raw, index * self.slot_stride) != prefix:
            return None
        return self.slot_view(index, key)

    def slot_view(self, index: int, key: tuple[Any, ...]) -> np.ndarray:
        """Slot ``index``'s data as an array of ``key = (dtype, shape)`` (kept for the next message like it)."""
        views = self._views[index]
        view = views.get(key)
        if view is None:
            dtype, shape = key
            start = index * self.slot_stride + _HEADER_BYTES
            nbytes = dtype.itemsize * math.prod(shape)
            if nbytes > self.slot_bytes:
                raise ValueError(f"{nbytes} bytes do not fit a {self.slot_bytes}-byte slot")
            if len(views) >= _VIEWS_KEPT:
                views.clear()
            view = views[key] = self._data[start : start + nbytes].view(dtype).reshape(shape)
        return view

    def data(self, start: int, nbytes: int) -> np.ndarray:
        """``nbytes`` of the segment from ``start`` (as ``peek_fields`` gives it): a view, valid until ``release``."""
        data: np.ndarray = self._data[start : start + nbytes]
        return data

    def extra(self) -> bytes:
        """The extra bytes written with the oldest unread piece."""
        at = (self._counters[8] % _SLOTS) * self.slot_stride + _EXTRA_OFFSET
        length = int.from_bytes(self._raw[at : at + 2], "little")
        return bytes(self._raw[at + 2 : at + 2 + length])

    def can_read(self) -> bool:
        counters = self._counters
        return counters[8] < counters[0]

    def peek(self) -> tuple[tuple[Any, ...], np.ndarray]:
        """The header and data bytes of the oldest unread piece (a view; valid until ``release``).

        The header is ``(tag, kind, dtype, shape, total, offset, nbytes)``.
        """
        base = (self._counters[8] % _SLOTS) * self.slot_stride
        header = unpack_header(self._raw, base)
        start = base + _HEADER_BYTES
        return header, self._data[start : start + header[6]]

    def release(self) -> None:
        self._counters[8] += 1

    def close(self) -> None:
        # every view must go before the mapping closes
        self._views = [{} for _ in range(_SLOTS)]
        self._counters.release()
        self._raw.release()
        self._data = None
        try:
            self.shm.close()
        except BufferError:  # pragma: no cover - a view escaped; the OS frees it at exit
            logger.debug("Shared memory %s still has exported views", self.name)
        if self.owner:
            unlink_segment(self.name)
