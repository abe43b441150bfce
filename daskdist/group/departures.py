"""How members leave an elastic group, on the scheduler: stalled members are fenced out, retired ones leave.

Two ways out besides a crash (which ``remove_worker`` sees):

* **Stalled.** A member's Dask worker that sends the scheduler no heartbeat
  for ``heartbeat_timeout`` seconds (its process stopped, its host cut off,
  its event loop frozen) is declared lost: the scheduler removes the worker
  (Dask's own ``worker-ttl`` is 5 minutes), which fences it out (its
  connections are closed; if it ever speaks again it is no worker of the
  cluster and its group generation is stale) and re-forms the group on the
  survivors, exactly as for a worker killed.
* **Retired.** ``client.retire_workers([...])`` or a worker's ``lifetime``
  (both reach the scheduler's ``retire_workers`` handler, which this module
  wraps) on a member of an elastic group first asks the group to stop at its
  next commit (``daskdist_leave``, read by the replicas at each commit); the
  client then re-forms the group without the member (``daskdist_graceful_leave``)
  with no rollback, and only then does Dask's retirement go on. A group that
  runs nothing (no commit comes) is re-formed by the scheduler at once; a leave
  not done within ``leave_timeout`` falls back to a loss (rollback to the last
  commit).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from distributed.scheduler import heartbeat_interval

from daskdist.group.group_state import GroupState

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["Departures", "GroupsOwner"]

logger = logging.getLogger(__name__)

#: How often the scheduler looks for stalled members (seconds).
_WATCH_INTERVAL = 0.25
#: How often a retirement looks whether its graceful leave is done (seconds).
_LEAVE_POLL = 0.05


class GroupsOwner(Protocol):
    """What departures need of the scheduler plugin that owns the groups (``DaskdistSchedulerPlugin``)."""

    groups: dict[str, GroupState]

    @property
    def running_scheduler(self) -> Scheduler:
        """The scheduler the plugin runs on."""

    def send_to_worker(self, address: str, msg: dict[str, Any]) -> None:
        """Send ``msg`` to the worker at ``address`` on its stream."""

    def change_membership(self, group_id: str, workers: list[str], reason: str = "", *,
                          admit: bool = False) -> Any:
        """Move ``group_id`` to a new generation whose members are on ``workers``."""


class Departures:
    """The scheduler plugin's part that fences stalled members out and turns retirements into graceful leaves.

    Parameters
    ----------
    plugin
        The daskdist scheduler plugin (its ``groups``, ``change_membership`` and scheduler).
    """

    def __init__(self, plugin: GroupsOwner):
        self.plugin = plugin
        self._watch: asyncio.Task[None] | None = None
        self._retire: Callable[..., Awaitable[dict[str, Any]]] | None = None
        # since when the scheduler's own event loop has kept time: after it was blocked, every worker's last
        # heartbeat looks old, so nobody is declared lost until it has been responsive for a whole deadline
        self.responsive_since = time.time()

    def start(self, scheduler: Scheduler) -> None:
        """Wrap the ``retire_workers`` handler and start watching members' heartbeats."""
        if self._retire is None:
            self._retire = scheduler.handlers["retire_workers"]
            scheduler.handlers["retire_workers"] = self.retire_workers
        scheduler.handlers["daskdist_graceful_leave"] = self.graceful_leave
        if self._watch is None:
            self._watch = asyncio.ensure_future(self._watch_heartbeats())

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    # -- stalled members ---------------------------------------------------------------

    def stalled(self, now: float | None = None) -> list[tuple[GroupState, str, float]]:
        """``(group, worker, seconds silent)`` for every member of an elastic group silent past its deadline."""
        scheduler = self.plugin.running_scheduler
        now = time.time() if now is None else now
        # never stricter than Dask itself: ten of the heartbeats the scheduler asks for (5 s with <= 10 workers)
        floor = 10 * heartbeat_interval(len(scheduler.workers))
        out = []
        for group in self.plugin.groups.values():
            if group.policy != "elastic" or group.heartbeat_timeout <= 0 or group.status not in ("starting",
                                                                                                 "running"):
                continue
            deadline = max(group.heartbeat_timeout, floor)
            if now - self.responsive_since < deadline:
                continue
            for address in group.workers:
                ws = scheduler.workers.get(address)
                if ws is not None and now - ws.last_seen > deadline:
                    out.append((group, address, now - ws.last_seen))
        return out

    async def _watch_heartbeats(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(_WATCH_INTERVAL)
            if time.monotonic() - before > _WATCH_INTERVAL + 1.0:  # the scheduler itself was blocked
                self.responsive_since = time.time()
            try:
                for group, address, silent in self.stalled():
                    await self._fence_out(group, address, silent)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the watch must outlive one bad round
                logger.exception("daskdist's heartbeat watch failed: %s", e)

    async def _fence_out(self, group: GroupState, address: str, silent: float) -> None:
        scheduler = self.plugin.running_scheduler
        if address not in scheduler.workers:
            return
        logger.warning("Worker %s, a member of the elastic group %s, sent no heartbeat for %.1f s (deadline %g s): "
                       "declared lost and removed from the cluster", address, group.group_id, silent,
                       group.heartbeat_timeout)
        scheduler.log_event("daskdist", {"action": "stalled", "group": group.group_id, "worker": address,
                                         "silent": silent, "deadline": group.heartbeat_timeout})
        # removing the worker closes its connections (fenced: what it sends later reaches no one) and calls the
        # plugin's remove_worker, which aborts the survivors' run and re-forms the group
        await scheduler.remove_worker(address, stimulus_id=f"daskdist-stalled-{time.time()}", close=True)

    # -- graceful leave ------------------------------------------------------------------

    async def retire_workers(self, workers: list[str] | None = None, *, names: list[Any] | None = None,
                             **kwargs: Any) -> dict[str, Any]:
        """Dask's ``retire_workers`` handler, after members of elastic groups among ``workers`` have left them."""
        assert self._retire is not None
        scheduler = self.plugin.running_scheduler
        if workers is not None:
            leaving = [w for w in workers if w in scheduler.workers]
        elif names is not None:
            wanted = {str(n) for n in names}
            leaving = [a for a, ws in scheduler.workers.items() if str(ws.name) in wanted]
        else:
            leaving = []  # workers_to_close: members are protected by valid_workers_downscaling
        if leaving:
            try:
                await self.leave(leaving)
            except Exception as e:  # never stop a retirement: at worst it is a loss
                logger.exception("Graceful leave of %s failed (%s): the retirement goes on as a loss", leaving, e)
        return await self._retire(workers=workers, names=names, **kwargs)

    async def leave(self, addresses: list[str]) -> None:
        """Take ``addresses`` out of every elastic group they are members of, at a commit; wait until done."""
        groups = [g for g in self.plugin.groups.values()
                  if g.policy == "elastic" and g.status in ("starting", "running") and g.membership is not None
                  and set(addresses) & set(g.workers)]
        for group in groups:
            ours = [a for a in addresses if a in group.workers]
            if len(ours) == len(group.workers):
                continue  # nobody would be left: Dask's retirement ends the group as a loss
            group.leaving.update(ours)
            logger.info("Members %s of %s are retiring: the group leaves them at its next commit", ours,
                        group.group_id)
            self.plugin.running_scheduler.log_event("daskdist", {"action": "leaving", "group": group.group_id,
                                                                 "workers": ours, "generation": group.generation})
            for address in group.workers:
                self.plugin.send_to_worker(address, {"op": "daskdist_leave", "group_id": group.group_id, "workers": ours})
        for group in groups:
            await self._wait_left(group)

    async def _wait_left(self, group: GroupState) -> None:
        deadline = time.monotonic() + group.leave_timeout
        idle_since: float | None = None
        while group.leaving & set(group.workers) and group.status in ("starting", "running"):
            if time.monotonic() >= deadline:
                logger.warning("%s did not leave %s within %g s: the retirement goes on, as a loss",
                               sorted(group.leaving), group.group_id, group.leave_timeout)
                return
            # nothing runs (no command, so no commit will come): the scheduler re-forms the group itself
            if await self._idle(group):
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= 0.5:
                    self.graceful_leave(group.group_id, reason="idle")
                    return
            else:
                idle_since = None
            await asyncio.sleep(_LEAVE_POLL)

    async def _idle(self, group: GroupState) -> bool:
        """Whether no member of ``group`` is running a command (each asked for its replica's state)."""
        scheduler = self.plugin.running_scheduler
        try:
            states = await asyncio.gather(*(
                scheduler.rpc(address).daskdist_status(group_id=group.group_id, rank=rank)
                for rank, address in enumerate(group.workers)))
        except Exception:
            return False
        return all(s is not None and s.get("state") in ("idle", "closed") for s in states)

    def graceful_leave(self, group_id: str, reason: str = "") -> dict[str, Any]:
        """Re-form ``group_id`` without its retiring members (the client asks at the commit the group stopped at).

        Answers ``{"status": "OK", "left": [...], "membership": ...}`` (``left`` empty when no member is retiring;
        ``membership``: the group's membership after it, ``Membership.to_msg``, so that the client needs no second
        call to learn it).
        """
        group = self.plugin.groups.get(group_id)
        if group is None:
            return {"status": "error", "message": f"unknown replica group {group_id}"}
        left = [a for a in group.workers if a in group.leaving]
        group.leaving.clear()
        if not left:
            return self._left(group, [])
        survivors = [a for a in group.workers if a not in left]
        group.retired.update(left)
        why = f"{', '.join(left)} retired: left {group_id} at a commit" + (f" ({reason})" if reason else "")
        try:
            self.plugin.change_membership(group_id, survivors, why)
        except ValueError as e:
            return {"status": "error", "message": str(e)}
        self.plugin.running_scheduler.log_event("daskdist", {"action": "left", "group": group_id, "workers": left,
                                                             "generation": group.generation})
        return self._left(group, left)

    @staticmethod
    def _left(group: Any, left: list[str]) -> dict[str, Any]:
        answer: dict[str, Any] = {"status": "OK", "left": left}
        if group.membership is not None:
            answer["membership"] = group.membership.to_msg()
        return answer
