"""Bounding the scheduler's own copy of an event topic.

The scheduler keeps the last ``distributed.admin.low-level-log-length``
(1000) events of every topic for ``Client.get_events``. The replicas' step
events (topic ``daskdist-steps``) each carry up to
``daskdist.metrics.event-max-steps`` step records, and the scheduler
plugin's ``MetricsStore`` already keeps what the dashboard and ``/metrics``
need, so that copy would be a second history up to 1000 events long.
``bound_topic`` shortens the copy of one topic to ``maxlen`` events.

Distributed has no public API for this: recent versions keep the events in
``Scheduler._broker._topics[topic].events``, older ones in
``Scheduler.events[topic]``; both are deques, replaced here by a shorter one
holding the same newest events.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["bound_topic", "topic_events"]

logger = logging.getLogger(__name__)


def topic_events(scheduler: Scheduler, topic: str) -> collections.deque[Any] | None:
    """The deque in which ``scheduler`` keeps ``topic``'s events, or None if there is none (yet)."""
    broker = getattr(scheduler, "_broker", None)
    if broker is not None:
        holder = getattr(broker, "_topics", {}).get(topic)
        return getattr(holder, "events", None)
    events = getattr(scheduler, "events", None)
    return events.get(topic) if isinstance(events, dict) else None


def bound_topic(scheduler: Scheduler, topic: str, maxlen: int) -> bool:
    """Keep at most ``maxlen`` (newest) events of ``topic`` on ``scheduler``; False where it cannot."""
    maxlen = max(int(maxlen), 0)
    events = topic_events(scheduler, topic)
    if not isinstance(events, collections.deque):
        return False
    if events.maxlen is not None and events.maxlen <= maxlen:
        return True
    shorter = collections.deque(events, maxlen=maxlen)
    broker = getattr(scheduler, "_broker", None)
    if broker is not None:
        broker._topics[topic].events = shorter
    else:
        scheduler.events[topic] = shorter  # type: ignore[attr-defined]  # distributed before the event broker
    logger.debug("The scheduler keeps the last %d events of topic %s", maxlen, topic)
    return True
