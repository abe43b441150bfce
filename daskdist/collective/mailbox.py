"""Where messages for one replica wait until its thread takes them.

The worker's event loop puts messages in; the replica thread takes them out by
tag with a deadline. Aborts (of one attempt, or of the whole group) wake the
waiting thread at once, so no replica stays blocked after a peer failed.
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
        self._cond = threading.Condition()
        self._messages: dict[Tag, Any] = {}
        self._attempt_aborts: dict[int, Abort] = {}
        self._group_abort: Abort | None = None
        self._current_attempt = -1

    def begin_attempt(self, attempt: int) -> None:
        """Start ``attempt`` (the count of failed commands): drop messages left over from earlier (aborted) attempts."""
        with self._cond:
            self._current_attempt = attempt
            stale = [tag for tag in self._messages if tag[0] < attempt]
            for tag in stale:
                del self._messages[tag]

    def put(self, tag: Tag, value: Any) -> None:
        """Deliver a message (called from the worker's event loop)."""
        with self._cond:
            if tag[0] < self._current_attempt or self._group_abort is not None:
                return
            self._messages[tag] = value
            self._cond.notify_all()

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
        with self._cond:
            while True:
                self.check(attempt)
                if tag in self._messages:
                    return self._messages.pop(tag)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise MailboxTimeout(tag)
                self._cond.wait(remaining)

    def check(self, attempt: int) -> None:
        """Raise the abort error of ``attempt`` or of the group, if there is one."""
        abort = self._group_abort or self._attempt_aborts.get(attempt)
        if abort is not None:
            raise abort.error()

    def abort_attempt(self, attempt: int, abort: Abort) -> None:
        """Abort ``attempt``: its waits raise, its messages are dropped. The first abort wins."""
        with self._cond:
            if attempt in self._attempt_aborts:
                return
            self._attempt_aborts[attempt] = abort
            while len(self._attempt_aborts) > _ABORTED_ATTEMPTS_KEPT:
                del self._attempt_aborts[min(self._attempt_aborts)]
            for stale in [t for t in self._messages if t[0] == attempt]:
                del self._messages[stale]
            self._cond.notify_all()

    def abort_group(self, abort: Abort) -> None:
        """Abort everything, for good (a replica of the group was lost)."""
        with self._cond:
            if self._group_abort is None:
                self._group_abort = abort
            self._messages.clear()
            self._cond.notify_all()

    @property
    def current_attempt(self) -> int:
        return self._current_attempt

    @property
    def group_abort(self) -> Abort | None:
        return self._group_abort

    def attempt_abort(self, attempt: int) -> Abort | None:
        with self._cond:
            return self._attempt_aborts.get(attempt)

    def __len__(self) -> int:
        with self._cond:
            return len(self._messages)
