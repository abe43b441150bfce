"""Membership changes the scheduler plugin announces, heard by the client instead of polled for.

The scheduler plugin logs an event on its topic (``"daskdist"``) whenever a
group moves to a new generation, closes or fails, and whenever a worker joins
or leaves the cluster. Dask lets a client hold one
handler per topic, and one client may drive several groups (several
strategies), so one ``Announcements`` per client listens for all of them and
wakes whoever waits for a group's next generation (``ReplicaGroup
.wait_for_generation``) or for any change (``wait_past``: elastic admission of
free workers, the parameter-server coordinator's watch). Waiters still ask the scheduler for the membership
itself: an announcement only says when to ask, so a missed event costs a
bounded delay (the waiter's own re-check period), never a wrong answer.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

__all__ = ["Announcements", "announcements_of"]

logger = logging.getLogger(__name__)


class Announcements:
    """The newest generation announced per group, and a condition to wait on.

    Parameters
    ----------
    topic
        The scheduler plugin's event topic.
    """

    def __init__(self, topic: str):
        self.topic = topic
        self.condition = threading.Condition()
        self.generations: dict[str, int] = {}  # group id -> the newest generation announced
        self.closed: set[str] = set()  # groups announced closed or failed
        #: Counts every change heard (a generation, a group ended, a worker added to or removed from the cluster).
        self.version = 0

    def handle(self, event: tuple[float, Any]) -> None:
        """The topic handler (runs on the client's event loop): note the event, wake the waiters."""
        _, msg = event
        if not isinstance(msg, dict):
            return
        action = msg.get("action")
        with self.condition:
            if action == "generation" and "group" in msg:
                group = str(msg["group"])
                self.generations[group] = max(int(msg.get("generation", 0)), self.generations.get(group, 0))
            elif action in ("close", "failed") and "group" in msg:
                self.closed.add(str(msg["group"]))
            elif action not in ("worker-added", "worker-removed"):
                return
            self.version += 1
            self.condition.notify_all()

    def wait(self, group_id: str, after: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s for ``group_id`` to be announced past generation ``after`` (or closed)."""
        def announced() -> bool:
            return self.generations.get(group_id, 0) > after or group_id in self.closed

        with self.condition:
            return self.condition.wait_for(announced, timeout=max(timeout, 0.0))

    def wait_past(self, version: int, timeout: float) -> int:
        """Wait up to ``timeout`` s for any change after ``version`` (``self.version`` as last seen); the version now."""
        with self.condition:
            self.condition.wait_for(lambda: self.version > version, timeout=max(timeout, 0.0))
            return self.version


_BY_CLIENT: weakref.WeakKeyDictionary[Any, Announcements] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def announcements_of(client: Any, topic: str) -> Announcements:
    """The ``Announcements`` of ``client`` on ``topic``, subscribed at first use (one handler per client)."""
    with _LOCK:
        announcements = _BY_CLIENT.get(client)
        if announcements is None:
            announcements = _BY_CLIENT[client] = Announcements(topic)
            try:
                client.subscribe_topic(topic, announcements.handle)
            except Exception as error:  # a client that cannot subscribe: waiters fall back to their re-checks
                logger.debug("Could not subscribe to %s: %s", topic, error)
        return announcements
