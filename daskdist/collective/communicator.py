"""A replica's collectives: validation, signatures, deadlines, aborts, algorithm choice.

``Communicator`` is what ``ReplicaContext.all_reduce`` and friends call. Each
collective gets a number within the current run; its messages are tagged
``(run_id, number, src, name)``. Every collective starts by sending a short
signature (kind, op, structure, shapes, dtypes) to the right neighbour and
checks the left neighbour's before using any data, so replicas that disagree
all raise ``CollectiveMismatchError`` instead of exchanging garbage or
waiting forever. Any failure inside a collective aborts the run on every
replica. A replica waiting in one collective longer than
``daskdist.collective.stall-warning`` warns, naming the replicas that have not
joined (``StallWatch``).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import cloudpickle
import numpy as np
import optree

from daskdist import config
from daskdist.arrays import describe, namespace
from daskdist.collective import algorithms
from daskdist.collective.buffers import BufferPool
from daskdist.collective.mailbox import Abort, MailboxTimeout
from daskdist.collective.packing import flatten, pack, signature
from daskdist.collective.reduction import check_dtype, combine_into
from daskdist.collective.single_copy import SingleCopyAllReduce
from daskdist.collective.small_allreduce import SmallAllReduce, shared_memory_route
from daskdist.collective.transport.base import PayloadMismatch, SendHandle, Transport
from daskdist.exceptions import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DaskdistError,
    kind_of,
)
from daskdist.ops import Algorithm, CommunicationImplementation, CommunicationOptions, ReduceOp

if TYPE_CHECKING:
    from daskdist.collective.nccl import NcclEngine

__all__ = ["Algorithm", "CollectiveCall", "Communicator", "ControlPlane", "StallWatch"]

logger = logging.getLogger(__name__)


class ControlPlane(Protocol):
    """What the communicator needs from the replica runtime besides moving data."""

    def abort_peers(self, run_id: int, abort: Abort) -> None:
        """Tell every other replica that ``run_id`` was aborted."""

    def probe(self, rank: int, timeout: float) -> dict | None:
        """Ask ``rank`` where it is (run, collective number, state); ``None`` if it does not answer."""

    def exchange(self, key: str, value: Any, deadline: float, run_id: int) -> dict[int, Any]:
        """Meet every replica under ``key`` and return each one's ``value`` (NCCL's unique id)."""


class CollectiveCall:
    """One collective in progress: tagged send/recv, signature check, deadline.

    Algorithms only see ``rank``, ``size``, ``send``, ``recv``, ``wait`` and
    ``mismatch``.
    """

    def __init__(self, comm: Communicator, kind: str, sig: str, deadline: float, timeout: float):
        self.comm = comm
        self.kind = kind
        self.sig = sig
        self.deadline = deadline
        self.timeout = timeout
        self.rank = comm.rank
        self.size = comm.size
        self.seq = comm.seq
        self.run_id = comm.run_id
        self.nbytes = 0
        self.part = ""  # distinguishes the messages of successive packs within one collective
        # Data tags carry a hash of the signature: a replica can never consume data from a peer
        # that passed something else; it waits until the replica that saw the mismatch aborts the run.
        self._data_suffix = f"#{zlib.crc32(sig.encode()):08x}"
        self._sig_checked = False
        self._sig_handle = comm.transport.send(self._right, self._sig_tag(self.rank), sig)

    @property
    def _right(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def _left(self) -> int:
        return (self.rank - 1) % self.size

    def _tag(self, src: int, name: str) -> tuple:
        return (self.run_id, self.seq, src, name + self._data_suffix)

    def _sig_tag(self, src: int) -> tuple:
        return (self.run_id, self.seq, src, "sig")

    def send(self, dst: int, name: str, payload: Any) -> SendHandle:
        self.nbytes += getattr(payload, "nbytes", 0)
        return self.comm.transport.send(dst, self._tag(self.rank, self.part + name), payload)

    def recv(self, src: int, name: str, expect: int | None = None) -> Any:
        self.check_signature()
        payload = self._take(src, self.part + name)
        if expect is not None and getattr(payload, "size", None) != expect:
            self.mismatch(
                f"replica {src} sent {getattr(payload, 'size', type(payload).__name__)} elements "
                f"where replica {self.rank} expected {expect}"
            )
        return payload

    def recv_into(self, src: int, name: str, out: Any, op: ReduceOp | None, base: Any = None) -> None:
        """Receive ``src``'s array and combine it into ``out`` with ``op`` (``None``: copy).

        ``base``: combine out of place, ``out = base op incoming``.
        """
        self.check_signature()
        try:
            self.comm.transport.recv_into(src, self._tag(src, self.part + name), self.deadline, out,
                                          _combiner(op), base)
        except PayloadMismatch as e:
            self.mismatch(f"replica {src} sent {e.got} elements where replica {self.rank} expected {e.expected}")
        except MailboxTimeout:
            raise CollectiveTimeoutError(self.comm.describe_timeout(self, src)) from None

    def sendrecv(self, dst: int, payload: Any, src: int, name: str, out: Any, op: ReduceOp | None,
                 base: Any = None) -> None:
        """Send ``payload`` to ``dst`` and receive ``src``'s array into ``out`` (as ``recv_into``), both under ``name``."""
        self.check_signature()
        self.nbytes += getattr(payload, "nbytes", 0)
        transport = self.comm.transport
        try:
            transport.sendrecv(dst, self._tag(self.rank, self.part + name), payload, src,
                               self._tag(src, self.part + name), self.deadline, out, _combiner(op), base)
        except PayloadMismatch as e:
            self.mismatch(f"replica {src} sent {e.got} elements where replica {self.rank} expected {e.expected}")
        except MailboxTimeout:
            raise CollectiveTimeoutError(self.comm.describe_timeout(self, src)) from None

    def wait(self, handle: SendHandle) -> None:
        handle.wait(self.deadline)

    def check_signature(self) -> None:
        if self._sig_checked:
            return
        left_sig = self._take_tag(self._left, self._sig_tag(self._left))
        self._sig_checked = True
        if left_sig != self.sig:
            self.mismatch(
                f"replica {self._left} passed {left_sig!r} but replica {self.rank} passed {self.sig!r}"
            )

    def mismatch(self, detail: str) -> None:
        raise CollectiveMismatchError(
            f"{self.kind} #{self.seq} of run {self.run_id}: the replicas passed different values; {detail}"
        )

    def _take(self, src: int, name: str) -> Any:
        return self._take_tag(src, self._tag(src, name))

    def _take_tag(self, src: int, tag: tuple) -> Any:
        try:
            return self.comm.transport.recv(src, tag, self.deadline)
        except MailboxTimeout:
            raise CollectiveTimeoutError(self.comm.describe_timeout(self, src)) from None

    def finish(self) -> None:
        self.check_signature()
        self._sig_handle.wait(self.deadline)


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
    nccl
        The ``NcclEngine`` that runs collectives of GPU arrays, set after the
        rendezvous when the whole group can use NCCL; ``None``: the generic
        algorithms carry every collective.
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
        on_stall: Callable[[dict], None] | None = None,
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
        self.run_id = 0
        self.seq = 0
        self.default_timeout = config.get_seconds("collective.timeout")
        self.current_kind: str | None = None
        self.small_message_bytes = int(config.get("collective.small-message-bytes"))
        self.on_stall = on_stall
        self.stall_warning = config.get_seconds("collective.stall-warning") if config.get(
            "collective.stall-warning") else 0.0
        self.active: tuple[Any, float] | None = None  # the collective in progress, since (monotonic)
        self._stall_watch: StallWatch | None = None
        self.buffers = BufferPool()  # result buffers of large all-reduces, reused once the caller drops them
        shm = shared_memory_route(transport, size, rank) if size > 1 else None
        self._small = SmallAllReduce(self, shm) if shm is not None else None
        self._single_copy = SingleCopyAllReduce(single_copy_bytes) if shm is not None else None
        self.nccl: NcclEngine | None = None

    def start_stall_watch(self) -> None:
        """Start the thread that warns about collectives waiting longer than ``collective.stall-warning``."""
        if self._stall_watch is None:
            self._stall_watch = StallWatch(self, self.stall_warning)

    def close(self) -> None:
        """Stop the stall watch, if one runs, and abort the NCCL communicator, if any."""
        if self._stall_watch is not None:
            self._stall_watch.stop()
            self._stall_watch = None
        if self.nccl is not None:
            self.nccl.close()

    # -- runs -----------------------------------------------------------------

    def begin_run(self, run_id: int) -> None:
        """Start numbering collectives for ``run_id`` and drop stale messages."""
        self.run_id = run_id
        self.seq = 0
        self.default_timeout = config.get_seconds("collective.timeout")  # read once per run, not per collective
        self.transport.mailbox.begin_run(run_id)

    def set_generation(self, generation: int) -> None:
        """How many of the group's runs had failed when the client sent this one (before its collectives).

        The same on every replica in one run; the NCCL communicator is
        aborted and re-made when it changes.
        """
        if self.nccl is not None:
            self.nccl.set_generation(generation)

    def abort_run(self, error: BaseException) -> None:
        """Abort the current run on every replica because of ``error`` raised here."""
        if isinstance(error, DaskdistError) and self.transport.mailbox.run_abort(self.run_id) is not None:
            return  # we are only echoing an abort that reached us
        if self.transport.mailbox.group_abort is not None:
            return
        kind = kind_of(error)
        message = str(error) if kind != "aborted" else (
            f"replica {self.rank} raised {type(error).__name__}: {error}"
        )
        abort = Abort(kind, message, self.rank)
        self.transport.mailbox.abort_run(self.run_id, abort)
        self.control.abort_peers(self.run_id, abort)

    # -- collectives ------------------------------------------------------------

    def all_reduce(self, op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None) -> Any:
        """Reduce ``value`` (a nested structure of arrays) across replicas; same structure back."""
        small = self._small
        if small is not None and type(value) is np.ndarray:
            plan = small.plan(op, value, options)
            if plan is not None:
                return small.run(plan, value)
        call_options = options
        op = ReduceOp.from_any(op)
        options = self.options.merge(options)
        leaves, treedef, restore = flatten(value)
        for leaf in leaves:
            check_dtype(op, leaf.dtype)
        if self.size == 1:
            return optree.tree_unflatten(treedef, [back(xp_copy(leaf)) for leaf, back in zip(leaves, restore)])
        if (small is not None and type(value) is not np.ndarray and treedef.num_nodes == 1 and len(leaves) == 1
                and isinstance(leaves[0], np.ndarray)):
            plan = small.plan(op, leaves[0], call_options)  # a number, a numpy scalar, a CPU DLPack tensor
            if plan is not None:
                return optree.tree_unflatten(treedef, [restore[0](small.run(plan, leaves[0]))])
        num_packs = self.algorithm.num_packs
        detail = f"{op.name} packs={options.bytes_per_pack}/{num_packs} {options.implementation.name}"
        nccl = self._nccl_for(leaves, options, self.algorithm.name in ("auto", "ring"))
        if nccl is not None:
            detail += " nccl"  # replicas that would take different paths disagree before any data moves
        sig = signature("all_reduce", detail, leaves, treedef)
        packed = pack(leaves, treedef, restore, options.bytes_per_pack, num_packs, borrow=True,
                      allocate=self.buffers.empty)
        if (small is not None and type(value) is not np.ndarray and len(packed.packs) == 1
                and isinstance(packed.packs[0].buffer, np.ndarray)):
            plan = small.plan_for_pack(op, packed.packs[0].buffer, call_options, sig)
            if plan is not None:  # one flat pack of at most a slot: the latency lane
                packed.packs[0].buffer = small.run(plan, packed.packs[0].buffer)
                return packed.unpack()

        def run(call: CollectiveCall) -> Any:
            on_nccl = []
            for index, p in enumerate(packed.packs):
                if nccl is not None and nccl.reduces(p.buffer.dtype):
                    on_nccl.append(p)
                    continue
                call.part = f"p{index}/"
                p.buffer = self._allreduce_buffer(call, p.buffer, op, options, p.borrowed)
            if on_nccl:
                nccl.all_reduce(call, on_nccl, op)
            return packed.unpack()

        return self._collective("all_reduce", sig, options, run)

    def all_gather(self, value: Any, axis: int, options: CommunicationOptions | None = None) -> Any:
        """Concatenate each leaf of ``value`` from all replicas along ``axis`` (rank order)."""
        options = self.options.merge(options)
        leaves, treedef, restore = flatten(value)
        axes = []
        for leaf in leaves:
            if leaf.ndim == 0:
                raise ValueError("all_gather needs arrays with at least one dimension; got a 0-d array")
            if not -leaf.ndim <= axis < leaf.ndim:
                raise ValueError(f"all_gather axis {axis} is out of range for {describe(leaf)}")
            axes.append(axis % leaf.ndim)
        if self.size == 1:
            return optree.tree_unflatten(treedef, [back(leaf) for leaf, back in zip(leaves, restore)])
        shapes = ", ".join(
            f"{leaf.dtype}[{','.join('*' if i == a else str(d) for i, d in enumerate(leaf.shape))}]"
            for leaf, a in zip(leaves, axes)
        )
        sig = f"all_gather axis={axis} | structure {treedef} | leaves [{shapes}]"
        nccl = self._nccl_for(leaves, options)
        if nccl is not None:
            sig += " | nccl"

        def run(call: CollectiveCall) -> Any:
            if nccl is not None:
                gathered_leaves = nccl.all_gather(call, leaves, axes)
                return optree.tree_unflatten(treedef, [back(x) for x, back in zip(gathered_leaves, restore)])
            gathered = algorithms.allgather_direct(call, leaves)
            out = []
            for i, (leaf, a, back) in enumerate(zip(leaves, axes, restore)):
                xp = namespace(leaf)
                out.append(back(xp.concatenate([part[i] for part in gathered], axis=a)))
            return optree.tree_unflatten(treedef, out)

        return self._collective("all_gather", sig, options, run)

    def reduce_scatter(self, op: ReduceOp | str, value: Any, axis: int = 0,
                       options: CommunicationOptions | None = None) -> Any:
        """Reduce ``value`` across replicas and return this replica's part of it along ``axis``.

        Each leaf is split along ``axis`` into ``num_replicas`` nearly equal
        parts, as ``numpy.array_split`` does; replica ``r`` gets part ``r``.
        """
        op = ReduceOp.from_any(op)
        options = self.options.merge(options)
        leaves, treedef, restore = flatten(value)
        for leaf in leaves:
            check_dtype(op, leaf.dtype)
            if leaf.ndim == 0 or not -leaf.ndim <= axis < leaf.ndim:
                raise ValueError(f"reduce_scatter axis {axis} is out of range for {describe(leaf)}")
        if self.size == 1:
            return optree.tree_unflatten(treedef, [back(xp_copy(x)) for x, back in zip(leaves, restore)])
        sig = signature("reduce_scatter", f"{op.name} axis={axis}", leaves, treedef)
        nccl = self._nccl_for(leaves, options)
        if nccl is not None and not all(nccl.reduces(leaf.dtype) for leaf in leaves):
            nccl = None
        if nccl is not None:
            sig += " | nccl"

        def run(call: CollectiveCall) -> Any:
            if nccl is not None:
                parts = nccl.reduce_scatter(call, leaves, op, axis)
                return optree.tree_unflatten(treedef, [back(x) for x, back in zip(parts, restore)])
            out = []
            for index, (leaf, back) in enumerate(zip(leaves, restore)):
                call.part = f"l{index}/"
                xp = namespace(leaf)
                moved = xp.moveaxis(leaf, axis, 0)
                rows = moved.shape[0]
                starts = [0]
                for length in (len(part) for part in xp.array_split(xp.empty(rows), self.size)):
                    starts.append(starts[-1] + length)
                row_size = int(moved[0].size) if rows else 0
                buf = xp.ascontiguousarray(moved).reshape(-1).copy()
                mine = algorithms.reducescatter_ring(call, buf, op, [s * row_size for s in starts])
                part = mine.reshape((starts[self.rank + 1] - starts[self.rank],) + moved.shape[1:])
                out.append(back(xp.moveaxis(part, 0, axis)))
            return optree.tree_unflatten(treedef, out)

        return self._collective("reduce_scatter", sig, options, run)

    def broadcast(self, value: Any, root: int = 0, options: CommunicationOptions | None = None) -> Any:
        """Return ``root``'s ``value`` on every replica (structures must match)."""
        options = self.options.merge(options)
        leaves, treedef, restore = flatten(value)
        if self.size == 1:
            return value
        sig = signature("broadcast", f"root={root}", leaves, treedef)
        nccl = self._nccl_for(leaves, options)
        if nccl is not None:
            sig += " | nccl"

        def run(call: CollectiveCall) -> Any:
            if nccl is not None:
                received = nccl.broadcast(call, leaves, root)
                return optree.tree_unflatten(treedef, [back(x) for x, back in zip(received, restore)])
            received = algorithms.broadcast_direct(call, leaves, root)
            return optree.tree_unflatten(treedef, [back(x) for x, back in zip(received, restore)])

        return self._collective("broadcast", sig, options, run)

    def all_gather_objects(self, obj: Any, options: CommunicationOptions | None = None) -> list[Any]:
        """Gather any picklable object from every replica, in rank order."""
        options = self.options.merge(options)
        if self.size == 1:
            return [obj]
        data = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

        def run(call: CollectiveCall) -> list[Any]:
            gathered = algorithms.allgather_direct(call, [data])
            return [obj if r == self.rank else pickle.loads(part[0]) for r, part in enumerate(gathered)]

        return self._collective("all_gather_objects", "all_gather_objects", options, run)

    def barrier(self, options: CommunicationOptions | None = None) -> None:
        """Return once every replica has reached this barrier."""
        options = self.options.merge(options)
        if self.size == 1:
            return

        def run(call: CollectiveCall) -> None:
            algorithms.allgather_direct(call, [])

        self._collective("barrier", "barrier", options, run)

    # -- machinery -------------------------------------------------------------

    def _nccl_for(self, leaves: list[Any], options: CommunicationOptions, algorithm_allows: bool = True
                  ) -> NcclEngine | None:
        """The NCCL engine when this collective takes it: every leaf a GPU array, implementation AUTO or NCCL.

        ``RING`` forces the generic ring; so do the algorithms that are not
        NCCL's (hierarchical, reduce-to-one, direct: ``algorithm_allows``).
        The engine exists on every replica or on none; a collective that takes
        it says so in its signature, so replicas that would take different
        paths raise ``CollectiveMismatchError`` before any data moves.
        """
        nccl = self.nccl
        if (nccl is None or not algorithm_allows or not leaves
                or options.implementation is CommunicationImplementation.RING):
            return None
        return nccl if all(nccl.accepts(leaf) for leaf in leaves) else None

    def _allreduce_buffer(self, call: CollectiveCall, buf: Any, op: ReduceOp, options: CommunicationOptions,
                          borrowed: bool = False) -> Any:
        """All-reduce one flat pack; ``borrowed``: ``buf`` is the caller's array, the result goes to a new one."""
        algorithm = self.algorithm
        in_place = borrowed and algorithm.name in ("reduce_to_one", "hierarchical")
        if in_place or (borrowed and buf.size == 0):
            buf = xp_copy(buf)  # these algorithms work in place
        if algorithm.name == "reduce_to_one":
            return algorithms.allreduce_reduce_to_one(call, buf, op, algorithm.root, algorithm.accumulation_fn)
        if buf.size == 0:
            return buf
        if algorithm.name == "direct":
            return algorithms.allreduce_direct(call, buf, op)
        if algorithm.name == "hierarchical":
            return algorithms.allreduce_hierarchical(call, buf, op, self.hosts)
        forced_ring = algorithm.name == "ring" or options.implementation is not CommunicationImplementation.AUTO
        if not forced_ring and buf.nbytes <= self.small_message_bytes:
            return algorithms.allreduce_direct(call, buf, op)
        if not forced_ring and self.multi_host:
            if borrowed:
                buf = xp_copy(buf)
            return algorithms.allreduce_hierarchical(call, buf, op, self.hosts)
        out = None
        if borrowed:
            out = self.buffers.empty_like(buf) if isinstance(buf, np.ndarray) else namespace(buf).empty_like(buf)
        single = self._single_copy
        if (not forced_ring and single is not None and isinstance(buf, np.ndarray) and single.wants(buf.nbytes)
                and single.probe(call) and buf.nbytes >= single.min_bytes):
            return single.allreduce(call, buf, op, out)
        return algorithms.allreduce_ring(call, buf, op, out)

    def _collective(self, kind: str, sig: str, options: CommunicationOptions, body: Callable[[CollectiveCall], Any]) -> Any:
        self.transport.mailbox.check(self.run_id)
        timeout = options.timeout_seconds or self.default_timeout
        self.seq += 1
        call = CollectiveCall(self, kind, sig, time.monotonic() + timeout, timeout)

        def run() -> Any:
            result = body(call)
            call.finish()
            return result

        return self.run_tracked(kind, call, run)

    def run_tracked(self, kind: str, call: Any, body: Callable[..., Any], *args: Any) -> Any:
        """Run ``body(*args)`` as the collective ``call`` in progress (every lane goes through here).

        Marks it for status probes and the stall watch, aborts the run on every
        replica if it fails (mismatch, timeout, lost peer, bad data) and reports
        its time and ``call.nbytes`` to ``on_collective`` when it succeeds.
        """
        start = time.monotonic()
        self.begin_tracking(kind, call, start)
        try:
            result = body(*args)
        except Exception as e:
            self.abort_run(e)
            raise
        finally:
            self.end_tracking()
        if self.on_collective is not None:
            self.on_collective(kind, time.monotonic() - start, call.nbytes)
        return result

    def begin_tracking(self, kind: str, call: Any, since: float) -> None:
        """Show ``call`` (in progress since ``since``, monotonic) to status probes and the stall watch."""
        self.current_kind = kind
        if self.stall_warning > 0 and self._stall_watch is None:
            self.start_stall_watch()
        self.active = (call, since)

    def end_tracking(self) -> None:
        """The tracked collective is over (``begin_tracking``)."""
        self.active = None
        self.current_kind = None

    def describe_timeout(self, call: CollectiveCall, waiting_for: int) -> str:
        """Explain a timeout: which replicas never joined this collective, and where they are."""
        missing = [f"replica {rank} {where}" for rank, where in self.missing_peers(call)]
        head = (
            f"{call.kind} #{call.seq} of run {call.run_id} timed out after {call.timeout:g}s "
            f"on replica {self.rank}"
        )
        if missing:
            return f"{head}: " + "; ".join(missing)
        return f"{head}: every replica joined, but data from replica {waiting_for} did not arrive in time"

    def missing_peers(self, call: CollectiveCall) -> list[tuple[int, str]]:
        """Probe the peers: ``(rank, where it is)`` for each that has not joined ``call``."""
        probe_timeout = config.get_seconds("collective.status-probe-timeout")
        missing = []
        for rank in range(self.size):
            if rank != self.rank:
                where = _where(self.control.probe(rank, probe_timeout), call)
                if where is not None:
                    missing.append((rank, where))
        return missing

    def report_stall(self, call: CollectiveCall, waited: float) -> None:
        """Warn that this replica has waited ``waited`` seconds in ``call`` (and tell ``on_stall``)."""
        missing = self.missing_peers(call)
        active = self.active
        if active is None or active[0] is not call:
            return  # it completed while the peers were probed: not a stall
        head = (f"{call.kind} #{call.seq} of run {call.run_id}: replica {self.rank} has waited "
                f"{waited:.1f}s for its peers")
        if missing:
            message = f"{head}; not joined: " + "; ".join(f"replica {r} {where}" for r, where in missing)
        else:
            message = f"{head}; every replica joined, the data is slow to arrive"
        logger.warning("%s", message)
        if self.on_stall is not None:
            self.on_stall({"run_id": call.run_id, "collective": call.seq, "kind": call.kind, "replica": self.rank,
                           "waited": waited, "missing": [r for r, _ in missing], "message": message})


class StallWatch:
    """A daemon thread that reports a communicator's collective once it has run longer than ``threshold``.

    The collective path only sets ``Communicator.active``; this thread polls it
    (a few times per threshold, at most once a second) and reports each stalled
    collective once.
    """

    def __init__(self, comm: Communicator, threshold: float):
        self._comm = weakref.ref(comm)  # a communicator dropped without ``close`` still ends the thread
        self.threshold = threshold
        self.interval = max(0.05, min(1.0, threshold / 4))
        self._stop = threading.Event()
        self._reported: tuple[int, int] | None = None
        self._thread = threading.Thread(target=self._run, name=f"daskdist-stall-watch-{comm.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            comm = self._comm()
            if comm is None:
                return
            active = comm.active
            if active is None:
                del comm
                continue
            call, since = active
            waited = time.monotonic() - since
            if waited >= self.threshold and self._reported != (call.run_id, call.seq):
                self._reported = (call.run_id, call.seq)
                try:
                    comm.report_stall(call, waited)
                except Exception as e:  # a warning must never break the replica
                    logger.debug("Stall report failed: %s", e)
            del comm, call, active


def _combiner(op: ReduceOp | None) -> Callable[[Any, Any, Any], None] | None:
    """The transport's ``combine`` for ``op`` (``None``: copy)."""
    if op is None:
        return None
    return lambda acc, part, base: combine_into(op, acc, part, base)


def xp_copy(leaf: Any) -> Any:
    return namespace(leaf).array(leaf, copy=True)


def _where(status: dict | None, call: CollectiveCall) -> str | None:
    """Describe a peer that has not joined ``call``, or ``None`` if it has."""
    if status is None:
        return "did not answer a status request (its worker may be busy or gone)"
    run, seq = status.get("run_id", -1), status.get("collective", 0)
    state = status.get("state")
    if run < call.run_id:
        return f"never started run {call.run_id} (it is {state}, last run {run})"
    if run > call.run_id:
        return None
    if seq >= call.seq:
        return None
    if state == "idle":
        return f"finished run {call.run_id} after joining {seq} collective(s), without joining this one"
    return f"has not joined it (it is at collective #{seq} of run {run}, or in user code)"
