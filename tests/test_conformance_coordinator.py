"""TensorFlow's ``ClusterCoordinator`` tests, run against daskdist with TensorFlow's expected values.

The sources are ``tensorflow/python/distribute/coordinator/cluster_coordinator_test.py``
(``StrategyIntegrationTest``, ``ClusterCoordinatorTest``): each test names the
one it ports. TF's cluster there is one worker and one parameter server on
CPU, so ``num_replicas_in_sync`` is 1; here the workers are two threaded Dask
workers (closures go to either) and one parameter server, and the
strategy still has one replica in sync. ``@tf.function`` is dropped,
``tf.constant(c)`` is ``np.float32(c)``, and ``tf.data.Dataset`` is
``daskdist.data.Dataset``.
"""

from __future__ import annotations

import numpy as np
import pytest

import daskdist as dd
from daskdist import distribute
from daskdist.cluster.identity import scheduler_workers
from daskdist.data import Dataset

ClusterCoordinator = dd.experimental.coordinator.ClusterCoordinator
RemoteValue = dd.experimental.coordinator.RemoteValue
VariableAggregation = dd.VariableAggregation


@pytest.fixture(scope="module")
def coordinator(threaded_client):
    info = scheduler_workers(threaded_client)
    ordered = sorted(info, key=lambda a: info[a]["name"])
    spec = dd.cluster_resolver.ClusterSpec({"ps": ordered[:1], "worker": ordered[1:]})
    resolver = dd.cluster_resolver.SimpleClusterResolver(spec)
    with dd.ParameterServerStrategy(resolver, client=threaded_client) as strategy:
        yield ClusterCoordinator(strategy)


def _value(variable):
    return np.asarray(variable.read_value()).tolist()


def test_run_and_reduce(coordinator):
    """``testRunAndReduce``: a scheduled function runs ``strategy.run`` then ``strategy.reduce``: ``(4., 2.)``.

    The scheduled function is in cross-replica context, its ``replica_fn`` in
    replica context; scheduled inside the scope and outside it.
    """
    strategy = coordinator.strategy
    assert not distribute.in_cross_replica_context()
    with strategy.scope():
        assert distribute.in_cross_replica_context()
        v = dd.Variable(initial_value=1.0)
        expected_result = (4.0 * strategy.num_replicas_in_sync, 2.0 * strategy.num_replicas_in_sync)

        def worker_fn(input_tensor):
            assert distribute.in_cross_replica_context()

            def replica_fn(input_tensor):
                assert not distribute.in_cross_replica_context()
                return input_tensor + v, input_tensor - v

            run_result = strategy.run(replica_fn, args=(input_tensor,))
            return strategy.reduce("SUM", run_result, axis=None)

        result = coordinator.schedule(worker_fn, args=(np.float32(3.0),))
        assert isinstance(result, RemoteValue)
        assert result.fetch() == expected_result

    result = coordinator.schedule(worker_fn, args=(np.float32(3.0),))
    assert result.fetch() == expected_result


def test_run_and_reduce_with_assign_add(coordinator):
    """``testRunAndReduceWithAssignAdd``: ``(4., 2.)`` twice; the ONLY_FIRST_REPLICA variable ends at 6."""
    strategy = coordinator.strategy
    with strategy.scope():
        v = dd.Variable(initial_value=1.0)
        v1 = dd.Variable(initial_value=0.0, aggregation=VariableAggregation.ONLY_FIRST_REPLICA)
        expected_result = (4.0 * strategy.num_replicas_in_sync, 2.0 * strategy.num_replicas_in_sync)

        def worker_fn(input_tensor):
            def replica_fn(input_tensor):
                assert not distribute.in_cross_replica_context()
                v1.assign_add(input_tensor)
                return input_tensor + v, input_tensor - v

            run_result = strategy.run(replica_fn, args=(input_tensor,))
            return strategy.reduce("SUM", run_result, axis=None)

        result = coordinator.schedule(worker_fn, args=(np.float32(3.0),))
        assert result.fetch() == expected_result

    result = coordinator.schedule(worker_fn, args=(np.float32(3.0),))
    assert result.fetch() == expected_result
    assert _value(v1) == 6.0


def test_variable_aggregation(coordinator):
    """``testVariableAggregation``: a SUM variable assigned ``replica_id + 1`` in replica context is the sum, 1."""
    strategy = coordinator.strategy
    with strategy.scope():
        v = dd.Variable(initial_value=1.0, aggregation=VariableAggregation.SUM)

        def worker_fn():
            def replica_fn():
                value = np.float32(distribute.get_replica_context().replica_id_in_sync_group + 1)
                v.assign(value)

            strategy.run(replica_fn)

        coordinator.schedule(worker_fn)
        coordinator.join()
        expected_result = 0.0
        for i in range(strategy.num_replicas_in_sync):
            expected_result = expected_result + i + 1
        assert _value(v) == expected_result


@pytest.mark.parametrize("from_function", [True, False], ids=["from_function", "from_dataset"])
def test_distributed_dataset_inside_per_worker_dataset_fn(coordinator, from_function):
    """``testDistributedDatasetInsidePerWorkerDatasetFn``: the first batch of ``range(1, 11).batch(4)``, ``([1, 2, 3, 4],)``."""
    strategy = coordinator.strategy
    if from_function:

        def per_worker_dataset_fn():
            dataset_fn = lambda _: Dataset.range(1, 11).batch(4)  # noqa: E731 - TF's lambda
            return strategy.distribute_datasets_from_function(dataset_fn)
    else:

        def per_worker_dataset_fn():
            dataset = Dataset.range(1, 11).batch(4)
            return strategy.experimental_distribute_dataset(dataset)

    def worker_fn(iterator):
        return strategy.experimental_local_results(next(iterator))

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    result = coordinator.schedule(worker_fn, args=(iter(per_worker_dataset),))
    result = result.fetch()
    expected_result = np.array_split(np.arange(1.0, 5.0), strategy.num_replicas_in_sync, axis=0)
    assert [np.asarray(r).tolist() for r in result] == [e.tolist() for e in expected_result]


def test_distribute_datasets_from_function(coordinator):
    """``testDistributeDatasetsFromFunction``: an input context is given; the first element is ``[[1]]``."""
    strategy = coordinator.strategy

    def per_worker_dataset_fn():
        def input_worker_device_fn(input_context):
            assert input_context is not None
            return Dataset.range(1, 11).batch(1)

        return strategy.distribute_datasets_from_function(input_worker_device_fn)

    def worker_fn(iterator):
        return strategy.experimental_local_results(next(iterator))

    distributed_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    result = coordinator.schedule(worker_fn, args=(iter(distributed_dataset),)).fetch()
    expected_result = [[1 + i] for i in range(strategy.num_replicas_in_sync)]
    assert [np.asarray(r).tolist() for r in result] == expected_result


def test_async_schedule_with_distributed_dataset(coordinator):
    """``testAsyncScheduleWithDistributedDataset``: ``reduce('MEAN', x)`` added five times is ``[10]``, ten times ``[20]``."""
    strategy = coordinator.strategy

    def input_fn():
        dataset = Dataset.from_tensor_slices(np.array([2.0], np.float32)).repeat().batch(strategy.num_replicas_in_sync)
        return strategy.experimental_distribute_dataset(dataset)

    with strategy.scope():
        v = dd.Variable(initial_value=np.zeros(1, np.float32))

    def worker_fn(iterator):
        x = next(iterator)
        reduced_value = strategy.reduce("MEAN", x, axis=None)
        v.assign_add(reduced_value)

    distributed_dataset = coordinator.create_per_worker_dataset(input_fn)
    iterator = iter(distributed_dataset)
    coordinator.join()  # joining without any scheduling doesn't hang
    assert _value(v) == [0.0]
    for _ in range(5):
        coordinator.schedule(worker_fn, args=(iterator,))
    coordinator.join()
    assert [np.asarray(r).tolist() for r in strategy.experimental_local_results(v.read_value())] == [[10.0]]
    for _ in range(5):
        coordinator.schedule(worker_fn, args=(iterator,))
    coordinator.join()
    coordinator.join()
    assert coordinator.done()
    assert [np.asarray(r).tolist() for r in strategy.experimental_local_results(v.read_value())] == [[20.0]]


def test_input_function_with_map_with_distributed_dataset(coordinator):
    """``testInputFunctionWithMapWithDistributedDataset``: ``range(0, 10).batch(n).map(x + 10)`` starts at ``[10]``.

    TF also counts that ``map_fn`` is traced once; nothing is traced here.
    """
    strategy = coordinator.strategy

    def input_fn():
        dataset = Dataset.range(0, 10).batch(strategy.num_replicas_in_sync).map(lambda x: x + 10)
        return strategy.experimental_distribute_dataset(dataset)

    def worker_fn(iterator):
        return next(iterator)

    distributed_dataset = coordinator.create_per_worker_dataset(input_fn)
    result = coordinator.schedule(worker_fn, args=(iter(distributed_dataset),))
    expected_result = np.array_split(np.arange(10.0, 10.0 + strategy.num_replicas_in_sync),
                                     strategy.num_replicas_in_sync, axis=0)
    assert [np.asarray(r).tolist() for r in strategy.experimental_local_results(result.fetch())] == [
        e.tolist() for e in expected_result]


def test_fn_return_nested_values(coordinator):
    """``ClusterCoordinatorTest.testFnReturnNestedValues``: ``2, (3, 4), [5], {'v': 1}``, by ``fetch`` both ways."""
    x = np.int32(1)

    def f():
        return x + 1, (x + 2, x + 3), [x + 4], {"v": x}

    got = coordinator.schedule(f)
    want = 2, (3, 4), [5], {"v": 1}
    assert got.fetch() == want
    assert coordinator.fetch(got) == want


def test_input_function(coordinator):
    """``ClusterCoordinatorTest.testInputFunction``: ``next`` of ``range(1, 2)`` is 1 on each of two closures; v is 2."""
    strategy = coordinator.strategy

    def input_fn():
        return Dataset.range(1, 2)

    with strategy.scope():
        v = dd.Variable(initial_value=0, dtype=np.int64)

    def worker_fn(iterator):
        x = next(iterator)
        v.assign_add(x)
        return x

    distributed_dataset = coordinator.create_per_worker_dataset(input_fn)
    result = coordinator.fetch(coordinator.schedule(worker_fn, args=(iter(distributed_dataset),)))
    assert result == 1
    result = coordinator.fetch(coordinator.schedule(worker_fn, args=(iter(distributed_dataset),)))
    assert result == 1
    assert _value(v) == 2


def test_pass_dataset_to_create_per_worker_dataset(coordinator):
    """``ClusterCoordinatorTest.testPassDatasetToCreatePerWorkerDataset``: the first batch is ``[1, 2, 3, 4]``."""
    dataset = Dataset.range(1, 11).batch(4)

    def worker_fn(iterator):
        return next(iterator)

    per_worker_dataset = coordinator.create_per_worker_dataset(dataset)
    result = coordinator.schedule(worker_fn, args=(iter(per_worker_dataset),)).fetch()
    assert np.asarray(result).tolist() == [1, 2, 3, 4]


def test_multiple_datasets(coordinator):
    """``ClusterCoordinatorTest.testMultipleDatasets``: ``0 + 5`` is 5; with a fresh first iterator, at least 5."""

    def input_fn1():
        return Dataset.range(0, 5)

    def input_fn2():
        return Dataset.range(5, 10)

    per_worker_iterator1 = iter(coordinator.create_per_worker_dataset(input_fn1))
    per_worker_iterator2 = iter(coordinator.create_per_worker_dataset(input_fn2))

    def worker_fn(iterator1, iterator2):
        return next(iterator1) + next(iterator2)

    result = coordinator.schedule(worker_fn, args=(per_worker_iterator1, per_worker_iterator2))
    assert result.fetch() == 5.0
    per_worker_iterator3 = iter(coordinator.create_per_worker_dataset(input_fn1))
    result = coordinator.schedule(worker_fn, args=(per_worker_iterator3, per_worker_iterator2))
    assert result.fetch() >= 5.0


def test_run_not_used_with_cluster_coordinator_schedule(coordinator, caplog):
    """``StrategyIntegrationTest.testRunNotUsedWithClusterCoordinatorSchedule``: ``run`` on the coordinator warns.

    TF's warning text each time ``run`` is called outside ``schedule``; the
    scheduled ``run`` gives ``((2, 0),)`` as local results.
    """
    import logging

    strategy = coordinator.strategy

    def input_fn():
        return Dataset.range(1, 3)

    with strategy.scope():
        v = dd.Variable(initial_value=1, dtype=np.int64)

        def replica_fn(input_tensor):
            return input_tensor + v, input_tensor - v

        def worker_fn(iterator):
            return strategy.run(replica_fn, args=(next(iterator),))

    per_worker_dataset = coordinator.create_per_worker_dataset(input_fn)
    warning = ("A `tf.distribute.experimental.ParameterServerStrategy` method is invoked without using "
               "`ClusterCoordinator.schedule`. If you are not tracing a tf.function, this method is possibly executed "
               "on the coordinator, which can be slow. To properly dispatch functions to run on workers, methods like "
               "`run` or `reduce` should be used within a function passed to "
               "`tf.distribute.experimental.coordinator.ClusterCoordinator.schedule`.")
    with caplog.at_level(logging.WARNING):
        strategy.run(replica_fn, args=(np.int64(1),))
    assert warning in caplog.messages
    caplog.clear()
    rv = coordinator.schedule(worker_fn, args=(iter(per_worker_dataset),))
    with caplog.at_level(logging.WARNING):
        strategy.run(replica_fn, args=(np.int64(1),))
    assert warning in caplog.messages
    expected_result = tuple([(2, 0)] * strategy.num_replicas_in_sync)
    assert strategy.experimental_local_results(rv.fetch()) == expected_result


@pytest.mark.parametrize("from_function", [True, False], ids=["from_function", "from_dataset"])
def test_pass_distributed_dataset_to_create_per_worker_dataset(coordinator, from_function):
    """``testPassDistributedDatasetToCreatePerWorkerDataset``: made on the coordinator, read on a worker: ``([1, 2, 3, 4],)``."""
    strategy = coordinator.strategy
    if from_function:
        dataset_fn = lambda _: Dataset.range(1, 11).batch(4)  # noqa: E731 - TF's lambda
        distributed_dataset = strategy.distribute_datasets_from_function(dataset_fn)
    else:
        dataset = Dataset.range(1, 11).batch(4)
        distributed_dataset = strategy.experimental_distribute_dataset(dataset)

    def worker_fn(iterator):
        return strategy.experimental_local_results(next(iterator))

    per_worker_dataset = coordinator.create_per_worker_dataset(distributed_dataset)
    result = coordinator.schedule(worker_fn, args=(iter(per_worker_dataset),)).fetch()
    expected_result = np.array_split(np.arange(1.0, 5.0), strategy.num_replicas_in_sync, axis=0)
    assert [np.asarray(r).tolist() for r in result] == [e.tolist() for e in expected_result]


# ---------------------------------------------------------------------------------------------
# parameter_server_strategy_v2_test.py, ParameterServerStrategyV2Test and VariablePartitioningTest
# ---------------------------------------------------------------------------------------------

_USAGE_WARNING = ("A `tf.distribute.experimental.ParameterServerStrategy` method is invoked without using "
                  "`ClusterCoordinator.schedule`.")


def test_run_and_reduce_not_used_with_cluster_coordinator_warn(coordinator, caplog):
    """``testRunNotUsedWithClusterCoordinator`` / ``testReduceNotUsedWithClusterCoordinator``: both log TF's warning."""
    import logging

    strategy = coordinator.strategy
    dataset = Dataset.range(8)
    with strategy.scope():
        v = dd.Variable(1, dtype=np.int64)

    def step_fn(iterator):
        return next(iterator) + v

    with caplog.at_level(logging.WARNING):
        assert strategy.run(step_fn, args=(iter(dataset),)) == 1
    assert any(m.startswith(_USAGE_WARNING) for m in caplog.messages)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        strategy.reduce("SUM", None, axis=None)
    assert any(m.startswith(_USAGE_WARNING) for m in caplog.messages)


def test_distribute_dataset_used_directly(coordinator):
    """``testDistributeDatasetUsedDirectly``: iterating a distributed dataset on the coordinator raises ``ValueError``."""
    strategy = coordinator.strategy
    dataset = Dataset.range(3)
    distributed_dataset = strategy.experimental_distribute_dataset(dataset)
    with pytest.raises(ValueError):
        iter(distributed_dataset)
    distributed_dataset = strategy.distribute_datasets_from_function(lambda: dataset)
    with pytest.raises(ValueError):
        iter(distributed_dataset)


def test_basic_variable_with_aggregation(coordinator):
    """``VariablePartitioningTest.testBasicVariableWithAggregation``: ``run`` on the coordinator (one replica) assigns
    ``[10, 1, 2, ..., 7]`` to a SUM variable; the function runs in replica context there."""
    strategy = coordinator.strategy
    with strategy.scope():
        v = dd.Variable(initial_value=[0, 0, 0, 0, 0, 0, 0, 0], dtype=np.float32,
                        aggregation=VariableAggregation.SUM)

    def replica_fn():
        replica_id = distribute.get_replica_context().replica_id_in_sync_group
        val = np.reshape(np.asarray(replica_id + 10, dtype=v.dtype), [1])
        v.assign(np.concatenate([val, np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], np.float32)], 0))

    strategy.run(replica_fn)
    expected_result = np.arange(8.0) * strategy.num_replicas_in_sync
    for i in range(strategy.num_replicas_in_sync):
        expected_result[0] = expected_result[0] + i + 10
    assert _value(v) == expected_result.tolist()


@pytest.fixture(scope="module")
def two_ps(threaded_client):
    """A ``make(partitioner)`` of strategies with two ps and one worker (TF's VariablePartitioningTest: two ps)."""
    info = scheduler_workers(threaded_client)
    ordered = sorted(info, key=lambda a: info[a]["name"])
    resolver = dd.cluster_resolver.SimpleClusterResolver(
        dd.cluster_resolver.ClusterSpec({"ps": ordered[:2], "worker": ordered[2:]}))
    made = []

    def make(partitioner=None):
        strategy = dd.ParameterServerStrategy(resolver, partitioner, client=threaded_client)
        made.append(strategy)
        return strategy

    yield make
    for strategy in made:
        strategy.close()


def _shards(v):
    return [np.asarray(s.numpy()).tolist() for s in v.variables]


def _tasks(v):
    return [s.device.split("/")[3] for s in v.variables]


def test_partitioned_non_callable_initial_value(two_ps):
    """``testNonCallableInitialValue``: 10 values in 4 shards ``[0, 1, 2] [3, 4, 5] [6, 7] [8, 9]`` on ps 0, 1, 0, 1."""
    strategy = two_ps(dd.experimental.partitioners.FixedShardsPartitioner(4))
    with strategy.scope():
        v = dd.Variable([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert isinstance(v, dd.experimental.ShardedVariable) and len(v.variables) == 4
    assert _tasks(v) == ["task:0", "task:1", "task:0", "task:1"]
    assert _shards(v) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_num_partitions_larger_than_size(two_ps):
    """``testNumPartitionsLargerThanSize``: 4 shards asked for 3 values: ``[0] [1] [2]`` on ps 0, 1, 0."""
    strategy = two_ps(dd.experimental.partitioners.FixedShardsPartitioner(4))
    with strategy.scope():
        v = dd.Variable([0, 1, 2])
    assert isinstance(v, dd.experimental.ShardedVariable) and len(v.variables) == 3
    assert _tasks(v) == ["task:0", "task:1", "task:0"]
    assert _shards(v) == [[0], [1], [2]]


def test_partition_to_one(two_ps):
    """``testPartitionToOne``: small variables stay whole, round-robin on ps 0 then ps 1."""
    strategy = two_ps(dd.experimental.partitioners.MinSizePartitioner(min_shard_bytes=64 << 20, max_shards=2))
    with strategy.scope():
        v1 = dd.Variable(np.zeros(10, np.int64))
        v2 = dd.Variable([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    for v in (v1, v2):
        assert isinstance(v, dd.Variable) and not isinstance(v, dd.experimental.ShardedVariable)
    assert "/job:ps/replica:0/task:0" in v1.device and "/job:ps/replica:0/task:1" in v2.device
    assert np.asarray(v1.numpy()).tolist() == [0] * 10 and np.asarray(v2.numpy()).tolist() == list(range(10))


def test_colocate_with(two_ps):
    """``testColocateWith``: a variable made in ``colocate_vars_with(shard 0)`` is whole and on that shard's ps."""
    strategy = two_ps(dd.experimental.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        v1 = dd.Variable([0, 1, 2, 3])
        with strategy.extended.colocate_vars_with(v1.variables[0]):
            v2 = dd.Variable([4, 5])
    assert isinstance(v1, dd.experimental.ShardedVariable)
    assert isinstance(v2, dd.Variable) and not isinstance(v2, dd.experimental.ShardedVariable)
    assert v2.device == v1.variables[0].device and np.asarray(v2.numpy()).tolist() == [4, 5]


@pytest.mark.parametrize("returns", [None, [], [0, 1, 1], [2, 2, 1]], ids=["None", "empty", "zero", "not_first_axis"])
def test_invalid_partitioner(two_ps, returns):
    """``testInvalidPartitioner``: a partitioner returning ``None``, ``[]``, ``[0, 1, 1]`` or ``[2, 2, 1]`` raises
    ``ValueError`` naming ``variable_partitioner``."""
    strategy = two_ps(lambda shape, dtype: returns)
    with pytest.raises(ValueError, match="variable_partitioner"), strategy.scope():
        dd.Variable([[[0, 1], [2, 3]], [[0, 1], [2, 3]]])


def test_basic_sharded_variable_with_aggregation(two_ps):
    """``testBasicShardedVariableWithAggregation``: ``[10, 1, 2, 3]`` and ``[4, 5, 6, 7]`` in the two shards."""
    strategy = two_ps(dd.experimental.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        v = dd.Variable(initial_value=[0, 0, 0, 0, 0, 0, 0, 0], dtype=np.float32,
                        aggregation=VariableAggregation.SUM)
    assert isinstance(v, dd.experimental.ShardedVariable) and len(v.variables) == 2

    def replica_fn():
        replica_id = distribute.get_replica_context().replica_id_in_sync_group
        val = np.reshape(np.asarray(replica_id + 10, dtype=v.dtype), [1])
        v.assign(np.concatenate([val, np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], np.float32)], 0))

    strategy.run(replica_fn)
    expected_result = np.arange(8.0) * strategy.num_replicas_in_sync
    for i in range(strategy.num_replicas_in_sync):
        expected_result[0] = expected_result[0] + i + 10
    assert _shards(v) == [part.tolist() for part in np.array_split(expected_result, 2)]


def test_cluster_type_names(threaded_client):
    """``ClusterTypeNameTest``: an arbitrary job name, an unknown current task type, two chiefs, no worker, no ps."""
    info = scheduler_workers(threaded_client)
    ordered = sorted(info, key=lambda a: info[a]["name"])

    def resolver(spec, **kwargs):
        return dd.cluster_resolver.SimpleClusterResolver(dd.cluster_resolver.ClusterSpec(spec), **kwargs)

    with pytest.raises(ValueError, match="Disallowed task type found in"):
        dd.ParameterServerStrategy(resolver({"ps": ordered[:1], "worker": ordered[1:2],
                                             "some_arbitrary_name": ordered[2:]}), client=threaded_client)
    with pytest.raises(ValueError, match="Unrecognized task_type: foobar"):
        dd.ParameterServerStrategy(resolver({"ps": ordered[:1], "worker": ordered[1:]}, task_type="foobar"),
                                   client=threaded_client)
    with pytest.raises(ValueError, match="There must be at most one 'chief' job."):
        dd.ParameterServerStrategy(resolver({"ps": ordered[:1], "worker": ordered[1:2], "chief": ["a:1", "b:2"]},
                                            task_type="chief", task_id=1), client=threaded_client)
    with pytest.raises(ValueError, match="There must be at least one worker."):
        dd.ParameterServerStrategy(resolver({"ps": ordered[:1], "chief": ["a:1"]}, task_type="ps", task_id=0),
                                   client=threaded_client)
    with pytest.raises(ValueError, match="There must be at least one ps."):
        dd.ParameterServerStrategy(resolver({"worker": ordered[1:], "chief": ["a:1"]}, task_type="worker", task_id=0),
                                   client=threaded_client)


def test_input_function_create_variables(coordinator):
    """``ClusterCoordinatorTest.testInputFunctionCreateVariables``: a per-worker dataset function that creates a
    variable raises ``ValueError``."""

    def input_fn():
        v = dd.Variable(initial_value=0.0)
        return v.read_value()

    with pytest.raises(ValueError, match="Creating variables in `dataset_fn` is not allowed"):
        coordinator.create_per_worker_dataset(input_fn)
    assert all(command.__name__ != "make_dataset" or args(0)[1] is not input_fn
               for command, args in coordinator._resources)  # a newcomer would not run it again
    per_worker = coordinator.create_per_worker_dataset(lambda: Dataset.range(1, 2))  # the coordinator still works
    assert coordinator.schedule(lambda it: next(it), args=(iter(per_worker),)).fetch() == 1
