"""Stopping an elastic epoch at a commit: members retire, or free workers wait to be admitted.

Replica side, shared by the built-in layers' elastic epoch
(``elastic/replica.py``) and the Keras 3 adapter's
(``daskdist/plugins/keras3/commands.py``). At a commit every replica adds
two flags to a sum over the replicas (replica 0's "free workers wait",
``FreeWorkerWatch``; any replica's "members retire", ``retiring``), so all
of them learn the same and all stop at that commit (``StopAtCommit``):
the epoch's command answers ``{"stopped_at": step, "leave": ...}`` and the
client re-forms the group there (``ElasticSession.change``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from daskdist.exceptions import StopAtCommit
from daskdist.group.service import ReplicaService

__all__ = ["FreeWorkerWatch", "StopAtCommit", "boundary_flags", "retiring", "stop_reply"]

logger = logging.getLogger(__name__)


def stop_reply(stop: StopAtCommit) -> dict[str, Any]:
    """What the epoch's command answers when it stopped at a commit (the client's ``ElasticSession`` reads it)."""
    return {"stopped_at": stop.step, "leave": stop.leave}


def retiring(service: ReplicaService) -> bool:
    """Whether the scheduler said members of this replica's group are retiring (``group.departures``)."""
    worker = getattr(service, "worker", None)
    extension = getattr(worker, "extensions", {}).get("daskdist") if worker is not None else None
    asked = getattr(extension, "retiring", None)
    return bool(asked(getattr(service, "group_id", None))) if asked is not None else False


class FreeWorkerWatch:
    """Replica 0's look at the cluster for workers outside the group, at most once per ``every`` seconds.

    Parameters
    ----------
    service
        The replica.
    every
        Seconds between two looks (``ElasticOptions.admit_every``); ``None``: never (no growth mid-epoch).
    room
        Whether the group may grow (below ``max_replicas``); every replica is told the same.
    """

    def __init__(self, service: ReplicaService, every: float | None, room: bool):
        self.service, self.every, self.room = service, every, room
        self.last = time.monotonic()

    @property
    def active(self) -> bool:
        """Whether this epoch looks for free workers at all (every replica knows the same)."""
        return self.every is not None and self.room

    def due(self) -> bool:
        """Whether free workers wait (replica 0 only; the others answer False and learn it from the all-reduce)."""
        if self.every is None or not self.room or self.service.rank != 0:
            return False
        now = time.monotonic()
        if now - self.last < self.every:
            return False
        self.last = now
        from distributed.utils import sync

        worker = getattr(self.service, "worker", None)
        if worker is None:
            return False
        try:
            everyone = sync(worker.loop, worker.scheduler.ncores, callback_timeout=10)
        except Exception as e:  # a slow scheduler must not fail the step: look again later
            logger.debug("Could not ask the scheduler for its workers: %s", e)
            return False
        return bool(set(everyone) - set(self.service.membership.addresses))


def boundary_flags(service: ReplicaService, watch: FreeWorkerWatch) -> list[float]:
    """This replica's two flags for a commit (``[free workers wait, members retire]``, 1.0 or 0.0), to be summed
    over the replicas with whatever the commit sums anyway; a sum above 0 stops every replica there."""
    return [1.0 if watch.due() else 0.0, 1.0 if retiring(service) else 0.0]
