"""``ProcessGroup``: the collectives of one membership generation, callable from any thread, sync or async.

A replica's runtime builds one root group per membership generation
(``replica/wiring.py``); ``ReplicaContext``'s collectives, the torch backend
and the Keras adapter all call it (``dd.get_replica_context().process_group``).
It can also be built on its own from a ``Communicator`` over any transport
(``build_process_group``), which is how it is tested.

Numbering and attempts
    Collectives are numbered per group, not per client command: a command
    boundary is a fence (``fence``), not a renumbering. Messages are tagged
    ``(attempt, number, src, name)``; the attempt (the client's count of failed
    commands) changes only after a failure, when numbering restarts on every
    replica together (``start_command``).

Ordering (decided here; torch's ``async_op`` semantics)
    * an async call (``async_op=True``) returns a ``Work`` at once; the
      collective runs on the generation's async threads. With
      ``daskdist.collective.async-window`` N above 1, up to N collectives of
      the generation are in flight together: each takes its collective
      number when it is issued (its messages are kept apart by their tags),
      and runs beside the others where the group's engines allow it (the
      generic engines over a transport; a group with a shared-memory lane,
      single copy or NCCL, and point-to-point work, run one at a time in
      issue order). Either way the works complete in issue order: when a
      ``Work`` is done (its ``wait`` returns, its callbacks ran), every work
      issued before it on this replica is done too. N = 1 is one FIFO thread;
    * a synchronous call first waits for the async work already issued,
      then runs inline on the caller's thread (no hand-off on the latency
      path);
    * one collective runs at a time per replica and generation (a lock, taken
      once a second thread has called one; the replica thread alone runs
      without it): calls from several threads are serialised in the order they take it,
      so threads that issue collectives concurrently must agree on an order
      across replicas themselves, as with any process group.

Aborts
    A collective that fails (mismatch, timeout, lost peer, a skipped
    collective) aborts the current attempt of the generation on every member,
    for the root group and all its subgroups: every pending and later
    collective of the attempt raises. ``abort(error)`` does the same on
    purpose. In a replica, the next client command after a failure starts a
    new attempt, and the group works again; a group lost with its generation
    (a replica lost) stays failed.

Timeout
    Every collective of a group has a deadline: the group's ``timeout``
    (``set_timeout``; default ``daskdist.collective.timeout``, read at each
    client command), unless its ``CommunicationOptions`` give one. A member
    that skips a collective makes it time out on the others, whose error
    names the member and the collective, and the abort reaches every member.

Subgroups
    ``new_group(ranks)`` is called by every member, with the same ranks; it
    returns a group for members and ``None`` for the others.
    ``member_group(ranks, key)`` is called by the members only, under a key
    they share (a torch group name). A subgroup has
    its own numbering and tag space over the root's transport (no
    shared-memory lane, single-copy or NCCL engine: the generic engines).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import zlib
from _thread import get_ident
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from daskdist import config
from daskdist.collective.core.communicator import Communicator
from daskdist.collective.mailbox import MailboxTimeout
from daskdist.collective.subgroup import P2P_SEQ, SubgroupControl, SubgroupTransport, subgroup_code
from daskdist.collective.work import Work
from daskdist.exceptions import CollectiveMismatchError, CollectiveTimeoutError
from daskdist.ops import CommunicationOptions, ReduceOp

__all__ = ["ProcessGroup", "Work"]

logger = logging.getLogger(__name__)

#: An async job: its place in issue order, future, function and arguments, settings, the collective number given at
#: issue (or ``None``), the communicator that number is of, and the last job issued before it that runs alone
#: (``-1``: none); ``alone``: the job runs with nothing else in flight.
_Job = tuple[int, "concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any] | None,
             int | None, Communicator | None, int, bool]


def async_window() -> int:
    """``daskdist.collective.async-window``: how many async collectives of a generation may be in flight together."""
    return max(1, int(config.get("collective.async-window", 1)))


#: What a job that runs beside others holds instead of the group's lock.
_NO_LOCK = contextlib.nullcontext()


class _Shared:
    """What the root group and its subgroups share: the lock, the FIFO thread, the subgroup registry."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()  # one collective at a time on this replica, in this generation
        # The thread that built the group (the replica thread) runs its collectives without the lock until
        # another thread calls one (``join``): the latency lane's 4 KiB all-reduce takes about 12 µs, and an
        # uncontended lock is a noticeable part of it. ``busy`` marks the owner inside a lock-free collective.
        self.owner = threading.get_ident()
        self.shared_by_threads = False
        self.busy = False
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.submit_lock = threading.Lock()  # keeps ``last`` the newest job of the queue
        self.last: concurrent.futures.Future[Any] | None = None  # the newest async job (all before it are older)
        self.issued = 0  # async jobs submitted, and finished with their future's callbacks run (``drain``)
        self.done = 0
        self.settled = threading.Condition(threading.Lock())
        self.window = async_window()
        self.threads: list[threading.Thread] = []
        self.last_alone = -1  # the newest job issued that runs alone
        self.groups: dict[int, ProcessGroup] = {}  # code -> group (the root is 0)
        self.settings = config.current_snapshot()
        self.closed = False

    def join(self) -> None:
        """A thread other than the owner is about to take the lock: from now on the owner takes it too."""
        if not self.shared_by_threads:
            self.shared_by_threads = True
            while self.busy:  # the owner's lock-free collective in flight (it re-checks the flag after ``busy``)
                time.sleep(0.0001)

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """``fn(*args)`` as the one collective in progress on this replica (see ``join``)."""
        if not self.shared_by_threads and get_ident() == self.owner:
            self.busy = True
            try:
                if not self.shared_by_threads:
                    return fn(*args)
            finally:
                self.busy = False
        elif get_ident() != self.owner:
            self.join()
        with self.lock:
            return fn(*args)

    def submit(self, kind: str, fn: Callable[..., Any], args: tuple[Any, ...],
               abort: Callable[[BaseException], None] | None = None, comm: Communicator | None = None) -> Work:
        """Issue ``fn(*args)`` as async work; ``comm``: it is a numbered collective of that communicator."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        settings = config.current_snapshot() or self.settings
        with self.submit_lock:
            if self.closed:
                raise RuntimeError(f"process group {self.name} is closed")
            if len(self.threads) < self.window and len(self.threads) < self.issued - self.done + 1:
                thread = threading.Thread(target=self._run, name=f"daskdist-pg-{self.name}-{len(self.threads)}",
                                          daemon=True)
                self.threads.append(thread)
                thread.start()
            index = self.issued
            number = None
            alone = True
            if self.window > 1 and comm is not None:  # numbered at issue: its place among the peers' is fixed
                number = comm.reserve_number()
                alone = not comm.concurrent_safe
            if alone:
                self.last_alone = index
            self.last = future
            self.issued += 1
            self.jobs.put((index, future, fn, args, settings, number, comm, self.last_alone if not alone else -1,
                           alone))
        return Work(future, kind, abort)

    def drain(self) -> None:
        """Wait until every async job issued so far has finished, its future's callbacks included (a
        ``Work.then`` chained on it is complete too); never raises."""
        last = self.last
        if last is None:
            return
        issued = self.issued
        concurrent.futures.wait([last])
        with self.settled:
            while self.done < issued and not (self.closed and not any(t.is_alive() for t in self.threads)):
                self.settled.wait(0.1)
        with self.submit_lock:
            if self.last is last:
                self.last = None

    def _run(self) -> None:
        self.join()
        while True:
            job = self.jobs.get()
            if job is None:
                return
            index, future, fn, args, settings, number, comm, after, alone = job
            # a job that runs alone waits for every earlier one, the others for the last of those (a window's
            # threads outlive a smaller window set at a later command: the order holds whatever their number)
            self._wait_until_done(index if alone else after + 1)
            error: BaseException | None = None
            result: Any = None
            if future.set_running_or_notify_cancel():
                try:
                    with config.use_snapshot(settings), self.lock if alone else _NO_LOCK:
                        if comm is not None and number is not None:
                            comm.use_number(number)
                        try:
                            result = fn(*args)
                        finally:
                            if comm is not None and number is not None:
                                comm.use_number(None)
                except BaseException as e:
                    error = e
                self._wait_until_done(index)  # complete in issue order
                if error is not None:
                    future.set_exception(error)  # runs the future's callbacks here
                else:
                    future.set_result(result)
            else:
                self._wait_until_done(index)
            with self.settled:
                self.done += 1
                self.settled.notify_all()
            del job, future, args, result, error

    def _wait_until_done(self, count: int) -> None:
        """Wait until the first ``count`` async jobs are done (jobs complete in issue order)."""
        if self.done >= count:
            return
        with self.settled:
            while self.done < count:
                self.settled.wait()

    def close(self) -> None:
        with self.submit_lock:
            self.closed = True
            threads = list(self.threads)
            for _ in threads:
                self.jobs.put(None)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)  # the work queued finishes (or fails at once after an abort)


class ProcessGroup:
    """The collectives of one group of replicas in one membership generation.

    Parameters
    ----------
    communicator
        Runs the collectives (rank, size, transport, engines).
    name
        Names the group (in thread names, errors and ``repr``; a torch
        backend's group name).
    generation
        The membership generation this group belongs to.
    ranks
        The global rank (rank in the root group) of each member; default:
        ``0 .. size - 1``.

    Attributes
    ----------
    rank, size
        This replica's rank in the group, and the number of members.
    ranks
        The global rank of each member.
    """

    def __init__(self, communicator: Communicator, name: str = "default", generation: int = 0,
                 ranks: Sequence[int] | None = None, *, _shared: _Shared | None = None,
                 _path: tuple[int, ...] = (), _root_members: Sequence[int] | None = None):
        self._comm = communicator
        self.rank = communicator.rank
        self.size = communicator.size
        self.name = name
        self.generation = generation
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(self.size))
        self._shared = _shared if _shared is not None else _Shared(name)
        self._path = _path
        self._code = subgroup_code(_path)
        self._root_members = list(_root_members) if _root_members is not None else list(range(self.size))
        self._children = 0  # new_group calls so far (every member counts them alike)
        self._p2p: dict[tuple[str, int, int], int] = {}  # (direction, peer, tag) -> messages so far in this attempt
        self._p2p_attempt = communicator.attempt
        self._shared.groups[self._code] = self
        self.inline_all_reduce = self._inline_all_reduce()

    def __repr__(self) -> str:
        return (f"<ProcessGroup {self.name} rank={self.rank}/{self.size} generation={self.generation} "
                f"attempt={self._comm.attempt}>")

    @property
    def communicator(self) -> Communicator:
        """The communicator that runs this group's collectives."""
        return self._comm

    @property
    def attempt(self) -> int:
        """The current attempt: how many of the client's commands had failed when the current one started."""
        return self._comm.attempt

    @property
    def closed(self) -> bool:
        """Whether the group's generation closed (its replica closed, or the group moved to a newer generation)."""
        return self._shared.closed

    def check_open(self) -> None:
        """Raise ``RuntimeError`` if the group's generation closed (``closed``)."""
        if self._shared.closed:
            raise RuntimeError(f"process group {self.name} (generation {self.generation}) is closed: its replica "
                               "closed or the group moved to a newer membership generation")

    @property
    def timeout(self) -> float:
        """The deadline of each collective of this group, in seconds (see ``set_timeout``)."""
        return float(self._comm.default_timeout)

    def set_timeout(self, seconds: float | None) -> None:
        """Make ``seconds`` this group's deadline for every collective (``None``: ``daskdist.collective.timeout``).

        It holds until changed (client commands do not reset it) for this
        group only: the root group's timeout is not its subgroups'.
        """
        self._comm.set_timeout(seconds)

    @property
    def sequence_number(self) -> int:
        """The number of this group's collectives begun in the current attempt (the number of the last one)."""
        return int(self._comm.seq)

    # -- collectives -------------------------------------------------------------

    def all_reduce(self, op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None, *,
                   async_op: bool = False, in_place: bool = False) -> Any:
        """Reduce ``value`` (a nested structure of arrays) across the members; the same structure back.

        ``async_op=True``: a ``Work`` whose result is that structure.
        ``in_place=True``: the result may be written into ``value``'s own
        memory (``Communicator.all_reduce``); the structure returned may still
        hold new arrays (small values, leaves fused into packs), so a caller
        that needs its arrays updated copies those back.
        """
        shared = self._shared
        if async_op:
            return shared.submit("all_reduce", self._comm.all_reduce, (op, value, options, in_place), self.abort,
                                 self._comm)
        if shared.closed:
            self.check_open()
        if shared.last is not None:
            shared.drain()
        return shared.call(self._comm.all_reduce, (op, value, options, in_place))

    def all_gather(self, value: Any, axis: int = 0, options: CommunicationOptions | None = None, *,
                   async_op: bool = False) -> Any:
        """Concatenate each leaf of ``value`` from every member along ``axis``, in rank order."""
        return self._call("all_gather", self._comm.all_gather, (value, axis, options), async_op)

    def reduce_scatter(self, op: ReduceOp | str, value: Any, axis: int = 0,
                       options: CommunicationOptions | None = None, *, async_op: bool = False) -> Any:
        """Reduce ``value`` across the members; each gets its part along ``axis`` (``numpy.array_split`` parts)."""
        return self._call("reduce_scatter", self._comm.reduce_scatter, (op, value, axis, options), async_op)

    def broadcast(self, value: Any, root: int = 0, options: CommunicationOptions | None = None, *,
                  async_op: bool = False) -> Any:
        """Member ``root``'s ``value`` (``root``: a rank of this group) on every member."""
        self._check_rank(root, "broadcast root")
        return self._call("broadcast", self._comm.broadcast, (value, root, options), async_op)

    def all_gather_objects(self, obj: Any, options: CommunicationOptions | None = None, *,
                           async_op: bool = False) -> Any:
        """Every member's picklable ``obj``, in rank order."""
        return self._call("all_gather_objects", self._comm.all_gather_objects, (obj, options), async_op)

    def barrier(self, options: CommunicationOptions | None = None, *, async_op: bool = False) -> Any:
        """Return once every member has reached this barrier."""
        return self._call("barrier", self._comm.barrier, (options,), async_op)

    # -- point to point ---------------------------------------------------------------

    def send(self, value: Any, dst: int, tag: int = 0, *, async_op: bool = False) -> Any:
        """Send ``value`` (an array or a nested structure of them) to member ``dst``.

        The k-th ``send`` to ``dst`` under ``tag`` meets the k-th ``recv``
        from this member under ``tag`` there (within an attempt). Returns once
        ``value`` may be reused (``async_op``: a ``Work``).
        """
        self._check_peer(dst, "send to")
        return self._call("send", self._send, (value, dst, int(tag)), async_op)

    def recv(self, src: int, tag: int = 0, *, async_op: bool = False) -> Any:
        """The value member ``src`` sent under ``tag`` (``async_op``: a ``Work`` whose result it is)."""
        self._check_peer(src, "receive from")
        return self._call("recv", self._recv, (src, int(tag)), async_op)

    # -- groups and lifecycle ------------------------------------------------------------

    def new_group(self, ranks: Sequence[int], name: str | None = None, *,
                  timeout: float | None = None) -> ProcessGroup | None:
        """A subgroup of the members ``ranks`` (ranks of this group); ``None`` on the other members.

        Every member of this group must call it, with the same ranks (a
        collective of this group: members that disagree all raise
        ``CollectiveMismatchError``). ``timeout``: the subgroup's deadline
        (``set_timeout``); default: this group's.
        """
        wanted = sorted({int(r) for r in ranks})
        if not wanted or any(not 0 <= r < self.size for r in wanted) or len(wanted) != len(list(ranks)):
            raise ValueError(f"new_group needs distinct ranks of this group (0..{self.size - 1}); got {list(ranks)!r}")
        index = self._children
        self._children += 1
        everyone = self.all_gather_objects(("new_group", index, wanted))
        for rank, proposal in enumerate(everyone):
            if proposal != everyone[0]:
                raise CollectiveMismatchError(
                    f"new_group on {self.name}: member 0 asked for ranks {everyone[0][2]} (subgroup #{everyone[0][1]}) "
                    f"but member {rank} asked for {proposal[2]} (subgroup #{proposal[1]})")
        if self.rank not in wanted:
            return None
        return self._subgroup(wanted, self._path + (index,), name or f"{self.name}/{index}", timeout)

    def member_group(self, ranks: Sequence[int], key: str, name: str | None = None, *,
                     timeout: float | None = None) -> ProcessGroup:
        """A subgroup of the members ``ranks`` (ranks of this group), made by those members only.

        Every member calls it with the same ranks and the same ``key``, which
        names the subgroup in this generation (torch's group name); members
        that disagree on the ranks raise ``CollectiveMismatchError``. The
        other members of this group take no part (as torch's ``new_group``
        of a backend made per member).
        """
        wanted = sorted({int(r) for r in ranks})
        if self.rank not in wanted or any(not 0 <= r < self.size for r in wanted) or len(wanted) != len(list(ranks)):
            raise ValueError(f"member_group needs distinct ranks of {self.name} (0..{self.size - 1}) including "
                             f"this member ({self.rank}); got {list(ranks)!r}")
        path = (*self._path, -1 - zlib.crc32(key.encode()))
        made = self._shared.groups.get(subgroup_code(path))
        if made is not None and made._root_members == [self._root_members[r] for r in wanted]:
            if timeout is not None:
                made.set_timeout(timeout)
            return made  # made under this key before (a torch world made again in the same generation)
        group = self._subgroup(wanted, path, name or key, timeout)
        everyone = group.all_gather_objects((key, wanted))
        for rank, proposal in enumerate(everyone):
            if proposal != everyone[0]:
                raise CollectiveMismatchError(
                    f"member_group on {self.name}: member 0 asked for ranks {everyone[0][1]} under {everyone[0][0]!r} "
                    f"but member {rank} asked for {proposal[1]} under {proposal[0]!r}")
        return group

    def _subgroup(self, wanted: list[int], path: tuple[int, ...], name: str, timeout: float | None) -> ProcessGroup:
        code = subgroup_code(path)
        root = self._shared.groups[0]._comm
        members = [self._root_members[r] for r in wanted]
        parent = self._comm
        comm = Communicator(
            wanted.index(self.rank), len(wanted), SubgroupTransport(root.transport, members, code),
            SubgroupControl(root.control, members, code), algorithm=parent.algorithm, options=parent.options,
            on_collective=parent.on_collective, hosts=[parent.hosts[r] for r in wanted], on_stall=parent.on_stall,
            single_copy_bytes=None,
        )
        comm.attempt, comm.run_id = root.attempt, root.run_id
        comm.set_timeout(parent.timeout_override if timeout is None else timeout)
        return ProcessGroup(comm, name, self.generation, [self.ranks[r] for r in wanted], _shared=self._shared,
                            _path=path, _root_members=members)

    def fence(self) -> None:
        """A command boundary: wait for every async collective issued so far (their errors stay in their ``Work``)."""
        self._shared.drain()

    def start_command(self, run_id: int, attempt: int) -> None:
        """For the replica runtime: client command ``run_id`` starts in ``attempt`` (its count of failed commands).

        A fence; when ``attempt`` is new, numbering restarts on the root group
        and every subgroup, and what is left of earlier attempts is dropped.
        """
        self._shared.drain()
        if get_ident() != self._shared.owner:
            self._shared.join()
        self._shared.window = async_window()  # the command's settings
        with self._shared.lock:
            for group in self._shared.groups.values():
                group._comm.begin_attempt(attempt)
                group._comm.begin_command(run_id)

    def abort(self, error: BaseException) -> None:
        """Abort the current attempt of this generation on every member: its pending and later collectives raise."""
        self._comm.abort_attempt(error)

    def collective_numbers(self) -> dict[str, int]:
        """The number of the last collective of each subgroup of the generation (status probes)."""
        return {str(code): group._comm.seq for code, group in list(self._shared.groups.items()) if code}

    def close(self) -> None:
        """Stop the FIFO thread (after the work queued) and every communicator of the generation's groups."""
        self._shared.close()
        for group in list(self._shared.groups.values()):
            group._comm.close()

    # -- machinery --------------------------------------------------------------------

    def _inline_all_reduce(self) -> Callable[..., Any]:
        """``all_reduce(reduce_op, value, options=None, in_place=False)``, synchronous, with no attribute lookups.

        What ``ReplicaContext.all_reduce`` and the torch backend's synchronous
        all-reduce bind: a small all-reduce takes about 12 µs, and each lookup
        on the way to the lane is a noticeable part of it.
        """
        shared = self._shared
        lock = shared.lock
        owner = shared.owner
        all_reduce = self._comm.all_reduce
        check_open = self.check_open

        def inline_all_reduce(reduce_op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None,
                              in_place: bool = False) -> Any:
            if shared.closed:
                check_open()
            if shared.last is not None:
                shared.drain()
            if not shared.shared_by_threads and get_ident() == owner:  # as ``_Shared.call``, inlined
                shared.busy = True
                try:
                    if not shared.shared_by_threads:
                        return all_reduce(reduce_op, value, options, in_place)
                finally:
                    shared.busy = False
            elif get_ident() != owner:
                shared.join()
            with lock:
                return all_reduce(reduce_op, value, options, in_place)

        return inline_all_reduce

    def _call(self, kind: str, fn: Callable[..., Any], args: tuple[Any, ...], async_op: bool) -> Any:
        shared = self._shared
        if async_op:
            return shared.submit(kind, fn, args, self.abort, None if kind in ("send", "recv") else self._comm)
        if shared.closed:
            self.check_open()
        if shared.last is not None:
            shared.drain()
        return shared.call(fn, args)

    def _check_rank(self, rank: int, what: str) -> None:
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.size:
            raise ValueError(f"{what} {rank!r} is not a rank of {self.name} (0..{self.size - 1})")

    def _check_peer(self, peer: int, what: str) -> None:
        self._check_rank(peer, f"{what} rank")
        if peer == self.rank:
            raise ValueError(f"member {self.rank} of {self.name} cannot {what} itself")

    def _p2p_tag(self, direction: str, peer: int, tag: int, src: int) -> tuple[int, int, int, str]:
        comm = self._comm
        if self._p2p_attempt != comm.attempt:
            self._p2p.clear()
            self._p2p_attempt = comm.attempt
        key = (direction, peer, tag)
        n = self._p2p.get(key, 0)
        self._p2p[key] = n + 1
        return (comm.attempt, P2P_SEQ, src, f"p2p/{tag}/{n}")

    def _send(self, value: Any, dst: int, tag: int) -> None:
        comm = self._comm
        comm.check_aborted()
        message_tag = self._p2p_tag("send", dst, tag, self.rank)
        deadline = time.monotonic() + comm.default_timeout
        try:
            comm.transport.send(dst, message_tag, value).wait(deadline)
        except Exception as e:
            comm.abort_attempt(e)
            raise

    def _recv(self, src: int, tag: int) -> Any:
        comm = self._comm
        comm.check_aborted()
        message_tag = self._p2p_tag("recv", src, tag, src)
        timeout = comm.default_timeout
        deadline = time.monotonic() + timeout
        try:
            try:
                value = comm.transport.recv(src, message_tag, deadline)
            except MailboxTimeout:
                raise CollectiveTimeoutError(
                    f"recv #{message_tag[3].rsplit('/', 1)[1]} from member {src} of {self.name} under tag {tag} "
                    f"timed out after {timeout:g}s on member {self.rank}"
                ) from None
        except Exception as e:
            comm.abort_attempt(e)
            raise
        return value.copy() if isinstance(value, np.ndarray) else value


def build_process_group(communicator: Communicator, name: str = "default", generation: int = 0) -> ProcessGroup:
    """The root group of a generation over ``communicator`` (any transport: a replica's, or a test's)."""
    return ProcessGroup(communicator, name, generation)
