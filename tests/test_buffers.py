"""Result buffers of large collectives are reused only once nobody holds them."""

from __future__ import annotations

import dask
import numpy as np

import daskdist as dd
from daskdist.collective.core.buffers import BufferPool


def test_an_idle_buffer_is_reused_and_a_held_one_is_not():
    pool = BufferPool(min_bytes=1024)
    first = pool.empty(1000, np.float32)
    address = first.__array_interface__["data"][0]
    del first
    second = pool.empty((10, 100), np.float32)  # same bytes, other shape: the idle buffer again
    assert second.__array_interface__["data"][0] == address and second.shape == (10, 100)
    view = second[3:5]
    del second
    third = pool.empty(1000, np.float32)  # ``view`` still holds the buffer: a new one
    assert third.__array_interface__["data"][0] != address
    assert len(pool) == 2
    assert pool.empty(10, np.float32).nbytes == 40 and len(pool) == 2  # small: never pooled
    del view


def test_the_pool_keeps_a_bounded_number_of_buffers():
    pool = BufferPool(min_bytes=16, max_buffers=3)
    held = [pool.empty(100 + i, np.uint8) for i in range(5)]
    assert len(pool) == 3
    del held
    for i in range(10):  # idle buffers of other sizes make room, dropped by position (not compared as arrays)
        keep = pool.empty(200 + i, np.float32)
        assert len(pool) <= 3 and keep.shape == (200 + i,)


def test_held_results_survive_later_all_reduces(threaded_client):
    """A large all-reduce's result stays intact while the caller holds it; dropped results are recycled."""
    with dask.config.set({"daskdist.collective.transport": "shm"}), \
            dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            n = 1 << 19  # 2 MiB of float32: the ring, with a pooled result
            kept = [ctx.all_reduce("SUM", np.full(n, float(i), np.float32)) for i in range(3)]
            packs = [ctx.all_reduce("SUM", [np.full(n, float(i)), np.full(7, float(i))]) for i in range(3)]
            for _ in range(5):
                ctx.all_reduce("SUM", np.ones(n, np.float32))  # dropped at once
            pool = len(ctx._runtime.communicator.buffers)
            ok = all(float(k.min()) == float(k.max()) == 3.0 * i for i, k in enumerate(kept))
            ok = ok and all(float(p[0].max()) == float(p[1].min()) == 3.0 * i for i, p in enumerate(packs))
            return ok, pool

        ok, pool = (strategy.experimental_local_results(v) for v in strategy.run(fn))
        assert all(ok)
        assert all(p <= 8 for p in pool)
