"""The socket lane for small all-reduces between hosts, on real clusters.

Every worker is its own host (``collective.hosts: per-worker``), so every
peer is reached over TCP. Results must be the general path's, bit for bit;
a lost peer must behave as on the general path (mismatches and timeouts,
including replicas that disagree about the path: ``test_small_allreduce``,
over both lanes).
"""

from __future__ import annotations

import dask
import numpy as np
import pytest

import daskdist as dd
from tests.support.killers import kill_the_awaited_peer
from tests.support.transports import LANES, lane_plans

CROSS_HOST = LANES["socket"]


def _cases(rank):
    import ml_dtypes

    rng = np.random.default_rng(rank)
    matrix = rng.standard_normal((6, 5))
    return [
        ("SUM", rng.standard_normal(1000).astype(np.float32)),
        ("MEAN", rng.standard_normal((7, 3)).astype(np.float16)),
        ("MEAN", rng.integers(-9, 9, 11).astype(np.int32)),
        ("MAX", rng.integers(0, 100, 13).astype(np.int8)),
        ("MIN", rng.standard_normal(9)),
        ("PRODUCT", rng.integers(1, 4, 5).astype(np.int64)),
        ("SUM", rng.random(9) > 0.5),
        ("PRODUCT", rng.random(9) > 0.2),
        ("SUM", np.array(float(rank))),  # 0-d
        ("SUM", matrix.T),  # not contiguous
        ("SUM", rng.standard_normal(11).astype(ml_dtypes.bfloat16)),
        (dd.ReduceOp.SUM, rng.standard_normal(16384).astype(np.float32)),  # 64 KiB: the largest one hop
    ]


def test_small_arrays_between_hosts_take_the_socket_lane_with_the_general_paths_results(threaded_client):
    with dask.config.set(CROSS_HOST), dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            from daskdist import context

            comm = context.current_runtime().communicator
            ctx = dd.get_replica_context()
            cases = _cases(ctx.replica_id_in_sync_group)
            lane = [ctx.all_reduce(op, x) for op, x in cases]
            kept, comm.socket_lane = comm.socket_lane, None
            try:
                general = [ctx.all_reduce(op, x) for op, x in cases]
            finally:
                comm.socket_lane = kept
            again = [ctx.all_reduce(op, x) for op, x in cases]  # the cached plans
            return [(type(a), a.dtype, a.shape, a.tobytes()) for a in lane + again], \
                [(type(g), g.dtype, g.shape, g.tobytes()) for g in general + general]

        out = strategy.experimental_local_results(strategy.run(fn))
        for lane, general in out:
            assert lane == general
        assert len({str(lane) for lane, _ in out}) == 1  # bit-identical on every replica
        assert lane_plans(strategy, threaded_client, "socket") == [len(_cases(0))] * 3


def test_what_the_direct_engine_would_not_take_stays_on_the_general_path(threaded_client):
    with dask.config.set(CROSS_HOST), dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            ring = dd.CommunicationOptions(implementation=dd.CommunicationImplementation.RING)
            return [ctx.all_reduce("SUM", np.ones(16385, np.float32)).sum(),  # above small-message-bytes
                    ctx.all_reduce("SUM", np.ones(3), ring).sum(),  # the ring asked for
                    ctx.all_reduce("SUM", np.ones(0)).size,  # empty
                    ctx.all_reduce("SUM", [np.ones(3)])[0].sum()]  # not a bare array

        out = strategy.experimental_local_results(strategy.run(fn))
        assert all(r == [3 * 16385, 9.0, 0, 9.0] for r in out)
        assert lane_plans(strategy, threaded_client, "socket") == [0, 0, 0]

    with dask.config.set({**CROSS_HOST, "daskdist.collective.socket.lane": False}), \
            dd.MirroredStrategy(client=threaded_client) as strategy:
        assert lane_plans(strategy, threaded_client, "socket") == [-1, -1, -1]


@pytest.mark.slow
def test_a_killed_peer_wakes_replicas_waiting_in_the_socket_lane(make_cluster, tmp_path):
    client = make_cluster(3, processes=True)
    with dask.config.set(CROSS_HOST):
        strategy = dd.MirroredStrategy(client=client)
    # ranks 0 and 1 wait in the socket lane for rank 2's array: each holds the one plan it took
    lines = kill_the_awaited_peer(client, strategy, tmp_path, 1000, lane_plans=True)
    assert lines == ["0 ReplicaLostError 1", "1 ReplicaLostError 1"]
    strategy.close()


def test_small_all_reduces_in_flight_together_on_the_socket_lane_each_get_their_own_result(threaded_client):
    """An async window of 4 runs socket-lane all-reduces of one shape at once (their frames share packed
    headers, renumbered under the connection's write lock): each meets its own peers' arrays."""
    with dask.config.set({**CROSS_HOST, "daskdist.collective.async-window": 4}), \
            dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            group, rank = ctx.process_group, ctx.replica_id_in_sync_group
            works = [group.all_reduce("SUM", np.full(1000, float(i + rank), np.float32), async_op=True)
                     for i in range(40)]
            return [float(w.wait()[0]) for w in works], rank

        for sums, _ in strategy.experimental_local_results(strategy.run(fn)):
            assert sums == [3.0 * i + 3 for i in range(40)]
        assert lane_plans(strategy, threaded_client, "socket") == [1, 1, 1]
