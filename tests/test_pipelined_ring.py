"""The pipelined ring and hierarchical all-reduce of groups that span hosts (``engines.pipeline``).

In-memory transports (no cluster): results against the plain ring, bit for
bit, and against numpy, and the order of messages that makes it a pipeline. The same engines on
real namespace hosts: ``tests/test_multihost_allreduce.py``.
"""

from __future__ import annotations

import dask
import numpy as np
import pytest

from daskdist.collective.core.communicator import Algorithm
from daskdist.collective.core.engines.pipeline import PieceSize, RingSchedule
from daskdist.ops import CommunicationImplementation, CommunicationOptions, ReduceOp

from .fakes import InMemoryGroup
from .reference import NUMPY_OPS, random_inputs

RING = CommunicationOptions(implementation=CommunicationImplementation.RING)
PIECE = 256  # bytes: a few hundred pieces per chunk


def _run(size, hosts, op, xs, algorithm="auto", options=None, piece=PIECE):
    with dask.config.set({"daskdist.collective.pipeline-bytes": piece}):
        group = InMemoryGroup(size, Algorithm(algorithm), hosts=hosts)
    results = group.run_ranks(lambda c: c.all_reduce(op, xs[c.rank], options))
    for r in results:
        assert not isinstance(r, Exception), r
    return results


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize(("op", "dtype"), [("SUM", "float32"), ("MEAN", "float64"), ("MAX", "int32"),
                                           ("MEAN", "int64"), ("PRODUCT", "float64")])
def test_the_pipelined_ring_gives_the_plain_rings_bits_on_every_replica(size, op, dtype):
    xs = random_inputs(size, (10_007,), dtype, seed=size)  # not a multiple of the ring or the piece
    kept = [x.copy() for x in xs]
    pipelined = _run(size, [f"h{r}" for r in range(size)], op, xs, options=RING)
    plain = _run(size, ["one"] * size, op, xs, options=RING)  # one host: the ring is not pipelined
    for got, want in zip(pipelined, plain):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert all(np.array_equal(x, k) for x, k in zip(xs, kept))  # the callers' arrays are only read
    # and against numpy, which shares no code with either ring (the summation order differs: a few ulp)
    stacked = np.stack(kept)
    if op == "MEAN":
        total = np.sum(stacked, axis=0, dtype=stacked.dtype)
        want = np.trunc(total / size).astype(dtype) if np.dtype(dtype).kind == "i" else total / size
    else:
        want = NUMPY_OPS[ReduceOp[op]](stacked)
    tolerance = {"float32": 1e-5, "float64": 1e-12}.get(dtype, 0.0)  # integers: exact
    for got in pipelined:
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "a", "b"], ["a", "a", "a", "b"],
                                   ["a", "b", "b", "b"], ["a", "a", "b", "b", "c", "c"]])
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MAX"])
def test_the_pipelined_hierarchical_all_reduce_equals_the_flat_one(hosts, op):
    size = len(hosts)
    xs = random_inputs(size, (20_011,), "float64", seed=7)
    want = {"SUM": np.sum, "MEAN": np.mean, "MAX": np.max}[op](np.stack(xs), axis=0)
    for algorithm in ("auto", "hierarchical"):
        results = _run(size, hosts, op, xs, algorithm)
        for r in results:
            np.testing.assert_allclose(r, want, rtol=1e-12, atol=1e-14)  # summation order differs from numpy's
            assert np.array_equal(r, results[0])
    ints = random_inputs(size, (5_003,), "int64", seed=3)
    exact = _run(size, hosts, "SUM", ints, "hierarchical")
    assert all(np.array_equal(r, np.sum(np.stack(ints), axis=0)) for r in exact)


def _logged(group, log):
    """Record, per rank, the names of the messages it sends and receives, in the order it does so."""
    for comm in group.comms:
        transport, rank = comm.transport, comm.rank
        send, recv_into = transport.send, transport.recv_into

        def logged_send(dst, tag, payload, send=send, rank=rank):
            log.setdefault(rank, []).append(("send", dst, tag[3].split("#")[0]))
            return send(dst, tag, payload)

        def logged_recv_into(src, tag, *args, recv_into=recv_into, rank=rank):
            log.setdefault(rank, []).append(("recv", src, tag[3].split("#")[0]))
            return recv_into(src, tag, *args)

        transport.send, transport.recv_into = logged_send, logged_recv_into


def _sized(group, sizes):
    """Record, per rank, each message it sends: (destination, name, bytes)."""
    for comm in group.comms:
        send = comm.transport.send

        def sized_send(dst, tag, payload, send=send, rank=comm.rank):
            sizes.setdefault(rank, []).append((dst, tag[3].split("#")[0], getattr(payload, "nbytes", 0)))
            return send(dst, tag, payload)

        comm.transport.send = sized_send


def test_each_piece_is_forwarded_before_the_next_one_is_received():
    log: dict[int, list] = {}
    with dask.config.set({"daskdist.collective.pipeline-bytes": 4096}):
        group = InMemoryGroup(3, Algorithm("ring"), hosts=["a", "b", "c"])
    _logged(group, log)
    xs = [np.full(3 * 4096, r + 1.0, np.float32) for r in range(3)]  # a chunk of 4 pieces per replica
    results = group.run_ranks(lambda c: c.all_reduce("SUM", xs[c.rank]))
    assert all(np.array_equal(r, np.full(3 * 4096, 6.0, np.float32)) for r in results)
    events = [e for e in log[0] if e[2].startswith(("p0/rs", "p0/ag"))]
    names = [f"{kind} {name.split('/')[1]}" for kind, _, name in events]
    # the first step's four pieces leave at once, then every received piece goes on before the next arrives
    assert names[:4] == ["send rs0.0", "send rs0.1", "send rs0.2", "send rs0.3"]
    assert names[4:12] == ["recv rs0.0", "send rs1.0", "recv rs0.1", "send rs1.1",
                           "recv rs0.2", "send rs1.2", "recv rs0.3", "send rs1.3"]
    assert names[12:14] == ["recv rs1.0", "send ag0.0"] and names[-1] == "recv ag1.3"
    assert len(names) == 4 * (1 + 2 + 2 + 2 + 1)  # pieces x (first sends, 3 steps of receive + send, last receive)
    assert {dst for kind, dst, _ in events if kind == "send"} == {1} and {
        src for kind, src, _ in events if kind == "recv"} == {2}


def test_the_schedule_covers_every_element_once_in_the_rings_orders():
    for n, size, piece in [(10, 3, 2), (7, 4, 100), (3, 4, 1), (1000, 2, 64)]:
        for rank in range(size):
            s = RingSchedule(n, size, rank, piece)
            for order in (s.needed(), s.finished()):
                covered = sorted(i for lo, hi in order for i in range(lo, hi))
                assert covered == list(range(n))
                assert all(0 < hi - lo <= piece for lo, hi in order)
            assert s.needed() == [p for k in range(size) for p in s.pieces[(rank - k) % size]]
            assert s.finished() == [p for k in range(size) for p in s.pieces[(rank + 1 - k) % size]]


def test_a_chunk_under_pipeline_bytes_still_goes_in_pipeline_pieces_messages():
    """A 16.8 MB DDP bucket over two hosts was one 8.4 MB message per ring step with 8 MiB pieces: the link
    idled until all of it had arrived (BENCHMARKS 14, across hosts). Now each chunk goes in at least
    ``pipeline-pieces`` messages, unless they would be under ``pipeline-min-bytes``."""
    log: dict[int, list] = {}
    settings = {"daskdist.collective.pipeline-bytes": "8MiB", "daskdist.collective.pipeline-pieces": 4,
                "daskdist.collective.pipeline-min-bytes": 1024}
    with dask.config.set(settings):
        group = InMemoryGroup(2, Algorithm("auto"), hosts=["a", "b"])
    _logged(group, log)
    n = 2 * 40_000 + 3  # two chunks of ~160 KB, far under 8 MiB: one message each before
    xs = random_inputs(2, (n,), "float32", seed=7)
    results = group.run_ranks(lambda c: c.all_reduce("SUM", xs[c.rank]))
    assert all(np.array_equal(r, xs[0] + xs[1]) for r in results)
    for rank in (0, 1):
        sent = [name.split("/")[1] for kind, _, name in log[rank] if kind == "send" and name.startswith("p0/")]
        assert sorted(sent) == sorted(f"{step}.{k}" for step in ("rs0", "ag0") for k in range(4)), sent
    # the same bits as the plain ring
    plain = _run(2, ["a", "a"], "SUM", xs, options=RING)
    assert all(np.array_equal(r, p) for r, p in zip(results, plain))


def test_the_piece_size_rule():
    pieces = PieceSize(8 << 20, 4, 1 << 20)
    bucket = 16_785_408 // 4  # DDP's first bucket of the MLP (a 2048x2048 Linear's weight and bias), float32
    chunk = -(-bucket // 2)
    assert pieces.elements(bucket, 2, 4) == -(-chunk // 4)  # a quarter of the chunk: 4 messages per ring step
    assert len(RingSchedule(bucket, 2, 0, pieces.elements(bucket, 2, 4)).chunk(0)) == 4
    assert pieces.elements(64 << 18, 2, 4) * 4 == 8 << 20  # 64 MiB: chunks of 32 MiB in 8 MiB pieces, as before
    assert pieces.elements(350_000, 2, 4) * 4 == 1 << 20  # the CNN's 1.4 MB: the floor, so one 0.7 MB message
    assert PieceSize(4096, 4, 1 << 20).elements(1 << 20, 2, 4) * 4 == 4096  # pipeline-bytes stays the largest
    assert PieceSize(8 << 20).elements(bucket, 2, 4) * 4 == 8 << 20  # pieces=1: the old rule
    assert PieceSize(8 << 20, 4, 1 << 20).elements(3, 2, 8) == 1 << 17  # never below one element's worth


def test_a_schedule_with_a_lead_grows_each_chunks_pieces_from_it_and_shrinks_them_back():
    """The last piece of a chunk was as long as the middle ones: the last one final on a host's first replica went
    down to its host's others whole after the link was done. Now the lengths up to half a piece come back in
    reverse at the end, where a whole piece stays between."""
    s = RingSchedule(2 * 50, 2, 0, piece=16, lead=3)
    for chunk in s.pieces:
        lengths = [hi - lo for lo, hi in chunk]
        assert lengths == [3, 6, 12, 10, 10, 6, 3], lengths  # 12 > 16 / 2 does not come back
    s = RingSchedule(16 << 20, 2, 1, piece=(8 << 20) // 4, lead=(2 << 20) // 4)  # 64 MiB of float32: 2, 4, ..., 4, 2 MiB
    assert [(hi - lo) * 4 >> 20 for lo, hi in s.chunk(0)][:2] == [2, 4] and [
        (hi - lo) * 4 >> 20 for lo, hi in s.chunk(0)][-2:] == [4, 2]
    assert [hi - lo for lo, hi in RingSchedule(8, 2, 0, piece=16, lead=3).chunk(0)] == [3, 1]  # a chunk under it all
    assert [hi - lo for lo, hi in RingSchedule(2 * 30, 2, 0, piece=16, lead=3).chunk(0)] == [3, 6, 12, 9]  # no room
    assert [hi - lo for lo, hi in RingSchedule(2 * 40, 2, 0, 16, lead=9).chunk(0)] == [9, 16, 15]  # 9 > 16 / 2
    assert RingSchedule(100, 2, 0, 16, lead=16).pieces == RingSchedule(100, 2, 0, 16).pieces  # no ramp: as before
    assert PieceSize(8 << 20, 4, 2 << 20).lead(2 << 20, 4) == 1 << 19  # pipeline-min-bytes
    assert PieceSize(8 << 20, 4, 16 << 20).lead(2 << 20, 4) == 2 << 20  # never above the piece
    assert PieceSize(8 << 20).lead(2 << 20, 4) == 2 << 20  # no pipeline-min-bytes: no ramp


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "a", "a", "b"]])
def test_the_first_and_last_pieces_of_a_hierarchical_all_reduce_are_pipeline_min_bytes(hosts):
    """Nothing crossed the hosts until a host's first replica had summed a whole piece (8 MiB) from its host's
    others: at 2 hosts x 2 replicas the link started ~5-9 ms late (BENCHMARKS 24). Now each chunk's pieces
    grow from ``pipeline-min-bytes``, so the first cross-host send waits only for that much."""
    sizes: dict[int, list[tuple[int, str, int]]] = {}
    settings = {"daskdist.collective.pipeline-bytes": "8KiB", "daskdist.collective.pipeline-pieces": 1,
                "daskdist.collective.pipeline-min-bytes": "1KiB", "daskdist.collective.hierarchical-senders": "first"}
    with dask.config.set(settings):
        group = InMemoryGroup(4, Algorithm("hierarchical"), hosts=hosts)
    _sized(group, sizes)
    n = 2 * 10_000 + 1  # two chunks of ~40 KB: 1, 2, 4 KiB, then even pieces of at most 8 KiB
    xs = random_inputs(4, (n,), "int64", seed=5)
    results = group.run_ranks(lambda c: c.all_reduce("SUM", xs[c.rank]))
    assert all(np.array_equal(r, np.sum(np.stack(xs), axis=0)) for r in results)
    for leader in (0, 2) if hosts[1] == "a" and hosts[2] == "b" else (0, 3):
        across = [nbytes for dst, name, nbytes in sizes[leader] if "/hx-" in name and nbytes]
        assert across[:3] == [1024, 2048, 4096], across[:5]
        assert max(across) <= 8192 and sum(across) == n * 8  # every element once each way (a ring of two hosts)
    up = [nbytes for dst, name, nbytes in sizes[1] if "/h-up" in name]
    assert up[:3] == [1024, 2048, 4096] and sum(up) == n * 8
    # and the last piece a first replica sends down to its host, after the link is done, is as small again
    down = [nbytes for dst, name, nbytes in sizes[0] if "/h-down" in name and dst == 1]
    assert down[-3:] == [4096, 2048, 1024] and sum(down) == n * 8, down[-5:]


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "a", "b"], ["a", "a", "a", "b", "b", "b"]])
def test_with_every_replica_sending_each_carries_its_slice_across_and_every_channel_is_read_in_order(hosts):
    """Only each host's first replica sent across hosts: at 2 hosts x 2 replicas one stream per direction, fed by
    one process that also summed all of its host's gradient. Now each of a host's replicas owns a slice: its own
    connection across, its share of the in-host sums; and each in-host channel carries its messages in the order
    the receiver reads them (a message read out of order is copied aside)."""
    log: dict[int, list] = {}
    sizes: dict[int, list[tuple[int, str, int]]] = {}
    settings = {"daskdist.collective.pipeline-bytes": "8KiB", "daskdist.collective.pipeline-pieces": 1,
                "daskdist.collective.pipeline-min-bytes": "1KiB"}  # hierarchical-senders: all, the default
    with dask.config.set(settings):
        group = InMemoryGroup(len(hosts), Algorithm("hierarchical"), hosts=hosts)
    _logged(group, log)
    _sized(group, sizes)
    width = len(hosts) // 2
    n = width * 2 * 10_000 + 1  # slices of ~80 KB, one element short in the last
    xs = random_inputs(len(hosts), (n,), "int64", seed=5)
    results = group.run_ranks(lambda c: c.all_reduce("SUM", xs[c.rank]))
    assert all(np.array_equal(r, np.sum(np.stack(xs), axis=0)) for r in results)
    length = -(-n // width)
    for rank, host in enumerate(hosts):
        across = [(dst, nbytes) for dst, name, nbytes in sizes[rank] if "/hx" in name and nbytes]
        assert {hosts[dst] for dst, _ in across} == {"b" if host == "a" else "a"}  # every replica crosses
        assert [nbytes for _, nbytes in across[:3]] == [1024, 2048, 4096], across[:5]
        index = [r for r, h in enumerate(hosts) if h == host].index(rank)
        assert sum(nbytes for _, nbytes in across) == 8 * (min(n, (index + 1) * length) - index * length)
    for src in range(len(hosts)):  # each in-host channel: read in the order written
        for dst in range(len(hosts)):
            if src != dst and hosts[src] == hosts[dst]:
                sent = [name for kind, to, name in log[src] if kind == "send" and to == dst and "/h-" in name]
                read = [name for kind, frm, name in log[dst] if kind == "recv" and frm == src and "/h-" in name]
                assert sent and sent == read


@pytest.mark.parametrize("n", [1, 3, 4, 5, 7, 9, 13])
@pytest.mark.parametrize("senders", ["all", "first"])
def test_a_hierarchical_all_reduce_of_a_few_elements_with_every_replica_sending(n, senders):
    """Slices a few elements long: the last one's pieces clipped to nothing send nothing, in their places."""
    hosts = ["a", "a", "b", "b"]
    xs = random_inputs(4, (n,), "int64", seed=n)
    settings = {"daskdist.collective.pipeline-min-bytes": 8, "daskdist.collective.hierarchical-senders": senders}
    with dask.config.set(settings):
        results = _run(4, hosts, "SUM", xs, "hierarchical", piece=16)
    assert all(np.array_equal(r, np.sum(np.stack(xs), axis=0)) for r in results)


def test_a_schedule_clipped_to_a_shorter_slice_keeps_its_pieces_in_place():
    full = RingSchedule(10, 2, 0, piece=2)
    clipped = RingSchedule(10, 2, 0, piece=2, limit=7)
    assert len(clipped.needed()) == len(full.needed()) and len(clipped.finished()) == len(full.finished())
    assert sorted(i for lo, hi in clipped.needed() for i in range(lo, hi)) == list(range(7))
    assert [(lo, hi) for lo, hi in clipped.pieces[1]] == [(5, 7), (7, 7), (7, 7)]
