"""The scheduler side: group membership and its generations, rendezvous, failure broadcast.

The scheduler never carries tensors. It knows the membership of each group
(``Membership``: members with address, device, host and role, in one
generation), lets replicas meet at the start of each generation (and later
under a key, ``exchange``: NCCL's unique id), and owns membership changes:
``change_membership`` (the handler ``daskdist_change_membership``) moves a
group to a new generation and tells its workers; when a worker hosting a
member leaves the cluster, the group's policy decides: ``fixed`` fails the
group (every other replica's collectives fail at once with
``ReplicaLostError``, and so does the client), ``elastic`` re-forms it on the
survivors in a new generation. Workers hosting members are protected from
Dask's downscaling (``valid_workers_downscaling``, as the P2P shuffle does).
Members need not be replicas: a strategy's parameter stores form a group of
members with role ``ps`` (``daskdist.ps.members``), hosted by the worker
plugin, which this plugin covers alike (a lost ps fails its group).
Groups whose client disconnects are closed. Members of elastic groups that
stall are fenced out, and retired ones leave at a commit (``group.departures``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from daskdist import config
from daskdist.dashboard import page, prometheus
from daskdist.dashboard.event_log import bound_topic
from daskdist.dashboard.store import STEP_TOPIC, MetricsStore
from daskdist.group.departures import Departures
from daskdist.group.group_state import GroupState, Meeting
from daskdist.group.kv_store import KeyValueStore
from daskdist.group.membership import Member, Membership, MembershipPolicy
from daskdist.group.worker_plugin import DaskdistWorkerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

__all__ = ["EVENT_TOPIC", "DaskdistSchedulerPlugin", "GroupState", "Meeting"]

logger = logging.getLogger(__name__)

EVENT_TOPIC = "daskdist"


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
        self.departures = Departures(self)
        self.kv = KeyValueStore()  # torch.distributed's Store of each group (plugins.torch)

    @property
    def running_scheduler(self) -> Scheduler:
        """The scheduler this plugin was started on."""
        if self.scheduler is None:
            raise RuntimeError("the daskdist scheduler plugin has not been started")
        return self.scheduler

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
                "daskdist_membership": self.membership,
                "daskdist_change_membership": self.change_membership_handler,
                "daskdist_kv": self.kv.handle,
            }
        )
        scheduler.extensions["daskdist"] = self
        self.departures.start(scheduler)
        plugin = dumps(DaskdistWorkerPlugin())  # type: ignore[no-untyped-call]
        await scheduler.register_worker_plugin(None, plugin, name="daskdist", idempotent=True)
        prometheus.register_store(self.store)
        try:
            page.install(scheduler)
        except Exception as e:  # the dashboard is a convenience: never fail the plugin for it
            logger.warning("Could not add the daskdist page to the dashboard: %s", e)

    # -- handlers ----------------------------------------------------------------

    def register_group(self, group_id: str, workers: list[str], client: str | None = None,
                       membership: dict[str, Any] | None = None, policy: MembershipPolicy = "fixed",
                       strategy_token: str | None = None, heartbeat_timeout: float = 0.0,
                       leave_timeout: float = 60.0) -> dict[str, Any]:
        """Announce a group about to launch one replica on each of ``workers`` (rank order), generation 0.

        ``heartbeat_timeout`` and ``leave_timeout`` (seconds, elastic groups): see ``group.departures``.
        """
        missing = [w for w in workers if w not in self.running_scheduler.workers]
        if missing:
            return {"status": "error", "message": f"workers {missing} are not part of the cluster"}
        if policy not in ("fixed", "elastic"):
            return {"status": "error", "message": f"unknown membership policy {policy!r}: fixed or elastic"}
        self.groups[group_id] = GroupState(
            group_id, list(workers), client,
            membership=Membership.from_msg(membership) if membership is not None else None, policy=policy,
            strategy_token=strategy_token, heartbeat_timeout=float(heartbeat_timeout),
            leave_timeout=float(leave_timeout),
        )
        self.running_scheduler.log_event(EVENT_TOPIC, {"action": "register", "group": group_id, "workers": workers,
                                               "generation": 0})
        self.store.membership_changed(strategy_token or group_id, 0, list(workers), [], "started", group_id)
        return {"status": "OK"}

    async def rendezvous(self, group_id: str, rank: int, address: str, info: dict[str, Any] | None = None,
                         generation: int | None = None) -> dict[str, Any]:
        """Called by each replica at the start of a generation; returns once all have arrived, with everyone's ``info``.

        ``info`` carries what peers need to reach the replica directly
        (``Transport.local_info()``: its TCP listening address, its UCX
        address); the scheduler only passes it on. A replica of an older
        generation is answered with a ``stale`` error.
        """
        group = self.groups.get(group_id)
        if group is None:
            return {"status": "error", "message": f"unknown replica group {group_id}"}
        if group.status in ("failed", "closed"):
            return {"status": "error", "message": group.reason}
        stale = group.stale(generation, f"the rendezvous of replica {rank}")
        if stale is not None:
            return stale
        if generation is not None and generation > group.generation:
            return {"status": "error", "message": f"generation {generation} of {group_id} does not exist yet"}
        if rank >= len(group.workers) or group.workers[rank] != address:
            expected = group.workers[rank] if rank < len(group.workers) else "no worker (no such rank)"
            return {"status": "error", "message": f"replica {rank} started on {address}, expected {expected}"}
        group.arrived[rank] = address
        group.info[rank] = info or {}
        if len(group.arrived) == len(group.workers):
            group.status = "running"
            group.ready.set()
        ready, infos = group.ready, group.info  # this generation's: a change while waiting wakes it with an error
        await ready.wait()
        if group.status != "running" or (generation is not None and generation != group.generation):
            return {"status": "error", "kind": "stale" if group.status == "starting" else "lost",
                    "message": group.reason or f"{group_id} moved to generation {group.generation}"}
        return {"status": "OK", "info": {str(r): i for r, i in infos.items()}}

    async def exchange(self, group_id: str, key: str, rank: int, value: Any = None, timeout: float = 0.5,
                       generation: int | None = None) -> dict[str, Any]:
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
        stale = group.stale(generation, f"the exchange {key!r} of replica {rank}")
        if stale is not None:
            return stale
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
        stale = group.stale(generation, f"the exchange {key!r} of replica {rank}")
        if stale is not None:
            return stale
        if group.status != "running":
            return {"status": "error", "message": group.reason or f"replica group {group_id} is {group.status}"}
        meeting.fetched.add(rank)
        if len(meeting.fetched) == len(group.workers):
            group.meetings.pop(key, None)
        return {"status": "OK", "values": {str(r): v for r, v in meeting.values.items()}}

    async def wait_group(self, group_id: str, timeout: float, final: bool = True) -> dict[str, Any]:
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
        return {"status": "OK", "info": {str(r): i for r, i in group.info.items()}}

    def close_group(self, group_id: str) -> dict[str, Any]:
        """Forget a group (the strategy closed it)."""
        group = self.groups.pop(group_id, None)
        if group is not None:
            group.status = "closed"
            group.reason = group.reason or f"group {group_id} was closed"
            group.ready.set()
            group.wake_meetings()
            self.running_scheduler.log_event(EVENT_TOPIC, {"action": "close", "group": group_id})
        self.kv.drop(f"{group_id}/")
        self.store.close_group(group.strategy_token or group_id if group is not None else group_id)
        return {"status": "OK"}

    def group_status(self, group_id: str) -> dict[str, Any]:
        group = self.groups.get(group_id)
        if group is None:
            return {"status": "unknown", "reason": ""}
        return {"status": group.status, "reason": group.reason, "generation": group.generation}

    def membership(self, group_id: str, generation: int | None = None) -> dict[str, Any]:
        """The group's current membership (``Membership.to_msg``), or a ``stale`` error if ``generation`` is older."""
        group = self.groups.get(group_id)
        if group is None or group.membership is None:
            return {"status": "error", "message": f"unknown replica group {group_id}"}
        stale = group.stale(generation, "a membership request")
        if stale is not None:
            return stale
        return {"status": "OK", "membership": group.membership.to_msg(), "state": group.status,
                "policy": group.policy, "retired": sorted(group.retired)}

    # -- membership changes ----------------------------------------------------------

    def change_membership(self, group_id: str, workers: list[str], reason: str = "", *,
                          admit: bool = False) -> Membership:
        """Move a group to a new generation whose members are on ``workers`` (rank order).

        The scheduler-plugin API the elastic policy builds on. Members kept
        keep their device, host and role. Under the ``fixed`` policy a change
        fails the group (``ReplicaLostError`` everywhere), as a lost worker
        does; under ``elastic`` the group waits for the survivors to meet in
        the new generation (``rendezvous``), each told by a
        ``daskdist_new_generation`` message. Messages of older generations
        are rejected from now on.

        Raises
        ------
        ValueError
            Unknown group, a group that failed or closed, a worker that is not in the cluster or hosts no
            replica of the group (unless ``admit``), or no worker at all.

        With ``admit=True`` workers that host no replica yet become members
        (``_newcomer``): the caller (elastic training, ``daskdist.elastic.recovery.admit``) starts their
        replicas, which meet the others at the new generation's rendezvous.
        """
        group = self.groups.get(group_id)
        if group is None or group.membership is None:
            raise ValueError(f"unknown replica group {group_id}")
        if group.status in ("failed", "closed"):
            raise ValueError(f"replica group {group_id} is {group.status}: {group.reason}")
        missing = [w for w in workers if w not in self.running_scheduler.workers]
        if missing:
            raise ValueError(f"workers {missing} are not part of the cluster")
        known = {m.address: m for m in group.membership.members}
        newcomers = [w for w in workers if w not in known]
        if newcomers and not admit:  # admitting members means launching replicas on them (elastic.recovery.admit)
            raise ValueError(f"workers {newcomers} host no replica of {group_id}: a new generation can only keep, "
                             "drop or reorder the current members")
        if not workers:
            raise ValueError(f"a generation of {group_id} needs at least one member")
        members = tuple(known[w] if w in known else _newcomer(w) for w in workers)
        new = group.membership.next(members)
        previous = list(group.workers)
        group.membership, group.generation, group.workers = new, int(new.generation), list(workers)
        change = self.store.membership_changed(group.strategy_token or group_id, int(new.generation), list(workers),
                                               previous, reason, group_id, sorted(group.retired))
        self.running_scheduler.log_event(EVENT_TOPIC, {"action": "generation", "group": group_id,
                                               "strategy": group.strategy_token, **change.to_msg(),
                                               "workers": list(workers)})
        logger.log(logging.WARNING if change.lost else logging.INFO,
                   "Replica group %s moved to generation %d: %d -> %d members (lost %s, left %s, admitted %s): %s",
                   group_id, new.generation, len(previous), len(workers), change.lost or "none",
                   change.left or "none", change.admitted or "none", reason or "no reason given")
        # wake everyone waiting in the old generation's rendezvous or meetings: they are stale now
        group.ready.set()
        group.wake_meetings()
        group.meetings = {}
        group.ready, group.arrived, group.info = asyncio.Event(), {}, {}
        if group.policy == "fixed":
            group.reason = (f"{reason or 'its membership changed'}: replica group {group_id} moved to generation "
                            f"{new.generation} and its membership policy is fixed, so it fails")
            gone = set(self.running_scheduler.workers)
            self._fail(group, lost_worker=next((w for w in previous if w not in gone), None), addresses=previous)
            return new
        group.status = "starting"
        for address in sorted(set(previous) | set(workers)):
            self.send_to_worker(address, {"op": "daskdist_new_generation", "group_id": group_id,
                                 "membership": new.to_msg(), "message": reason})
        return new

    def change_membership_handler(self, group_id: str, workers: list[str], reason: str = "",
                                  admit: bool = False) -> dict[str, Any]:
        """Handler form of ``change_membership``: ``{"status": "OK", "membership": ...}`` or an error message."""
        try:
            membership = self.change_membership(group_id, workers, reason, admit=admit)
        except ValueError as e:
            return {"status": "error", "message": str(e)}
        return {"status": "OK", "membership": membership.to_msg()}

    def valid_workers_downscaling(self, scheduler: Scheduler, workers: list[WorkerState]) -> list[WorkerState]:
        """Dask's downscaling may retire any worker but those hosting a member of a live group."""
        participating = {a for g in self.groups.values() if g.status in ("starting", "running") for a in g.workers}
        return [w for w in workers if w.address not in participating]

    # -- scheduler hooks -----------------------------------------------------------

    def log_event(self, topic: str, msg: Any) -> None:
        """Every event logged on the scheduler: step timings and fit progress go to the store.

        The scheduler's own log of the step topic is cut to the last
        ``daskdist.metrics.scheduler-event-log`` events: the store holds the steps.
        """
        self.store.record(topic, msg)
        if topic == STEP_TOPIC and self.scheduler is not None:
            bound_topic(self.scheduler, topic, self.step_event_log)

    async def close(self) -> None:
        self.departures.stop()

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        """Announce the new worker (elastic groups and coordinators waiting for one listen: ``announcements``)."""
        scheduler.log_event(EVENT_TOPIC, {"action": "worker-added", "worker": worker})

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        scheduler.log_event(EVENT_TOPIC, {"action": "worker-removed", "worker": worker})
        for group in list(self.groups.values()):
            group.leaving.discard(worker)
            if worker not in group.workers or group.status in ("failed", "closed"):
                continue
            rank = group.workers.index(worker)
            reason = (
                f"replica {rank} of {group.group_id} was lost: its worker {worker} left the cluster "
                "(crashed, was killed, or was retired)"
            )
            logger.warning("%s", reason)
            survivors = [w for w in group.workers if w != worker]
            if group.policy == "elastic" and group.membership is not None and survivors:
                group.reason = reason
                for address in group.workers:  # the run in flight fails everywhere, as under ``fixed``
                    if address != worker:
                        self.send_to_worker(address, {"op": "daskdist_abort_group", "group_id": group.group_id,
                                             "message": reason, "worker": worker,
                                             "generation": group.generation})
                self.change_membership(group.group_id, survivors, reason)
            else:
                group.reason = reason
                self._fail(group, lost_worker=worker)

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        for group in list(self.groups.values()):
            if group.client == client:
                for address in group.workers:
                    self.send_to_worker(address, {"op": "daskdist_close_group", "group_id": group.group_id,
                                         "message": f"the client {client} of {group.group_id} disconnected"})
                self.groups.pop(group.group_id, None)

    # -- helpers -----------------------------------------------------------------

    def _fail(self, group: GroupState, lost_worker: str | None = None, addresses: list[str] | None = None) -> None:
        group.status = "failed"
        group.ready.set()
        group.wake_meetings()
        self.running_scheduler.log_event(
            EVENT_TOPIC, {"action": "failed", "group": group.group_id, "reason": group.reason, "worker": lost_worker}
        )
        for address in group.workers if addresses is None else addresses:
            if address != lost_worker:
                # no generation: a failed group is dead in every generation
                self.send_to_worker(address, {"op": "daskdist_abort_group", "group_id": group.group_id,
                                     "message": group.reason, "worker": lost_worker})

    def send_to_worker(self, address: str, msg: dict[str, Any]) -> None:
        """Send ``msg`` to the worker at ``address`` on its stream (dropped if it is gone or closing)."""
        stream = self.running_scheduler.stream_comms.get(address)
        if stream is not None:
            try:
                stream.send(msg)
            except Exception as e:  # the worker may be closing too
                logger.debug("Could not send %s to %s: %s", msg["op"], address, e)


def _newcomer(address: str) -> Member:
    """The member a newly admitted worker becomes: a CPU replica, its address as its host (peers reach it by TCP)."""
    return Member(address, "/job:localhost/replica:0/task:0/device:CPU:0", address)
