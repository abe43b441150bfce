"""The single-copy all-reduce (replicas read each other's arrays in place), on real clusters."""

from __future__ import annotations

import os

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers
from daskdist.collective.core.engines.single_copy.all_reduce import CrossMemory, chunk_bounds, cross_memory

pytestmark = pytest.mark.skipif(cross_memory() is None, reason="needs Linux process_vm_readv")

#: shared memory between the replicas, and the single-copy path from 4 KiB on (64 KiB slots: the latency
#: lane, which takes up to a slot with two replicas, stops at 64 KiB)
LOW = {"daskdist.collective.transport": "shm", "daskdist.collective.shm.single-copy-bytes": "4KiB",
       "daskdist.collective.shm.slot-bytes": "64KiB"}


def _single_copy_state(client, strategy) -> list[bool | None]:
    """``usable`` of every replica's single-copy path (``None``: not probed yet)."""
    token = strategy.extended.group.group_id

    def state(dask_worker):
        return [runtime.communicator.single_copy.usable
                for group, runtime in dask_worker.extensions["daskdist"].replicas.items() if group == token]

    return [s for part in client.run(state).values() for s in part]


def _inputs(seed, n, dtype, shape):
    out = []
    for r in range(n):
        rng = np.random.default_rng([seed, r])
        if dtype == "bool":
            out.append(rng.random(shape) > 0.5)
        elif np.dtype(dtype).kind in "iuV":
            out.append(rng.integers(0, 4, shape).astype(dtype))
        else:
            out.append(rng.standard_normal(shape).astype(dtype))
    return out


def _reduce_in_rank_order(op, arrays, dtype):
    ufunc = {"SUM": np.add, "MEAN": np.add, "MAX": np.maximum, "MIN": np.minimum, "PRODUCT": np.multiply}[op]
    if dtype == "bool":
        ufunc = np.logical_or
    acc = arrays[0].copy()
    for a in arrays[1:]:
        ufunc(acc, a, out=acc)
    if op == "MEAN":
        acc = np.divide(acc, np.asarray(len(arrays), dtype)).astype(dtype)
    return acc


CASES = [
    ("SUM", "float32", (100_003,)),  # not divisible by the replicas, nor by the chunk alignment
    ("MEAN", "float64", (301, 257)),
    ("MAX", "int8", (70_001,)),
    ("MIN", "uint8", (90_000,)),
    ("PRODUCT", "int64", (40_099,)),
    ("SUM", "bool", (100_007,)),
    ("SUM", "float16", (65_537,)),
    ("SUM", "float32", (200_000,)),  # several pieces per chunk
]


@pytest.mark.parametrize("replicas", [2, 3])
def test_results_equal_numpy_bit_for_bit(threaded_client, replicas):
    """Each chunk is reduced once, in rank order, by its owner: exactly what numpy gives in rank order."""
    with dask.config.set(LOW), dd.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(replicas)],
                                                    client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            n, rank = ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group
            bad = []
            for i, (op, dtype, shape) in enumerate(CASES):
                inputs = _inputs(i, n, dtype, shape)
                mine = inputs[rank].copy()
                got = ctx.all_reduce(op, inputs[rank])
                want = _reduce_in_rank_order(op, inputs, dtype)
                if got.shape != want.shape or got.dtype != want.dtype or got.tobytes() != want.tobytes():
                    bad.append((op, dtype, shape))
                if inputs[rank].tobytes() != mine.tobytes():
                    bad.append(("input changed", op, dtype))
            # a structure packed into a buffer of the collective's own: reduced in place
            parts = _inputs(99, n, "float32", (30_000,))
            got = ctx.all_reduce("SUM", [parts[rank], parts[rank][:5000] * 2])
            want = _reduce_in_rank_order("SUM", parts, "float32")
            if got[0].tobytes() != want.tobytes() or not np.allclose(got[1], want[:5000] * 2, rtol=1e-6):
                bad.append("packed structure")
            return bad

        out = strategy.experimental_local_results(strategy.run(fn))
        assert all(b == [] for b in out), out
        assert _single_copy_state(threaded_client, strategy) == [True] * replicas


def test_replica_processes_read_each_other(process_client):
    """Two worker processes: the kernel lets them read each other; 24 MB of float64, many pieces per chunk."""
    with dd.MirroredStrategy(client=process_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            rank = ctx.replica_id_in_sync_group
            x = np.arange(3_000_001, dtype=np.float64) * (rank + 1)
            first = ctx.all_reduce("SUM", x)
            again = ctx.all_reduce("MEAN", x)
            return bool(np.array_equal(first, np.arange(3_000_001) * 3.0)), bool(
                np.array_equal(again, np.arange(3_000_001) * 1.5)), os.getpid()

        ok1, ok2, pids = strategy.run(fn)
        # True on every replica: TF's regroup returns the shared True itself (False would be PerReplica)
        assert ok1 is True and ok2 is True
        assert len(set(strategy.experimental_local_results(pids))) == 2
        assert _single_copy_state(process_client, strategy) == [True, True]


def _no_cross_memory():
    from daskdist.collective.core.engines.single_copy import all_reduce as single_copy

    single_copy._CROSS_MEMORY[:] = [None]  # as on a system without process_vm_readv


def test_a_replica_that_cannot_read_its_peers_makes_every_replica_use_the_ring(make_cluster):
    client = make_cluster(2, processes=True)
    client.run(_no_cross_memory, workers=[min(scheduler_workers(client))])
    with dd.MirroredStrategy(client=client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            x = np.full(1_000_000, ctx.replica_id_in_sync_group + 1.0, np.float32)
            return float(ctx.all_reduce("SUM", x).sum()), float(ctx.all_reduce("SUM", x * 2).sum())

        first, second = strategy.run(fn)
        assert strategy.experimental_local_results(first) == (3e6, 3e6)
        assert strategy.experimental_local_results(second) == (6e6, 6e6)
        assert _single_copy_state(client, strategy) == [False, False]


def test_switched_off_on_the_client(threaded_client):
    with dask.config.set({**LOW, "daskdist.collective.shm.single-copy-bytes": None}), dd.MirroredStrategy(
            client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            return float(ctx.all_reduce("SUM", np.ones(100_000, np.float32)).sum())

        assert strategy.experimental_local_results(strategy.run(fn)) == (3e5,) * 3
        assert _single_copy_state(threaded_client, strategy) == [False] * 3


def test_chunk_bounds_cover_everything_on_page_boundaries():
    for nbytes, itemsize, size in [(4096 * 10 + 4, 4, 3), (8, 8, 4), (0, 4, 2), (1 << 26, 2, 4), (12_345, 1, 2)]:
        bounds = chunk_bounds(nbytes, itemsize, size)
        assert bounds[0] == 0 and bounds[-1] == nbytes // itemsize and len(bounds) == size + 1
        assert all(a <= b for a, b in zip(bounds, bounds[1:]))
        assert all((b * itemsize) % 4096 == 0 for b in bounds[1:-1])


def test_cross_memory_reads_and_reports_bad_addresses():
    reader = CrossMemory()
    source = np.arange(100_000, dtype=np.int32)
    out = np.empty_like(source)
    reader.read(os.getpid(), source.ctypes.data, out)
    assert np.array_equal(out, source)
    with pytest.raises(OSError):
        reader.read(os.getpid(), 8, out)  # nothing is mapped at address 8
