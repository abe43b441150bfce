"""Shipping a replica's step timings to the scheduler, in batches, on a timer.

A replica queues each finished step's timing (``StepEventShipper.add``, on
the replica's thread: a deque append and a flag test, nothing else) and the
shipper sends the queued steps as one Dask event on topic ``daskdist-steps``:

- ``daskdist.metrics.event-interval`` after the first step queued since the
  last event, from a one-shot timer on the worker's event loop, so the steps
  of a short run arrive even when no further step follows;
- at once when ``daskdist.metrics.event-max-steps`` steps are queued (so one
  event stays small), or when the interval is zero;
- on ``flush`` (the replica closes: every step is sent).

Steps go through a ``collections.deque`` (appends and pops are atomic), so
the replica thread and the event loop never lock each other.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["STEP_EVENT_TOPIC", "StepEventShipper"]

logger = logging.getLogger(__name__)

STEP_EVENT_TOPIC = "daskdist-steps"


class StepEventShipper:
    """Batches one replica's step timings into ``daskdist-steps`` events.

    Parameters
    ----------
    worker
        The worker the replica runs on (its ``log_event`` sends the events).
    group_id, rank, size
        Who the steps belong to (carried in every event).
    interval
        Seconds a queued step waits at most before it is sent (0: sent at once).
    max_steps
        Steps per event at most; a full batch is sent at once.
    """

    def __init__(self, worker: Worker, group_id: str, rank: int, size: int, interval: float, max_steps: int):
        self.worker = worker
        self.group_id = group_id
        self.rank = rank
        self.size = size
        self.interval = max(0.0, float(interval))
        self.max_steps = max(1, int(max_steps))
        self.loop: asyncio.AbstractEventLoop = worker.loop.asyncio_loop  # type: ignore[attr-defined]
        self._steps: collections.deque[dict[str, Any]] = collections.deque()
        self._timer_armed = False  # a flush is scheduled on the event loop for the steps queued
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._sending = threading.Lock()  # one flush at a time, so events leave in step order

    def add(self, step: dict[str, Any]) -> None:
        """Queue one step (replica thread); it is sent within ``interval`` seconds."""
        self._steps.append(step)
        if self.interval <= 0 or len(self._steps) >= self.max_steps:
            self.flush()
        elif not self._timer_armed:
            # once per batch, not per step: the flag is cleared by the timer before it drains the queue,
            # so a step queued after the drain arms the next timer
            self._timer_armed = True
            try:
                self.loop.call_soon_threadsafe(self._arm_timer)
            except RuntimeError:  # the worker's loop is closed: nothing can be sent any more
                self._timer_armed = False

    def _arm_timer(self) -> None:
        """On the event loop: flush ``interval`` seconds from now."""
        if not self._closed:
            self._timer = self.loop.call_later(self.interval, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_armed = False
        self.flush()

    def flush(self) -> None:
        """Send every queued step now, in events of at most ``max_steps`` steps (any thread)."""
        with self._sending:
            while self._steps:
                batch: list[dict[str, Any]] = []
                while self._steps and len(batch) < self.max_steps:
                    batch.append(self._steps.popleft())  # only this (locked) drain pops
                try:
                    self.worker.log_event(STEP_EVENT_TOPIC, {"group": self.group_id, "replica": self.rank,
                                                             "size": self.size, "steps": batch})
                except Exception as e:  # the worker is closing: the steps cannot reach the scheduler any more
                    logger.debug("Could not send %d step timing(s) of replica %d: %s", len(batch), self.rank, e)
                    return

    def close(self) -> None:
        """Send what is queued and stop the timer (the replica is closing)."""
        self._closed = True
        self.flush()
        timer = self._timer
        if timer is not None:
            try:
                self.loop.call_soon_threadsafe(timer.cancel)
            except RuntimeError:  # the loop is already closed; so is the timer
                pass

    def pending(self) -> int:
        """Steps queued and not sent yet."""
        return len(self._steps)

    def __repr__(self) -> str:
        return f"<StepEventShipper {self.group_id} replica={self.rank} pending={self.pending()}>"
