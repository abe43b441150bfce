"""Collective algorithms against numpy, over in-memory transports (no cluster needed)."""

from __future__ import annotations

import collections
import time

import numpy as np
import pytest

from daskdist.collective.core.communicator import Algorithm
from daskdist.exceptions import CollectiveAbortedError, CollectiveMismatchError, CollectiveTimeoutError
from daskdist.ops import CommunicationImplementation, CommunicationOptions, ReduceOp

from .fakes import InMemoryGroup
from .reference import NUMPY_OPS, random_inputs

RING = CommunicationOptions(implementation=CommunicationImplementation.RING)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["auto", "ring", "direct", "reduce_to_one"])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (1001,), (3, 5)])
def test_all_reduce_sum_matches_numpy(size, algorithm, shape):
    group = InMemoryGroup(size, Algorithm(algorithm))
    xs = random_inputs(size, shape, "float64")
    results = group.run_ranks(lambda c: c.all_reduce(ReduceOp.SUM, xs[c.rank]))
    expected = np.sum(xs, axis=0)
    for r in results:
        assert not isinstance(r, Exception), r
        np.testing.assert_allclose(r, expected, rtol=1e-12)
        assert r.shape == expected.shape
    # every replica holds the very same bits
    for r in results[1:]:
        assert np.array_equal(r, results[0])


@pytest.mark.parametrize("op", list(NUMPY_OPS))
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8"])
def test_every_op_and_dtype(op, dtype):
    size = 3
    group = InMemoryGroup(size)
    xs = random_inputs(size, (13,), dtype, seed=1)
    for options in (None, RING):
        results = group.run_ranks(lambda c, options=options: c.all_reduce(op, xs[c.rank], options))
        expected = NUMPY_OPS[op](np.stack(xs))
        for r in results:
            assert r.dtype == np.dtype(dtype)
            np.testing.assert_allclose(r.astype("float64"), expected.astype("float64"), rtol=2e-3)


def test_bool_sum_is_logical_or_and_mean_is_rejected():
    group = InMemoryGroup(2)
    xs = [np.array([True, False, False]), np.array([False, False, True])]
    results = group.run_ranks(lambda c: c.all_reduce("SUM", xs[c.rank]))
    assert results[0].tolist() == [True, False, True]
    results = group.run_ranks(lambda c: c.all_reduce("MEAN", xs[c.rank]))
    assert all(isinstance(r, TypeError) for r in results)


@pytest.mark.parametrize("options", [None, RING])
def test_mean_of_floats_and_ints(options):
    group = InMemoryGroup(4)
    floats = [np.full(5, r, np.float32) for r in range(4)]
    results = group.run_ranks(lambda c: c.all_reduce(ReduceOp.MEAN, floats[c.rank], options))
    np.testing.assert_allclose(results[0], np.full(5, 1.5))
    ints = [np.full(5, r, np.int32) for r in range(4)]
    results = group.run_ranks(lambda c: c.all_reduce(ReduceOp.MEAN, ints[c.rank], options))
    assert results[0].dtype == np.int32 and results[0].tolist() == [1] * 5  # truncating, as TF's Div


def test_nested_structures_and_packs():
    Point = collections.namedtuple("Point", "x y")
    group = InMemoryGroup(3, Algorithm("ring", num_packs=2))

    def value(rank):
        return {
            "a": np.full((2, 2), rank, np.float32),
            "b": [np.arange(3, dtype=np.int64) * rank, Point(np.float64(rank), np.ones(4, np.float32))],
            "c": None,
        }

    for bytes_per_pack in (0, 8, 1 << 20):
        options = CommunicationOptions(bytes_per_pack=bytes_per_pack)
        results = group.run_ranks(lambda c, options=options: c.all_reduce("SUM", value(c.rank), options))
        for r in results:
            assert set(r) == {"a", "b", "c"} and r["c"] is None
            np.testing.assert_array_equal(r["a"], np.full((2, 2), 3, np.float32))
            np.testing.assert_array_equal(r["b"][0], np.arange(3) * 3)
            assert isinstance(r["b"][1], Point)
            assert r["b"][1].x == 3.0
            np.testing.assert_array_equal(r["b"][1].y, np.full(4, 3, np.float32))


def test_inputs_are_not_modified():
    group = InMemoryGroup(2, Algorithm("ring"))
    xs = [np.ones(10), np.ones(10)]
    group.run_ranks(lambda c: c.all_reduce("SUM", xs[c.rank]))
    assert xs[0].tolist() == [1.0] * 10


def test_all_gather_uneven_and_nested():
    group = InMemoryGroup(3)
    results = group.run_ranks(
        lambda c: c.all_gather({"x": np.full((c.rank + 1, 2), c.rank)}, axis=0)
    )
    for r in results:
        assert r["x"].shape == (6, 2)
        assert r["x"][:, 0].tolist() == [0, 1, 1, 2, 2, 2]
    results = group.run_ranks(lambda c: c.all_gather(np.full((2, 1), c.rank), axis=1))
    assert results[0].tolist() == [[0, 1, 2], [0, 1, 2]]


def test_broadcast_objects_and_barrier():
    group = InMemoryGroup(3)
    results = group.run_ranks(lambda c: c.broadcast(np.full(3, c.rank + 10), root=1))
    assert all(r.tolist() == [11, 11, 11] for r in results)
    results = group.run_ranks(lambda c: c.all_gather_objects({"rank": c.rank}))
    assert results[2] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert group.run_ranks(lambda c: c.barrier()) == [None, None, None]


def test_reduce_to_one_with_accumulation_fn():
    calls = []

    def add_n(values):
        calls.append(len(values))
        return np.sum(values, axis=0)

    group = InMemoryGroup(3, Algorithm("reduce_to_one", root=2, accumulation_fn=add_n))
    results = group.run_ranks(lambda c: c.all_reduce("SUM", np.full(4, c.rank, np.float32)))
    assert all(r.tolist() == [3.0] * 4 for r in results)
    assert calls == [3]  # only the root accumulates


@pytest.mark.parametrize(
    "make, what",
    [
        (lambda r: np.ones(3 + r, np.float32), "float32["),
        (lambda r: np.ones(3, np.float32 if r == 0 else np.float64), "float64[3]"),
        (lambda r: {"a": np.ones(3)} if r == 0 else {"b": np.ones(3)}, "structure"),
        (lambda r: np.ones(100_000 if r == 1 else 3, np.float32), "100000"),
    ],
)
@pytest.mark.parametrize("size", [2, 4])
def test_mismatch_raises_on_every_replica(make, what, size):
    group = InMemoryGroup(size)
    start = time.monotonic()
    results = group.run_ranks(lambda c: c.all_reduce("SUM", make(c.rank), CommunicationOptions(timeout_seconds=20)))
    assert time.monotonic() - start < 10
    for r in results:
        assert isinstance(r, CollectiveMismatchError), r
        assert what in str(r)


def test_timeout_names_the_replica_that_never_joined():
    group = InMemoryGroup(3)
    options = CommunicationOptions(timeout_seconds=0.5)

    def fn(c):
        if c.rank == 2:
            return "skipped"
        return c.all_reduce("SUM", np.ones(3), options)

    results = group.run_ranks(fn)
    assert results[2] == "skipped"
    errors = [r for r in results[:2]]
    assert all(isinstance(e, (CollectiveTimeoutError, CollectiveAbortedError)) for e in errors)
    assert any(isinstance(e, CollectiveTimeoutError) for e in errors)
    message = str(next(e for e in errors if isinstance(e, CollectiveTimeoutError)))
    assert "replica 2" in message and "all_reduce #1" in message


def test_a_failed_run_does_not_poison_the_next():
    group = InMemoryGroup(2)

    def fails(c):
        if c.rank == 0:
            raise ZeroDivisionError("boom")
        return c.all_reduce("SUM", np.ones(2))

    results = group.run_ranks(fails, run_id=1)
    assert isinstance(results[0], ZeroDivisionError)
    assert isinstance(results[1], CollectiveAbortedError) and "ZeroDivisionError: boom" in str(results[1])
    results = group.run_ranks(lambda c: c.all_reduce("SUM", np.ones(2)), run_id=2)
    assert results[0].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("algorithm", ["auto", "ring", "direct", "reduce_to_one"])
def test_several_packs_in_one_collective_do_not_mix(algorithm):
    group = InMemoryGroup(3, Algorithm(algorithm))
    results = group.run_ranks(
        lambda c: c.all_reduce("SUM", [np.full(2, c.rank, np.float32), np.full(3, c.rank, np.int64), c.rank])
    )
    for r in results:
        assert r[0].tolist() == [3.0, 3.0] and r[1].tolist() == [3, 3, 3] and int(r[2]) == 3


@pytest.mark.parametrize("algorithm", ["auto", "ring", "reduce_to_one"])
def test_same_sizes_but_different_structure_fail_everywhere(algorithm):
    """Replica 0 differs only in structure: replicas that agree with their left neighbour must still raise."""
    group = InMemoryGroup(3, Algorithm(algorithm))
    results = group.run_ranks(
        lambda c: c.all_reduce("SUM", [np.ones(3)] if c.rank == 0 else {"w": np.ones(3)},
                               CommunicationOptions(timeout_seconds=20))
    )
    assert all(isinstance(r, (CollectiveMismatchError,)) for r in results), results
    results = group.run_ranks(
        lambda c: c.broadcast([np.ones(3)] if c.rank == 2 else {"w": np.ones(3)}, root=0,
                              options=CommunicationOptions(timeout_seconds=20)), run_id=2
    )
    assert all(isinstance(r, CollectiveMismatchError) for r in results), results


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("shape, axis", [((10,), 0), ((7, 3), 0), ((2, 9), 1), ((2,), 0)])
def test_reduce_scatter_matches_numpy(size, shape, axis):
    group = InMemoryGroup(size)
    xs = random_inputs(size, shape, "float64", seed=3)
    results = group.run_ranks(lambda c: c.reduce_scatter("SUM", {"x": xs[c.rank]}, axis=axis))
    expected = np.array_split(np.sum(xs, axis=0), size, axis=axis)
    for rank, r in enumerate(results):
        assert not isinstance(r, Exception), r
        np.testing.assert_allclose(r["x"], expected[rank])


def test_bfloat16_all_reduce():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    group = InMemoryGroup(3)
    xs = [np.full(5, r + 0.5, ml_dtypes.bfloat16) for r in range(3)]
    for op, want in (("SUM", 4.5), ("MEAN", 1.5), ("MAX", 2.5)):
        for options in (None, RING):
            results = group.run_ranks(lambda c, op=op, options=options: c.all_reduce(op, xs[c.rank], options))
            assert results[0].dtype == ml_dtypes.bfloat16
            assert results[0].astype("float32").tolist() == [want] * 5


@pytest.mark.parametrize(
    "hosts", [["a", "a", "b", "b"], ["a", "b", "a", "b"], ["a", "a", "a", "b"], ["x", "x", "x", "x"]]
)
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MAX"])
def test_hierarchical_all_reduce(hosts, op):
    xs = random_inputs(4, (100_003,), "float64", seed=5)
    want = {"SUM": np.sum, "MEAN": np.mean, "MAX": np.max}[op](np.stack(xs), axis=0)
    for algorithm in (Algorithm("auto"), Algorithm("hierarchical")):
        group = InMemoryGroup(4, algorithm, hosts=hosts)
        results = group.run_ranks(lambda c: c.all_reduce(op, xs[c.rank]))
        for r in results:
            assert not isinstance(r, Exception), r
            np.testing.assert_allclose(r, want, rtol=1e-12, atol=1e-14)  # summation order differs from numpy's
            assert np.array_equal(r, results[0])


def test_the_stall_watch_ends_with_a_communicator_dropped_without_close():
    """A replica that crashed never calls ``close``: its stall-watch thread must not outlive it."""
    import gc

    group = InMemoryGroup(2)
    group.run_ranks(lambda c: c.all_reduce("SUM", np.ones(2)))
    threads = [c._stall_watch._thread for c in group.comms]
    assert all(t.is_alive() for t in threads)
    del group
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.is_alive() for t in threads)


def _record_sends(group: InMemoryGroup) -> list[list[tuple[str, int, list[str]]]]:
    """Per rank: ``(how, dst, message names)`` of every send, ``how`` being ``send`` or ``send_many``."""
    records: list[list[tuple[str, int, list[str]]]] = [[] for _ in range(group.size)]
    for rank, comm in enumerate(group.comms):
        transport = comm.transport
        plain_send = transport.send

        def send(dst, tag, payload, _log=records[rank], _send=plain_send):
            _log.append(("send", dst, [tag[-1]]))
            return _send(dst, tag, payload)

        def send_many(dst, messages, _log=records[rank], _send=plain_send):
            _log.append(("send_many", dst, [tag[-1] for tag, _ in messages]))
            return [_send(dst, tag, payload) for tag, payload in messages]

        transport.send, transport.send_many = send, send_many
    return records


def test_a_collectives_signature_rides_with_its_first_data_to_the_right_neighbour():
    """One write for the signature and the data of a small all-reduce (a socket's ``sendmsg``), not two."""
    group = InMemoryGroup(2, Algorithm("direct"))
    records = _record_sends(group)
    results = group.run_ranks(lambda c: c.all_reduce(ReduceOp.SUM, np.full(4, c.rank + 1.0)))
    assert [r.tolist() for r in results] == [[3.0] * 4] * 2
    for rank, record in enumerate(records):
        assert [how for how, _, _ in record] == ["send_many"], record
        how, dst, names = record[0]
        assert dst == (rank + 1) % 2 and names[0] == "sig" and "d#" in names[1]


def test_a_replica_whose_first_step_is_to_receive_sends_its_signature_before_it_blocks():
    """Broadcast from rank 0 over 3: rank 1 never sends data to its right neighbour (rank 2), whose signature
    check waits for it; rank 1 must send its signature alone before blocking, or rank 2 would time out."""
    group = InMemoryGroup(3, Algorithm("direct"))
    records = _record_sends(group)
    results = group.run_ranks(lambda c: c.broadcast(np.arange(5.0) if c.rank == 0 else np.zeros(5), root=0),
                              timeout=20)
    assert all(np.array_equal(r, np.arange(5.0)) for r in results), results
    assert ("send", 2, ["sig"]) in records[1]
    mismatched = group.run_ranks(lambda c: c.broadcast(np.zeros(5 if c.rank != 1 else 6), root=0), timeout=20)
    assert all(isinstance(r, CollectiveMismatchError) for r in mismatched), mismatched
