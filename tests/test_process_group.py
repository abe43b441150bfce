"""The process-group layer (``daskdist.collective.process_group``): on its own, then on real workers.

On its own: process groups over the in-memory fake of ``tests/fakes.py``
(no cluster, no ``Worker``), and over ``DaskTransport`` built from an RPC
callable between real Dask workers. Then inside replicas
(``dd.get_replica_context().process_group``) over the shared-memory, socket
and Dask transports between worker processes.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist import config
from daskdist.collective.core.communicator import Communicator
from daskdist.collective.mailbox import Abort, Mailbox
from daskdist.collective.process_group import ProcessGroup, build_process_group
from daskdist.collective.transport.dask import DaskTransport
from daskdist.collective.work import Work
from daskdist.exceptions import CollectiveAbortedError, CollectiveMismatchError, CollectiveTimeoutError

from .fakes import InMemoryGroup

_MADE: list[ProcessGroup] = []  # closed after each test: each runs a FIFO thread once it has async work


@pytest.fixture(autouse=True)
def _groups_closed():
    yield
    while _MADE:
        _MADE.pop().close()


def _groups(size: int) -> tuple[InMemoryGroup, list[ProcessGroup]]:
    fake = InMemoryGroup(size)
    groups = [build_process_group(c, "test") for c in fake.comms]
    _MADE.extend(groups)
    return fake, groups


def _run(fake: InMemoryGroup, groups: list[ProcessGroup], fn, timeout: float = 60) -> list:
    """``fn(group)`` on every rank as one command (exceptions returned), then a fence, as the runtime does."""

    def body(comm):
        group = groups[comm.rank]
        try:
            return fn(group)
        finally:
            group.fence()

    return fake.run_ranks(body, timeout=timeout)


# -- on its own, over the in-memory fake ------------------------------------------------------


def test_sync_and_async_collectives_give_the_same_results():
    fake, groups = _groups(3)

    def fn(g: ProcessGroup):
        x = np.arange(4.0) + g.rank
        works = [
            g.all_reduce("SUM", x, async_op=True),
            g.all_gather(x, async_op=True),
            g.reduce_scatter("SUM", np.arange(6.0), async_op=True),
            g.broadcast(x, root=2, async_op=True),
            g.all_gather_objects({"r": g.rank}, async_op=True),
            g.barrier(async_op=True),
        ]
        assert all(isinstance(w, Work) for w in works)
        sync = [g.all_reduce("SUM", x), g.all_gather(x), g.reduce_scatter("SUM", np.arange(6.0)),
                g.broadcast(x, root=2), g.all_gather_objects({"r": g.rank}), g.barrier()]
        done = [w.wait(timeout=30) for w in works]
        assert all(w.is_completed() and w.is_success() and w.exception() is None for w in works)
        assert works[0].get_future().result() is done[0]
        return done, sync

    inputs = [np.arange(4.0) + r for r in range(3)]
    for rank, (done, sync) in enumerate(_run(fake, groups, fn)):
        for a, b in zip(done, sync):
            if isinstance(a, np.ndarray):
                assert np.array_equal(a, b)
            else:
                assert a == b
        assert done[0].tolist() == [3.0, 6.0, 9.0, 12.0]
        # against numpy too: async and sync share one engine, so comparing them cannot see its bugs
        np.testing.assert_array_equal(done[1], np.concatenate(inputs))
        np.testing.assert_array_equal(done[2], np.array_split(3 * np.arange(6.0), 3)[rank])
        assert done[3].tolist() == [2.0, 3.0, 4.0, 5.0]
        assert done[4] == [{"r": 0}, {"r": 1}, {"r": 2}]


def test_numbering_goes_on_across_commands_and_restarts_only_in_a_new_attempt():
    fake, groups = _groups(2)
    assert [g.rank for g in groups] == [0, 1] and groups[0].ranks == (0, 1) and groups[0].size == 2
    _run(fake, groups, lambda g: [g.all_reduce("SUM", np.ones(2)) for _ in range(3)])
    _run(fake, groups, lambda g: g.barrier())
    assert [g.communicator.seq for g in groups] == [4, 4]  # a command boundary is a fence, not a renumbering
    assert [g.attempt for g in groups] == [0, 0]

    out = _run(fake, groups, lambda g: g.all_reduce("SUM", np.ones(2 + g.rank)))  # a mismatch: the command fails
    assert all(isinstance(e, CollectiveMismatchError | CollectiveAbortedError) for e in out), out
    out = _run(fake, groups, lambda g: g.all_reduce("SUM", np.ones(2)))
    assert [g.attempt for g in groups] == [1, 1] and [g.communicator.seq for g in groups] == [1, 1]
    assert [r.tolist() for r in out] == [[2.0, 2.0]] * 2


def test_async_work_runs_in_issue_order_and_a_sync_call_waits_for_it():
    fake, groups = _groups(3)

    def fn(g: ProcessGroup):
        works = [g.all_reduce("SUM", np.full(3, float(i)), async_op=True) for i in range(20)]
        works.append(g.all_gather_objects(g.rank, async_op=True))
        last = g.all_reduce("MAX", np.array([g.rank]))  # inline, after every async one
        assert all(w.is_completed() for w in works)
        return [w.result()[0] for w in works[:20]], works[20].result(), int(last[0])

    for sums, objects, last in _run(fake, groups, fn):
        assert sums == [3.0 * i for i in range(20)]
        assert objects == [0, 1, 2] and last == 2


def _slowed(groups: list[ProcessGroup], peak: dict[int, int]) -> None:
    """Make each group's all-reduces start after a random pause of up to 10 ms; ``peak``: most at once, per rank."""
    lock = threading.Lock()
    in_flight = dict.fromkeys(range(len(groups)), 0)
    peak.update(in_flight)
    for g in groups:
        original, rng, rank = g.communicator.all_reduce, random.Random(g.rank), g.rank

        def all_reduce(*args, original=original, rng=rng, rank=rank, **kwargs):
            with lock:
                in_flight[rank] += 1
                peak[rank] = max(peak[rank], in_flight[rank])
            try:
                time.sleep(rng.uniform(0, 0.01))  # each rank starts its collectives in its own order
                return original(*args, **kwargs)
            finally:
                with lock:
                    in_flight[rank] -= 1

        g.communicator.all_reduce = all_reduce


@pytest.mark.parametrize("window", [1, 4])
def test_async_collectives_in_a_window_overlap_keep_their_numbers_and_complete_in_issue_order(window):
    """With ``async-window`` 4 up to four async all-reduces run at once, each rank starting them in a random order:
    each still meets its own peers (numbered at issue), the works complete in issue order (callbacks and ``wait``),
    and a synchronous call after them sees every result. Failed with the numbers taken when a collective starts
    (sums mixed up or a mismatch) and with completion as each finished (callbacks out of order)."""
    with dask.config.set({"daskdist.collective.async-window": window}):
        fake, groups = _groups(3)
    peak: dict[int, int] = {}
    _slowed(groups, peak)

    def fn(g: ProcessGroup):
        completed: list[int] = []
        works = [g.all_reduce("SUM", np.full(3, float(i + g.rank)), async_op=True) for i in range(24)]
        for i, w in enumerate(works):
            w.get_future().add_done_callback(lambda _, i=i: completed.append(i))
        middle = works[12].wait()
        assert all(w.is_completed() for w in works[:12])  # an earlier work is done when a later one is
        last = g.all_reduce("MAX", np.array([g.rank]))  # inline, after every async one
        assert all(w.is_completed() for w in works)
        return [w.result()[0] for w in works], completed, float(middle[0]), int(last[0])

    for sums, completed, middle, last in _run(fake, groups, fn):
        assert sums == [3.0 * i + 3 for i in range(24)]
        assert completed == list(range(24)) and middle == 39.0 and last == 2
    assert all(n == 1 for n in peak.values()) if window == 1 else all(n > 1 for n in peak.values())


@pytest.mark.parametrize("senders", ["all", "first"])
def test_an_async_window_over_shared_memory_and_sockets_runs_large_all_reduces_one_at_a_time(threaded_client, senders):
    """Replicas on two hosts, two of them sharing one (shared memory between them, sockets across): large async
    all-reduces in a window of 4 each get their own sum. Failed with the window letting them run at once where
    shared memory carries part of a collective (a large message's pieces from two collectives interleaved in one
    channel: a piece read as a message, or a timeout), at 2 hosts x 2 replicas in either hierarchical mode."""
    settings = {"daskdist.collective.hosts": "blocks:2", "daskdist.collective.async-window": 4,
                "daskdist.collective.hierarchical-senders": senders, "daskdist.collective.timeout": "60s"}
    with dask.config.set(settings), dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            group, rank = ctx.process_group, ctx.replica_id_in_sync_group
            routes = "+".join(sorted({t.name for t in dd.context.current_runtime().transport.routes_by_peer().values()}))
            works = [group.all_reduce("SUM", np.full(1 << 20, float(i + rank), np.float32), async_op=True)
                     for i in range(8)]  # 4 MiB each: many shared-memory pieces, the hierarchical engine
            return [(float(w.wait()[0]), float(w.result()[-1])) for w in works], routes

        results = strategy.experimental_local_results(strategy.run(fn))
    n = len(results)
    assert "shm+socket" in {routes for _, routes in results}  # both transports carry the collectives
    for sums, _ in results:
        assert sums == [(n * i + n * (n - 1) / 2,) * 2 for i in range(8)]


def test_waiting_on_a_work_whose_collective_timed_out_raises_the_collectives_error():
    """``Work.wait()`` turned the collective's own ``CollectiveTimeoutError`` (a ``TimeoutError``, like the
    future's wait timeout) into a ``TypeError`` formatting ``timeout=None``; now it raises the collective's error."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(CollectiveTimeoutError("all_reduce #3: data from replica 2 did not arrive in time"))
    work = Work(future, "all_reduce")
    for timeout in (None, 5.0):
        with pytest.raises(CollectiveTimeoutError, match="did not arrive in time"):
            work.wait(timeout)
    pending = Work(concurrent.futures.Future(), "all_reduce")
    with pytest.raises(TimeoutError, match="did not complete within 0.01s"):
        pending.wait(0.01)


def test_a_message_wakes_only_the_collective_waiting_for_it_and_an_abort_wakes_them_all(monkeypatch):
    """Collectives of a window wait in the mailbox at once: a message wakes the thread waiting for its tag,
    not every waiter (one wake-up per message). Failed with one condition notified to all (each message woke
    the three other waiters too)."""
    from daskdist.collective import mailbox as mailbox_module

    wakes: dict[str, int] = {}

    class CountingCondition(threading.Condition):  # what every wait sleeps on (an Event waits on one too)
        def wait(self, timeout=None):
            woke = super().wait(timeout)
            name = threading.current_thread().name
            wakes[name] = wakes.get(name, 0) + 1
            return woke

    monkeypatch.setattr(mailbox_module.threading, "Condition", CountingCondition)
    box = Mailbox()
    got: dict[str, object] = {}

    def waiter(seq):
        try:
            got[f"w{seq}"] = box.take((0, seq, 1, "d"), time.monotonic() + 30)
        except Exception as e:
            got[f"w{seq}"] = e

    threads = [threading.Thread(target=waiter, args=(seq,), name=f"w{seq}") for seq in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # all four wait
    for seq in range(3):
        box.put((0, seq, 1, "d"), seq)
        threads[seq].join(30)
        time.sleep(0.1)  # any other waiter woken by it is back asleep before the next message
    assert [got[f"w{seq}"] for seq in range(3)] == [0, 1, 2]
    assert [wakes.get(f"w{seq}", 0) for seq in range(4)] == [1, 1, 1, 0]  # the fourth slept through all three
    box.abort_attempt(0, Abort("aborted", "stop", 1))
    threads[3].join(30)
    assert isinstance(got["w3"], CollectiveAbortedError) and wakes["w3"] == 1


def test_an_in_place_all_reduce_reduces_into_the_callers_array_and_the_default_only_reads_it():
    """``in_place=True`` (the torch backend's all-reduce): a contiguous array is reduced where it lies.

    Shown failing with ``in_place`` ignored (the pack borrowed): the result is a pooled buffer, ``x`` unchanged.
    """
    fake, groups = _groups(3)
    n = 1 << 16  # 512 KiB of float64: above small-message-bytes, so the ring takes it

    def fn(g: ProcessGroup):
        x = np.arange(n, dtype=np.float64) + g.rank
        kept = x.copy()
        plain = g.all_reduce("SUM", x)
        untouched = np.array_equal(x, kept)
        y = np.arange(n, dtype=np.float64) + g.rank
        into = g.all_reduce("SUM", y, in_place=True)
        z = np.arange(n, dtype=np.float64) + g.rank
        work = g.all_reduce("SUM", z, async_op=True, in_place=True)
        later = work.wait(timeout=30)
        small = g.all_reduce("SUM", np.ones(3), in_place=True)  # a new array: the caller copies such back
        return untouched, np.shares_memory(plain, x), np.shares_memory(into, y), np.array_equal(y, plain), \
            np.shares_memory(later, z), np.array_equal(z, plain), small.tolist()

    expected = 3 * np.arange(n, dtype=np.float64) + 3
    for untouched, plain_shares, into_shares, y_summed, later_shares, z_summed, small in _run(fake, groups, fn):
        assert untouched and not plain_shares
        assert into_shares and y_summed and later_shares and z_summed
        assert small == [3.0, 3.0, 3.0]
    assert np.array_equal(_run(fake, groups, lambda g: g.all_reduce("SUM", np.arange(n, dtype=np.float64) + g.rank,
                                                                    in_place=True))[0], expected)


def test_collectives_from_other_threads_of_the_replica():
    fake, groups = _groups(2)

    def fn(g: ProcessGroup):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # e.g. a framework's communication thread
            first = pool.submit(lambda: g.all_reduce("SUM", np.ones(5))).result()
            work = pool.submit(lambda: g.all_reduce("SUM", np.ones(5) * 2, async_op=True)).result()
        return first.tolist(), work.wait().tolist()

    assert _run(fake, groups, fn) == [([2.0] * 5, [4.0] * 5)] * 2


def test_subgroups_have_their_own_numbering_and_members():
    fake, groups = _groups(4)

    def fn(g: ProcessGroup):
        evens = g.new_group([0, 2])
        odds = g.new_group([1, 3])
        mine = evens if g.rank % 2 == 0 else odds
        assert (evens is None) == (g.rank % 2 == 1) and (odds is None) == (g.rank % 2 == 0)
        total = mine.all_reduce("SUM", np.array([float(g.rank)]))
        gathered = mine.all_gather(np.array([g.rank]), async_op=True).wait()
        pair = mine.new_group([0])  # nested: a group of one
        alone = pair.all_reduce("SUM", np.ones(1)) if pair is not None else None
        world = g.all_reduce("SUM", np.ones(1))
        return (mine.rank, mine.size, mine.ranks, total.tolist(), gathered.tolist(),
                None if alone is None else alone.tolist(), world.tolist(), mine.communicator.seq)

    out = _run(fake, groups, fn)
    assert out[0] == (0, 2, (0, 2), [2.0], [0, 2], [1.0], [4.0], 3)  # all-reduce, all-gather, new_group
    assert out[3] == (1, 2, (1, 3), [4.0], [1, 3], None, [4.0], 3)
    assert [g.communicator.seq for g in groups] == [3] * 4  # two new_group exchanges and one all-reduce


def test_new_group_refuses_bad_or_disagreeing_ranks_on_every_member():
    fake, groups = _groups(3)
    with pytest.raises(ValueError, match="distinct ranks"):
        groups[0].new_group([0, 5])
    with pytest.raises(ValueError, match="distinct ranks"):
        groups[0].new_group([1, 1])
    out = _run(fake, groups, lambda g: g.new_group([0, 1] if g.rank else [0, 2]))
    assert all(isinstance(e, CollectiveMismatchError) and "new_group" in str(e) for e in out), out


def test_send_and_recv_pair_by_peer_tag_and_order():
    fake, groups = _groups(3)

    def fn(g: ProcessGroup):
        if g.rank == 0:
            g.send(np.arange(3), 2, tag=7)
            g.send({"a": np.ones(2), "b": [1, 2]}, 2)
            work = g.send(np.zeros(1), 2, tag=7, async_op=True)
            work.wait()
            return "sent"
        if g.rank == 2:
            untagged = g.recv(0)  # the second message, under tag 0
            first, second = g.recv(0, tag=7), g.recv(0, tag=7, async_op=True).wait()
            return untagged["a"].tolist(), untagged["b"], first.tolist(), second.tolist()
        return None

    out = _run(fake, groups, fn)
    assert out[0] == "sent" and out[1] is None
    assert out[2] == ([1.0, 1.0], [1, 2], [0, 1, 2], [0.0])
    with pytest.raises(ValueError, match="itself"):
        groups[1].send(np.ones(1), 1)
    with pytest.raises(ValueError, match="not a rank"):
        groups[1].recv(3)


def test_a_failed_async_collective_is_in_its_work_on_every_member():
    fake, groups = _groups(3)

    def fn(g: ProcessGroup):
        work = g.all_reduce("SUM", np.ones(3 if g.rank != 1 else 4), async_op=True)
        later = g.barrier(async_op=True)
        with pytest.raises((CollectiveMismatchError, CollectiveAbortedError)):
            work.wait(timeout=30)
        assert isinstance(later.get_future().exception(timeout=30), CollectiveAbortedError | CollectiveMismatchError)
        return type(work.exception()).__name__

    out = _run(fake, groups, fn)
    assert set(out) <= {"CollectiveMismatchError", "CollectiveAbortedError"} and "CollectiveMismatchError" in out


def test_abort_fails_the_attempt_on_every_member_and_the_next_attempt_works():
    fake, groups = _groups(2)

    def fn(g: ProcessGroup):
        if g.rank == 0:
            g.abort(RuntimeError("the framework gave up"))
            raise RuntimeError("the framework gave up")
        with pytest.raises(CollectiveAbortedError, match="replica 0 raised RuntimeError: the framework gave up"):
            g.all_reduce("SUM", np.ones(1), dd.CommunicationOptions(timeout_seconds=30))
        return "raised"

    out = _run(fake, groups, fn)
    assert isinstance(out[0], RuntimeError) and out[1] == "raised"
    assert [r.tolist() for r in _run(fake, groups, lambda g: g.all_reduce("SUM", np.ones(1)))] == [[2.0]] * 2


def test_work_wait_with_a_timeout_raises_timeout_error_and_the_work_goes_on():
    fake, groups = _groups(2)

    def fn(g: ProcessGroup):
        if g.rank == 1:
            time.sleep(0.5)
        work = g.all_reduce("SUM", np.ones(1), async_op=True)
        if g.rank == 0:
            with pytest.raises(TimeoutError):
                work.wait(timeout=0.05)
        return work.wait(timeout=30).tolist()

    assert _run(fake, groups, fn) == [[2.0]] * 2


# -- a collective one replica never joins --------------------------------------------------------------


@pytest.mark.parametrize("path", ["lane", "general"])
def test_a_collective_a_finished_replica_skipped_raises_at_once_on_every_other(path):
    """Before the fix every replica waited the whole timeout (here 60 s) for a replica that had moved on."""
    fake, groups = _groups(3)
    value = np.ones(4) if path == "lane" else [np.ones(4), np.ones(2, np.int32)]

    def fn(g: ProcessGroup):
        g.all_reduce("SUM", value)
        if g.rank == 1:
            return "finished"  # skips the second collective
        g.all_reduce("SUM", value, dd.CommunicationOptions(timeout_seconds=60))
        return "joined"

    start = time.monotonic()
    out = _run(fake, groups, fn)
    assert time.monotonic() - start < 15
    assert out[1] == "finished"
    for rank in (0, 2):
        assert isinstance(out[rank], CollectiveMismatchError), out
        message = str(out[rank])
        assert "replica 1 finished run 1" in message and "all_reduce #2" in message
        assert "without joining this one" in message


def test_a_slow_replica_that_is_still_running_gets_the_full_timeout():
    with dask.config.set({"daskdist.collective.skip-check": "0.3s"}):  # read as the groups are built
        fake, groups = _groups(2)

    def fn(g: ProcessGroup):
        if g.rank == 1:
            time.sleep(1.2)  # well past collective.skip-check (0.3 s, checked again every 0.3 s): slow, not finished
        return g.all_reduce("SUM", np.ones(2), dd.CommunicationOptions(timeout_seconds=60)).tolist()

    assert _run(fake, groups, fn) == [[2.0, 2.0]] * 2


def test_timeout_seconds_zero_disables_the_deadline_as_in_tensorflow():
    fake, groups = _groups(2)

    def fn(g: ProcessGroup, options):
        if g.rank == 1:
            time.sleep(1.2)
        return g.all_reduce("SUM", np.ones(2), options)

    with dask.config.set({"daskdist.collective.timeout": "0.5s"}):  # what None means (read at each command)
        out = _run(fake, groups, lambda g: fn(g, None))
        assert isinstance(out[0], CollectiveTimeoutError) and "timed out after 0.5s" in str(out[0])
        out = _run(fake, groups, lambda g: fn(g, dd.CommunicationOptions(timeout_seconds=0)))
    assert [r.tolist() for r in out] == [[2.0, 2.0]] * 2
    with pytest.raises(ValueError, match="0: no deadline"):
        dd.CommunicationOptions(timeout_seconds=-1)


def test_skip_check_off_waits_for_the_timeout():
    with dask.config.set({"daskdist.collective.skip-check": 0}):
        fake, groups = _groups(2)

    def fn(g: ProcessGroup):
        if g.rank == 1:
            return "finished"
        return g.all_reduce("SUM", np.ones(2), dd.CommunicationOptions(timeout_seconds=1))

    out = _run(fake, groups, fn)
    assert isinstance(out[0], CollectiveTimeoutError) and "without joining this one" in str(out[0])


# -- built without a Worker: DaskTransport from an RPC callable, between real workers ----------------


class _Control:
    """The control plane of a group built by hand (no replica runtime): aborts through the peers' mailboxes."""

    def __init__(self, rank: int, mailboxes: list[Mailbox]):
        self.rank = rank
        self.mailboxes = mailboxes

    def abort_peers(self, attempt: int, abort: Abort) -> None:
        for r, mailbox in enumerate(self.mailboxes):
            if r != self.rank:
                mailbox.abort_attempt(attempt, abort)

    def probe(self, rank: int, timeout: float) -> dict | None:
        return None

    def exchange(self, key, value, deadline, attempt):
        raise NotImplementedError


def test_a_group_over_dask_comms_needs_only_an_rpc_callable(make_cluster):
    client = make_cluster(2, processes=False)
    workers = list(client.cluster.workers.values())
    mailboxes = [Mailbox(), Mailbox()]
    for worker, mailbox in zip(workers, mailboxes):  # what the daskdist worker plugin does, in two lines
        worker.handlers["daskdist_message"] = (
            lambda comm=None, mailbox=mailbox, tag=None, payload=None, **kw: mailbox.put(tuple(tag), payload))
    addresses = [w.address for w in workers]
    groups = [
        build_process_group(Communicator(r, 2, DaskTransport(r, addresses, mailboxes[r], workers[r].rpc,
                                                             workers[r].loop.asyncio_loop, "g"),
                                         _Control(r, mailboxes)), "dask-comms")
        for r in range(2)
    ]

    def body(g: ProcessGroup):
        total = g.all_reduce("SUM", np.arange(1000.0) * (g.rank + 1), async_op=True)
        sub = g.new_group([1])
        if g.rank == 0:
            g.send(np.arange(3), 1)
        got = g.recv(0).tolist() if g.rank == 1 else None
        return total.wait(timeout=30)[:3].tolist(), sub is None, got

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        out = list(pool.map(body, groups))
    assert out == [([0.0, 3.0, 6.0], True, None), ([0.0, 3.0, 6.0], False, [0, 1, 2])]
    for g in groups:
        g.close()


# -- inside replicas, over real transports between worker processes -------------------------------------------


def _pg_roundtrip():
    ctx = dd.get_replica_context()
    g = ctx.process_group
    rank = g.rank
    works = [g.all_reduce("SUM", np.full(1024, float(rank + i)), async_op=True) for i in range(3)]
    big = g.all_reduce("SUM", np.ones(1 << 20, np.float32), async_op=True)  # 4 MiB: the packed engines
    small = ctx.all_reduce("SUM", np.ones(3))  # ReplicaContext is a user of the same group
    sub = g.new_group([g.size - 1])
    if rank == 0:
        g.send(np.arange(5), g.size - 1, tag=3)
    received = g.recv(0, tag=3).tolist() if rank == g.size - 1 else [-1] * 5  # one structure on every replica

    def from_thread():
        return g.all_gather(np.array([rank]), async_op=True).wait(timeout=60).tolist()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        gathered = pool.submit(from_thread).result()
    return ([w.wait(timeout=60)[0] for w in works], float(big.wait(timeout=60)[7]), small.tolist(), sub is None,
            received, gathered, g.name, g.generation, g.ranks, threading.current_thread().name.startswith("daskdist"))


@pytest.mark.parametrize("transport", ["shm", "socket", "dask"])
def test_replicas_use_the_process_group_over_real_transports(process_client, transport):
    with dask.config.set({"daskdist.collective.transport": transport}), \
            dd.MirroredStrategy(client=process_client) as strategy:
        for _ in range(2):  # a second command goes on numbering (a fence, not a renumbering)
            out = strategy.experimental_local_results(strategy.run(_pg_roundtrip))
        assert len(out) == 2
        for rank, (sums, big, small, not_member, received, gathered, name, generation, ranks, replica_thread) \
                in enumerate(out):
            assert sums == [1.0, 3.0, 5.0] and big == 2.0 and small == [2.0] * 3
            assert not_member == (rank == 0)
            assert received == ([0, 1, 2, 3, 4] if rank == 1 else [-1] * 5)
            assert gathered == [0, 1] and ranks == (0, 1) and generation == 0 and name.endswith("/0")
            assert replica_thread


def test_a_replica_that_finishes_without_joining_fails_the_run_at_once(process_client):
    """On real workers: the client gets the error in seconds, not after the 300 s default."""
    with dd.MirroredStrategy(client=process_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            if ctx.replica_id_in_sync_group == 1:
                return None
            return ctx.all_reduce("SUM", np.ones(2))

        start = time.monotonic()
        with pytest.raises(dd.CollectiveMismatchError, match=r"replica 1 finished run \d+ .*without joining") as info:
            strategy.run(fn)
        assert time.monotonic() - start < 20
        assert "all_reduce #" in str(info.value)
        # the group goes on with a new attempt
        ok = strategy.experimental_local_results(strategy.run(lambda: dd.get_replica_context().all_reduce(
            "SUM", np.ones(2))))
        assert [v.tolist() for v in ok] == [[2.0, 2.0]] * 2


# -- c10d's contract: the group's timeout, member-made subgroups, sequence numbers, Work ----------------


def test_the_groups_timeout_is_the_deadline_of_its_collectives_and_outlives_commands():
    fake, groups = _groups(2)
    for g in groups:
        g.set_timeout(0.5)
        g.start_command(7, g.attempt)  # a new client command does not reset it
    assert [g.timeout for g in groups] == [0.5, 0.5]

    def fn(g: ProcessGroup):
        if g.rank == 1:
            time.sleep(2.0)  # skips the all-reduce
            return "skipped"
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match="all_reduce"):
            g.all_reduce("SUM", np.ones(1))
        return time.monotonic() - start

    waited, skipped = _run(fake, groups, fn)
    assert skipped == "skipped" and 0.4 < waited < 1.9, waited
    for g in groups:
        g.set_timeout(None)
    assert groups[0].timeout == config.get_seconds("collective.timeout")


def test_member_group_is_made_by_its_members_only_with_its_own_timeout_and_numbering():
    fake, groups = _groups(3)

    def fn(g: ProcessGroup):
        if g.rank == 1:
            return None  # not a member: takes no part
        sub = g.member_group([0, 2], "pair", timeout=5.0)
        before = sub.sequence_number
        total = sub.all_reduce("SUM", np.full(2, g.rank))
        again = g.member_group([0, 2], "pair")  # made under this key before: the same group
        return total.tolist(), sub.sequence_number - before, sub.timeout, again is sub, sub.rank, sub.size

    out = _run(fake, groups, fn)
    assert out[1] is None
    assert out[0] == ([2, 2], 1, 5.0, True, 0, 2) and out[2] == ([2, 2], 1, 5.0, True, 1, 2)


def test_work_then_failed_completed_and_abort():
    done = Work.completed(3, "all_reduce")
    assert done.is_completed() and done.is_success() and done.wait() == 3 and done.get_future().result() == 3
    assert done.then(lambda v: v + 1).wait() == 4
    broken = done.then(lambda v: 1 / 0)
    assert isinstance(broken.exception(), ZeroDivisionError) and not broken.is_success()
    failed = Work.failed(ValueError("bad"), "broadcast")
    with pytest.raises(ValueError, match="bad"):
        failed.then(lambda v: v).wait()

    future: concurrent.futures.Future = concurrent.futures.Future()
    aborted = []
    pending = Work(future, "barrier", abort=aborted.append)
    chained = pending.then(lambda v: v * 2)
    assert not chained.is_completed()
    chained.abort(RuntimeError("stop"))
    assert [str(e) for e in aborted] == ["stop"]
    future.set_result(21)
    assert chained.wait(timeout=5) == 42
    chained.abort()  # over already: nothing
    assert len(aborted) == 1


def test_abort_of_an_async_work_fails_it_and_the_queued_ones_on_every_member():
    fake, groups = _groups(2)

    def fn(g: ProcessGroup):
        if g.rank == 0:
            works = [g.all_reduce("SUM", np.ones(2), async_op=True) for _ in range(3)]
            time.sleep(0.3)  # rank 1 never joins: the first is in flight, the others queued
            works[0].abort(RuntimeError("given up"))
            return [type(w.get_future().exception(timeout=30)).__name__ for w in works]
        with pytest.raises(CollectiveAbortedError, match="given up"):
            time.sleep(0.6)
            g.all_reduce("SUM", np.ones(2), dd.CommunicationOptions(timeout_seconds=30))
        return "raised"

    out = _run(fake, groups, fn)
    assert out[0] == ["CollectiveAbortedError"] * 3 and out[1] == "raised", out


def test_a_fence_waits_for_what_is_chained_on_async_work():
    """``shutdown`` of a torch group drains: the copy back into the tensors (a ``Work.then``) is over too."""
    fake, groups = _groups(2)

    def fn(g: ProcessGroup):
        work = g.all_reduce("SUM", np.ones(2), async_op=True).then(lambda v: (time.sleep(0.3), v.tolist())[1])
        g.fence()
        return work.is_completed(), work.wait(timeout=5)

    assert _run(fake, groups, fn) == [(True, [2.0, 2.0])] * 2
