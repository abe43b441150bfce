"""The MirroredStrategy user story on real Dask clusters."""

from __future__ import annotations

import collections
import threading
import time

import cloudpickle
import numpy as np
import pytest

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers


def step(x, v):
    ctx = dd.get_replica_context()
    local = x * (ctx.replica_id_in_sync_group + 1)
    total = ctx.all_reduce(dd.ReduceOp.SUM, {"a": local, "b": [local, local]})
    v.assign_add(total["a"])
    return total["a"]


@pytest.mark.parametrize("client_name", ["threaded_client", "process_client"])
def test_run_all_reduces_structures_into_a_mean_mirrored_variable(request, client_name):
    client = request.getfixturevalue(client_name)
    n = len(scheduler_workers(client))
    with dd.MirroredStrategy(client=client) as strategy:
        assert strategy.num_replicas_in_sync == n
        with strategy.scope():
            v = dd.Variable(np.zeros(3, np.float32), aggregation=dd.VariableAggregation.MEAN)
        assert isinstance(v, dd.MirroredVariable)

        out = strategy.run(lambda x: step(x, v), args=(np.ones(3, np.float32),))
        assert isinstance(out, dd.PerReplica)
        expected = np.full(3, n * (n + 1) / 2, np.float32)
        local = strategy.experimental_local_results(out)
        assert isinstance(local, tuple) and len(local) == n
        for part in local:
            np.testing.assert_array_equal(part, expected)
        np.testing.assert_array_equal(strategy.reduce(dd.ReduceOp.MEAN, out, axis=None), expected)
        np.testing.assert_array_equal(strategy.reduce("SUM", out, axis=None), expected * n)
        np.testing.assert_array_equal(strategy.gather(out, axis=0), np.tile(expected, n))
        np.testing.assert_array_equal(v.numpy(), expected)
        np.testing.assert_array_equal(np.asarray(v), expected)

        vals = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.full(2, ctx.replica_id_in_sync_group)
        )
        gathered = strategy.run(lambda x: dd.get_replica_context().all_gather(x, axis=0), args=(vals,))
        for part in strategy.experimental_local_results(gathered):
            np.testing.assert_array_equal(part, np.repeat(np.arange(n), 2))


def test_replica_context_properties(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        info = strategy.run(
            lambda: (
                dd.get_replica_context().replica_id_in_sync_group,
                dd.get_replica_context().num_replicas_in_sync,
                dd.get_replica_context().devices,
                dd.get_replica_context().strategy.num_replicas_in_sync,
                dd.in_cross_replica_context(),
            )
        )
        # regroup turns the tuple of results into a tuple of PerReplica leaves; a value that every
        # replica returned alike (an equal Python scalar) comes back as itself, as TF's regroup does
        assert strategy.experimental_local_results(info[0]) == (0, 1, 2)
        assert info[1] == 3 and strategy.experimental_local_results(info[1]) == (3,)
        assert strategy.experimental_local_results(info[2][0])[1] == "/job:localhost/replica:0/task:0/device:CPU:1"
        assert info[4] is False
        assert info[3] == 3
        with strategy.scope():
            assert dd.in_cross_replica_context()
            assert dd.get_replica_context() is None
            assert dd.get_strategy() is strategy
    assert dd.get_replica_context().num_replicas_in_sync == 1  # default context


def test_all_reduce_batches_lists_and_reduces_ops(threaded_client):
    Pair = collections.namedtuple("Pair", "first second")
    with dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            r = ctx.replica_id_in_sync_group
            batch = ctx.all_reduce("SUM", [np.full(2, r, np.float32), np.full(3, r, np.int64), r])
            mean = ctx.all_reduce(dd.ReduceOp.MEAN, Pair(np.float64(r), np.full((2, 2), r, np.float32)))
            big = ctx.all_reduce("SUM", np.full(100_003, r, np.float32))  # ring path, odd size
            biggest = ctx.all_reduce(dd.ReduceOp.MAX, np.array([r, -r]))
            return batch, mean, big, biggest

        out = strategy.run(fn)
        batch, mean, big, biggest = _first_replica(strategy, out)
        assert batch[0].tolist() == [3.0, 3.0] and batch[1].tolist() == [3, 3, 3] and int(batch[2]) == 3
        assert isinstance(mean, Pair)
        assert float(mean.first) == 1.0 and mean.second.tolist() == [[1.0, 1.0], [1.0, 1.0]]
        assert big.shape == (100_003,) and np.all(big == 3.0)
        assert biggest.tolist() == [2, 0]


def _first_replica(strategy, out):
    """Replica 0's component of every leaf of ``out``."""
    import optree

    return optree.tree_map(
        lambda x: strategy.experimental_local_results(x)[0],
        out,
        is_leaf=lambda x: isinstance(x, dd.PerReplica),
    )


def test_cross_device_ops(threaded_client):
    for ops in (
        dd.NcclAllReduce(),
        dd.NcclAllReduce(num_packs=0),
        dd.HierarchicalCopyAllReduce(num_packs=2),
        dd.ReductionToOneDevice(),
        dd.ReductionToOneDevice(reduce_to_device="/cpu:1", accumulation_fn=lambda xs: np.sum(xs, axis=0)),
    ):
        with dd.MirroredStrategy(client=threaded_client, cross_device_ops=ops) as strategy:
            out = strategy.run(
                lambda: dd.get_replica_context().all_reduce(
                    "SUM", [np.arange(5.0) * dd.get_replica_context().replica_id_in_sync_group, np.ones(2)]
                )
            )
            first = _first_replica(strategy, out)
            assert first[0].tolist() == (np.arange(5.0) * 3).tolist(), ops
            assert first[1].tolist() == [3.0, 3.0]
    with pytest.raises(TypeError, match="cross_device_ops"):
        dd.MirroredStrategy(client=threaded_client, cross_device_ops="nccl")
    with pytest.raises(ValueError, match="reduce_to_device"):
        dd.MirroredStrategy(client=threaded_client, cross_device_ops=dd.ReductionToOneDevice("/cpu:7"))
    with pytest.raises(ValueError, match="num_packs"):
        dd.NcclAllReduce(num_packs=-1)


def test_merge_call(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        with strategy.scope():
            v = dd.Variable(np.zeros(2))

        def fn():
            ctx = dd.get_replica_context()

            def merge_fn(strat, value, var):
                assert isinstance(value, dd.PerReplica) and len(value.values) == 3
                total = strat.extended.reduce_to(dd.ReduceOp.SUM, value)
                strat.extended.update(var, lambda vv, t: vv.assign(t), args=(total,))
                return strat.reduce("MEAN", value, axis=None)

            return ctx.merge_call(merge_fn, args=(np.full(2, ctx.replica_id_in_sync_group + 1.0), v))

        out = strategy.run(fn)
        for part in strategy.experimental_local_results(out):
            assert part.tolist() == [2.0, 2.0]
        assert v.numpy().tolist() == [6.0, 6.0]
        # every copy was updated identically
        assert [x.tolist() for x in v.local_results()] == [[6.0, 6.0]] * 3


def test_one_device_strategy(threaded_client):
    with dd.OneDeviceStrategy("/cpu:0", client=threaded_client) as strategy:
        assert strategy.num_replicas_in_sync == 1
        out = strategy.run(lambda x: dd.get_replica_context().all_reduce("SUM", x) * 2, args=(np.ones(2),))
        assert isinstance(out, np.ndarray) and out.tolist() == [2.0, 2.0]
        assert strategy.experimental_local_results(out)[0] is out
        assert strategy.reduce("SUM", out, axis=None).tolist() == [2.0, 2.0]
        with strategy.scope():
            v = dd.Variable(3.0)
        strategy.run(lambda: v.assign_add(1.0))
        assert float(v.numpy()) == 4.0
    with pytest.raises(TypeError):
        dd.OneDeviceStrategy(["/cpu:0"], client=threaded_client)


def test_devices_select_workers_of_an_existing_cluster(threaded_client):
    workers = sorted(scheduler_workers(threaded_client).items(), key=lambda kv: str(kv[1]["name"]))
    with dd.MirroredStrategy(devices=["CPU:2", "/job:localhost/replica:0/task:0/device:CPU:0"],
                             client=threaded_client) as strategy:
        assert strategy.num_replicas_in_sync == 2
        assert strategy.extended.worker_addresses == (workers[2][0], workers[0][0])
        assert strategy.extended.worker_devices == (
            "/job:localhost/replica:0/task:0/device:CPU:2",
            "/job:localhost/replica:0/task:0/device:CPU:0",
        )
        where = strategy.run(lambda: dd.get_replica_context().devices[0])
        assert strategy.experimental_local_results(where) == strategy.extended.worker_devices


def test_distributed_arguments_go_to_their_replica(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        per = dd.PerReplica([np.full(2, 10 * r) for r in range(3)])
        out = strategy.run(lambda x, y, z=None: x + y + z, args=(per, np.ones(2)), kwargs={"z": per})
        assert [p.tolist() for p in strategy.experimental_local_results(out)] == [[1, 1], [21, 21], [41, 41]]
        with pytest.raises(ValueError, match="3 replicas"):
            strategy.run(lambda x: x, args=(dd.PerReplica([1, 2]),))


class TestVariables:
    def test_aggregations(self, threaded_client):
        with dd.MirroredStrategy(client=threaded_client) as strategy:
            with strategy.scope():
                mean = dd.Variable(np.zeros(2), aggregation="MEAN")
                total = dd.Variable(np.zeros(2), aggregation=dd.VariableAggregation.SUM)
                first = dd.Variable(np.zeros(2), aggregation=dd.VariableAggregation.ONLY_FIRST_REPLICA)
                plain = dd.Variable(np.zeros(2))

            def fn():
                r = dd.get_replica_context().replica_id_in_sync_group
                mean.assign_add(np.full(2, r, np.float64))
                total.assign(np.full(2, r + 1.0))
                first.assign_sub(np.full(2, r + 5.0))
                return mean.read_value()

            out = strategy.run(fn)
            assert mean.numpy().tolist() == [1.0, 1.0]
            assert total.numpy().tolist() == [6.0, 6.0]
            assert first.numpy().tolist() == [-5.0, -5.0]
            for name, var in (("mean", mean), ("total", total), ("first", first)):
                copies = {tuple(c.tolist()) for c in var.local_results()}
                assert len(copies) == 1, name
            assert all(p.tolist() == [1.0, 1.0] for p in strategy.experimental_local_results(out))

            with pytest.raises(ValueError, match="You must specify an aggregation method"):
                strategy.run(lambda: plain.assign_add(np.ones(2)))
            # from the client (cross-replica context) an update needs no aggregation
            plain.assign(np.array([1.0, 2.0]))
            plain.assign_add(np.array([1.0, 1.0]))
            assert {tuple(c.tolist()) for c in plain.local_results()} == {(2.0, 3.0)}
            assert plain.shape == (2,) and plain.dtype == np.float64 and plain.trainable

    def test_sync_on_read(self, threaded_client):
        with dd.MirroredStrategy(client=threaded_client) as strategy:
            with strategy.scope():
                count = dd.Variable(0.0, synchronization=dd.VariableSynchronization.ON_READ,
                                    aggregation=dd.VariableAggregation.SUM)
                avg = dd.Variable(0.0, synchronization="ON_READ", aggregation="MEAN")
            assert isinstance(count, dd.SyncOnReadVariable) and not count.trainable
            strategy.run(lambda: (count.assign_add(dd.get_replica_context().replica_id_in_sync_group + 1.0),
                                  avg.assign(dd.get_replica_context().replica_id_in_sync_group * 1.0)))
            assert float(count.numpy()) == 6.0
            assert float(avg.numpy()) == 1.0
            count.assign(9.0)  # SUM: each copy gets 9 / 3 so the aggregate reads 9
            assert float(count.numpy()) == 9.0
            with strategy.scope():  # TF 2 keeps an explicit trainable=True (strategy_test_lib._test_trainable_variable)
                assert dd.Variable(0.0, synchronization="ON_READ", trainable=True).trainable
            with pytest.raises(ValueError, match="does not support `assign_add` in cross-replica context"):
                count.assign_add(1.0)
            assert float(count.numpy()) == 9.0  # refused before anything changed

    def test_created_inside_a_replica_function(self, threaded_client):
        with dd.MirroredStrategy(client=threaded_client) as strategy:
            def make():
                r = dd.get_replica_context().replica_id_in_sync_group
                return dd.Variable(np.full(2, r + 7.0), aggregation="SUM", name="made")

            v = strategy.run(make)
            assert isinstance(v, dd.MirroredVariable)  # the same handle from every replica
            assert v.numpy().tolist() == [7.0, 7.0]  # replica 0's initial value
            strategy.run(lambda: v.assign_add(np.ones(2)))
            assert v.numpy().tolist() == [10.0, 10.0]

    def test_outside_a_scope_it_is_an_ordinary_variable(self):
        v = dd.Variable([1.0, 2.0], name="w")
        assert type(v) is dd.Variable and not isinstance(v, dd.MirroredVariable)
        v.assign_add([1.0, 1.0])
        assert v.numpy().tolist() == [2.0, 3.0]
        assert (v * 2).tolist() == [4.0, 6.0]
        with pytest.raises(ValueError, match="shape"):
            v.assign(np.ones(3))
        with pytest.raises(ValueError, match="aggregation"):
            dd.Variable(1.0, aggregation="AVERAGE")

    def test_captured_variables_are_not_shipped(self, threaded_client):
        with dd.MirroredStrategy(client=threaded_client) as strategy:
            with strategy.scope():
                big = dd.Variable(np.zeros(1_000_000, np.float32), aggregation="MEAN")

            def fn():
                big.assign_add(np.ones(1_000_000, np.float32))
                return float(big.value()[0])

            assert len(cloudpickle.dumps(fn)) < 10_000  # a 4 MB variable travels as a reference
            for expected in (1.0, 2.0):
                out = strategy.run(fn)
                assert strategy.experimental_local_results(out) == (expected,) * 3


def test_two_strategies_on_one_cluster_do_not_interfere(threaded_client):
    a = dd.MirroredStrategy(client=threaded_client)
    b = dd.MirroredStrategy(client=threaded_client)
    errors, results = [], {"a": [], "b": []}

    def loop(strategy, name, scale):
        try:
            for i in range(15):
                out = strategy.run(
                    lambda i=i: dd.get_replica_context().all_reduce("SUM", np.full(4, scale * (i + 1.0)))
                )
                results[name].append(strategy.experimental_local_results(out)[0][0])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(a, "a", 1.0)), threading.Thread(target=loop, args=(b, "b", 100.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    a.close()
    b.close()
    assert not errors
    assert results["a"] == [3.0 * (i + 1) for i in range(15)]
    assert results["b"] == [300.0 * (i + 1) for i in range(15)]


_REPLICA_THREADS: list[threading.Thread] = []  # the threaded cluster runs in this process


def _remember_thread():
    _REPLICA_THREADS.append(threading.current_thread())


def test_close_leaves_nothing_on_the_workers(threaded_client):
    strategy = dd.MirroredStrategy(client=threaded_client)
    with strategy.scope():
        dd.Variable(np.zeros(10))
    _REPLICA_THREADS.clear()
    strategy.run(_remember_thread)
    assert len(_REPLICA_THREADS) == 3
    group_id = strategy.extended.group.group_id
    strategy.close()
    strategy.close()  # idempotent

    def replicas_left(dask_worker):
        ext = dask_worker.extensions["daskdist"]
        return [key for key in ext.replicas if key == group_id]

    assert all(v == [] for v in threaded_client.run(replicas_left).values())
    groups = threaded_client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.extensions["daskdist"].groups))
    assert group_id not in groups
    deadline = time.monotonic() + 10  # releasing futures reaches the scheduler asynchronously
    while time.monotonic() < deadline:
        tasks = threaded_client.run_on_scheduler(
            lambda dask_scheduler: [k for k in dask_scheduler.tasks if str(k).startswith(group_id)]
        )
        if not tasks:
            break
        time.sleep(0.1)
    assert tasks == []
    while time.monotonic() < deadline and any(t.is_alive() for t in _REPLICA_THREADS):
        time.sleep(0.1)
    assert not any(t.is_alive() for t in _REPLICA_THREADS), "replica threads are still running after close()"
    transport_threads = [t for t in threading.enumerate() if group_id in t.name or "daskdist-shm" in t.name]
    assert not [t for t in transport_threads if t.is_alive()]


def test_step_timings_are_recorded_and_sent_to_the_scheduler(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        for _ in range(3):
            strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(1000)))
        timings = strategy.step_timings()
        assert len(timings) == 3
        for replica, steps in enumerate(timings):
            assert len(steps) == 3
            for t in steps:
                assert t["replica"] == replica
                assert t["allreduce"] > 0 and t["collectives"] == 1 and t["nbytes"] > 0
                assert t["total"] >= t["allreduce"] + t["compute"] - 1e-6
        token = strategy.extended.token
    # timings travel in batches (daskdist.metrics.event-interval); closing sends the rest
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        events = [e for _, e in threaded_client.get_events("daskdist-steps") if e.get("group") == token]
        steps = [(e["replica"], s["run_id"]) for e in events for s in e["steps"]]
        if len(steps) >= 9:
            break
        time.sleep(0.1)
    assert sorted(steps) == sorted({(t["replica"], t["run_id"]) for steps_ in timings for t in steps_})
