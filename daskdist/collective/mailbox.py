"""Where messages for one replica wait until its thread takes them.

The worker's event loop puts messages in; the replica thread takes them out by
tag with a deadline. Aborts (of one attempt, or of the whole group) wake the
waiting thread at once, so no replica stays blocked after a peer failed.
A message wakes only the thread waiting for its tag (several collectives of
an async window wait at once: one message is one wake-up, not one for each).

Each thread's event is kept in a dict keyed by thread id, not in a
``threading.local``: on CPython before 3.11.9 (gh-106883) dropping a
``threading.local`` inside a garbage collection that ``sys._current_frames()``
started deadlocks the interpreter with the GIL held, and Dask's profiler
calls ``sys._current_frames()`` in every worker's event loop, while a closed
generation's mailbox is cyclic garbage that only the collector frees.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from daskdist.exceptions import ERROR_KINDS, CollectiveAbortedError, DaskdistError, MailboxTimeout

__all__ = ["Abort", "Mailbox", "MailboxTimeout"]

Tag = tuple[Any, ...]  # (attempt, collective_seq, src_rank, name)

#: Aborted attempts remembered, so an abort that arrives before the attempt starts still counts.
_ABORTED_ATTEMPTS_KEPT = 64


class Abort:
    """Why an attempt (or the whole group) was aborted, as sent between replicas.

    Parameters
    ----------
    kind
        One of ``daskdist.exceptions.ERROR_KINDS`` (``"aborted"`` for a user error).
    message
        The text every replica raises.
    origin
        The rank that first raised, or ``None`` when the scheduler aborted.
    """

    __slots__ = ("kind", "message", "origin")

    def __init__(self, kind: str, message: str, origin: int | None):
        self.kind = kind
        self.message = message
        self.origin = origin

    def to_msg(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "origin": self.origin}

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> Abort:
        return cls(msg["kind"], msg["message"], msg.get("origin"))

    def error(self) -> DaskdistError:
        cls = ERROR_KINDS.get(self.kind, CollectiveAbortedError)
        return cls(self.message)


class Mailbox:
    """Tagged messages for one replica, with per-attempt and group-wide aborts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._messages: dict[Tag, Any] = {}
        self._waiters: dict[Tag, threading.Event] = {}  # tag -> the event of the thread waiting for it
        self._events: dict[int, threading.Event] = {}  # thread id -> its event, reused from wait to wait
        self._attempt_aborts: dict[int, Abort] = {}
        self._group_abort: Abort | None = None
        self._current_attempt = -1

    def begin_attempt(self, attempt: int) -> None:
        """Start ``attempt`` (the count of failed commands): drop messages left over from earlier (aborted) attempts."""
        with self._lock:
            self._current_attempt = attempt
            stale = [tag for tag in self._messages if tag[0] < attempt]
            for tag in stale:
                del self._messages[tag]

    def put(self, tag: Tag, value: Any) -> None:
        """Deliver a message (called from the worker's event loop)."""
        with self._lock:
            if tag[0] < self._current_attempt or self._group_abort is not None:
                return
            self._messages[tag] = value
            waiter = self._waiters.get(tag)
        if waiter is not None:
            waiter.set()

    def take(self, tag: Tag, deadline: float) -> Any:
        """Remove and return the message with ``tag``.

        Raises
        ------
        DaskdistError
            The attempt or group was aborted while waiting.
        MailboxTimeout
            ``deadline`` (a ``time.monotonic()`` value) passed first.
        """
        attempt = tag[0]
        with self._lock:
            self.check(attempt)
            if tag in self._messages:
                return self._messages.pop(tag)
            if deadline <= time.monotonic():
                raise MailboxTimeout(tag)
            thread = threading.get_ident()
            event = self._events.get(thread)
            if event is None:
                event = self._events[thread] = threading.Event()
            event.clear()
            self._waiters[tag] = event
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining > 0:
                    event.wait(remaining)
                with self._lock:
                    event.clear()
                    self.check(attempt)
                    if tag in self._messages:
                        return self._messages.pop(tag)
                if remaining <= 0:
                    raise MailboxTimeout(tag)
        finally:
            with self._lock:
                if self._waiters.get(tag) is event:
                    del self._waiters[tag]

    def check(self, attempt: int) -> None:
        """Raise the abort error of ``attempt`` or of the group, if there is one."""
        abort = self._group_abort or self._attempt_aborts.get(attempt)
        if abort is not None:
            raise abort.error()

    def abort_attempt(self, attempt: int, abort: Abort) -> None:
        """Abort ``attempt``: its waits raise, its messages are dropped. The first abort wins."""
        with self._lock:
            if attempt in self._attempt_aborts:
                return
            self._attempt_aborts[attempt] = abort
            while len(self._attempt_aborts) > _ABORTED_ATTEMPTS_KEPT:
                del self._attempt_aborts[min(self._attempt_aborts)]
            for stale in [t for t in self._messages if t[0] == attempt]:
                del self._messages[stale]
            self._wake_all()

    def abort_group(self, abort: Abort) -> None:
        """Abort everything, for good (a replica of the group was lost)."""
        with self._lock:
            if self._group_abort is None:
                self._group_abort = abort
            self._messages.clear()
            self._wake_all()

    def _wake_all(self) -> None:
        """Wake every waiting thread (hold ``_lock``): each re-checks the aborts."""
        for event in self._waiters.values():
            event.set()

    @property
    def current_attempt(self) -> int:
        return self._current_attempt

    @property
    def group_abort(self) -> Abort | None:
        return self._group_abort

    def attempt_abort(self, attempt: int) -> Abort | None:
        with self._lock:
            return self._attempt_aborts.get(attempt)

    def __len__(self) -> int:
        with self._lock:
            return len(self._messages)
