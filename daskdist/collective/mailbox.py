"""Where messages for one replica wait until its thread takes them.

The worker's event loop puts messages in; the replica thread takes them out by
tag with a deadline. Aborts (of one run, or of the whole group) wake the
waiting thread at once, so no replica stays blocked after a peer failed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from daskdist.exceptions import ERROR_KINDS, CollectiveAbortedError, DaskdistError, MailboxTimeout

__all__ = ["Abort", "Mailbox", "MailboxTimeout"]

Tag = tuple[Any, ...]  # (run_id, collective_seq, src_rank, name)

#: Aborted runs remembered, so an abort that arrives before the run starts still counts.
_ABORTED_RUNS_KEPT = 64


class Abort:
    """Why a run (or the whole group) was aborted, as sent between replicas.

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
    """Tagged messages for one replica, with per-run and group-wide aborts."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._messages: dict[Tag, Any] = {}
        self._run_aborts: dict[int, Abort] = {}
        self._group_abort: Abort | None = None
        self._current_run = -1

    def begin_run(self, run_id: int) -> None:
        """Start ``run_id``: drop messages left over from earlier (aborted) runs."""
        with self._cond:
            self._current_run = run_id
            stale = [tag for tag in self._messages if tag[0] < run_id]
            for tag in stale:
                del self._messages[tag]

    def put(self, tag: Tag, value: Any) -> None:
        """Deliver a message (called from the worker's event loop)."""
        with self._cond:
            if tag[0] < self._current_run or self._group_abort is not None:
                return
            self._messages[tag] = value
            self._cond.notify_all()

    def take(self, tag: Tag, deadline: float) -> Any:
        """Remove and return the message with ``tag``.

        Raises
        ------
        DaskdistError
            The run or group was aborted while waiting.
        MailboxTimeout
            ``deadline`` (a ``time.monotonic()`` value) passed first.
        """
        run_id = tag[0]
        with self._cond:
            while True:
                self.check(run_id)
                if tag in self._messages:
                    return self._messages.pop(tag)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise MailboxTimeout(tag)
                self._cond.wait(remaining)

    def check(self, run_id: int) -> None:
        """Raise the abort error of ``run_id`` or of the group, if there is one."""
        abort = self._group_abort or self._run_aborts.get(run_id)
        if abort is not None:
            raise abort.error()

    def abort_run(self, run_id: int, abort: Abort) -> None:
        """Abort ``run_id``: its waits raise, its messages are dropped. The first abort wins."""
        with self._cond:
            if run_id in self._run_aborts:
                return
            self._run_aborts[run_id] = abort
            while len(self._run_aborts) > _ABORTED_RUNS_KEPT:
                del self._run_aborts[min(self._run_aborts)]
            for stale in [t for t in self._messages if t[0] == run_id]:
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
    def current_run(self) -> int:
        return self._current_run

    @property
    def group_abort(self) -> Abort | None:
        return self._group_abort

    def run_abort(self, run_id: int) -> Abort | None:
        with self._cond:
            return self._run_aborts.get(run_id)

    def __len__(self) -> int:
        with self._cond:
            return len(self._messages)
