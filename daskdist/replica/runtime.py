"""The replica runtime: one long-lived thread per replica that runs what the client sends.

``replica_main`` is the body of the replica task the strategy pins to each
chosen worker. It secedes from the worker's thread pool (so the worker can
still compute data tasks), registers with the worker's daskdist extension,
meets its peers at the scheduler's rendezvous, then serves commands until the
strategy closes it. Commands arrive from the client through the worker's
``daskdist_call`` handler, never as Dask tasks, so a step costs a message,
not a scheduler round trip.

``ReplicaRuntime`` keeps the command loop and the control plane, and
implements ``daskdist.group.service.ReplicaService`` for what commands use
(rank, size, generation, context, timer, events, the resident store). What
knows the peers is one generation's ``Wiring`` (``replica/wiring.py``) with
its ``ProcessGroup``, rebuilt when the group moves to a new generation; the
residents stay. A client command is a fence of the process group, not a
renumbering: its collectives go on numbering from the last command's, and a
new attempt (numbering from zero) starts only after a command failed
(the client sends its count of failed commands with every command). The
replica thread reads settings only from the client's snapshot carried by the
spec (``daskdist.config.use_snapshot``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import optree
from distributed import get_worker, secede
from distributed.comm.addressing import get_address_host
from distributed.utils import sync

from daskdist import config, context, serialization
from daskdist.arrays import namespace
from daskdist.collective.core.engines.nccl.engine import engine_for_group
from daskdist.collective.core.engines.nccl.support import local_features, parse_setting
from daskdist.collective.mailbox import Abort, Mailbox, MailboxTimeout
from daskdist.collective.process_group import ProcessGroup
from daskdist.exceptions import RendezvousError, ReplicaLostError, StaleGenerationError
from daskdist.group.membership import Generation, Membership, Rank, check_generation
from daskdist.group.service import BATCH, VARIABLE, ResidentStore
from daskdist.group.spec import GroupSpec
from daskdist.replica import allocator
from daskdist.replica.command_server import CommandServer
from daskdist.replica.context import ReplicaContext
from daskdist.replica.events import StepEventShipper
from daskdist.replica.strategy_view import ReplicaStrategyView
from daskdist.replica.timing import StepTimer
from daskdist.replica.wiring import Wiring, wire
from daskdist.variables.distributed import VariableSpec, check_same_spec_on_every_replica, distributed_variable_class
from daskdist.wire.tls import worker_contexts

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["ReplicaRuntime", "pin_replica_thread", "replica_main"]

logger = logging.getLogger(__name__)

_NO_COMMAND = object()  # serve(): the command queue was empty

STALL_EVENT_TOPIC = "daskdist-stall"


class ReplicaRuntime:
    """Command loop and control plane of one replica; implements ``ReplicaService``.

    Event-loop side: ``submit``, ``deliver``, ``abort_run``, ``abort_group``,
    ``new_generation``, ``stop``, ``status`` (called by the worker plugin's
    handlers). Replica-thread side: ``serve`` and everything it calls.
    """

    def __init__(self, worker: Worker, spec: GroupSpec, rank: int):
        self.worker = worker
        self.spec = spec
        self.group_id = spec.group_id
        self.strategy_token = spec.strategy_token
        self.membership: Membership = spec.membership
        self.generation: Generation = spec.membership.generation
        self.rank: Rank = Rank(rank)
        self.size = spec.membership.size
        self.devices = spec.membership.devices
        self.loop: asyncio.AbstractEventLoop = worker.loop.asyncio_loop  # type: ignore[attr-defined]
        self.objects = ResidentStore(f"replica {rank} of {spec.group_id}")
        self.timer = StepTimer(rank, int(config.get("metrics.history")))
        self._wiring: Wiring = self._wire(spec.membership, rank)
        self._server: CommandServer | None = None
        if config.get("client.command-channel", "direct") == "direct":
            self._server = CommandServer(get_address_host(worker.address), spec.secret, worker_contexts(worker)[0])
        self.context = ReplicaContext(self)
        self.context.bind(self._wiring.group)
        self.strategy_view = ReplicaStrategyView(self)
        self.state = "starting"
        self.run_id = -1
        self._commands: queue.Queue[tuple[int, bytes, int, dict[str, Any] | None, asyncio.Future[Any]] | None] = queue.Queue()
        self._announced: Membership | None = None  # a newer generation the scheduler told us of
        self._early: dict[int, list[tuple[tuple[Any, ...], Any]]] = {}  # peers' messages of a generation not yet wired
        self._aborted_runs: dict[int, Abort] = {}  # client commands the client aborted (an interrupt), newest last
        self._generation_lock = threading.Lock()
        self._stopping = False  # the strategy is closing: connections ending now are expected
        self._created_in_replica = 0
        self._close_callbacks: list[Callable[[], None]] = []  # add_close_callback: called by close(), newest first
        # the dashboard's unit is the strategy (its token), so a training run's figures outlive generations
        self._step_events = (StepEventShipper(worker, self.strategy_token, rank, self.size,
                                              config.get_seconds("metrics.event-interval"),
                                              int(config.get("metrics.event-max-steps", 256)))
                             if config.get("metrics.log-events") else None)

    def __repr__(self) -> str:
        return (f"<ReplicaRuntime {self.group_id} generation={self.generation} rank={self.rank}/{self.size} "
                f"state={self.state}>")

    # -- the service protocol ---------------------------------------------------------

    @property
    def token(self) -> str:
        """The strategy's identity: what pickled handles carry (not the group id, so it outlives generations)."""
        return self.strategy_token

    @property
    def mailbox(self) -> Mailbox:
        return self._wiring.mailbox

    @property
    def transport(self) -> Any:
        return self._wiring.transport

    @property
    def communicator(self) -> Any:
        return self._wiring.communicator

    @property
    def process_group(self) -> ProcessGroup:
        """This generation's root process group (``ReplicaContext.process_group``)."""
        return self._wiring.group

    @property
    def known_generation(self) -> int:
        """The newest generation this replica knows of: its own, or one the scheduler announced."""
        announced = self._announced
        return max(self.generation, announced.generation if announced is not None else 0)

    def log_event(self, topic: str, msg: Any) -> None:
        self.worker.log_event(topic, msg)

    def add_close_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when this replica closes (its strategy closed, or its worker left the group).

        For what a framework adapter makes per replica that must not outlive it
        (the torch plug-in's default process group). Callbacks run in the
        replica thread, newest first, before the generation's wiring closes; one
        that raises is logged and the others still run.
        """
        self._close_callbacks.append(callback)

    # -- event-loop side ---------------------------------------------------------

    def submit(self, run_id: int, payload: bytes, generation: int = 0, settings: dict[str, Any] | None = None) -> asyncio.Future[Any]:
        """Queue a command of ``generation`` (with the client's new settings, if they changed); the future
        resolves with the response message."""
        future = self.loop.create_future()
        if self.state == "closed":
            future.set_result(self._closed_response())
        else:
            self._commands.put((run_id, payload, generation, settings, future))
            if self._server is not None:
                self._server.wake()
        return future

    def deliver(self, generation: int, tag: tuple[Any, ...], payload: Any) -> None:
        """A peer's payload (Dask comms): into this generation's mailbox; kept for a newer one; dropped if stale."""
        with self._generation_lock:
            if generation == self.generation:
                self._wiring.mailbox.put(tag, payload)
            elif generation > self.generation:
                self._early.setdefault(generation, []).append((tag, payload))
            else:
                logger.debug("Replica %d of %s dropped a message %s of stale generation %d (now %d)",
                             self.rank, self.group_id, tag, generation, self.generation)

    def abort_run(self, generation: int, run_id: int | None, abort: dict[str, Any], attempt: int | None = None) -> None:
        """An abort for ``generation`` (not if stale): of a peer's attempt, of a client command, or of the generation.

        ``attempt`` given: a peer's collective failed in that attempt of the
        process group; this replica's waits in it fail. Else ``run_id``: the
        client aborted that command (an interrupt); its collectives fail,
        now or when it starts. ``run_id=None``: a peer's transport lost
        another replica (``peer_lost``): the generation is lost.
        """
        if generation != self.generation:
            return
        if attempt is not None:
            self.mailbox.abort_attempt(attempt, Abort.from_msg(abort))
        elif run_id is None:
            self.abort_group(str(abort.get("message", "a peer was lost")), generation)
        else:
            self._aborted_runs[run_id] = Abort.from_msg(abort)
            while len(self._aborted_runs) > 64:
                del self._aborted_runs[min(self._aborted_runs)]
            if run_id == self.run_id and self.state == "running":
                self.mailbox.abort_attempt(self.communicator.attempt, Abort.from_msg(abort))

    def peer_lost(self, peer: int | None, message: str) -> None:
        """A transport lost ``peer`` for good (no heartbeat, or reset): fail the generation here and on every peer.

        Called from a transport thread. This replica's waits raise
        ``ReplicaLostError`` at once; the other replicas get a group abort
        (those that cannot be reached learn it from their own heartbeats).
        """
        wiring = self._wiring
        if wiring.mailbox.group_abort is not None or self._stopping:
            return
        logger.warning("%s", message)
        abort = Abort("lost", message, self.rank)
        wiring.mailbox.abort_group(abort)
        self.loop.call_soon_threadsafe(wiring.transport.group_aborted)
        for rank, address in enumerate(wiring.membership.addresses):
            if rank != self.rank and rank != peer:
                asyncio.run_coroutine_threadsafe(self._send_abort(address, rank, None, abort), self.loop)

    def abort_group(self, message: str, generation: int | None = None) -> None:
        """The group is lost in ``generation`` (``None``: the current one): wake and fail every wait."""
        if generation is not None and generation != self.generation:
            return
        wiring = self._wiring
        wiring.mailbox.abort_group(Abort("lost", message, None))
        wiring.transport.group_aborted()

    def new_generation(self, membership: Membership) -> None:
        """The scheduler moved the group on: the current generation's waits fail; the next command re-forms."""
        if membership.generation <= self.generation:
            return
        self._announced = membership
        self.abort_group(f"{self.group_id} moved to generation {membership.generation}", self.generation)

    def stop(self) -> None:
        """Ask the replica thread to finish after the commands already queued."""
        self._stopping = True
        self._commands.put(None)
        if self._server is not None:
            self._server.wake()

    def status(self) -> dict[str, Any]:
        """Where this replica is, for peers' probes (``collective.stall``).

        The state is read first: a replica seen idle has finished its
        command, so the numbers read after it are final for that command.
        """
        state = self.state
        wiring = self._wiring
        communicator = wiring.communicator
        return {
            "state": state,
            "attempt": communicator.attempt,
            "run_id": self.run_id,
            "collective": communicator.seq,
            "groups": wiring.group.collective_numbers(),
            "kind": communicator.current_kind,
            "generation": self.generation,
        }

    # -- control plane used by the communicator (replica thread) ---------------

    def abort_peers(self, attempt: int, abort: Abort) -> None:
        for rank, address in enumerate(self.membership.addresses):
            if rank != self.rank:
                asyncio.run_coroutine_threadsafe(self._send_abort(address, rank, self.run_id, abort, attempt),
                                                 self.loop)

    async def _send_abort(self, address: str, rank: int, run_id: int | None, abort: Abort,
                          attempt: int | None = None) -> None:
        """Send ``abort`` of ``attempt`` (``None``: for good, the whole generation) to replica ``rank``."""
        try:
            await self.worker.rpc(address).daskdist_abort(
                group_id=self.group_id, generation=self.generation, rank=rank, run_id=run_id, abort=abort.to_msg(),
                attempt=attempt, reply=False,
            )
        except Exception as e:  # the peer may be gone; the scheduler tells the others
            logger.debug("Could not send abort to replica %d on %s: %s", rank, address, e)

    def probe(self, rank: int, timeout: float) -> dict[str, Any] | None:
        address = self.membership.addresses[rank]
        coro = self.worker.rpc(address).daskdist_status(group_id=self.group_id, rank=rank)
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            status: dict[str, Any] | None = future.result(timeout)
            return status
        except Exception:
            future.cancel()
            return None

    def exchange(self, key: str, value: Any, deadline: float, attempt: int) -> dict[int, Any]:
        """Meet every replica at the scheduler under ``key`` (after the rendezvous); ``{rank: value}`` back.

        Polls in slices of at most 0.5 s, checking this attempt's and the group's
        aborts between them. Values travel as msgpack (tuples come back as lists).

        Raises
        ------
        MailboxTimeout
            ``deadline`` (monotonic) passed before every replica came.
        ReplicaLostError
            The scheduler has failed or closed the group.
        """
        while True:
            self.mailbox.check(attempt)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MailboxTimeout(key)
            wait = min(0.5, remaining)
            response = sync(self.worker.loop, self.worker.scheduler.daskdist_exchange, group_id=self.group_id,
                            key=key, rank=self.rank, value=value, timeout=wait, generation=self.generation,
                            callback_timeout=wait + 30)
            status = response.get("status")
            if status == "OK":
                return {int(rank): v for rank, v in response["values"].items()}
            if status != "waiting":
                self.mailbox.check(attempt)  # the group's own abort names the cause best
                raise ReplicaLostError(response.get("message", f"replica group {self.group_id} is gone"))

    # -- generations (replica thread) ---------------------------------------------

    def _wire(self, membership: Membership, rank: int) -> Wiring:
        return wire(rank, membership, self.spec, self.worker, control=self, on_collective=self._collective_done,
                    on_stall=self._report_stall, on_peer_lost=self.peer_lost)

    def rendezvous(self, timeout: float) -> None:
        """Meet every member of this generation at the scheduler; connect the transports to their ``local_info``."""
        wiring = self._wiring
        info = {
            **wiring.transport.local_info(),
            **(self._server.local_info() if self._server is not None else {}),
            "nccl": local_features(parse_setting(self.spec.nccl), any("GPU" in d for d in self.devices)),
        }
        response = sync(
            self.worker.loop,
            self.worker.scheduler.daskdist_rendezvous,
            group_id=self.group_id,
            rank=self.rank,
            address=self.worker.address,
            info=info,
            generation=self.generation,
            callback_timeout=timeout + 5,
        )
        if response.get("status") != "OK":
            if response.get("kind") == "stale":
                raise StaleGenerationError(response.get("message", "stale generation"), self.group_id)
            raise RendezvousError(response.get("message", "rendezvous failed"))
        infos = {int(rank): i for rank, i in response["info"].items()}
        wiring.transport.connect(infos, wiring.membership)
        wiring.communicator.nccl = engine_for_group(
            self.rank, self.size, {r: i.get("nccl") for r, i in infos.items()}, wiring.mailbox, self.exchange)

    def _membership_of(self, generation: int) -> Membership:
        """The membership of ``generation``: as announced by the scheduler's stream, else asked for."""
        announced = self._announced
        if announced is not None and announced.generation == generation:
            return announced
        response = sync(self.worker.loop, self.worker.scheduler.daskdist_membership, group_id=self.group_id,
                        generation=generation, callback_timeout=30)
        if response.get("status") != "OK":
            raise ReplicaLostError(response.get("message", f"replica group {self.group_id} is gone"))
        membership = Membership.from_msg(response["membership"])
        if membership.generation != generation:
            check_generation(self.group_id, membership.generation, generation, "a command")
            raise ReplicaLostError(f"{self.group_id} has no generation {generation} (it is at {membership.generation})")
        return membership

    def _switch_generation(self, generation: int) -> None:
        """Re-form in ``generation``: close this generation's wiring, build and connect the next one.

        Residents (variables, models, shards) stay; a worker no longer in the
        membership stops its replica.
        """
        membership = self._membership_of(generation)
        try:
            rank = membership.rank_of(self.worker.address)
        except ValueError:
            self.stop()
            raise ReplicaLostError(
                f"worker {self.worker.address} is not a member of {self.group_id} in generation {generation}",
                worker=self.worker.address) from None
        old = self._wiring
        old.close()
        new = self._wire(membership, rank)
        with self._generation_lock:
            self._wiring = new
            self.context.bind(new.group)
            self.membership, self.rank, self.size, self.devices = membership, Rank(rank), membership.size, membership.devices
            self.generation = membership.generation
            early = self._early.pop(int(generation), [])
            self._early = {g: m for g, m in self._early.items() if g > generation}
        for tag, payload in early:
            new.mailbox.put(tag, payload)
        if self._step_events is not None:  # steps are reported under the new rank and size
            self._step_events.rank, self._step_events.size = int(rank), membership.size
        self.rendezvous(config.get_seconds("rendezvous.timeout"))
        logger.info("Replica %d of %s re-formed in generation %d (%d members)", self.rank, self.group_id,
                    self.generation, self.size)

    # -- replica thread -----------------------------------------------------------

    def serve(self) -> None:
        """Run commands until ``stop``; answer what is left with a 'closed' error."""
        self.state = "idle"
        server = self._server
        while True:
            item: Any
            if server is None:
                item = self._commands.get()
            else:
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    item = _NO_COMMAND
                if item is _NO_COMMAND:
                    # wait on the client's direct channel and on the queue's wake-up, in this thread; outside the
                    # `except` block, so a command's error does not carry queue.Empty as its context
                    for conn, (run_id, generation, settings, payload) in server.wait():
                        response = self._execute(run_id, payload, generation, settings)
                        response["run_id"] = run_id
                        server.reply(conn, response)
                    continue
            if item is None:
                break
            run_id, payload, generation, settings, future = item
            response = self._execute(run_id, payload, generation, settings)
            self.loop.call_soon_threadsafe(_resolve, future, response)
        self.state = "closed"
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self.loop.call_soon_threadsafe(_resolve, item[-1], self._closed_response())

    def close(self) -> None:
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in reversed(callbacks):
            try:
                callback()
            except Exception:  # one adapter's failure must not keep the replica from closing
                logger.exception("A close callback of replica %d of %s failed", self.rank, self.group_id)
        if self._step_events is not None:
            self._step_events.close()
        if self._server is not None:
            self._server.close()
        self._wiring.close()
        self.objects.clear()
        self.timer.history.clear()

    def _closed_response(self) -> dict[str, Any]:
        error = ReplicaLostError(f"replica {self.rank} of {self.group_id} is closed", worker=self.worker.address)
        return serialization.error_message(error, self.rank, self.worker.address)

    def _execute(self, run_id: int, payload: bytes | memoryview, generation: int = 0, settings: dict[str, Any] | None = None) -> dict[str, Any]:
        if settings is not None:  # the client's daskdist.* keys changed since its last command
            self.spec.config = settings
            config.install_snapshot(settings)
        try:
            check_generation(self.group_id, self.known_generation, generation, f"a command (run {run_id})")
            if generation > self.generation:
                self._switch_generation(generation)
        except Exception as e:
            return serialization.error_message(e, self.rank, self.worker.address)
        if self.mailbox.group_abort is not None:
            return serialization.error_message(self.mailbox.group_abort.error(), self.rank, self.worker.address)
        self.state = "running"  # before the run id: a peer that reads "idle" then this run id saw it finished
        self.run_id = run_id
        group = self._wiring.group
        frame = context.Frame(
            strategy=self.strategy_view,
            replica_context=self.context,
            variable_creator=self._create_variable,
            owner=self,
        )
        try:
            with context.enter(frame):
                command, args, failed_commands = serialization.loads(payload)
                group.start_command(run_id, failed_commands)  # a fence; a new attempt after a failed command
                aborted = self._aborted_runs.pop(run_id, None)
                if aborted is not None:  # the client aborted it before it started
                    self.mailbox.abort_attempt(failed_commands, aborted)
                result = command(self, *args)
                response: dict[str, Any] = {"status": "OK", "result": serialization.dumps(result)}
                group.fence()
                if self.mailbox.attempt_abort(group.attempt) is not None:  # a collective error the function caught:
                    response["attempt_aborted"] = True  # the client starts a new attempt for the next command
                return response
        except Exception as e:
            group.abort(e)
            return serialization.error_message(e, self.rank, self.worker.address)
        finally:
            group.fence()  # the command's async collectives end with it (after an abort: they fail at once)
            self.state = "idle"

    def run_step(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``fn`` as one timed step (its samples: the rows of a distributed batch among its arguments)."""
        self.timer.begin(self.run_id)
        try:
            return fn(*args, **kwargs)
        finally:
            self.record_step(self.timer.end(samples=self._batch_rows(args, kwargs)))

    def _batch_rows(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """Rows of the first argument that is a batch of a distributed dataset held here, if any."""
        if not args and not kwargs:
            return None
        held = {id(leaf) for batch in self.objects.objects(BATCH) for leaf in optree.tree_leaves(batch)}
        if not held:
            return None
        for value in (*args, *kwargs.values()):  # a whole batch, or its components (``for x, y in dist``)
            for leaf in optree.tree_leaves(value):
                if id(leaf) in held:
                    return int(leaf.shape[0]) if getattr(leaf, "ndim", 0) else 0
        return None

    def _collective_done(self, kind: str, seconds: float, nbytes: int) -> None:
        """A collective finished (the communicator's callback): time it, with its identity in the group."""
        communicator = self._wiring.communicator  # one lookup, not two through the property
        self.timer.add_collective(kind, seconds, nbytes, (communicator.run_id, communicator.seq))

    def record_step(self, timing: Any) -> None:
        """Queue a finished step's timing for the scheduler (sent within ``metrics.event-interval``, ``events``)."""
        if self._step_events is not None:
            self._step_events.add(timing.to_dict(spans=False))

    def _report_stall(self, info: dict[str, Any]) -> None:
        """A collective of this replica stalls (from the communicator's stall watch): tell the scheduler."""
        self.worker.log_event(STALL_EVENT_TOPIC, {"group": self.strategy_token, **info})

    def flush_step_events(self) -> None:
        """Send the step timings queued and not sent yet now (as events of ``metrics.event-max-steps``)."""
        if self._step_events is not None:
            self._step_events.flush()

    def _create_variable(self, *args: Any, **kwargs: Any) -> Any:
        """``dd.Variable(...)`` inside a replica function: replica 0's initial value, on every replica."""
        value, spec = VariableSpec.build(*args, **kwargs)
        check_same_spec_on_every_replica(self.process_group.all_gather_objects(spec))
        value = self.context._broadcast(value, root=0)
        self._created_in_replica += 1
        var_id = f"r{self._created_in_replica}"
        local = namespace(value).array(value, copy=True)
        variable = distributed_variable_class(spec)(spec, self.token, var_id, local_value=local, runtime=self)
        self.objects.install(VARIABLE, var_id, variable)
        return variable


def _resolve(future: asyncio.Future[Any], response: dict[str, Any]) -> None:
    if not future.done():
        future.set_result(response)


def replica_main(spec: GroupSpec, rank: int) -> str:
    """Body of the long-lived replica task pinned to one worker (reads only the client's settings)."""
    with config.use_snapshot(spec.config or None):
        return _replica_main(spec, rank)


def _replica_main(spec: GroupSpec, rank: int) -> str:
    worker = get_worker()
    extension = worker.extensions.get("daskdist")
    if extension is None:
        raise RuntimeError(f"the daskdist worker plugin is not installed on worker {worker.address}")
    secede()  # type: ignore[no-untyped-call]
    runtime = ReplicaRuntime(worker, spec, rank)
    extension.add_replica(runtime)
    thread = threading.current_thread()
    previous_name, thread.name = thread.name, f"daskdist-replica-{rank}-{spec.group_id}"
    previous_cores = pin_replica_thread(spec, rank)
    allocator.tune_for_replicas(spec.malloc)
    try:
        runtime.rendezvous(config.get_seconds("rendezvous.timeout"))
        logger.debug("Replica %d of %s serving on %s", rank, spec.group_id, worker.address)
        runtime.serve()
    finally:
        extension.remove_replica(runtime)
        runtime.close()
        thread.name = previous_name
        if previous_cores is not None:
            os.sched_setaffinity(0, previous_cores)  # the thread goes back to the worker's pool
    return f"replica {rank} of {spec.group_id} closed"


def pin_replica_thread(spec: GroupSpec, rank: int) -> set[int] | None:
    """Bind this replica's thread to one core of its host (``daskdist.replica.pin-cores``), as MPI binds ranks.

    Replicas that wait for each other spin for a few microseconds; two of them
    left on one core by the scheduler make every exchange a context switch.
    ``auto`` pins the k-th replica of a host to the k-th core this process may
    use, when the host's replicas do not outnumber those cores; ``false`` never
    pins. Returns the previous affinity (to restore), or ``None``.
    """
    setting = spec.pin_cores
    if setting in (False, None, "false") or not hasattr(os, "sched_setaffinity"):
        return None
    hosts = spec.hosts or list(spec.addresses)
    local = [r for r in range(spec.size) if hosts[r] == hosts[rank]]
    try:
        cores = sorted(os.sched_getaffinity(0))
        if len(local) > len(cores) or len(local) < 2:
            return None
        os.sched_setaffinity(0, {cores[local.index(rank)]})
    except OSError as e:  # pragma: no cover - a restricted container
        logger.debug("Could not pin replica %d to a core: %s", rank, e)
        return None
    return set(cores)
