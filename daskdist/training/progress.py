"""Replica 0's live progress of a ``fit`` (the dashboard's progress bar, Keras' verbose bar on the client).

Replica 0 sends ``{"tag", "epoch", "step", "logs"}`` on ``PROGRESS_TOPIC`` at
most every ``interval`` seconds while an epoch runs, and once with ``step ==
-1`` at its end; the scheduler keeps the latest per ``fit`` (``dashboard.store``)
and the client's ``fit`` subscribes to the topic for its progress callbacks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from daskdist.dashboard.store import PROGRESS_TOPIC

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService

__all__ = ["PROGRESS_INTERVAL", "PROGRESS_TOPIC", "ProgressReporter"]

PROGRESS_INTERVAL = 0.25  # seconds between replica 0's progress events


class ProgressReporter:
    """One epoch's progress events from one replica (only replica 0 sends any).

    Parameters
    ----------
    service
        The replica (``log_event``, ``rank``).
    tag
        The ``fit``'s tag (its events carry it).
    epoch
        The epoch.
    first_step
        The step the epoch goes on from (an elastic epoch resumed part-way): steps are counted from it.
    """

    def __init__(self, service: ReplicaService, tag: str, epoch: int, first_step: int = 0,
                 interval: float = PROGRESS_INTERVAL):
        self.service, self.tag, self.epoch, self.first_step = service, tag, epoch, first_step
        self.interval = interval
        self._sent = 0.0

    def __call__(self, done: int, logs: Callable[[], Mapping[str, Any] | None] | None = None) -> None:
        """``done`` steps of this command ran; ``logs`` reads the running logs (``None``: none sent). It is called
        only when an event goes out (replica 0, once per interval), never on the other steps."""
        now = time.monotonic()
        if self.service.rank != 0 or now - self._sent < self.interval:
            return
        self._sent = now
        event: dict[str, Any] = {"tag": self.tag, "epoch": self.epoch, "step": self.first_step + done}
        read = logs() if logs is not None else None
        if read is not None:
            event["logs"] = read
        self.service.log_event(PROGRESS_TOPIC, event)

    def end(self, logs: dict[str, Any]) -> None:
        """The epoch's end (``step == -1``) with its logs."""
        if self.service.rank == 0:
            self.service.log_event(PROGRESS_TOPIC, {"tag": self.tag, "epoch": self.epoch, "step": -1, "logs": logs})
