"""The scheduler side: group membership, rendezvous, failure broadcast.

The scheduler never carries tensors. It knows which workers host the
replicas of each group, lets replicas meet at start-up (and later under a
key, ``exchange``: NCCL's unique id), and when a worker hosting a replica
leaves the cluster it tells every other replica of that group (through the
workers' stream) so their collectives fail at once with ``ReplicaLostError``.
Groups whose client disconnects are closed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from daskdist import config
from daskdist.cluster.worker_plugin import DaskdistWorkerPlugin
from daskdist.dashboard import page, prometheus
from daskdist.dashboard.event_log import bound_topic
from daskdist.dashboard.store import STEP_TOPIC, MetricsStore

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["DaskdistSchedulerPlugin", "GroupState", "Meeting"]

logger = logging.getLogger(__name__)

EVENT_TOPIC = "daskdist"


@dataclass
class Meeting:
    """A later meeting of a running group's replicas under one key (``exchange``)."""

    values: dict[int, Any] = field(default_factory=dict)
    fetched: set[int] = field(default_factory=set)
    ready: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class GroupState:
    """What the scheduler knows of one replica group."""

    group_id: str
    workers: list[str]
    client: str | None
    status: str = "starting"  # starting -> running -> failed | closed
    reason: str = ""
    arrived: dict[int, str] = field(default_factory=dict)
    info: dict[int, dict] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    meetings: dict[str, Meeting] = field(default_factory=dict)

    def wake_meetings(self) -> None:
        """The group failed or closed: every replica waiting in ``exchange`` gets an answer now."""
        for meeting in self.meetings.values():
            meeting.ready.set()


class DaskdistSchedulerPlugin(SchedulerPlugin):
    """Owns the state of every replica group on this scheduler."""

    name = "daskdist"
    idempotent = True

    def __init__(self) -> None:
        self.groups: dict[str, GroupState] = {}
        self.scheduler: Scheduler | None = None
        self.store = MetricsStore(int(config.get("metrics.history")),
                                  straggler_min_wait=config.get_seconds("metrics.straggler-min-wait"))
        self.step_event_log = int(config.get("metrics.scheduler-event-log"))

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update(
            {
                "daskdist_register_group": self.register_group,
                "daskdist_rendezvous": self.rendezvous,
                "daskdist_exchange": self.exchange,
                "daskdist_wait_group": self.wait_group,
                "daskdist_close_group": self.close_group,
                "daskdist_group_status": self.group_status,
            }
        )
        scheduler.extensions["daskdist"] = self
        await scheduler.register_worker_plugin(None, dumps(DaskdistWorkerPlugin()), name="daskdist", idempotent=True)
        prometheus.register_store(self.store)
        try:
            page.install(scheduler)
        except Exception as e:  # the dashboard is a convenience: never fail the plugin for it
            logger.warning("Could not add the daskdist page to the dashboard: %s", e)

    # -- handlers ----------------------------------------------------------------

    def register_group(self, group_id: str, workers: list[str], client: str | None = None) -> dict:
        """Announce a group about to launch one replica on each of ``workers`` (rank order)."""
        missing = [w for w in workers if w not in self.scheduler.workers]
        if missing:
            return {"status": "error", "message": f"workers {missing} are not part of the cluster"}
        self.groups[group_id] = GroupState(group_id, list(workers), client)
        self.scheduler.log_event(EVENT_TOPIC, {"action": "register", "group": group_id, "workers": workers})
        return {"status": "OK"}

    async def rendezvous(self, group_id: str, rank: int, address: str, info: dict | None = None) -> dict:
        """Called by each replica when it starts; returns once all have arrived, with everyone's ``info``.

        ``info`` carries what peers need to reach the replica directly (its
        TCP listening address); the scheduler only passes it on.
        """
        group = self.groups.get(group_id)
        if group is None:
            return {"status": "error", "message": f"unknown replica group {group_id}"}
        if group.status in ("failed", "closed"):
            return {"status": "error", "message": group.reason}
        if group.workers[rank] != address:
            return {"status": "error", "message": f"replica {rank} started on {address}, expected {group.workers[rank]}"}
        group.arrived[rank] = address
        group.info[rank] = info or {}
        if len(group.arrived) == len(group.workers):
            group.status = "running"
            group.ready.set()
        await group.ready.wait()
        if group.status != "running":
            return {"status": "error", "message": group.reason}
        return {"status": "OK", "info": {str(r): i for r, i in group.info.items()}}

    async def exchange(self, group_id: str, key: str, rank: int, value: Any = None, timeout: float = 0.5) -> dict:
        """A rendezvous under ``key`` after the group is running: each replica posts ``value``, all get all.

        Used for what replicas must agree on later (NCCL's unique id, made by
        rank 0 when the first GPU collective needs a communicator). Answers
        ``{"status": "waiting"}`` after ``timeout`` seconds so the replica can
        check its aborts and deadline between polls (its value stays posted),
        ``{"status": "OK", "values": {rank: value}}`` once every replica has
        posted, or an error once the group has failed or closed.
        """
        group = self.groups.get(group_id)
        if group is None:
            return {"status": "error", "message": f"unknown replica group {group_id}"}
        if group.status != "running":
            return {"status": "error", "message": group.reason or f"replica group {group_id} is {group.status}"}
        meeting = group.meetings.get(key)
        if meeting is None:
            meeting = group.meetings[key] = Meeting()
        meeting.values[rank] = value
        if len(meeting.values) == len(group.workers):
            meeting.ready.set()
        try:
            await asyncio.wait_for(meeting.ready.wait(), timeout)
        except asyncio.TimeoutError:
            return {"status": "waiting"}
        if group.status != "running":
            return {"status": "error", "message": group.reason or f"replica group {group_id} is {group.status}"}
        meeting.fetched.add(rank)
        if len(meeting.fetched) == len(group.workers):
            group.meetings.pop(key, None)
        return {"status": "OK", "values": {str(r): v for r, v in meeting.values.items()}}

    async def wait_group(self, group_id: str, timeout: float, final: bool = True) -> dict:
        """Called by the client after launching: OK once every replica has met.

        With ``final=False`` a timeout only answers ``{"status": "waiting"}``
        (the client polls, watching its replica tasks meanwhile); with
        ``final=True`` it fails the group and says which replicas never came.
        """
        group = self.groups.get(group_id)
        if group is None:
            return {"status": "error", "message": f"unknown replica group {group_id}"}
        try:
            await asyncio.wait_for(group.ready.wait(), timeout)
        except asyncio.TimeoutError:
            if not final:
                return {"status": "waiting"}
            absent = [r for r in range(len(group.workers)) if r not in group.arrived]
            where = ", ".join(f"replica {r} on {group.workers[r]}" for r in absent)
            group.reason = (
                f"replicas did not all start within the rendezvous timeout: {where} never arrived "
                "(is the worker busy with other tasks, or out of threads?)"
            )
            self._fail(group)
            return {"status": "error", "message": group.reason}
        if group.status != "running":
            return {"status": "failed", "message": group.reason}
        return {"status": "OK"}

    def close_group(self, group_id: str) -> dict:
        """Forget a group (the strategy closed it)."""
        group = self.groups.pop(group_id, None)
        if group is not None:
            group.status = "closed"
            group.reason = group.reason or f"group {group_id} was closed"
            group.ready.set()
            group.wake_meetings()
            self.scheduler.log_event(EVENT_TOPIC, {"action": "close", "group": group_id})
        self.store.close_group(group_id)
        return {"status": "OK"}

    def group_status(self, group_id: str) -> dict:
        group = self.groups.get(group_id)
        if group is None:
            return {"status": "unknown", "reason": ""}
        return {"status": group.status, "reason": group.reason}

    # -- scheduler hooks -----------------------------------------------------------

    def log_event(self, topic: str, msg: Any) -> None:
        """Every event logged on the scheduler: step timings and fit progress go to the store.

        The scheduler's own log of the step topic is cut to the last
        ``daskdist.metrics.scheduler-event-log`` events: the store holds the steps.
        """
        self.store.record(topic, msg)
        if topic == STEP_TOPIC and self.scheduler is not None:
            bound_topic(self.scheduler, topic, self.step_event_log)

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        for group in list(self.groups.values()):
            if worker not in group.workers or group.status in ("failed", "closed"):
                continue
            rank = group.workers.index(worker)
            group.reason = (
                f"replica {rank} of {group.group_id} was lost: its worker {worker} left the cluster "
                "(crashed, was killed, or was retired)"
            )
            logger.warning("%s", group.reason)
            self._fail(group, lost_worker=worker)

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        for group in list(self.groups.values()):
            if group.client == client:
                for address in group.workers:
                    self._send(address, {"op": "daskdist_close_group", "group_id": group.group_id,
                                         "message": f"the client {client} of {group.group_id} disconnected"})
                self.groups.pop(group.group_id, None)

    # -- helpers -----------------------------------------------------------------

    def _fail(self, group: GroupState, lost_worker: str | None = None) -> None:
        group.status = "failed"
        group.ready.set()
        group.wake_meetings()
        self.scheduler.log_event(
            EVENT_TOPIC, {"action": "failed", "group": group.group_id, "reason": group.reason, "worker": lost_worker}
        )
        for address in group.workers:
            if address != lost_worker:
                self._send(address, {"op": "daskdist_abort_group", "group_id": group.group_id,
                                     "message": group.reason, "worker": lost_worker})

    def _send(self, address: str, msg: dict) -> None:
        stream = self.scheduler.stream_comms.get(address)
        if stream is not None:
            try:
                stream.send(msg)
            except Exception as e:  # the worker may be closing too
                logger.debug("Could not send %s to %s: %s", msg["op"], address, e)
