"""The client's handle on a replica group: launch, send commands, gather answers, close.

Launching submits one long-lived task per chosen worker (pinned, all at
once) and waits at the scheduler plugin until every replica has met. After
that, every command goes straight from the client to the replicas' workers
through the client's connection pool; the scheduler is not involved. Every
command carries the group's membership generation as the client knows it
(``membership``); replicas of a newer generation reject it with
``StaleGenerationError``. ``refresh_membership`` learns the scheduler's
current generation and tells the ``on_membership`` callbacks.

This is client code: it imports no worker-side module. The replica task is
the strategy's (``replica_task``: ``daskdist.replica.launch.run_replica``,
which imports the runtime on the worker).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from distributed import Client, Future
from distributed.comm.core import CommClosedError

from daskdist import config, serialization
from daskdist.cluster.client_state import check_client_open, client_is_closed
from daskdist.cluster.identity import scheduler_workers
from daskdist.cluster.interrupts import abort_interrupted_run
from daskdist.cluster.placement import Placement
from daskdist.collective.core.engines.nccl.support import parse_setting as parse_nccl_setting
from daskdist.collective.core.settings import parse_single_copy_bytes
from daskdist.exceptions import RendezvousError, ReplicaLostError, StrategyClosedError
from daskdist.group.announcements import announcements_of
from daskdist.group.channel import WAIT_ENDING_KINDS, CommandChannels, client_ssl_context
from daskdist.group.membership import GroupId, Member, Membership, MembershipPolicy, SchedulerView
from daskdist.group.scheduler_plugin import EVENT_TOPIC, DaskdistSchedulerPlugin
from daskdist.group.service import restore_residents, snapshot_residents
from daskdist.group.spec import GroupSpec

__all__ = ["ReplicaGroup", "ReplicaTask"]

logger = logging.getLogger(__name__)

#: The long-lived task each member's worker runs: ``task(spec, rank)`` (``daskdist.replica.launch.run_replica``).
ReplicaTask = Callable[[GroupSpec, int], str]

#: When several replicas fail, the error the client raises is the first kind in this order.
_ERROR_PRIORITY = ("lost", "stale", "user", "mismatch", "timeout", "aborted")


class ReplicaGroup:
    """Replicas of one strategy on a Dask cluster.

    Parameters
    ----------
    client
        A synchronous ``distributed.Client`` connected to the cluster.
    placements
        Rank -> worker, from ``place_replicas``.
    replica_task
        The task started pinned on each member's worker, ``replica_task(spec, rank)``:
        ``daskdist.replica.launch.run_replica`` (it imports the replica runtime there).
    strategy_token
        The identity of the owning strategy (what its handles pickle); a new one if not given.
    hosts
        The host of each replica as transports see it (default: the placements' hosts).
    policy
        What a membership change does (``daskdist.group.membership-policy`` by default).
    spec_options
        Extra ``GroupSpec`` fields (algorithm, options, transport); ``nccl``
        defaults to ``daskdist.collective.nccl`` as read here. The spec also
        carries a snapshot of every ``daskdist.*`` key as read here: the only
        settings the replicas use.
    """

    def __init__(self, client: Client, placements: list[Placement], replica_task: ReplicaTask,
                 strategy_token: str | None = None, hosts: list[str] | None = None,
                 policy: MembershipPolicy | None = None, **spec_options: Any):
        if getattr(client, "asynchronous", False):
            raise TypeError("daskdist strategies need a synchronous Client (asynchronous=False)")
        self.client = client
        self.placements = placements
        self.replica_task = replica_task
        self.group_id = GroupId(f"daskdist-{uuid.uuid4().hex[:12]}")
        self.strategy_token = strategy_token or f"strategy-{uuid.uuid4().hex[:12]}"
        spec_options.setdefault("nccl", config.get("collective.nccl", "auto"))
        parse_nccl_setting(spec_options["nccl"])  # a bad value fails here, not on the workers
        spec_options.setdefault("single_copy_bytes",
                                parse_single_copy_bytes(config.get("collective.shm.single-copy-bytes")))
        policy = policy or config.get("group.membership-policy", "fixed")
        if policy not in ("fixed", "elastic"):
            raise ValueError(f"daskdist.group.membership-policy must be 'fixed' or 'elastic', got {policy!r}")
        hosts = hosts or [p.host for p in placements]
        members = tuple(Member(p.address, p.device.to_string(), h) for p, h in zip(placements, hosts))
        self.membership = Membership(self.group_id, 0, members)  # type: ignore[arg-type]
        self.spec = GroupSpec(
            membership=self.membership,
            strategy_token=self.strategy_token,
            policy=policy,
            config=config.snapshot(),
            secret=uuid.uuid4().hex,
            **spec_options,
        )
        self._channels: CommandChannels | None = None
        self._command_infos: dict[str, Any] | None = None  # where the replicas' command servers listen
        self._sent_settings = self.spec.config  # what the replicas read (a command carries a newer one)
        self._membership_callbacks: list[Callable[[Membership], None]] = []
        self.futures: list[Future[Any]] = []
        #: The worker of each of ``futures`` (a member's rank changes with generations; its task does not).
        self.task_workers: list[str] = []
        self.failure: BaseException | None = None
        self.closed = False
        self._run_ids = itertools.count(1)
        self._lock = threading.Lock()
        #: Runs that failed so far (or whose collectives a replica aborted): sent with every run, it is the
        #: replicas' process-group attempt, so they all renumber their collectives (and re-make NCCL) together
        #: after a failure (``ProcessGroup.start_command``).
        self.failed_runs = 0

    @property
    def size(self) -> int:
        return self.membership.size

    @property
    def addresses(self) -> list[str]:
        return self.membership.addresses

    @property
    def generation(self) -> int:
        return self.membership.generation

    @property
    def command_path(self) -> str:
        """How ``call`` reaches the replicas: ``"direct"`` (the command channel) or ``"dask"`` (Dask RPC)."""
        return "direct" if self._channels is not None and self._channels.has(self.addresses) else "dask"

    def _loop(self) -> asyncio.AbstractEventLoop:
        """The client's event loop."""
        loop: asyncio.AbstractEventLoop = self.client.loop.asyncio_loop  # type: ignore[union-attr]
        return loop

    def _sync(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``Client.sync`` (untyped in distributed): run a coroutine function on the client's loop, wait here."""
        return self.client.sync(fn, *args, **kwargs)  # type: ignore[no-untyped-call]

    def _ask_scheduler(self, handler: str, **kwargs: Any) -> dict[str, Any]:
        """Call the scheduler plugin's ``handler`` and return its answer."""
        scheduler: Any = self.client.scheduler
        answer: dict[str, Any] = self._sync(getattr(scheduler, handler), **kwargs)
        return answer

    # -- membership ----------------------------------------------------------------

    def on_membership(self, callback: Callable[[Membership], None]) -> None:
        """Call ``callback(membership)`` whenever ``refresh_membership`` finds a new generation."""
        self._membership_callbacks.append(callback)

    def refresh_membership(self) -> Membership:
        """Learn the group's current membership from the scheduler plugin; later commands carry its generation.

        Raises
        ------
        StrategyClosedError
            The scheduler no longer knows the group (closed, or failed and forgotten).
        """
        response = self._ask_scheduler("daskdist_membership", group_id=self.group_id)
        if response.get("status") != "OK":
            raise StrategyClosedError(response.get("message", f"replica group {self.group_id} is gone"))
        return self._take_membership(response["membership"])

    def _take_membership(self, msg: dict[str, Any]) -> Membership:
        """The scheduler's membership ``msg`` (``Membership.to_msg``): kept when of a newer generation."""
        membership = Membership.from_msg(msg)
        if membership.generation > self.membership.generation:
            logger.info("Replica group %s is now at generation %d on %s", self.group_id, membership.generation,
                        membership.addresses)
            self.membership = membership
            for callback in list(self._membership_callbacks):
                callback(membership)
        return self.membership

    def scheduler_view(self) -> SchedulerView:
        """What the scheduler plugin knows of the group now: its membership and the members that retired.

        Unlike ``refresh_membership`` this changes nothing on the client.

        Raises
        ------
        StrategyClosedError
            The scheduler no longer knows the group.
        """
        response = self._ask_scheduler("daskdist_membership", group_id=self.group_id)
        if response.get("status") != "OK":
            raise StrategyClosedError(response.get("message", f"replica group {self.group_id} is gone"))
        return SchedulerView(Membership.from_msg(response["membership"]), frozenset(response.get("retired", ())))

    def wait_for_generation(self, after: int, timeout: float, recheck: float = 1.0) -> Membership | None:
        """Wait until the scheduler has the group past generation ``after``; its membership, ``None`` at ``timeout``.

        Woken by the scheduler plugin's announcement of the new generation
        (``daskdist.group.announcements``), not by polling; ``recheck``
        seconds bound the wait should an announcement be missed.
        """
        announcements = announcements_of(self.client, EVENT_TOPIC)
        deadline = time.monotonic() + timeout
        while True:
            membership = self.refresh_membership()
            if membership.generation > after:
                return membership
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            announcements.wait(self.group_id, after, min(remaining, recheck))

    def cluster_changes(self) -> int:
        """How many changes (generations, groups ended, workers joining or leaving) this client heard so far."""
        return announcements_of(self.client, EVENT_TOPIC).version

    def wait_for_cluster_change(self, seen: int, timeout: float) -> int:
        """Wait up to ``timeout`` s for a change after ``seen`` (``cluster_changes``); the count now."""
        return announcements_of(self.client, EVENT_TOPIC).wait_past(seen, timeout)

    def admit(self, newcomers: Sequence[str], reason: str = "") -> Membership:
        """Add the workers ``newcomers`` in a new generation and start a replica on each; the new membership.

        Returns once every newcomer's replica runs (it meets the others at the
        group's first command of the new generation).

        Raises
        ------
        ReplicaLostError
            The scheduler refused the change, a newcomer left the cluster
            before its replica started (``worker`` names it), or the replicas
            did not start within 60 s.
        """
        workers = list(self.addresses) + list(newcomers)
        response = self._ask_scheduler("daskdist_change_membership", group_id=self.group_id, workers=workers,
                                       reason=reason or f"admitting {', '.join(newcomers)}", admit=True)
        if response.get("status") != "OK":
            raise ReplicaLostError(f"could not admit {list(newcomers)}: {response.get('message')}")
        membership = self.refresh_membership()
        spec = dataclasses.replace(self.spec, membership=membership)
        for address in newcomers:
            rank = membership.rank_of(address)
            self.task_workers.append(address)
            self.futures.append(self.client.submit(
                self.replica_task, spec, rank, key=f"{self.group_id}-replica-g{membership.generation}-{rank}",
                workers=[address], allow_other_workers=False, pure=False))
        deadline = time.monotonic() + 60
        while not all(self._hosts_replica(a) for a in newcomers):
            present = scheduler_workers(self.client)
            gone = [a for a in newcomers if a not in present]
            if gone:  # lost while starting: a loss like any other (the scheduler re-forms the group without it)
                raise ReplicaLostError(f"the worker {gone[0]} admitted into {self.group_id} left the cluster "
                                       "before its replica started", worker=gone[0])
            if time.monotonic() >= deadline:
                raise ReplicaLostError(f"the replicas admitted on {list(newcomers)} did not start within 60 s")
            time.sleep(0.1)
        logger.info("Admitted %s into %s (generation %d)", list(newcomers), self.group_id, membership.generation)
        return membership

    def let_retiring_leave(self) -> Membership:
        """Re-form the group without the members asked to retire (``retire_workers``); the new membership.

        A group with none retiring keeps its generation.

        Raises
        ------
        ReplicaLostError
            The scheduler refused the change.
        """
        response = self._ask_scheduler("daskdist_graceful_leave", group_id=self.group_id)
        if response.get("status") != "OK":
            raise ReplicaLostError(f"could not let members retire from {self.group_id}: {response.get('message')}")
        if "membership" in response:  # the membership after it came with the answer (else: asked for)
            return self._take_membership(response["membership"])
        return self.refresh_membership()

    def _hosts_replica(self, address: str) -> bool:
        """Whether the worker at ``address`` runs a replica of this group (its worker plugin knows it)."""
        group_id = self.group_id

        def check(dask_worker: Any) -> bool:
            extension = dask_worker.extensions.get("daskdist")
            return extension is not None and group_id in extension.replicas

        try:
            return bool(self.client.run(check, workers=[address]).get(address))
        except Exception:
            return False

    # -- lifecycle ---------------------------------------------------------------

    def launch(self) -> None:
        """Install the plugins, start one replica task per worker, and wait for the rendezvous."""
        self.client.register_plugin(DaskdistSchedulerPlugin(), name="daskdist")
        if self.spec.policy == "elastic":  # listen for its generations from the start (wait_for_generation)
            announcements_of(self.client, EVENT_TOPIC)
        response = self._ask_scheduler("daskdist_register_group", group_id=self.group_id,
            workers=self.addresses,
            client=self.client.id,
            membership=self.membership.to_msg(),
            policy=self.spec.policy,
            strategy_token=self.strategy_token,
            heartbeat_timeout=config.get_seconds("elastic.heartbeat-timeout"),
            leave_timeout=config.get_seconds("elastic.leave-timeout"),
        )
        if response.get("status") != "OK":
            raise ValueError(response.get("message"))
        for rank, address in enumerate(self.addresses):
            self.task_workers.append(address)
            self.futures.append(
                self.client.submit(
                    self.replica_task,
                    self.spec,
                    rank,
                    key=f"{self.group_id}-replica-{rank}",
                    workers=[address],
                    allow_other_workers=False,
                    pure=False,
                )
            )
        timeout = config.get_seconds("rendezvous.timeout")
        deadline = time.monotonic() + timeout
        while True:
            # wait at the scheduler in short slices, so a replica task that fails at start-up is seen at once
            slice_ = max(0.01, min(0.5, deadline - time.monotonic()))
            response = self._ask_scheduler("daskdist_wait_group", group_id=self.group_id, timeout=slice_, final=False
            )
            if response.get("status") == "OK":
                break
            failed = [(i, f) for i, f in enumerate(self.futures) if f.status == "error"]
            if failed:
                rank, future = failed[0]
                error = future.exception()  # type: ignore[no-untyped-call]  # before the release forgets it
                self._release()
                raise RendezvousError(f"replica {rank} failed to start on {self.addresses[rank]}: {error!r}") from error
            if response.get("status") == "failed" or time.monotonic() >= deadline:
                final = self._ask_scheduler("daskdist_wait_group", group_id=self.group_id, timeout=0.01, final=True
                )
                self._release()
                raise RendezvousError(final.get("message", "rendezvous failed"))
        infos = response.get("info", {})
        self._open_channels({address: (infos.get(str(rank)) or {}).get("command")
                             for rank, address in enumerate(self.addresses)})
        logger.debug("Replica group %s is up on %s", self.group_id, self.addresses)

    def _open_channels(self, endpoints: dict[str, Any]) -> None:
        """Connect the direct command channel to every replica (``daskdist.client.command-channel``).

        ``endpoints``: worker address -> where its replica's command server
        listens (from the rendezvous). Falls back to the workers' Dask RPC
        handler when the setting says ``dask`` or a replica's port cannot be
        reached from here.
        """
        if config.get("client.command-channel", "direct") != "direct":
            return
        self._command_infos = None  # set again once every replica is reached
        channels = CommandChannels(self.spec.secret, client_ssl_context(self.client))
        try:
            for address in self.addresses:
                endpoint = endpoints.get(address)
                if endpoint is None:
                    raise ConnectionError(f"the replica on {address} offers no command channel")
                channels.connect(address, tuple(endpoint))
        except (OSError, ConnectionError) as e:
            channels.close()
            logger.info("Commands to %s go through Dask RPC: the direct channel is unavailable (%s)", self.group_id, e)
            return
        self._channels = channels
        self._command_infos = endpoints

    def close(self, timeout: float = 30) -> None:
        """Stop every replica, wait for their tasks to end, and forget the group everywhere.

        Replicas whose worker has left the cluster are skipped: their task
        can never finish, and the scheduler forgets it when released. That
        includes workers that die while the others stop (a close right after
        a crash, before the scheduler has noticed it).
        """
        if self.closed:
            return
        self.closed = True
        if client_is_closed(self.client):  # the scheduler closed this client's replicas when the client left
            logger.info("Closing %s after its Dask client was closed: the scheduler already stopped its replicas",
                        self.group_id)
            self._channels_close()
            self.futures, self.task_workers = [], []
            return
        try:
            ranks = self._ranks_alive(range(self.size))
            self._sync(self._stop, ranks)
            deadline = time.monotonic() + timeout
            while ranks:
                try:
                    self._task_of(ranks[0]).result(timeout=min(0.5, max(0.1, deadline - time.monotonic())))
                    ranks.pop(0)
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise
                    ranks = self._ranks_alive(ranks)
        except Exception as e:  # the cluster may already be gone, or a replica is stuck in user code
            logger.warning("Replicas of %s did not all stop cleanly: %r", self.group_id, e)
        self._release()

    def _task_of(self, rank: int) -> Future[Any]:
        """The replica task of the member at ``rank`` in the current generation."""
        return self.futures[self.task_workers.index(self.addresses[rank])]

    def _ranks_alive(self, ranks: Any) -> list[int]:
        """Those of ``ranks`` whose worker is still in the cluster."""
        alive = set(scheduler_workers(self.client))
        return [r for r in ranks if self.addresses[r] in alive]

    def _channels_close(self) -> None:
        if self._channels is not None:
            self._channels.close()
            self._channels = None

    def _release(self) -> None:
        self._channels_close()
        try:
            self._ask_scheduler("daskdist_close_group", group_id=self.group_id)
        except Exception as e:
            logger.debug("Closing group %s at the scheduler: %s", self.group_id, e)
        for future in self.futures:
            future.release()  # type: ignore[no-untyped-call]
        self.futures = []
        self.task_workers = []

    async def _stop(self, ranks: list[int]) -> None:
        async def stop(rank: int) -> None:
            try:
                await asyncio.wait_for(
                    self.client.rpc(self.addresses[rank]).daskdist_stop(group_id=self.group_id, rank=rank), 10
                )
            except (OSError, CommClosedError, asyncio.TimeoutError) as e:
                logger.debug("Could not stop replica %d of %s: %r", rank, self.group_id, e)

        await asyncio.gather(*(stop(r) for r in ranks))

    # -- residents ---------------------------------------------------------------

    def snapshot_residents(self, kinds: tuple[str, ...] | None = None) -> list[dict[tuple[str, str], Any]]:
        """Every replica's resident state (variables, models with optimizer state, shards, iterators), by rank.

        Each entry maps ``(kind, id)`` to that resident's ``snapshot()``; the
        arrays are copies, so later steps do not change them.
        """
        return self.call(snapshot_residents, (kinds,))

    def restore_residents(self, states: list[dict[tuple[str, str], Any]] | dict[tuple[str, str], Any]) -> None:
        """Put back snapshots: one per replica (a list, by rank), or one for all (replica 0's, say).

        Raises
        ------
        KeyError
            A snapshot names a resident some replica does not hold; nothing is restored there.
        """
        if isinstance(states, dict):
            self.call(restore_residents, (states,))
        else:
            if len(states) != self.size:
                raise ValueError(f"restore_residents got {len(states)} snapshots for {self.size} replicas")
            self.call(restore_residents, [(s,) for s in states])

    # -- commands ----------------------------------------------------------------

    def call(self, command: Callable[..., Any], args_per_replica: Sequence[tuple[Any, ...]] | tuple[Any, ...] = (),
             ranks: Sequence[int] | None = None, *, role: str | None = None, member: int | None = None) -> list[Any]:
        """Run ``command(runtime, *args)`` on replicas; return their results in rank order.

        Calls are ordered: one at a time per group (the commands of one call
        reach every replica in the same order, which collectives need).

        Parameters
        ----------
        args_per_replica
            One argument tuple for all replicas, or a list with one tuple per replica (indexed by rank).
        ranks
            Only these replicas (default: all). Commands that use collectives
            must go to all.
        role
            Only the members with this role (``Member.role``).
        member
            Only this rank.

        Raises
        ------
        StrategyClosedError
            The group was closed or has failed.
        StaleGenerationError
            The replicas are at a newer membership generation than this handle
            (``refresh_membership``).
        Exception
            The root cause when replicas fail: a lost replica first, then the
            user's own exception, then mismatches, timeouts, aborts.
        """
        ranks = self._targets(ranks, role, member)
        if not ranks:
            return []
        with self._lock:  # one call at a time: every replica sees the calls in one order
            run_id, payloads, settings = self._prepare(command, args_per_replica, ranks)
            if self._channels is None and self._command_infos is not None:
                self._open_channels(self._command_infos)  # after an interrupt dropped them
            channels = self._channels
            targets = {r: self.addresses[r] for r in ranks}
            try:
                if channels is not None and channels.has(list(targets.values())):
                    responses = channels.call(targets, run_id, self.membership.generation, settings, payloads,
                                              config.get_seconds("client.abort-grace"))
                else:
                    responses = self._sync(self._call_all, run_id, payloads, self.membership.generation, settings)
            except BaseException as e:
                self.failed_runs += 1
                if not isinstance(e, Exception):  # Ctrl-C, SystemExit: the replicas must not go on without us
                    if channels is not None:  # a frame may be cut in half: the next call reconnects
                        channels.close()
                        self._channels = None
                    abort_interrupted_run(self.client, self.addresses, self.group_id, ranks, run_id, e,
                                          self.membership.generation)
                raise
            if _counts_as_failed(responses):
                self.failed_runs += 1
        return self._results(responses, ranks)

    def submit(self, command: Callable[..., Any], args_per_replica: Sequence[tuple[Any, ...]] | tuple[Any, ...] = (),
               ranks: Sequence[int] | None = None, *, role: str | None = None,
               member: int | None = None) -> concurrent.futures.Future[list[Any]]:
        """Start ``command(runtime, *args)`` on replicas without waiting; the future gives ``call``'s result.

        Several submitted commands (and a ``call``) may be in flight at once,
        to different members or the same ones: a parameter-server coordinator
        runs closures on many workers this way. They are not ordered against
        each other, so a submitted command must not use collectives. Targets
        as in ``call``.
        """
        ranks = self._targets(ranks, role, member)
        result: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        if not ranks:
            result.set_result([])
            return result
        with self._lock:  # only to number the run and snapshot the settings
            run_id, payloads, settings = self._prepare(command, args_per_replica, ranks)
        generation = self.membership.generation
        running = asyncio.run_coroutine_threadsafe(self._call_all(run_id, payloads, generation, settings),
                                                   self._loop())

        def done(finished: concurrent.futures.Future[dict[int, dict[str, Any] | None]]) -> None:
            try:
                responses = finished.result()
                if _counts_as_failed(responses):
                    with self._lock:
                        self.failed_runs += 1
                result.set_result(self._results(responses, ranks))
            except BaseException as e:
                result.set_exception(e)

        running.add_done_callback(done)
        return result

    def _targets(self, ranks: Sequence[int] | None, role: str | None, member: int | None) -> list[int]:
        """The ranks a command goes to; raises if the group cannot take commands."""
        if self.closed:
            raise StrategyClosedError("This strategy is closed; create a new one")
        check_client_open(self.client, "This strategy", _CLIENT_LEFT)
        if self.failure is not None:
            raise StrategyClosedError(
                f"This strategy's replica group failed and cannot run more work ({self.failure}); "
                "create a new strategy"
            ) from self.failure
        if sum(x is not None for x in (ranks, role, member)) > 1:
            raise TypeError("give at most one of ranks, role and member")
        if role is not None:
            return list(self.membership.ranks(role))
        if member is not None:
            if not 0 <= member < self.size:
                raise ValueError(f"member {member} is not a rank of this group (size {self.size})")
            return [member]
        return list(range(self.size)) if ranks is None else list(ranks)

    def _prepare(self, command: Callable[..., Any], args_per_replica: Sequence[tuple[Any, ...]] | tuple[Any, ...],
                 ranks: list[int]) -> tuple[int, dict[int, bytes], dict[str, Any] | None]:
        """Number a run and pickle its payloads (one shared payload when every replica gets the same arguments)."""
        failures = self.failed_runs  # the failure count in the payload must be the one this run starts with
        settings = self._settings_to_send()
        if isinstance(args_per_replica, tuple):
            shared = serialization.dumps((command, args_per_replica, failures))
            payloads = {r: shared for r in ranks}
        else:
            payloads = {r: serialization.dumps((command, tuple(args_per_replica[r]), failures)) for r in ranks}
        return next(self._run_ids), payloads, settings

    def _settings_to_send(self) -> dict[str, Any] | None:
        """A new snapshot of the client's ``daskdist.*`` keys if they changed since the replicas got one, else ``None``."""
        if config.live_settings() == self._sent_settings["daskdist"]:
            return None
        self._sent_settings = config.snapshot()
        return self._sent_settings

    async def _call_all(self, run_id: int, payloads: dict[int, bytes], generation: int,
                        settings: dict[str, Any] | None) -> dict[int, dict[str, Any] | None]:
        tasks = {asyncio.ensure_future(self._call_one(rank, run_id, payload, generation, settings)): rank
                 for rank, payload in payloads.items()}
        responses: dict[int, dict[str, Any] | None] = {rank: None for rank in payloads}
        pending = set(tasks)
        failed = lost = False
        while pending and not failed:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                response = responses[tasks[task]] = task.result()
                failed |= response.get("status") != "OK"
                lost |= response.get("kind") in WAIT_ENDING_KINDS
        if pending and not lost:  # a replica failed: give the others a bounded time to report why (not after a
            # loss or a new generation: the members still silent may be gone, cut off with no FIN or RST)
            done, pending = await asyncio.wait(pending, timeout=config.get_seconds("client.abort-grace"))
            for task in done:
                responses[tasks[task]] = task.result()
        for task in pending:  # a lost group is dead: nothing the others say changes the outcome
            task.cancel()
        return responses

    async def _call_one(self, rank: int, run_id: int, payload: bytes, generation: int, settings: dict[str, Any] | None) -> dict[str, Any]:
        address = self.addresses[rank]
        try:
            response: dict[str, Any] = await self.client.rpc(address).daskdist_call(
                group_id=self.group_id, generation=generation, rank=rank, run_id=run_id, payload=payload,
                settings=settings,
            )
            return response
        except (OSError, CommClosedError) as e:
            error = ReplicaLostError(
                f"replica {rank} was lost: the connection to its worker {address} failed ({e})", worker=address
            )
            return serialization.error_message(error, rank, address)

    def _results(self, responses: dict[int, dict[str, Any] | None], ranks: list[int]) -> list[Any]:
        errors = [r for r in responses.values() if r is not None and r.get("status") != "OK"]
        if not errors:
            return [serialization.loads(_answer(responses, r)["result"]) for r in ranks]
        errors.sort(key=lambda m: _ERROR_PRIORITY.index(m["kind"]) if m["kind"] in _ERROR_PRIORITY else 99)
        root = errors[0]
        error = serialization.exception_from_message(root)
        silent = [r for r, m in responses.items() if m is None]
        if silent:
            serialization.add_note(
                error,
                f"replicas {silent} did not answer within daskdist.client.abort-grace after the failure "
                "(still busy in user code?)"
            )
        if root["kind"] == "lost" and client_is_closed(self.client):  # not a lost worker: the client left
            check_client_open(self.client, "This strategy", _CLIENT_LEFT)
        if root["kind"] == "lost" and self.spec.policy == "fixed":
            self.failure = error
        raise error


_CLIENT_LEFT = " and a new strategy on it (the scheduler stopped this strategy's replicas when its client left)"


def _answer(responses: dict[int, dict[str, Any] | None], rank: int) -> dict[str, Any]:
    """Replica ``rank``'s answer, known to be there."""
    response = responses[rank]
    if response is None:
        raise RuntimeError(f"replica {rank} gave no answer")  # not reached: only called when every replica answered
    return response


def _counts_as_failed(responses: dict[int, dict[str, Any] | None]) -> bool:
    """Whether a run starts a new attempt of the replicas' process group: a replica failed, or aborted its
    collectives (a collective error the user's function caught still leaves that attempt aborted)."""
    return any(r is None or r.get("status") != "OK" or r.get("attempt_aborted") for r in responses.values())
