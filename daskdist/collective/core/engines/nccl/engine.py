"""The NCCL engine: collectives of cupy arrays through ``cupy.cuda.nccl``, polled and abortable.

One ``NcclCommunicator`` per replica group, made lazily, inside the replica
(never on the worker's event loop), by the first collective whose leaves are
all cupy arrays. Groups that never reduce GPU arrays never pay for NCCL's
set-up (a bootstrap round and GPU buffers), and when it is made every rank
is known to be inside the same collective (its signature already checked), on
the GPU its arrays live on.

How a communicator comes to be
    At the rendezvous every replica reports what it has (``local_features``:
    NCCL's version, whether cupy can name bfloat16, which GPU it sits on);
    ``engine_for_group`` turns the reports into one decision the whole group
    shares: an engine on every replica, or none anywhere (a replica without
    NCCL, a version without ``ncclCommAbort``, two replicas on one GPU).
    At the first collective of an *attempt* (see below) rank 0 calls
    ``get_unique_id()`` and every rank meets at the scheduler plugin's
    keyed exchange (the rendezvous mechanism, under ``nccl/<attempt>``);
    then each rank calls ``NcclCommunicator(size, unique_id, rank)`` in a
    helper thread (the call blocks until every rank has joined) while the
    replica thread polls for it with the collective's deadline and aborts.

Attempts and generations
    One engine per membership generation (``daskdist.replica.wiring`` builds
    it with the generation's communicator): a new generation always gets a
    new NCCL communicator. Within a generation, the client counts the commands
    that failed and sends the count with every command: the group's attempt
    (``Communicator.begin_attempt``). A failed command does not by itself
    re-make the communicator: at the first NCCL collective of a later attempt
    every rank says at the scheduler's keyed exchange (``nccl-keep/<attempt>``)
    whether it still holds its communicator. If all do (the failure never
    reached NCCL: a user error, a Python-level abort) they keep it; if any
    rank dropped its own (an abort or timeout inside NCCL leaves it unusable)
    every rank aborts its communicator and they make a new one under
    ``nccl/<attempt>``, including those whose own communicator looked healthy.

Waiting
    The engine never waits inside CUDA or NCCL. It waits on the host until the
    caller's stream has produced the inputs (so nothing is queued behind
    user kernels when an abort comes), enqueues the NCCL calls on a stream
    of its own, records an event and polls it (``backoff_wait``, as the
    shared-memory transport waits), checking the replica's mailbox (run and
    group aborts), ``check_async_error()`` and the collective's deadline.
    On a timeout, an abort or an NCCL error the communicator is aborted
    (``abort()``) and dropped, and the same errors as on every other path
    are raised: ``CollectiveTimeoutError``, ``ReplicaLostError``,
    ``CollectiveMismatchError``, ``CollectiveAbortedError``.

Ending
    A communicator always ends with ``abort()``, also when the replica
    closes: it only frees local resources and never waits for peers, which
    may be gone, where ``destroy()`` may first flush work with them. It is
    never left to cupy's finaliser, which would destroy it on whatever
    thread collects it.

Reductions use NCCL's ``SUM``/``PROD``/``MAX``/``MIN``; ``MEAN`` is ``SUM``
then ``reduction.finalize`` (TF's integer truncation). Booleans reduce as
``uint8`` (``SUM`` = or = ``MAX``, ``PRODUCT`` = and = ``MIN``). dtypes NCCL
has no type for (int16, uint16, complex, bfloat16 without NCCL 2.10) go
through the generic algorithms. All-gather and broadcast move bytes, so
every dtype takes NCCL there.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from daskdist.arrays import _is_cupy
from daskdist.collective.core.call import CollectiveCall
from daskdist.collective.core.engines.nccl.support import (
    describe_nccl_error,
    group_features,
    nccl_dtype_name,
    nccl_op_name,
)
from daskdist.collective.core.reduction import finalize
from daskdist.collective.mailbox import Mailbox, MailboxTimeout
from daskdist.collective.transport.shm_channel import backoff_wait
from daskdist.exceptions import CollectiveAbortedError, CollectiveTimeoutError
from daskdist.ops import ReduceOp

__all__ = ["CupyDevice", "NcclEngine", "engine_for_group"]

logger = logging.getLogger(__name__)

#: ``cudaErrorNotReady``: what ``cudaEventQuery`` answers while the event is still ahead.
_CUDA_NOT_READY = 600
#: Bytes per ``broadcast`` call: older cupy declares its count a C ``int``.
_BROADCAST_CHUNK = (1 << 31) - 1


def engine_for_group(rank: int, size: int, features: dict[int, dict[str, Any] | None], mailbox: Mailbox,
                     exchange: Callable[[str, Any, float, int], dict[int, Any]]) -> NcclEngine | None:
    """The engine of replica ``rank``, or ``None`` when the group does not use NCCL (the same on every replica)."""
    if size < 2 or not any(features.values()):
        return None
    usable, bfloat16, reason = group_features(features, size)
    if not usable:
        if rank == 0:
            logger.warning("GPU collectives of this group use the generic transports: %s", reason)
        return None
    return NcclEngine(rank, size, mailbox, exchange, CupyDevice(), bfloat16=bfloat16)


# -- cupy ------------------------------------------------------------------------------


class CupyDevice:
    """What the engine asks of cupy (streams, events, pointers); unit tests swap in a fake."""

    def __init__(self) -> None:
        import cupy
        from cupy.cuda import nccl

        self.xp = cupy
        self.nccl = nccl

    @staticmethod
    def accepts(array: Any) -> bool:
        """Whether ``array`` lives on a GPU (a cupy array)."""
        return _is_cupy(array)

    def device_of(self, array: Any) -> int:
        return int(array.device.id)

    @contextlib.contextmanager
    def using(self, device: int) -> Iterator[None]:
        with self.xp.cuda.Device(device):
            yield

    def new_stream(self) -> Any:
        """A stream of the current device that does not wait for the legacy default stream."""
        return self.xp.cuda.Stream(non_blocking=True)

    def record(self, stream: Any = None) -> Any:
        """An event recorded on ``stream`` (``None``: the caller's current stream)."""
        event = self.xp.cuda.Event(block=False, disable_timing=True)
        event.record(stream)  # None: cupy records on the current stream
        return event

    def done(self, event: Any) -> bool:
        """Whether ``event`` has happened; a CUDA error behind it raises (``Event.done`` would stay false)."""
        runtime = self.xp.cuda.runtime
        status = runtime.eventQuery(event.ptr)
        if status == 0:  # cudaSuccess
            return True
        if status == _CUDA_NOT_READY:
            return False
        runtime.check_status(status)  # raises CUDARuntimeError naming the failure
        return False

    @staticmethod
    def pointer(array: Any) -> int:
        return int(array.data.ptr)

    @staticmethod
    def stream_pointer(stream: Any) -> int:
        return int(stream.ptr)

    @staticmethod
    def to_host(array: Any) -> Any:
        return array.get()


# -- the engine --------------------------------------------------------------------------


class _NcclFailure(Exception):
    """Internal: ``check_async_error`` raised (the cause) while a collective was waited for."""


class _PendingInit:
    """The result of an ``NcclCommunicator`` being made in a helper thread, which the replica may give up on."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.comm: Any = None
        self.error: BaseException | None = None
        self._abandoned = False
        self._lock = threading.Lock()

    def finish(self, comm: Any = None, error: BaseException | None = None) -> bool:
        """Store the outcome; ``False`` if the replica already gave up (the caller must abort ``comm``)."""
        with self._lock:
            if self._abandoned:
                return False
            self.comm, self.error = comm, error
            self.done.set()
            return True

    def abandon(self) -> Any:
        """Give up waiting; returns a communicator that was made meanwhile (to abort), else ``None``."""
        with self._lock:
            self._abandoned = True
            comm, self.comm = self.comm, None
            return comm


class NcclEngine:
    """The NCCL side of one replica's collectives (see the module docstring).

    Parameters
    ----------
    rank, size
        This replica and the group size.
    mailbox
        The replica's mailbox: its run and group aborts end every wait.
    exchange
        ``exchange(key, value, deadline, attempt)``: meet every replica at the
        scheduler under ``key``, return ``{rank: value}`` (the runtime's
        ``ReplicaRuntime.exchange``); raises ``MailboxTimeout`` at ``deadline``.
    device
        ``CupyDevice`` (a fake in unit tests).
    bfloat16
        The whole group can reduce bfloat16 with NCCL.
    spin_seconds
        How long a wait spins before yielding (``backoff_wait``).
    """

    tag = " | nccl"  # what a collective that takes this engine adds to its signature (``engines.choice``)

    def __init__(self, rank: int, size: int, mailbox: Mailbox,
                 exchange: Callable[[str, Any, float, int], dict[int, Any]], device: Any,
                 bfloat16: bool = False, spin_seconds: float = 50e-6):
        self.rank = rank
        self.size = size
        self.mailbox = mailbox
        self.exchange = exchange
        self.device = device
        self.nccl = device.nccl
        self.bfloat16 = bfloat16
        self.spin_seconds = spin_seconds
        self.attempt = 0
        self.communicators_made = 0
        self._comm: Any = None
        self._comm_device: int | None = None
        self._comm_attempt = -1
        self._streams: dict[int, Any] = {}
        self._keys_used: set[str] = set()

    def __repr__(self) -> str:
        state = "none" if self._comm is None else f"attempt {self._comm_attempt} on GPU {self._comm_device}"
        return f"<NcclEngine rank={self.rank}/{self.size} communicator: {state}>"

    # -- what takes this path ------------------------------------------------------

    def accepts(self, array: Any) -> bool:
        """Whether ``array`` can go through NCCL (it is a GPU array)."""
        return bool(self.device.accepts(array))

    def reduces(self, dtype: Any) -> bool:
        """Whether NCCL can reduce ``dtype`` (else the generic algorithms do)."""
        return nccl_dtype_name(dtype, self.bfloat16) is not None

    # -- lifecycle -----------------------------------------------------------------

    def set_attempt(self, attempt: int) -> None:
        """The group's ``attempt`` (failed commands so far) starts; the first NCCL collective asks whether to keep
        the communicator (see the module's docstring)."""
        self.attempt = attempt

    def close(self) -> None:
        """Abort the communicator, if any (local; never waits for peers, which may be gone)."""
        self._drop()

    def _drop(self) -> None:
        comm, self._comm = self._comm, None
        self._comm_device = None
        if comm is not None:
            try:
                comm.abort()
            except Exception as e:  # an already broken communicator
                logger.debug("Aborting the NCCL communicator of replica %d: %s", self.rank, e)

    # -- collectives -----------------------------------------------------------------

    def all_reduce(self, call: CollectiveCall, packs: Sequence[Any], op: ReduceOp) -> None:
        """All-reduce each pack (``packing.Pack``) with NCCL; each pack's ``buffer`` becomes its result.

        A pack that owns its buffer is reduced in place; a borrowed one (the
        caller's array) into a new array.
        """
        call.check_signature()
        device = self._device_of([p.buffer for p in packs])
        nccl, dev = self.nccl, self.device
        with dev.using(device):
            plan = []
            for p in packs:
                buf = p.buffer
                out = self.device.xp.empty_like(buf) if p.borrowed else buf
                plan.append((buf, out, self._nccl_dtype(buf.dtype), getattr(nccl, nccl_op_name(op, buf.dtype))))
                call.nbytes += buf.nbytes

            def launch(comm: Any, stream: int) -> None:
                for buf, out, dtype, nccl_op in plan:
                    if buf.size:
                        comm.allReduce(dev.pointer(buf), dev.pointer(out), buf.size, dtype, nccl_op, stream)

            self._run(call, device, launch)
            for p, (_, out, _, _) in zip(packs, plan):
                finalize(op, out, self.size)
                p.buffer, p.borrowed = out, False

    def reduce_scatter(self, call: CollectiveCall, leaves: Sequence[Any], op: ReduceOp, axis: int) -> list[Any]:
        """Reduce each leaf and return this rank's part along ``axis`` (``numpy.array_split``'s parts).

        Parts of equal size take ``reduceScatter``; uneven ones an ``allReduce``
        of the whole of which each rank keeps its part.
        """
        call.check_signature()
        device = self._device_of(leaves)
        nccl, dev, xp, size, rank = self.nccl, self.device, self.device.xp, self.size, self.rank
        with dev.using(device):
            plan = []
            for leaf in leaves:
                moved = xp.moveaxis(leaf, axis, 0)
                rows, rest = moved.shape[0], moved.shape[1:]
                row = math.prod(rest)
                lengths = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
                start = sum(lengths[:rank])
                send = xp.ascontiguousarray(moved).reshape(-1)
                even = rows % size == 0
                out = xp.empty(lengths[rank] * row if even else send.size, leaf.dtype)
                plan.append((send, out, even, start, lengths[rank], rest, self._nccl_dtype(leaf.dtype),
                             getattr(nccl, nccl_op_name(op, leaf.dtype))))
                call.nbytes += send.nbytes

            def launch(comm: Any, stream: int) -> None:
                for send, out, even, _, _, _, dtype, nccl_op in plan:
                    if not out.size:
                        continue
                    if even:
                        comm.reduceScatter(dev.pointer(send), dev.pointer(out), out.size, dtype, nccl_op, stream)
                    else:
                        comm.allReduce(dev.pointer(send), dev.pointer(out), send.size, dtype, nccl_op, stream)

            self._run(call, device, launch)
            results = []
            for _send, out, even, start, length, rest, _, _ in plan:
                row = math.prod(rest)
                mine = out if even else out[start * row:(start + length) * row].copy()
                finalize(op, mine, size)
                results.append(xp.moveaxis(mine.reshape((length,) + tuple(rest)), 0, axis))
            return results

    def all_gather(self, call: CollectiveCall, leaves: Sequence[Any], axes: Sequence[int]) -> list[Any]:
        """Concatenate each leaf from every rank along its axis, in rank order (lengths may differ).

        First an ``allGather`` of every leaf's length along its axis, then one
        ``allGather`` of bytes per leaf, each padded to the longest.
        """
        call.check_signature()
        device = self._device_of(leaves)
        nccl, dev, xp, size = self.nccl, self.device, self.device.xp, self.size
        with dev.using(device):
            moved = [xp.moveaxis(leaf, a, 0) for leaf, a in zip(leaves, axes)]
            mine = xp.asarray([m.shape[0] for m in moved], dtype="int64")
            everyone = xp.empty((size, len(leaves)), dtype="int64")

            def launch_lengths(comm: Any, stream: int) -> None:
                comm.allGather(dev.pointer(mine), dev.pointer(everyone), len(leaves), nccl.NCCL_INT64, stream)

            self._run(call, device, launch_lengths)
            lengths = [[int(n) for n in row] for row in dev.to_host(everyone)]
            plan = []
            for i, m in enumerate(moved):
                longest = max(lengths[r][i] for r in range(size))
                if m.shape[0] == longest:
                    send = xp.ascontiguousarray(m)
                else:
                    send = xp.zeros((longest,) + m.shape[1:], m.dtype)
                    send[: m.shape[0]] = m
                recv = xp.empty((size, longest) + m.shape[1:], m.dtype)
                plan.append((send, recv))
                call.nbytes += send.nbytes

            def launch(comm: Any, stream: int) -> None:
                for send, recv in plan:
                    if send.nbytes:
                        comm.allGather(dev.pointer(send), dev.pointer(recv), send.nbytes, nccl.NCCL_UINT8, stream)

            self._run(call, device, launch)
            results = []
            for i, ((send, recv), a) in enumerate(zip(plan, axes)):
                counts = [lengths[r][i] for r in range(size)]
                if all(n == send.shape[0] for n in counts):
                    whole = recv.reshape((size * send.shape[0],) + send.shape[1:])
                else:
                    whole = xp.concatenate([recv[r, : counts[r]] for r in range(size)], axis=0)
                results.append(xp.moveaxis(whole, 0, a))
            return results

    def broadcast(self, call: CollectiveCall, leaves: Sequence[Any], root: int) -> list[Any]:
        """Every rank gets ``root``'s leaves (the root keeps its own, as on the generic path)."""
        call.check_signature()
        device = self._device_of(leaves)
        dev, xp = self.device, self.device.xp
        with dev.using(device):
            if self.rank == root:
                buffers = [xp.ascontiguousarray(leaf) for leaf in leaves]
            else:
                buffers = [xp.empty(leaf.shape, leaf.dtype) for leaf in leaves]
            call.nbytes += sum(b.nbytes for b in buffers) if self.rank == root else 0

            def launch(comm: Any, stream: int) -> None:
                for buf in buffers:  # in place: the root's buffer is read, the others' written
                    ptr = dev.pointer(buf) if buf.nbytes else 0
                    for offset in range(0, buf.nbytes, _BROADCAST_CHUNK):
                        count = min(_BROADCAST_CHUNK, buf.nbytes - offset)
                        comm.broadcast(ptr + offset, ptr + offset, count, self.nccl.NCCL_UINT8, root, stream)

            self._run(call, device, launch)
        return list(leaves) if self.rank == root else buffers

    # -- machinery -------------------------------------------------------------------

    def _nccl_dtype(self, dtype: Any) -> Any:
        """cupy's NCCL constant for ``dtype`` (``reduces`` says which dtypes have one)."""
        name = nccl_dtype_name(dtype, self.bfloat16)
        if name is None:
            raise TypeError(f"replica {self.rank}: NCCL cannot reduce dtype {dtype}")
        return getattr(self.nccl, name)

    def _device_of(self, arrays: Sequence[Any]) -> int:
        devices: set[int] = {int(self.device.device_of(a)) for a in arrays}
        if len(devices) != 1:
            raise ValueError(f"replica {self.rank}: one collective's GPU arrays are on several GPUs {sorted(devices)}")
        device = devices.pop()
        if self._comm is not None and device != self._comm_device:
            raise ValueError(
                f"replica {self.rank}: its NCCL communicator is on GPU {self._comm_device} but this collective's "
                f"arrays are on GPU {device}; keep a replica's arrays on one GPU"
            )
        return device

    def _run(self, call: CollectiveCall, device: int, launch: Callable[[Any, int], None]) -> None:
        """Make sure there is a communicator, wait for the inputs, enqueue ``launch`` and poll it to the end."""
        ready = self.device.record(None)  # the caller's stream, once it has written the inputs
        comm = self._communicator(call, device)
        # nothing is queued behind the caller's kernels: an abort never leaves an NCCL kernel waiting to start
        self._wait(call, lambda: self.device.done(ready), None)
        stream = self._streams[device]
        try:
            launch(comm, self.device.stream_pointer(stream))
            finished = self.device.record(stream)
            self._wait(call, lambda: self.device.done(finished), comm)
        except BaseException:
            self._drop()  # peers may be inside the same NCCL call: abort it; the next attempt re-makes it
            raise

    def _communicator(self, call: CollectiveCall, device: int) -> Any:
        """This attempt's communicator: the one held if every rank still holds one, else made now (unique id
        through the scheduler)."""
        if self._comm is not None and self._comm_attempt == self.attempt:
            return self._comm
        if self.attempt > 0 and self._keeps(call):
            self._comm_attempt = self.attempt
            return self._comm
        self._drop()
        key = f"nccl/{self.attempt}"
        if key in self._keys_used:  # every drop happens in a failing command, which starts a new attempt
            raise CollectiveAbortedError(
                f"replica {self.rank}: the NCCL communicator of attempt {self.attempt} was already made "
                "and dropped; the group must start a new command"
            )
        self._keys_used.add(key)
        mine = list(self.nccl.get_unique_id()) if self.rank == 0 else None
        try:
            values = self.exchange(key, mine, call.deadline, call.attempt)
        except MailboxTimeout:
            raise CollectiveTimeoutError(call.comm.describe_timeout(call, 0)) from None
        sent = values.get(0)
        if not sent:
            raise CollectiveAbortedError(f"replica {self.rank}: replica 0 sent no NCCL unique id under {key}")
        unique_id = tuple(int(b) for b in sent)  # msgpack made it a list; cupy wants a tuple
        comm = self._init(call, unique_id, device)
        if device not in self._streams:
            self._streams[device] = self.device.new_stream()
        self._comm, self._comm_device, self._comm_attempt = comm, device, self.attempt
        self.communicators_made += 1
        logger.debug("Replica %d made its NCCL communicator (attempt %d, GPU %d)", self.rank,
                     self.attempt, device)
        return comm

    def _keeps(self, call: CollectiveCall) -> bool:
        """Whether every rank still holds its communicator after a failed command (one exchange per attempt)."""
        key = f"nccl-keep/{self.attempt}"
        if key in self._keys_used:
            return False
        self._keys_used.add(key)
        try:
            held = self.exchange(key, self._comm is not None, call.deadline, call.attempt)
        except MailboxTimeout:
            raise CollectiveTimeoutError(call.comm.describe_timeout(call, 0)) from None
        keep = len(held) == self.size and all(held.values())
        if not keep and self._comm is not None:
            logger.debug("Replica %d: a peer dropped its NCCL communicator in a failed command; it is re-made",
                         self.rank)
        return keep

    def _init(self, call: CollectiveCall, unique_id: tuple[Any, ...], device: int) -> Any:
        """``NcclCommunicator(size, unique_id, rank)`` in a helper thread, waited for like a collective."""
        pending = _PendingInit()

        def body() -> None:
            try:
                with self.device.using(device):
                    comm = self.nccl.NcclCommunicator(self.size, unique_id, self.rank)
            except BaseException as e:
                pending.finish(error=e)
                return
            if not pending.finish(comm=comm):  # the replica gave up meanwhile
                comm.abort()

        threading.Thread(target=body, name=f"daskdist-nccl-init-{self.rank}", daemon=True).start()
        try:
            self._wait(call, pending.done.is_set, None)
        except BaseException:
            late = pending.abandon()
            if late is not None:
                late.abort()
            raise
        if pending.error is not None:
            raise CollectiveAbortedError(
                f"{call.kind} #{call.seq} of run {call.run_id}: replica {self.rank} could not make its NCCL "
                f"communicator: {describe_nccl_error(pending.error)}"
            ) from pending.error
        return pending.comm

    def _wait(self, call: CollectiveCall, ready: Callable[[], bool], comm: Any) -> None:
        """Poll ``ready`` until true, raising on an abort, an NCCL error of ``comm`` or the deadline."""
        mailbox, attempt, run_id = self.mailbox, call.attempt, call.run_id

        def check() -> None:
            mailbox.check(attempt)
            if comm is not None:
                try:
                    comm.check_async_error()
                except Exception as e:
                    raise _NcclFailure() from e

        try:
            backoff_wait(ready, call.deadline, check, self.spin_seconds)
        except MailboxTimeout:
            raise CollectiveTimeoutError(call.comm.describe_timeout(call, (self.rank - 1) % self.size)) from None
        except _NcclFailure as failure:
            cause = failure.__cause__ or failure  # raised from the NCCL error
            self._await_abort(attempt, call.deadline)  # a lost peer: prefer the scheduler's ReplicaLostError
            raise CollectiveAbortedError(
                f"{call.kind} #{call.seq} of run {run_id}: NCCL reported an error on replica {self.rank}: "
                f"{describe_nccl_error(cause)}"
            ) from cause

    def _await_abort(self, attempt: int, deadline: float, grace: float = 2.0) -> None:
        """After an NCCL error, give the group's own abort (which names the cause) a moment to arrive."""
        until = min(deadline, time.monotonic() + grace)
        while time.monotonic() < until:
            self.mailbox.check(attempt)
            time.sleep(0.01)
