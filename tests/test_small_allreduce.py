"""The small all-reduce lanes (shared memory on one host, sockets between hosts), on real clusters.

Results, bit-identity and every failure mode of the general path must hold on
the lanes too, including when replicas disagree about which lane to take.
The failure bodies run over both lanes; ``test_socket_lane`` has the rest of
the socket lane's own behaviour.
"""

from __future__ import annotations

import time

import dask
import numpy as np
import pytest

import daskdist as dd
from tests.support.transports import LANES, lane_plans

SHM = LANES["shm"]


def _by_replica(strategy, out) -> list[tuple]:
    """A ``strategy.run`` result that is a tuple of ``PerReplica`` values, as one tuple per replica."""
    return list(zip(*(strategy.experimental_local_results(v) for v in out)))


def test_small_arrays_take_the_lane_and_match_numpy_bit_for_bit(threaded_client):
    with dask.config.set(SHM), dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            rank = ctx.replica_id_in_sync_group
            rng = np.random.default_rng(rank)
            x = rng.standard_normal(1000).astype(np.float32)
            got = [ctx.all_reduce("SUM", x) for _ in range(3)]
            mean = ctx.all_reduce(dd.ReduceOp.MEAN, np.float64(rank))
            return got[0], got[2], mean

        out = _by_replica(strategy, strategy.run(fn))
        inputs = [np.random.default_rng(r).standard_normal(1000).astype(np.float32) for r in range(3)]
        want = (inputs[0] + inputs[1]) + inputs[2]  # rank order, as every replica reduces
        for first, third, mean in out:
            assert first.tobytes() == want.tobytes() and third.tobytes() == want.tobytes()
            assert float(mean) == 1.0
        assert all(n >= 2 for n in lane_plans(strategy, threaded_client))


def test_replicas_that_agree_on_the_signature_agree_on_the_lane(threaded_client):
    """Contiguous or not, a number or a 0-d array, options or none: same signature, same results."""
    with dask.config.set(SHM), dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            rank = ctx.replica_id_in_sync_group
            base = np.arange(20.0).reshape(4, 5)
            x = base.T.copy() if rank == 0 else np.ascontiguousarray(base.T).T.T  # same values
            if rank == 1:
                x = base.T  # a non-contiguous view
            a = ctx.all_reduce("SUM", x, dd.CommunicationOptions() if rank == 2 else None)
            b = ctx.all_reduce("SUM", 2.0 if rank == 0 else np.array(2.0))
            return a, b

        out = _by_replica(strategy, strategy.run(fn))
        for a, b in out:
            assert np.array_equal(a, 3 * np.arange(20.0).reshape(4, 5).T)
            assert float(b) == 6.0


@pytest.mark.parametrize("lane", sorted(LANES))
@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda r: np.ones(100_000 if r == 1 else 3, np.float32), "float32[100000]"),
        (lambda r: np.ones(4 if r == 2 else 3, np.float32), "float32[4]"),
        (lambda r: np.ones(3, np.float32 if r != 2 else np.int32), "int32[3]"),
        (lambda r: np.ones(3) if r != 0 else [np.ones(3)], "PyTreeSpec([*])"),
    ],
    ids=["lane-vs-ring", "shape", "dtype", "structure"],
)
def test_a_mismatch_across_lanes_raises_on_every_replica(threaded_client, make, fragment, lane):
    with dask.config.set(LANES[lane]), dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            try:
                ctx.all_reduce("SUM", make(ctx.replica_id_in_sync_group), dd.CommunicationOptions(timeout_seconds=60))
            except dd.CollectiveError as e:
                return f"{type(e).__name__}: {e}"
            return "no error"

        start = time.monotonic()
        results = strategy.experimental_local_results(strategy.run(fn))
        assert time.monotonic() - start < 10
        assert all(r.startswith(("CollectiveMismatchError", "CollectiveAbortedError")) for r in results), results
        assert any(r.startswith("CollectiveMismatchError") and fragment in r for r in results), results
        # the group is still usable afterwards
        ok = strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(2)))
        assert all(v.tolist() == [3.0, 3.0] for v in strategy.experimental_local_results(ok))
        assert all(n >= 1 for n in lane_plans(strategy, threaded_client, lane))  # the lane was taken


@pytest.mark.parametrize("lane", sorted(LANES))
def test_a_replica_that_never_joins_times_out_naming_it(threaded_client, lane):
    with dask.config.set(LANES[lane]), dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            if ctx.replica_id_in_sync_group == 1:
                return "skipped"
            try:
                ctx.all_reduce("SUM", np.ones(4), dd.CommunicationOptions(timeout_seconds=1))
            except dd.CollectiveError as e:
                return f"{type(e).__name__}: {e}"
            return "no error"

        results = strategy.experimental_local_results(strategy.run(fn))
        assert results[1] == "skipped"
        timeouts = [r for r in results if r.startswith("CollectiveTimeoutError")]
        assert timeouts and all("replica 1" in r for r in timeouts), results
        assert lane_plans(strategy, threaded_client, lane) == [1, 0, 1]  # the waiting replicas took the lane


@pytest.mark.parametrize(
    "replicas, elements, lane",
    [
        (2, 3 << 17, lambda cores: True),  # 1.5 MiB, two replicas: up to one 2 MiB slot
        (3, 3 << 17, lambda cores: False),  # 1.5 MiB, three replicas: beyond half a slot, the ring
        (3, 1 << 18, lambda cores: 3 > cores),  # 1 MiB, three replicas: one hop only when they outnumber cores
    ],
)
def test_the_lane_takes_larger_arrays_where_one_hop_wins(threaded_client, replicas, elements, lane):
    """Two replicas: one slot (the ring would move the same bytes in two steps); oversubscribed: half a slot."""
    from daskdist.collective.transport.shm import usable_cores

    devices = [f"/cpu:{i}" for i in range(replicas)]
    with dask.config.set(SHM), dd.MirroredStrategy(devices=devices, client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            return ctx.all_reduce("SUM", np.full(elements, ctx.replica_id_in_sync_group + 1.0, np.float32))

        want = sum(range(1, replicas + 1))
        for result in strategy.experimental_local_results(strategy.run(fn)):
            assert result.shape == (elements,) and float(result.min()) == float(result.max()) == want
        plans = lane_plans(strategy, threaded_client, usable=False)
        assert plans and all(n == 1 for n in plans)  # one entry cached either way ...
        assert all(t == lane(usable_cores()) for t in [n > 0 for n in lane_plans(strategy, threaded_client)])  # ... usable or not


def test_a_structure_fused_into_one_pack_takes_the_lane(threaded_client):
    """A list of gradients of one dtype is one flat pack: it goes one hop, results and errors as usual."""
    with dask.config.set(SHM), dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            r = ctx.replica_id_in_sync_group
            grads = {"w": np.full((8, 4), r + 1.0, np.float32), "b": [np.arange(3, dtype=np.float32) * r]}
            out = ctx.all_reduce("MEAN", grads)
            ok = (out["w"].shape == (8, 4) and float(out["w"].min()) == float(out["w"].max()) == 2.0
                  and out["b"][0].tolist() == [0.0, 1.0, 2.0])
            bad = [np.ones(3 + (r == 2), np.float32), np.ones(2, np.float32)]
            try:
                ctx.all_reduce("SUM", bad, dd.CommunicationOptions(timeout_seconds=30))
                error = "no error"
            except dd.CollectiveError as e:
                error = f"{type(e).__name__}: {e}"
            return ok, error

        oks, errors = (strategy.experimental_local_results(v) for v in strategy.run(fn))
        assert all(oks), oks
        assert any(e.startswith("CollectiveMismatchError") and "float32[4]" in e for e in errors), errors
        assert all(e.startswith(("CollectiveMismatchError", "CollectiveAbortedError")) for e in errors), errors
        token = strategy.extended.group.group_id

        def pack_plans(dask_worker):
            return [sum(1 for k, p in runtime.communicator.lane._plans.items() if k[0] == "pack" and p is not None)
                    for group, runtime in dask_worker.extensions["daskdist"].replicas.items() if group == token]

        assert all(n >= 1 for part in threaded_client.run(pack_plans).values() for n in part)


def test_the_lane_never_takes_more_than_a_slot(threaded_client):
    """``small-message-bytes`` above the slot size: arrays larger than a slot go in pieces, not through the lane."""
    settings = {**SHM, "daskdist.collective.small-message-bytes": 1 << 20, "daskdist.collective.shm.slot-bytes": "64KiB"}
    with dask.config.set(settings), dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            x = np.arange(50_000, dtype=np.float32) * (ctx.replica_id_in_sync_group + 1)  # 200 KB: 3+ slots
            return ctx.all_reduce("SUM", x)

        for got in strategy.experimental_local_results(strategy.run(fn)):
            assert np.array_equal(got, np.arange(50_000, dtype=np.float32) * 6)


def _interleaved_collectives():
    """Replica function: lane all-reduces of several signatures, mixed with general-path collectives.

    A channel slot keeps the lane header it last held and typed views of its
    data; messages of other signatures and of the general path in between must
    never leave a stale header, and results must never alias a slot.
    """
    ctx = dd.get_replica_context()
    rank = ctx.replica_id_in_sync_group
    results = []
    for i in range(30):
        kind = i % 5
        if kind == 0:
            results.append(ctx.all_reduce("SUM", np.full(7, rank + i, np.int32)))
        elif kind == 1:
            results.append(ctx.all_reduce("MAX", np.float64(rank * i)))
        elif kind == 2:
            results.append(ctx.all_gather(np.array([rank, i]), axis=0))
        elif kind == 3:
            results.append(ctx.all_reduce("MEAN", (np.arange(3001) % 7).astype(np.float16) + rank))
        else:  # two dtypes: two packs, the general path
            pair = ctx.all_reduce("SUM", [np.full(5, rank, np.int64), np.full(3, i, np.float32)])
            results.extend(pair)
    return results


def _interleaved_expected(n: int) -> list[np.ndarray]:
    expected = []
    for i in range(30):
        kind = i % 5
        if kind == 0:
            expected.append(sum(np.full(7, r + i, np.int32) for r in range(n)))
        elif kind == 1:
            expected.append(np.float64((n - 1) * i))
        elif kind == 2:
            expected.append(np.concatenate([np.array([r, i]) for r in range(n)]))
        elif kind == 3:
            parts = [(np.arange(3001) % 7).astype(np.float16) + r for r in range(n)]
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            expected.append(total / np.float16(n))
        else:
            expected.extend([np.full(5, n * (n - 1) // 2, np.int64), np.full(3, n * i, np.float32)])
    return expected


@pytest.mark.parametrize("client_name", ["threaded_client", "process_client"])
def test_lane_slots_stay_correct_among_other_collectives(request, client_name):
    client = request.getfixturevalue(client_name)
    with dask.config.set(SHM), dd.MirroredStrategy(client=client) as strategy:
        n = strategy.num_replicas_in_sync
        per_replica = _by_replica(strategy, strategy.run(_interleaved_collectives))
        taken = lane_plans(strategy, client)
    expected = _interleaved_expected(n)
    for results in per_replica:
        assert len(results) == len(expected)
        for got, want in zip(results, expected, strict=True):
            assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == np.shape(want)
            assert got.tobytes() == np.asarray(want).tobytes()
    assert all(count >= 3 for count in taken)  # three signatures took the lane
