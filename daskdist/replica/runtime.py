"""The replica runtime: one long-lived thread per replica that runs what the client sends.

``replica_main`` is the body of the replica task the strategy pins to each
chosen worker. It secedes from the worker's thread pool (so the worker can
still compute data tasks), registers with the worker's daskdist extension,
meets its peers at the scheduler's rendezvous, then serves commands until the
strategy closes it. Commands arrive from the client through the worker's
``daskdist_call`` handler, never as Dask tasks, so a step costs a message,
not a scheduler round trip.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import optree
from distributed import get_worker, secede
from distributed.comm.addressing import get_address_host
from distributed.utils import sync

from daskdist import config, context, serialization
from daskdist.arrays import namespace
from daskdist.collective import nccl
from daskdist.collective.communicator import Algorithm, Communicator
from daskdist.collective.mailbox import Abort, Mailbox, MailboxTimeout
from daskdist.collective.transport.base import Transport
from daskdist.collective.transport.dask import DaskTransport
from daskdist.collective.transport.routed import RoutedTransport
from daskdist.collective.transport.shm import ShmTransport, shm_supported
from daskdist.collective.transport.socket import SocketTransport
from daskdist.exceptions import RendezvousError, ReplicaLostError
from daskdist.ops import CommunicationOptions
from daskdist.replica import allocator
from daskdist.replica.context import ReplicaContext
from daskdist.replica.events import StepEventShipper
from daskdist.replica.strategy_view import ReplicaStrategyView
from daskdist.replica.timing import StepTimer
from daskdist.variables import VariableSpec, check_same_spec_on_every_replica, distributed_variable_class

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["GroupSpec", "ReplicaRuntime", "replica_main"]

logger = logging.getLogger(__name__)

STALL_EVENT_TOPIC = "daskdist-stall"


@dataclass
class GroupSpec:
    """Everything a replica needs to know about its group (sent with the replica task)."""

    group_id: str
    addresses: list[str]
    devices: list[str]
    hosts: list[str] = field(default_factory=list)
    algorithm: Algorithm = field(default_factory=Algorithm)
    options: CommunicationOptions = field(default_factory=CommunicationOptions)
    transport: str = "auto"
    shm_slot_bytes: int = 2 << 20
    single_copy_bytes: int | None = 1 << 20  # ``collective.shm.single-copy-bytes`` as the client saw it
    pin_cores: Any = "auto"  # ``daskdist.replica.pin-cores`` as the client saw it
    malloc: Any = "auto"  # ``daskdist.replica.malloc`` as the client saw it
    nccl: Any = "auto"  # ``daskdist.collective.nccl`` as the client saw it

    @property
    def size(self) -> int:
        return len(self.addresses)


TRANSPORTS = ("auto", "shm", "socket", "dask", "ucx")


def _make_transport(rank: int, spec: GroupSpec, mailbox: Mailbox, worker: Worker,
                    on_peer_lost: Callable[[int | None, str], None] | None = None) -> Transport:
    """The transport of one replica, chosen per peer.

    ``spec.transport``: ``"auto"`` (shared memory to same-host peers, direct
    TCP to the others), ``"shm"`` (every peer must share the host),
    ``"socket"`` (TCP to every peer), ``"dask"`` (Dask comms) or ``"ucx"``
    (UCX to every peer; needs ucxx, never picked by ``"auto"``). GPU groups
    use Dask comms (their arrays are not in host memory) for signatures and
    for what NCCL does not carry (``daskdist.collective.nccl``).
    """
    if spec.transport not in TRANSPORTS:
        raise ValueError(f"Unknown transport {spec.transport!r} (daskdist.collective.transport): {', '.join(TRANSPORTS)}")
    hosts = spec.hosts or list(spec.addresses)
    peers = [r for r in range(spec.size) if r != rank]
    same_host = [r for r in peers if hosts[r] == hosts[rank]] if spec.transport in ("auto", "shm") else []
    if same_host and not shm_supported():  # logged; off x86-64 the shm slots would need a fence
        if spec.transport == "shm":
            raise ValueError(f"the shm transport needs a 64-bit x86 machine; this one is {platform.machine()}")
        same_host = []
    on_gpu = any("GPU" in d for d in spec.devices)
    if spec.transport == "shm" and (len(same_host) != len(peers) or on_gpu):
        raise ValueError("the shm transport needs every replica on one host, with CPU devices")
    if spec.transport == "dask" or on_gpu or not peers:
        return DaskTransport(rank, spec.addresses, mailbox, worker, spec.group_id)
    routes: dict[int, Transport] = {}
    if spec.transport == "ucx":
        from daskdist.collective.transport.ucx import UcxTransport  # imports ucxx: only when asked for

        ucx = UcxTransport(rank, spec.addresses, mailbox, spec.group_id, peers)
        return RoutedTransport(rank, spec.addresses, mailbox, dict.fromkeys(peers, ucx))
    if same_host:
        shm = ShmTransport(rank, spec.addresses, mailbox, same_host, spec.group_id, spec.shm_slot_bytes)
        routes.update({r: shm for r in same_host})
    remote = [r for r in peers if r not in routes]
    if remote:
        tcp = SocketTransport(rank, spec.addresses, mailbox, spec.group_id, get_address_host(worker.address),
                              *_tls_contexts(worker), on_peer_lost=on_peer_lost)
        routes.update({r: tcp for r in remote})
    return RoutedTransport(rank, spec.addresses, mailbox, routes)


def _tls_contexts(worker: Worker) -> tuple[Any, Any]:
    """The cluster's TLS contexts for replica sockets, or ``(None, None)`` on plain TCP clusters."""
    if not worker.address.startswith("tls://"):
        return None, None
    server = worker.security.get_listen_args("worker").get("ssl_context")
    client = worker.security.get_connection_args("worker").get("ssl_context")
    return server, client


class ReplicaRuntime:
    """State and command loop of one replica.

    Event-loop side: ``submit``, ``stop``, ``status`` (called by the worker
    plugin's handlers). Replica-thread side: ``serve`` and everything it calls.
    """

    def __init__(self, worker: Worker, spec: GroupSpec, rank: int):
        self.worker = worker
        self.spec = spec
        self.rank = rank
        self.size = spec.size
        self.token = spec.group_id
        self.devices = spec.devices
        self.loop = worker.loop.asyncio_loop
        self.mailbox = Mailbox()
        self.transport = _make_transport(rank, spec, self.mailbox, worker, on_peer_lost=self.peer_lost)
        self.timer = StepTimer(rank, int(config.get("metrics.history")))
        self.communicator = Communicator(
            rank, self.size, self.transport, control=self, algorithm=spec.algorithm,
            options=spec.options, on_collective=self._collective_done, hosts=spec.hosts or None,
            on_stall=self._report_stall, single_copy_bytes=spec.single_copy_bytes,
        )
        self.context = ReplicaContext(self)
        self.strategy_view = ReplicaStrategyView(self)
        self.state = "starting"
        self.run_id = -1
        self._commands: queue.Queue[tuple[int, bytes, asyncio.Future] | None] = queue.Queue()
        self._stopping = False  # the strategy is closing: connections ending now are expected
        self._resident: dict[str, Any] = {}
        self._created_in_replica = 0
        self._step_events = (StepEventShipper(worker, self.token, rank, self.size,
                                              config.get_seconds("metrics.event-interval"),
                                              int(config.get("metrics.event-max-steps", 256)))
                             if config.get("metrics.log-events") else None)

    def __repr__(self) -> str:
        return f"<ReplicaRuntime {self.token} rank={self.rank}/{self.size} state={self.state}>"

    # -- event-loop side ---------------------------------------------------------

    def submit(self, run_id: int, payload: bytes) -> asyncio.Future:
        """Queue a command; the future resolves with the response message."""
        future = self.loop.create_future()
        if self.state == "closed":
            future.set_result(self._closed_response())
        else:
            self._commands.put((run_id, payload, future))
        return future

    def stop(self) -> None:
        """Ask the replica thread to finish after the commands already queued."""
        self._stopping = True
        self._commands.put(None)

    def status(self) -> dict:
        return {
            "run_id": self.run_id,
            "collective": self.communicator.seq,
            "kind": self.communicator.current_kind,
            "state": self.state,
        }

    def abort_group(self, abort: Abort) -> None:
        """The group is lost for good (from the scheduler): wake and fail every wait."""
        self.mailbox.abort_group(abort)
        self.transport.group_aborted()

    def peer_lost(self, peer: int | None, message: str) -> None:
        """A transport lost ``peer`` for good (no heartbeat, or reset): fail the group here and on every peer.

        Called from a transport thread. This replica's waits raise
        ``ReplicaLostError`` at once; the other replicas get a group abort
        (those that cannot be reached learn it from their own heartbeats).
        """
        if self.mailbox.group_abort is not None or self._stopping:
            return
        logger.warning("%s", message)
        abort = Abort("lost", message, self.rank)
        self.mailbox.abort_group(abort)
        self.loop.call_soon_threadsafe(self.transport.group_aborted)
        for rank, address in enumerate(self.spec.addresses):
            if rank != self.rank and rank != peer:
                asyncio.run_coroutine_threadsafe(self._send_abort(address, rank, None, abort), self.loop)

    # -- control plane used by the communicator (replica thread) ---------------

    def abort_peers(self, run_id: int, abort: Abort) -> None:
        for rank, address in enumerate(self.spec.addresses):
            if rank != self.rank:
                asyncio.run_coroutine_threadsafe(self._send_abort(address, rank, run_id, abort), self.loop)

    async def _send_abort(self, address: str, rank: int, run_id: int | None, abort: Abort) -> None:
        """Send ``abort`` for ``run_id`` to replica ``rank`` (``None``: for good, the whole group)."""
        try:
            await self.worker.rpc(address).daskdist_abort(
                group_id=self.token, rank=rank, run_id=run_id, abort=abort.to_msg(), reply=False
            )
        except Exception as e:  # the peer may be gone; the scheduler tells the others
            logger.debug("Could not send abort to replica %d on %s: %s", rank, address, e)

    def probe(self, rank: int, timeout: float) -> dict | None:
        address = self.spec.addresses[rank]
        coro = self.worker.rpc(address).daskdist_status(group_id=self.token, rank=rank)
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except Exception:
            future.cancel()
            return None

    def exchange(self, key: str, value: Any, deadline: float, run_id: int) -> dict[int, Any]:
        """Meet every replica at the scheduler under ``key`` (after the rendezvous); ``{rank: value}`` back.

        Polls in slices of at most 0.5 s, checking this run's and the group's
        aborts between them. Values travel as msgpack (tuples come back as lists).

        Raises
        ------
        MailboxTimeout
            ``deadline`` (monotonic) passed before every replica came.
        ReplicaLostError
            The scheduler has failed or closed the group.
        """
        while True:
            self.mailbox.check(run_id)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MailboxTimeout(key)
            wait = min(0.5, remaining)
            response = sync(self.worker.loop, self.worker.scheduler.daskdist_exchange, group_id=self.token, key=key,
                            rank=self.rank, value=value, timeout=wait, callback_timeout=wait + 30)
            status = response.get("status")
            if status == "OK":
                return {int(rank): v for rank, v in response["values"].items()}
            if status != "waiting":
                self.mailbox.check(run_id)  # the group's own abort names the cause best
                raise ReplicaLostError(response.get("message", f"replica group {self.token} is gone"))

    # -- replica thread -----------------------------------------------------------

    def rendezvous(self, timeout: float) -> None:
        """Wait at the scheduler until every replica of the group has started."""
        response = sync(
            self.worker.loop,
            self.worker.scheduler.daskdist_rendezvous,
            group_id=self.token,
            rank=self.rank,
            address=self.worker.address,
            info={"socket": list(self._sockets().listen_address) if self._sockets() else None,
                  "ucx": getattr(self._ucx(), "address", None),
                  "nccl": nccl.local_features(nccl.parse_setting(self.spec.nccl),
                                              any("GPU" in d for d in self.spec.devices))},
            callback_timeout=timeout + 5,
        )
        if response.get("status") != "OK":
            raise RendezvousError(response.get("message", "rendezvous failed"))
        sockets = self._sockets()
        if sockets is not None:
            infos = {int(rank): info for rank, info in response["info"].items()}
            sockets.set_peer_addresses({r: tuple(i["socket"]) for r, i in infos.items() if i.get("socket")})
        ucx = self._ucx()
        if ucx is not None:
            ucx.set_peer_addresses({int(r): i["ucx"] for r, i in response["info"].items() if i.get("ucx")})
        self.communicator.nccl = nccl.engine_for_group(
            self.rank, self.size, {int(r): i.get("nccl") for r, i in response["info"].items()}, self.mailbox,
            self.exchange)

    def _sockets(self) -> SocketTransport | None:
        """This replica's TCP transport, if any peer is reached through one."""
        routes = getattr(self.transport, "routes", {})
        return next((t for t in routes.values() if isinstance(t, SocketTransport)), None)

    def _ucx(self) -> Any:
        """This replica's UCX transport, if the group uses one."""
        routes = getattr(self.transport, "routes", {})
        return next((t for t in routes.values() if getattr(t, "name", None) == "ucx"), None)

    def serve(self) -> None:
        """Run commands until ``stop``; answer what is left with a 'closed' error."""
        self.state = "idle"
        while True:
            item = self._commands.get()
            if item is None:
                break
            run_id, payload, future = item
            response = self._execute(run_id, payload)
            self.loop.call_soon_threadsafe(_resolve, future, response)
        self.state = "closed"
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self.loop.call_soon_threadsafe(_resolve, item[2], self._closed_response())

    def close(self) -> None:
        if self._step_events is not None:
            self._step_events.close()
        self.communicator.close()
        self.transport.close()
        self._resident.clear()
        self.timer.history.clear()

    def _closed_response(self) -> dict:
        error = ReplicaLostError(f"replica {self.rank} of {self.token} is closed", worker=self.worker.address)
        return serialization.error_message(error, self.rank, self.worker.address)

    def _execute(self, run_id: int, payload: bytes) -> dict:
        if self.mailbox.group_abort is not None:
            return serialization.error_message(self.mailbox.group_abort.error(), self.rank, self.worker.address)
        self.run_id = run_id
        self.communicator.begin_run(run_id)
        self.state = "running"
        frame = context.Frame(
            strategy=self.strategy_view,
            replica_context=self.context,
            variable_creator=self._create_variable,
            owner=self,
        )
        try:
            with context.enter(frame):
                command, args, generation = serialization.loads(payload)
                self.communicator.set_generation(generation)
                result = command(self, *args)
                return {"status": "OK", "result": serialization.dumps(result)}
        except Exception as e:
            self.communicator.abort_run(e)
            return serialization.error_message(e, self.rank, self.worker.address)
        finally:
            self.state = "idle"

    def run_step(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Call ``fn`` as one timed step (its samples: the rows of a distributed batch among its arguments)."""
        self.timer.begin(self.run_id)
        try:
            return fn(*args, **kwargs)
        finally:
            self.record_step(self.timer.end(samples=self._batch_rows(args, kwargs)))

    def _batch_rows(self, args: tuple, kwargs: dict) -> int | None:
        """Rows of the first argument that is a batch of a distributed dataset held here, if any."""
        if not args and not kwargs:
            return None
        held = {id(leaf) for k in self.resident_keys(prefix="batch:") for leaf in optree.tree_leaves(self._resident[k])}
        if not held:
            return None
        for value in (*args, *kwargs.values()):  # a whole batch, or its components (``for x, y in dist``)
            for leaf in optree.tree_leaves(value):
                if id(leaf) in held:
                    return int(leaf.shape[0]) if getattr(leaf, "ndim", 0) else 0
        return None

    def _collective_done(self, kind: str, seconds: float, nbytes: int) -> None:
        """A collective finished (the communicator's callback): time it, with its identity in the group."""
        self.timer.add_collective(kind, seconds, nbytes, (self.communicator.run_id, self.communicator.seq))

    def record_step(self, timing: Any) -> None:
        """Queue a finished step's timing for the scheduler (sent within ``metrics.event-interval``, ``events``)."""
        if self._step_events is not None:
            self._step_events.add(timing.to_dict(spans=False))

    def _report_stall(self, info: dict) -> None:
        """A collective of this replica stalls (from the communicator's stall watch): tell the scheduler."""
        self.worker.log_event(STALL_EVENT_TOPIC, {"group": self.token, **info})

    def flush_step_events(self) -> None:
        """Send the step timings queued and not sent yet now (as events of ``metrics.event-max-steps``)."""
        if self._step_events is not None:
            self._step_events.flush()

    # -- objects that live on the replica -----------------------------------------

    def add_resident(self, object_id: str, obj: Any) -> None:
        self._resident[object_id] = obj

    def discard_resident(self, object_id: str) -> None:
        self._resident.pop(object_id, None)

    def pop_resident(self, object_id: str) -> Any:
        return self._resident.pop(object_id, None)

    def resident_keys(self, prefix: str = "") -> list[str]:
        return [k for k in self._resident if k.startswith(prefix)]

    def resident_object(self, object_id: str) -> Any:
        try:
            return self._resident[object_id]
        except KeyError:
            raise KeyError(f"replica {self.rank} of {self.token} holds no object {object_id!r}") from None

    def _create_variable(self, *args: Any, **kwargs: Any) -> Any:
        """``dd.Variable(...)`` inside a replica function: replica 0's initial value, on every replica."""
        value, spec = VariableSpec.build(*args, **kwargs)
        check_same_spec_on_every_replica(self.communicator.all_gather_objects(spec))
        value = self.context._broadcast(value, root=0)
        self._created_in_replica += 1
        var_id = f"r{self._created_in_replica}"
        local = namespace(value).array(value, copy=True)
        variable = distributed_variable_class(spec)(spec, self.token, var_id, local_value=local, runtime=self)
        self._resident[var_id] = variable
        return variable


def _resolve(future: asyncio.Future, response: dict) -> None:
    if not future.done():
        future.set_result(response)


def replica_main(spec: GroupSpec, rank: int) -> str:
    """Body of the long-lived replica task pinned to one worker."""
    worker = get_worker()
    extension = worker.extensions.get("daskdist")
    if extension is None:
        raise RuntimeError(f"the daskdist worker plugin is not installed on worker {worker.address}")
    secede()
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
