"""A replica's collectives: validation, the one-replica shortcut, engine choice, aborts.

``Communicator`` is the engine room of a ``ProcessGroup``
(``collective.process_group``), which is what ``ReplicaContext.all_reduce``
and friends call. Each collective is a ``CollectiveCall``
(``core.call``): numbered within the group's current attempt (not per
client command), tagged, checked against the neighbours' signatures, bounded
by a deadline. ``all_reduce`` follows TensorFlow's ``reduce`` →
``reduce_implementation`` shape: validate into an ``AllReducePlan``, return a
copy when the group has one replica, then run the first engine that accepts
the plan: the latency lane, NCCL, or the packed path with its pack engines
(``collective.engines``). Any failure inside a collective aborts the run on
every replica (the group's current attempt); a replica waiting longer than
``daskdist.collective.stall-warning`` warns, naming the replicas that have
not joined, and one that waits for a replica known to have finished the
command without joining raises at once (``collective.stall``).

Attempts: every message is tagged ``(attempt, seq, src, name)``. The attempt is the
number of the group's client commands that had failed when the current one
started (the client counts them and sends the count with each command), so
it is the same on every replica; a failed collective aborts the attempt, and
the next command starts a new one: numbering restarts and what is left of
the aborted attempt is dropped. A successful command does not renumber.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import optree

from daskdist import config
from daskdist.collective.core import algorithms, collectives, stall
from daskdist.collective.core.buffers import BufferPool
from daskdist.collective.core.call import CollectiveCall
from daskdist.collective.core.engines.base import AllReducePlan, DeviceEngine
from daskdist.collective.core.engines.choice import all_reduce_engine, device_engine_for
from daskdist.collective.core.engines.direct import copy_of
from daskdist.collective.core.engines.lane import LaneEngine
from daskdist.collective.core.engines.nccl.all_reduce import NcclAllReduce
from daskdist.collective.core.engines.packed import PackedAllReduce, pack_engines
from daskdist.collective.core.engines.single_copy.all_reduce import SingleCopyAllReduce
from daskdist.collective.core.engines.socket_lane import SocketLaneEngine
from daskdist.collective.mailbox import Abort
from daskdist.collective.transport.base import Transport, sole_route
from daskdist.collective.transport.shm import ShmTransport
from daskdist.collective.transport.socket import SocketTransport
from daskdist.exceptions import DaskdistError, kind_of
from daskdist.ops import Algorithm, CommunicationOptions, ReduceOp, timeout_of

__all__ = ["Algorithm", "Communicator", "ControlPlane"]

logger = logging.getLogger(__name__)


class ControlPlane(Protocol):
    """What the communicator needs from the replica runtime besides moving data."""

    def abort_peers(self, attempt: int, abort: Abort) -> None:
        """Tell every other replica that the group's ``attempt`` was aborted."""

    def probe(self, rank: int, timeout: float) -> dict[str, Any] | None:
        """Ask ``rank`` where it is (run, collective number, state); ``None`` if it does not answer."""

    def exchange(self, key: str, value: Any, deadline: float, attempt: int) -> dict[int, Any]:
        """Meet every replica under ``key`` and return each one's ``value`` (NCCL's unique id)."""


class Communicator:
    """The collectives of one replica in one group.

    Parameters
    ----------
    rank, size
        This replica's rank and the group size.
    transport
        Moves payloads to peers (see ``daskdist.collective.transport``).
    control
        Aborts peers and probes their state (the replica runtime).
    algorithm
        All-reduce algorithm chosen by the strategy's ``cross_device_ops``.
    options
        Group-wide default ``CommunicationOptions``.
    on_collective
        Called with ``(kind, seconds, nbytes)`` after each collective (step timing).
    hosts
        The host of each rank; when ranks span several hosts and some share
        one, large all-reduces go hierarchically (within hosts, then across).
    on_stall
        Called with a description (``run_id``, ``collective``, ``kind``,
        ``replica``, ``waited``, ``missing``, ``message``) when this replica has
        waited in one collective longer than ``collective.stall-warning``.
    single_copy_bytes
        All-reduces from this size, among replicas that all share a host,
        read the peers' arrays in place (``SingleCopyAllReduce``); ``None``: never.

    Attributes
    ----------
    lane
        The latency lane (``LaneEngine``) when every peer is reached through
        shared memory, else ``None``.
    socket_lane
        The socket lane (``SocketLaneEngine``) when every peer is reached
        over TCP (and ``collective.socket.lane`` is on), else ``None``.
    single_copy
        The single-copy all-reduce when every peer is reached through shared
        memory, else ``None``.
    nccl
        The ``NcclEngine`` that runs collectives of GPU arrays, set after the
        rendezvous when the whole group can use NCCL; ``None``: the generic
        engines carry every collective.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        transport: Transport,
        control: ControlPlane,
        algorithm: Algorithm | None = None,
        options: CommunicationOptions | None = None,
        on_collective: Callable[[str, float, int], None] | None = None,
        hosts: Sequence[str] | None = None,
        on_stall: Callable[[dict[str, Any]], None] | None = None,
        single_copy_bytes: int | None = 1 << 20,
    ):
        self.rank = rank
        self.size = size
        self.transport = transport
        self.control = control
        self.algorithm = algorithm or Algorithm()
        self.options = options or CommunicationOptions()
        self.on_collective = on_collective
        self.hosts = list(hosts) if hosts else [str(r) for r in range(size)]
        groups = algorithms.host_groups(self.hosts)
        self.multi_host = 1 < len(groups) < size  # several hosts, and some host holds several replicas
        self.attempt = 0  # the first field of every tag: see the module docstring
        self.run_id = 0  # the client command in progress (named in errors and probes; not in tags)
        self.seq = 0
        self._numbering = threading.Lock()  # numbers taken at issue (async work) and at run time
        # thread id -> the number given at issue to the collective that thread runs next; a dict, not a
        # threading.local, which on CPython < 3.11.9 can deadlock the interpreter when the collector frees it
        # (``collective.mailbox``)
        self._reserved: dict[int, int] = {}
        self._windowed = False  # a number was taken at issue: numbering takes ``_numbering`` from then on
        self.default_timeout = config.get_seconds("collective.timeout")
        self.timeout_override: float | None = None  # the group's own deadline (``set_timeout``), kept over commands
        self.current_kind: str | None = None
        self.small_message_bytes = int(config.get("collective.small-message-bytes"))
        self.on_stall = on_stall
        self.stall_warning = config.get_seconds("collective.stall-warning") if config.get(
            "collective.stall-warning") else 0.0
        self.skip_check = config.get_seconds("collective.skip-check") if config.get(
            "collective.skip-check") else 0.0
        self.active: tuple[Any, float] | None = None  # the collective in progress, since (monotonic)
        self._stall_watch: stall.StallWatch | None = None
        self._check_aborts = transport.mailbox.check  # bound once: the mailbox lives as long as this generation
        self.buffers = BufferPool()  # result buffers of large all-reduces, reused once the caller drops them
        shm = sole_route(transport, size, rank, ShmTransport)
        # a shared-memory channel carries one collective's large message at a time (its pieces follow each other)
        self._over_shared_memory = any(isinstance(t, ShmTransport) for t in transport.routes_by_peer().values())
        self.lane = LaneEngine(self, shm.lane()) if shm is not None else None
        self.single_copy = SingleCopyAllReduce(single_copy_bytes) if shm is not None else None
        self.nccl: DeviceEngine | None = None  # set by the runtime after the rendezvous
        self.packed = PackedAllReduce(
            pack_engines(self.algorithm, self.buffers, self.hosts, self.multi_host, self.small_message_bytes,
                         self.single_copy),
            self.algorithm.name)
        self._on_nccl = NcclAllReduce(self.packed)
        sockets = sole_route(transport, size, rank, SocketTransport) if config.get("collective.socket.lane", True) else None
        self.socket_lane = SocketLaneEngine(self, sockets) if sockets is not None else None

    def start_stall_watch(self) -> None:
        """Start the thread that watches waiting collectives (``collective.stall-warning`` and ``skip-check``)."""
        if self._stall_watch is None:
            self._stall_watch = stall.StallWatch(self, self.stall_warning, self.skip_check)

    def close(self) -> None:
        """Stop the stall watch, if one runs, and abort the NCCL communicator, if any."""
        if self._stall_watch is not None:
            self._stall_watch.stop()
            self._stall_watch = None
        if self.nccl is not None:
            self.nccl.close()

    # -- commands and attempts ------------------------------------------------------

    def begin_command(self, run_id: int) -> None:
        """A client command starts: name it in errors and probes, and re-read the default timeout (no renumbering)."""
        self.run_id = run_id
        if self.timeout_override is None:  # read once per command, not per collective
            self.default_timeout = config.get_seconds("collective.timeout")

    def set_timeout(self, seconds: float | None) -> None:
        """The deadline of every collective from now on, kept over commands (``None``: ``collective.timeout``)."""
        if seconds is not None and not seconds > 0:
            raise ValueError(f"a collective's timeout must be a positive number of seconds; got {seconds!r}")
        self.timeout_override = None if seconds is None else float(seconds)
        self.default_timeout = (self.timeout_override if self.timeout_override is not None
                                else config.get_seconds("collective.timeout"))

    def begin_attempt(self, attempt: int) -> None:
        """Move to ``attempt`` (how many of the group's commands had failed): numbering restarts, stale messages go.

        Nothing happens when ``attempt`` is the current one. The NCCL engine,
        if any, checks at its next collective whether every replica still
        holds its communicator (a failed command may have aborted one in the
        middle of a collective) and re-makes it only if not.
        """
        if attempt == self.attempt:
            return
        self.attempt = attempt
        self.seq = 0
        self.transport.mailbox.begin_attempt(attempt)
        if self.nccl is not None:
            self.nccl.set_attempt(attempt)

    def abort_attempt(self, error: BaseException) -> None:
        """Abort the current attempt on every replica because of ``error`` raised here."""
        mailbox = self.transport.mailbox
        if isinstance(error, DaskdistError) and mailbox.attempt_abort(self.attempt) is not None:
            return  # we are only echoing an abort that reached us
        if mailbox.group_abort is not None:
            return
        kind = kind_of(error)
        message = str(error) if kind != "aborted" else (
            f"replica {self.rank} raised {type(error).__name__}: {error}"
        )
        self.abort_with(Abort(kind, message, self.rank))

    def abort_with(self, abort: Abort) -> None:
        """Abort the current attempt here and on every other replica with ``abort`` (the first abort wins)."""
        self.transport.mailbox.abort_attempt(self.attempt, abort)
        self.control.abort_peers(self.attempt, abort)

    def check_aborted(self) -> None:
        """Raise the error of the current attempt's abort (or of the generation's), if there is one."""
        self._check_aborts(self.attempt)

    def next_collective(self) -> int:
        """Number the next collective of the attempt (raising first if the attempt was aborted).

        A collective issued asynchronously into a window (``reserve_number``)
        gets the number it was given at issue instead.
        """
        self._check_aborts(self.attempt)
        if not self._windowed:  # no number was ever taken at issue: the latency path stays lock-free
            self.seq += 1
            return self.seq
        reserved = self._reserved.pop(threading.get_ident(), None)
        if reserved is not None:
            return reserved
        with self._numbering:
            self.seq += 1
            return self.seq

    def reserve_number(self) -> int:
        """Take the next collective number now, for a collective that runs later (async work in a window)."""
        with self._numbering:
            self._windowed = True
            self.seq += 1
            return self.seq

    def use_number(self, number: int | None) -> None:
        """The next collective this thread starts is ``number`` (``reserve_number``); ``None``: forget it."""
        if number is None:
            self._reserved.pop(threading.get_ident(), None)
        else:
            self._reserved[threading.get_ident()] = number

    @property
    def concurrent_safe(self) -> bool:
        """Whether several collectives may run at once here: only the generic engines over a transport that
        keeps them apart (no shared memory to any peer, whose channels and segments hold one collective at a
        time, and no NCCL communicator)."""
        return not self._over_shared_memory and self.nccl is None  # the lane and single copy need shared memory

    # -- collectives ------------------------------------------------------------

    def all_reduce(self, op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None,
                   in_place: bool = False) -> Any:
        """Reduce ``value`` (a nested structure of arrays) across replicas; same structure back.

        Validate, shortcut one replica, choose an engine, run it. A bare numpy
        array the latency lane (or, between hosts, the socket lane) has a
        (cached, validated) plan for goes to it before anything else: that
        lookup is the whole dispatch of a small all-reduce. ``in_place``: the caller's arrays may receive the result
        (a contiguous leaf that is a pack by itself is reduced where it lies,
        and the result is a view of it: no result buffer, no copy back);
        otherwise they are only read.
        """
        lane = self.lane
        bare = type(value) is np.ndarray
        if bare:
            if lane is not None:
                lane_plan = lane.plan(op, value, options)
                if lane_plan is not None:
                    return lane.run(lane_plan, value)
            elif self.socket_lane is not None and self.nccl is None:
                socket_plan = self.socket_lane.plan(op, value, options)
                if socket_plan is not None:
                    return self.socket_lane.run(socket_plan, value)
        plan = AllReducePlan(op, value, self.options.merge(options), options, self.algorithm.num_packs,
                             self.buffers.empty, in_place)
        if self.size == 1:
            return optree.tree_unflatten(plan.treedef, [back(copy_of(x)) for x, back in zip(plan.leaves, plan.restore)])
        plan.bare_array = bare
        plan.nccl = device_engine_for(self.nccl, plan.leaves, plan.options, self.algorithm.name in ("auto", "ring"))
        if lane is not None:
            lane_plan = lane.accepts(plan)
            if lane_plan is not None:
                return lane.run_plan(plan, lane_plan)
        engine = all_reduce_engine(plan, self._on_nccl, self.packed)
        return self.run_collective("all_reduce", plan.sig, plan.options, lambda call: engine.run(call, plan))

    def all_gather(self, value: Any, axis: int, options: CommunicationOptions | None = None) -> Any:
        """Concatenate each leaf of ``value`` from all replicas along ``axis`` (rank order)."""
        return collectives.all_gather(self, value, axis, options)

    def reduce_scatter(self, op: ReduceOp | str, value: Any, axis: int = 0,
                       options: CommunicationOptions | None = None) -> Any:
        """Reduce ``value`` across replicas and return this replica's part of it along ``axis``.

        Each leaf is split along ``axis`` into ``num_replicas`` nearly equal
        parts, as ``numpy.array_split`` does; replica ``r`` gets part ``r``.
        """
        return collectives.reduce_scatter(self, op, value, axis, options)

    def broadcast(self, value: Any, root: int = 0, options: CommunicationOptions | None = None) -> Any:
        """Return ``root``'s ``value`` on every replica (structures must match)."""
        return collectives.broadcast(self, value, root, options)

    def all_gather_objects(self, obj: Any, options: CommunicationOptions | None = None) -> list[Any]:
        """Gather any picklable object from every replica, in rank order."""
        return collectives.all_gather_objects(self, obj, options)

    def barrier(self, options: CommunicationOptions | None = None) -> None:
        """Return once every replica has reached this barrier."""
        collectives.barrier(self, options)

    # -- machinery -------------------------------------------------------------

    def run_collective(self, kind: str, sig: str, options: CommunicationOptions,
                       body: Callable[[CollectiveCall], Any]) -> Any:
        """Run ``body`` as the next collective of the attempt: a ``CollectiveCall`` with its signature and deadline."""
        timeout = timeout_of(options.timeout_seconds, self.default_timeout)
        seq = self.next_collective()
        call = CollectiveCall(self, kind, sig, time.monotonic() + timeout, timeout, seq)

        def run() -> Any:
            result = body(call)
            call.finish()
            return result

        return self.run_tracked(kind, call, run)

    def run_tracked(self, kind: str, call: Any, body: Callable[..., Any], *args: Any) -> Any:
        """Run ``body(*args)`` as the collective ``call`` in progress.

        Marks it for status probes and the stall watch, aborts the attempt on every
        replica if it fails (mismatch, timeout, lost peer, bad data) and reports
        its time and ``call.nbytes`` to ``on_collective`` when it succeeds.
        """
        start = time.monotonic()
        self.begin_tracking(kind, call, start)
        try:
            result = body(*args)
        except Exception as e:
            self.abort_attempt(e)
            raise
        finally:
            self.end_tracking(call)
        if self.on_collective is not None:
            self.on_collective(kind, time.monotonic() - start, call.nbytes)
        return result

    def begin_tracking(self, kind: str, call: Any, since: float) -> None:
        """Show ``call`` (in progress since ``since``, monotonic) to status probes and the stall watch."""
        self.current_kind = kind
        if self._stall_watch is None and (self.stall_warning > 0 or self.skip_check > 0):
            self.start_stall_watch()
        self.active = (call, since)

    def end_tracking(self, call: Any = None) -> None:
        """The tracked collective is over (``begin_tracking``); ``call``: only if it is still the one shown (async
        collectives in a window begin and end in any order; the watch shows the latest begun)."""
        active = self.active
        if call is not None and active is not None and active[0] is not call:
            return
        self.active = None
        self.current_kind = None

    def describe_timeout(self, call: Any, waiting_for: int) -> str:
        """Explain a timeout: which replicas never joined this collective, and where they are."""
        return stall.describe_timeout(self, call, waiting_for)

    def missing_peers(self, call: Any) -> list[tuple[int, str]]:
        """Probe the peers: ``(rank, where it is)`` for each that has not joined ``call``."""
        return stall.missing_peers(self, call)

    def check_skipped(self, call: Any) -> bool:
        """Abort ``call`` on every replica if a peer finished the command without joining it; whether it did."""
        return stall.check_skipped(self, call)

    def report_stall(self, call: Any, waited: float) -> None:
        """Warn that this replica has waited ``waited`` seconds in ``call`` (and tell ``on_stall``)."""
        stall.report_stall(self, call, waited)
