"""TensorFlow's own examples, run against ``from daskdist import distribute``, with TensorFlow's expected values.

One test per example. Each names its source: the file under
``tensorflow/python/distribute/`` (and the docstring or test in it), the
distributed-input tutorial, or a seed page. The values asserted are the ones
TensorFlow documents (or, where its documentation prints none, what
TensorFlow 2.21 computes for the same code on two logical CPUs). Tensors
become numpy arrays; ``tf.constant(c)`` becomes ``np.float32(c)`` or
``np.asarray(c)``; ``@tf.function`` is dropped (nothing is traced here);
``distribution.extended.call_for_each_replica(fn)`` is written
``strategy.run(fn)``. Where daskdist keeps a deliberate difference (docs/strategies.md,
"Deliberate differences"), the test checks the documented behaviour and says so.

The examples use TensorFlow's two devices ``["GPU:0", "GPU:1"]``; here they
are the two workers of a real two-process Dask cluster.
"""

from __future__ import annotations

import numpy as np
import pytest

import daskdist as dd
from daskdist import distribute, keras
from daskdist.cross_device_ops import AllReduceCrossDeviceOps  # TF's class, not exported in tf.distribute
from daskdist.data import Dataset

ReduceOp = distribute.ReduceOp


@pytest.fixture(scope="module")
def strategy(process_client):
    with distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], client=process_client) as strategy:
        yield strategy


def local(strategy, value):
    """``experimental_local_results`` as plain Python values (TF's ``self.evaluate``)."""
    return [np.asarray(part).tolist() for part in strategy.experimental_local_results(value)]


def replica_id():
    return distribute.get_replica_context().replica_id_in_sync_group


# ---------------------------------------------------------------------------------------------
# distribute_lib.py docstrings
# ---------------------------------------------------------------------------------------------


def test_value_context_docstring_value_fn():
    """distribute_lib.py, ``ValueContext`` docstring, first example."""

    def value_fn(context):
        return context.replica_id_in_sync_group / context.num_replicas_in_sync

    context = distribute.experimental.ValueContext(replica_id_in_sync_group=2, num_replicas_in_sync=4)
    assert value_fn(context) == 0.5


def test_value_context_docstring_distribute_values(strategy):
    """distribute_lib.py, ``ValueContext`` docstring, second example: ``(2, 2)``."""

    def value_fn(value_context):
        return value_context.num_replicas_in_sync

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn)
    assert strategy.experimental_local_results(distributed_values) == (2, 2)


def test_scope_docstring_variables_inside_and_outside(strategy):
    """distribute_lib.py, ``Strategy.scope`` docstring (also mirrored_strategy.py's class docstring)."""
    with strategy.scope():
        mirrored_variable = dd.Variable(1.0)
    assert isinstance(mirrored_variable, dd.MirroredVariable)
    assert local(strategy, mirrored_variable) == [1.0, 1.0]
    regular_variable = dd.Variable(1.0)
    assert type(regular_variable) is dd.Variable
    assert float(regular_variable.numpy()) == 1.0


def test_mirrored_strategy_docstring_variable_made_by_a_function_in_scope(strategy):
    """mirrored_strategy.py, ``MirroredStrategy`` docstring: a variable a (tf.)function makes in scope is mirrored."""
    x = []

    def create_variable():
        if not x:
            x.append(dd.Variable(1.0))
        return x[0]

    with strategy.scope():
        _ = create_variable()
    assert isinstance(x[0], dd.MirroredVariable)
    assert local(strategy, x[0]) == [1.0, 1.0]


def test_experimental_distribute_dataset_docstring(strategy):
    """distribute_lib.py, ``experimental_distribute_dataset`` docstring: ``range(4).batch(2)`` on two replicas."""
    global_batch_size = 2
    dataset = Dataset.range(4).batch(global_batch_size)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    def replica_fn(input):
        return input * 2

    result = []
    for x in dist_dataset:
        result.append(strategy.run(replica_fn, args=(x,)))
    assert [local(strategy, r) for r in result] == [[[0], [2]], [[4], [6]]]


def test_run_docstring_tensor_input(strategy):
    """distribute_lib.py, ``Strategy.run`` docstring, first example: ``PerReplica{6.0, 6.0}``."""
    tensor_input = np.float32(3.0)

    def replica_fn(input):
        return input * 2.0

    result = strategy.run(replica_fn, args=(tensor_input,))
    assert isinstance(result, distribute.DistributedValues)
    assert local(strategy, result) == [6.0, 6.0]


def test_run_docstring_distributed_values_input(strategy):
    """distribute_lib.py, ``Strategy.run`` docstring, second example: every replica returns 4, so ``run`` gives 4."""

    def value_fn(value_context):
        return value_context.num_replicas_in_sync

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn)

    def replica_fn2(input):
        return input * 2

    result = strategy.run(replica_fn2, args=(distributed_values,))
    assert result == 4 and not isinstance(result, distribute.DistributedValues)


def test_run_docstring_all_reduce_in_replica_fn(strategy):
    """distribute_lib.py, ``Strategy.run`` docstring, third example: ``PerReplica{1, 1}``."""

    def value_fn(value_context):
        return np.asarray(value_context.replica_id_in_sync_group, np.int32)

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn)

    def replica_fn(input):
        return distribute.get_replica_context().all_reduce("sum", input)

    result = strategy.run(replica_fn, args=(distributed_values,))
    assert local(strategy, result) == [1, 1]


def test_reduce_docstring(strategy):
    """distribute_lib.py, ``Strategy.reduce`` docstring: SUM of the replica ids is 1."""

    def step_fn():
        i = distribute.get_replica_context().replica_id_in_sync_group
        return np.asarray(i, np.int32)

    per_replica_result = strategy.run(step_fn)
    total = strategy.reduce("SUM", per_replica_result, axis=None)
    assert int(total) == 1


def test_reduce_docstring_what_should_axis_be(strategy):
    """distribute_lib.py, ``Strategy.reduce`` docstring, "What should axis be?": [4, 6, 8, 10], 28, and MEAN over 6."""
    per_replica_result = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(4.0) + 4 * ctx.replica_id_in_sync_group)  # examples [0..3] and [4..7]
    assert strategy.reduce("sum", per_replica_result, axis=None).tolist() == [0 + 4, 1 + 5, 2 + 6, 3 + 7]
    assert float(strategy.reduce("sum", per_replica_result, axis=0)) == sum(range(8))
    partial = dd.PerReplica([np.array([0.0, 1.0, 2.0, 3.0]), np.array([4.0, 5.0])])  # a last batch of 6
    assert float(strategy.reduce(distribute.ReduceOp.MEAN, partial, axis=0)) == sum(range(6)) / 6


def test_distribute_values_from_function_docstring_constant(strategy):
    """distribute_lib.py, ``experimental_distribute_values_from_function`` docstring, first example."""
    distributed_values = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(1.0))
    assert local(strategy, distributed_values) == [1.0, 1.0]


def test_distribute_values_from_function_docstring_numpy_input(strategy):
    """distribute_lib.py, ``experimental_distribute_values_from_function`` docstring, second example: (3.0, 2.0)."""
    array_value = np.array([3.0, 2.0, 1.0])

    def value_fn(ctx):
        return array_value[ctx.replica_id_in_sync_group]

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn)
    assert strategy.experimental_local_results(distributed_values) == (3.0, 2.0)


def test_distribute_values_from_function_docstring_num_replicas(strategy):
    """distribute_lib.py, ``experimental_distribute_values_from_function`` docstring, third example: (2, 2)."""
    distributed_values = strategy.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync)
    assert strategy.experimental_local_results(distributed_values) == (2, 2)


def test_gather_docstring_two_replicas(strategy):
    """distribute_lib.py, ``Strategy.gather`` docstring, first example: shape (4, 1)."""
    distributed_values = strategy.experimental_distribute_values_from_function(lambda _: np.array([[1], [2]], np.int32))
    gathered = strategy.gather(distributed_values, axis=0)
    assert gathered.shape == (4, 1) and gathered.tolist() == [[1], [2], [1], [2]]


def test_gather_docstring_four_replicas_each_axis(make_cluster):
    """distribute_lib.py, ``Strategy.gather`` docstring, second example (four replicas; axes 0, 1, 2)."""
    client = make_cluster(4, processes=False)
    with distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"], client=client) as strategy:
        single_tensor = np.arange(6, dtype=np.int32).reshape(1, 2, 3)
        distributed_values = strategy.experimental_distribute_values_from_function(lambda _: single_tensor)
        assert strategy.gather(distributed_values, axis=0).shape == (4, 2, 3)
        assert strategy.gather(distributed_values, axis=1).tolist() == [[[0, 1, 2], [3, 4, 5]] * 4]
        assert strategy.gather(distributed_values, axis=2).tolist() == [
            [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4, 5]]
        ]


def test_replica_context_docstring_replica_ids(strategy):
    """distribute_lib.py, ``ReplicaContext`` class docstring: ``PerReplica{0, 1}``."""

    def func():
        replica_context = distribute.get_replica_context()
        return replica_context.replica_id_in_sync_group

    result = strategy.run(func)
    assert isinstance(result, distribute.DistributedValues)
    assert local(strategy, result) == [0, 1]


def test_all_reduce_docstring_one_value(strategy):
    """distribute_lib.py, ``ReplicaContext.all_reduce`` docstring, first example (also the seed page): (2.0, 2.0)."""

    def step_fn():
        ctx = distribute.get_replica_context()
        value = np.float32(1.0)
        return ctx.all_reduce(distribute.ReduceOp.SUM, value)

    assert local(strategy, strategy.run(step_fn)) == [2.0, 2.0]


def test_all_reduce_docstring_batched_list(strategy):
    """distribute_lib.py, ``ReplicaContext.all_reduce`` docstring, second example: one list per replica."""

    def step_fn():
        ctx = distribute.get_replica_context()
        value1 = np.float32(1.0)
        value2 = np.float32(2.0)
        return ctx.all_reduce(distribute.ReduceOp.SUM, [value1, value2])

    results = strategy.experimental_local_results(strategy.run(step_fn))
    assert isinstance(results, tuple) and len(results) == 2
    assert [[float(v) for v in r] for r in results] == [[2.0, 4.0], [2.0, 4.0]]
    assert all(isinstance(r, list) for r in results)


def test_all_gather_docstring_one_value(strategy):
    """distribute_lib.py, ``ReplicaContext.all_gather`` docstring, first example."""

    def gather_value():
        ctx = distribute.get_replica_context()
        local_value = np.array([1, 2, 3], np.int32)
        return ctx.all_gather(local_value, axis=0)

    result = strategy.run(gather_value)
    assert isinstance(result, distribute.DistributedValues)
    assert local(strategy, result) == [[1, 2, 3, 1, 2, 3]] * 2


def test_all_gather_docstring_nest(strategy):
    """distribute_lib.py, ``ReplicaContext.all_gather`` docstring, second example: a list of PerReplica."""

    def gather_nest():
        ctx = distribute.get_replica_context()
        value_1 = np.array([1, 2, 3], np.int32)
        value_2 = np.array([[1, 2], [3, 4]], np.int32)
        return ctx.all_gather([value_1, value_2], axis=0)

    result = strategy.run(gather_nest)
    assert isinstance(result, list) and all(isinstance(r, distribute.DistributedValues) for r in result)
    per_replica = strategy.experimental_local_results(result)
    assert len(per_replica) == 2
    for first, second in per_replica:
        assert first.tolist() == [1, 2, 3, 1, 2, 3]
        assert second.tolist() == [[1, 2], [3, 4], [1, 2], [3, 4]]


# ---------------------------------------------------------------------------------------------
# distribute_utils.py (regroup / select_replica) and mirrored_run.py (merge_call)
# ---------------------------------------------------------------------------------------------


def test_run_of_a_function_returning_none_is_none(strategy):
    """distribute_utils.py, ``regroup``: one object returned by every replica is returned unwrapped."""
    assert strategy.run(lambda: None) is None
    assert strategy.run(lambda: (None, {"flag": True})) == (None, {"flag": True})
    assert strategy.experimental_local_results(strategy.run(lambda: None)) == (None,)


def test_run_of_a_variable_returns_the_variable(strategy):
    """distribute_utils.py, ``regroup``: a distributed variable every replica returned is that variable."""
    with strategy.scope():
        v = dd.Variable(3.0)
    assert strategy.run(lambda: v) is v


def test_merge_call_hands_each_replica_its_component(strategy):
    """distribute_lib.py, ``ReplicaContext.merge_call`` ("Returns: the return value of ``merge_fn``, except for
    ``PerReplica`` values which are unpacked"); mirrored_run.py applies ``select_replica``."""

    def fn():
        ctx = distribute.get_replica_context()

        def merge(strategy, value):
            return value  # a PerReplica: each replica must get its own component back

        return ctx.merge_call(merge, args=(np.int32(ctx.replica_id_in_sync_group),))

    assert local(strategy, strategy.run(fn)) == [0, 1]


def test_merge_call_result_that_is_not_distributed_reaches_every_replica(strategy):
    """mirrored_run.py: a plain value returned by ``merge_fn`` reaches every replica as is (TF 2.21 returns 7)."""

    def fn():
        return distribute.get_replica_context().merge_call(lambda strategy: 7)

    assert strategy.run(fn) == 7


# ---------------------------------------------------------------------------------------------
# mirrored_strategy_test.py, MirroredVariableUpdateTest and SyncOnReadVariableAssignTest
# ---------------------------------------------------------------------------------------------


def _mirrored(strategy, value, aggregation=None):
    with strategy.scope():
        if aggregation is None:
            return dd.Variable(value, name="foo")
        return dd.Variable(value, name="foo", aggregation=aggregation)


def test_assign_mirrored_var_replica_context_without_aggregation_type(strategy):
    """mirrored_strategy_test.py, ``testAssignMirroredVarReplicaContextWithoutAggregationType``; ops/variables.py,
    ``tf.VariableAggregation`` docstring: "NONE: ... giving an error if you use a variable-update operation with
    multiple replicas".

    TensorFlow's documented rule (and this test in TF 2.0-2.3) raises "You must
    specify an aggregation method to update a MirroredVariable in Replica
    Context"; TF 2.21's code updates each replica's copy instead. The stated
    rule wins (docs/strategies.md, "Deliberate differences"): the copies cannot drift apart.
    """
    mirrored_var = _mirrored(strategy, 1.0)
    with pytest.raises(ValueError, match="You must specify an aggregation method to update a MirroredVariable in "
                                         "Replica Context"):
        strategy.run(lambda: mirrored_var.assign(5.0))
    assert local(strategy, mirrored_var) == [1.0, 1.0]  # nothing changed on any replica


def test_variable_aggregation_docstring(strategy):
    """ops/variables.py, ``tf.VariableAggregation`` docstring: MEAN of 1.0 added on both replicas gives 6.0 on both."""
    with strategy.scope():
        v = dd.Variable(5.0, aggregation=dd.VariableAggregation.MEAN)

    def update_fn():
        return v.assign_add(1.0)

    assert local(strategy, strategy.run(update_fn)) == [6.0, 6.0]


def test_assign_mirrored_var_replica_context_with_sum_is_a_documented_difference(strategy):
    """mirrored_strategy_test.py, ``testAssignMirroredVarReplicaContextWithSum``.

    TensorFlow raises "A non-DistributedValues value 5.0 cannot be reduced"
    through merge_call (eager) and gives 5.0 inside ``tf.function``: it can
    tell that every replica passed the same Python object. Replicas here are
    processes, so the values are SUM-aggregated as any other per-replica value
    (docs/strategies.md, "Deliberate differences"): 5.0 on two replicas gives 10.0.
    """
    mirrored_var = _mirrored(strategy, 1.0, "SUM")
    strategy.run(lambda: mirrored_var.assign(5.0))
    assert float(mirrored_var.numpy()) == 10.0


def test_assign_mirrored_var_cross_device_context(strategy):
    """mirrored_strategy_test.py, ``testAssignMirroredVarCrossDeviceContext``: 6.0."""
    mirrored_var = _mirrored(strategy, 1.0)
    assert float(mirrored_var.numpy()) == 1.0
    assert float(np.asarray(mirrored_var.assign(6.0))) == 6.0


# mirrored_strategy_test.py's table of updates in a replica context, MEAN aggregation: each replica's own
# id (the MEAN of 0 and 1 is applied) or one value every replica passes
_REPLICA_CONTEXT_UPDATES = [
    # TF's test, method, initial value, each replica's update (None: its replica id), TF's expected value
    ("testAssignMirroredVarReplicaContext", "assign", 1.0, None, 0.5),
    ("testAssignMirroredVarReplicaContextWithSingleValue", "assign", 1.0, 5.0, 5.0),
    ("testAssignAddMirroredVarReplicaContext", "assign_add", 1.0, None, 1.5),
    ("testAssignAddMirroredVarReplicaContextWithSingleValue", "assign_add", 1.0, 5.0, 6.0),
    ("testAssignSubMirroredVarReplicaContext", "assign_sub", 5.0, None, 4.5),
    ("testAssignSubMirroredVarReplicaContextWithSingleValue", "assign_sub", 5.0, 1.0, 4.0),
]


@pytest.mark.parametrize(("method", "initial", "update", "expected"), [case[1:] for case in _REPLICA_CONTEXT_UPDATES],
                         ids=[case[0] for case in _REPLICA_CONTEXT_UPDATES])
def test_mirrored_var_updated_in_a_replica_context(strategy, method, initial, update, expected):
    """mirrored_strategy_test.py, ``test{Assign,AssignAdd,AssignSub}MirroredVarReplicaContext[WithSingleValue]``."""
    mirrored_var = _mirrored(strategy, initial, "MEAN")

    def fn():
        value = np.asarray(replica_id(), mirrored_var.dtype) if update is None else update
        getattr(mirrored_var, method)(value)

    strategy.run(fn)
    assert float(mirrored_var.numpy()) == expected


def test_assign_add_mirrored_var_cross_device_context(strategy):
    """mirrored_strategy_test.py, ``testAssignAddMirroredVarCrossDeviceContext``: 7.0, then 9.0 with read_value=False."""
    mirrored_var = _mirrored(strategy, 1.0)
    assert float(np.asarray(mirrored_var.assign_add(6.0, read_value=True))) == 7.0
    assert local(strategy, mirrored_var) == [7.0, 7.0]
    assert mirrored_var.assign_add(2.0, read_value=False) is None
    assert local(strategy, mirrored_var) == [9.0, 9.0]
    assert tuple(strategy.extended.worker_devices) == (
        "/job:localhost/replica:0/task:0/device:CPU:0",
        "/job:localhost/replica:0/task:0/device:CPU:1",
    )


def test_assign_sub_mirrored_var_cross_device_context(strategy):
    """mirrored_strategy_test.py, ``testAssignSubMirroredVarCrossDeviceContext``: 3.0 on both copies."""
    mirrored_var = _mirrored(strategy, 5.0)
    assert float(np.asarray(mirrored_var.assign_sub(2.0))) == 3.0
    assert local(strategy, mirrored_var) == [3.0, 3.0]


def test_assign_replica_local_var_sum_aggregation(strategy):
    """mirrored_strategy_test.py, ``SyncOnReadVariableAssignTest.testAssignReplicaLocalVarSumAggregation``: 2.0, 6.0."""
    def model_fn():
        return dd.Variable(1.0, synchronization=dd.VariableSynchronization.ON_READ,
                           aggregation=dd.VariableAggregation.SUM)

    with strategy.scope():
        sync_on_read_var = strategy.run(model_fn)
    assert isinstance(sync_on_read_var, dd.SyncOnReadVariable)
    assert float(sync_on_read_var.numpy()) == 2.0
    sync_on_read_var.assign(6.0)
    assert float(sync_on_read_var.numpy()) == 6.0


def test_assign_replica_local_var_mean_aggregation(strategy):
    """mirrored_strategy_test.py, ``SyncOnReadVariableAssignTest.testAssignReplicaLocalVarMeanAggregation``."""
    def model_fn():
        return dd.Variable(1.0, synchronization=dd.VariableSynchronization.ON_READ,
                           aggregation=dd.VariableAggregation.MEAN)

    with strategy.scope():
        sync_on_read_var = strategy.run(model_fn)
    assert float(sync_on_read_var.numpy()) == 1.0
    sync_on_read_var.assign(6.0)
    assert float(sync_on_read_var.numpy()) == 6.0


# ---------------------------------------------------------------------------------------------
# mirrored_variable_test.py, MirroredVariableCreationTest
# ---------------------------------------------------------------------------------------------


def _merge_noop():
    distribute.get_replica_context().merge_call(lambda _: _)


def test_single_variable_created_in_replicas_is_one_mirrored_variable(strategy):
    """mirrored_variable_test.py, ``testSingleVariable`` / ``testUnnamedVariable`` / ``testVarDistributeStrategy``.

    TensorFlow's names carry a graph output suffix (``foo:0``); daskdist has
    no graph and keeps the name given (docs/strategies.md, "Deliberate differences").
    """
    def model_fn():
        v = dd.Variable(1.0, name="foo")
        _merge_noop()
        return v

    def unnamed_fn():
        v = dd.Variable(1.0)
        _merge_noop()
        return v

    with strategy.scope():
        result = strategy.run(model_fn)
        unnamed = strategy.run(unnamed_fn)
    assert isinstance(result, dd.MirroredVariable) and result.name == "foo"
    assert isinstance(unnamed, dd.MirroredVariable) and unnamed.name == "Variable"
    assert result.distribute_strategy is strategy
    assert local(strategy, result) == [1.0, 1.0]


def test_multiple_variables(strategy):
    """mirrored_variable_test.py, ``testMultipleVariables``: five MirroredVariables foo0 .. foo4."""
    def model_fn():
        vs = [dd.Variable(1.0, name="foo" + str(i)) for i in range(5)]
        _merge_noop()
        return vs

    with strategy.scope():
        result = strategy.run(model_fn)
    assert [v.name for v in result] == [f"foo{i}" for i in range(5)]
    assert all(isinstance(v, dd.MirroredVariable) for v in result)


def test_with_variable_kinds_and_aggregations(strategy):
    """mirrored_variable_test.py, ``testWithVariableAndVariableScope`` (without TF1's variable_scope)."""
    def model_fn():
        v0 = dd.Variable(1.0, name="var0", aggregation=None)
        v1 = dd.Variable(1.0, name="var1")
        _merge_noop()
        v2 = dd.Variable(1.0, name="var2", synchronization=dd.VariableSynchronization.ON_READ,
                         aggregation=dd.VariableAggregation.SUM)
        v3 = dd.Variable(1.0, name="var3", synchronization=dd.VariableSynchronization.ON_WRITE,
                         aggregation=dd.VariableAggregation.MEAN)
        return v0, v1, v2, v3

    with strategy.scope():
        v = dd.Variable(1.0, name="var-main0")
        assert v.name == "var-main0"
        v0, v1, v2, v3 = strategy.run(model_fn)
    assert isinstance(v0, dd.MirroredVariable) and v0.name == "var0"
    assert isinstance(v1, dd.MirroredVariable) and v1.name == "var1"
    assert isinstance(v2, dd.SyncOnReadVariable) and v2.aggregation is dd.VariableAggregation.SUM
    assert isinstance(v3, dd.MirroredVariable) and v3.aggregation is dd.VariableAggregation.MEAN


def test_only_first_replica_updates_variables(strategy):
    """mirrored_variable_test.py, ``testOnlyFirstReplicaUpdatesVariables``: on-read (7, 12) reads 7; on-write 10, 10."""
    def create_fn():
        aggregation = dd.VariableAggregation.ONLY_FIRST_REPLICA
        v0 = dd.Variable(2.0, name="on_read", synchronization=dd.VariableSynchronization.ON_READ,
                         aggregation=aggregation)
        v1 = dd.Variable(3.0, name="on_write", synchronization=dd.VariableSynchronization.ON_WRITE,
                         aggregation=aggregation)
        return v0, v1

    with strategy.scope():
        v0, v1 = strategy.run(create_fn)
    assert local(strategy, v0) == [2.0, 2.0] and float(v0.numpy()) == 2.0
    assert local(strategy, v1) == [3.0, 3.0]

    def update_member_fn():
        replica_id_plus_one = np.float32(replica_id() + 1)
        update0 = v0.assign_add(5.0 * replica_id_plus_one)
        update1 = v1.assign_add(7.0 * replica_id_plus_one)
        return update0, update1

    strategy.run(update_member_fn)
    assert local(strategy, v0) == [2.0 + 5.0, 2.0 + 2 * 5.0]  # writes to an on-read variable are not synchronized
    assert float(v0.numpy()) == 2.0 + 5.0  # reads come from the first replica
    assert local(strategy, v1) == [3.0 + 7.0, 3.0 + 7.0]  # only replica 0's argument is used


def test_sync_on_read_variable(strategy):
    """mirrored_variable_test.py, ``testSyncOnReadVariable``: components (3, 4) and (0, 6); reads SUM 7, MEAN 3."""
    def model_fn():
        r = replica_id()
        v_sum = dd.Variable(1.0, synchronization=dd.VariableSynchronization.ON_READ,
                            aggregation=dd.VariableAggregation.SUM)
        v_mean = dd.Variable(4.0, synchronization=dd.VariableSynchronization.ON_READ,
                             aggregation=dd.VariableAggregation.MEAN)
        v_sum.assign_add(2.0 + r)
        v_mean.assign(6.0 * r)
        return v_sum, v_mean

    with strategy.scope():
        ret_v_sum, ret_v_mean = strategy.run(model_fn)
    assert isinstance(ret_v_sum, dd.SyncOnReadVariable) and isinstance(ret_v_mean, dd.SyncOnReadVariable)
    assert local(strategy, ret_v_sum) == [3.0, 4.0]
    assert local(strategy, ret_v_mean) == [0.0, 6.0]
    assert float(ret_v_sum.numpy()) == 7.0 and float(np.asarray(ret_v_sum)) == 7.0
    assert float(ret_v_mean.numpy()) == 3.0


def test_none_synchronization_is_refused(strategy):
    """mirrored_variable_test.py, ``testNoneSynchronizationWithVariable`` (TF 2.21's message)."""
    message = "`NONE` variable synchronization mode is not supported with tf.distribute"
    with strategy.scope(), pytest.raises(ValueError, match=message):
        dd.Variable(1.0, name="v", synchronization=dd.VariableSynchronization.NONE)


def test_invalid_synchronization_and_aggregation_are_refused(strategy):
    """mirrored_variable_test.py, ``testInvalidSynchronizationWithVariable`` / ``testInvalidAggregationWithVariable``."""
    with strategy.scope():
        with pytest.raises(ValueError, match="Invalid variable synchronization mode: Invalid for variable: v"):
            dd.Variable(1.0, name="v", synchronization="Invalid")
        with pytest.raises(ValueError, match="Invalid variable aggregation mode: invalid for variable: v"):
            dd.Variable(1.0, name="v", synchronization=dd.VariableSynchronization.ON_WRITE, aggregation="invalid")


def test_non_matching_variable_creation(strategy):
    """mirrored_variable_test.py, ``testNonMatchingVariableCreation``: RuntimeError (TF 2.21: "mismatching name on device 1")."""
    def model_fn(name):
        v = dd.Variable(1.0, name=name)
        _merge_noop()
        return v

    with strategy.scope():
        names = dd.PerReplica(("foo", "bar"))
        with pytest.raises(RuntimeError, match="Tried to create variable bar with mismatching name on device 1"):
            strategy.run(model_fn, args=(names,))
    assert local(strategy, strategy.run(replica_id)) == [0, 1]  # the strategy goes on working


# ---------------------------------------------------------------------------------------------
# values.py / values_util.py: where TensorFlow raises
# ---------------------------------------------------------------------------------------------


def test_mean_aggregation_of_a_non_float_distributed_variable_is_refused(strategy):
    """values.py, ``DistributedVariable.__init__`` (TF 2.21; values_test.py ``testAssignAggregationMeanDTypeNonFloat``).

    Current TensorFlow refuses the variable at creation; the older test refused
    the replica-context update. Either way no integer mean is ever computed.
    """
    with strategy.scope():
        with pytest.raises(ValueError, match="aggregation=MEAN and a non-floating dtype is not supported"):
            dd.Variable(1, aggregation=dd.VariableAggregation.MEAN, dtype="int32")
        total = dd.Variable(3, aggregation=dd.VariableAggregation.SUM, dtype="int32")  # SUM is fine
    strategy.run(lambda: total.assign(np.int32(replica_id())))
    assert int(total.numpy()) == 1


@pytest.mark.parametrize("method", ["assign_add", "assign_sub"])
def test_sync_on_read_sum_variable_refuses_assign_add_and_sub_in_cross_replica_context(strategy, method):
    """values_util.py, ``on_read_assign_add_cross_replica`` / ``on_read_assign_sub_cross_replica``."""
    def model_fn():
        return dd.Variable(1.0, synchronization="ON_READ", aggregation="SUM")

    with strategy.scope():
        v = strategy.run(model_fn)
    message = f"SyncOnReadVariable does not support `{method}` in cross-replica context when aggregation is set to"
    with pytest.raises(ValueError, match=message):
        getattr(v, method)(1.0)  # from the client

    def in_merge_call():
        return distribute.get_replica_context().merge_call(lambda s: getattr(v, method)(1.0))

    with pytest.raises(ValueError, match=message):
        strategy.run(in_merge_call)  # inside merge_call: cross-replica context on the replicas
    assert float(v.numpy()) == 2.0  # nothing changed
    # in replica context each replica updates its own copy
    strategy.run(lambda: getattr(v, method)(1.0))
    assert float(v.numpy()) == (4.0 if method == "assign_add" else 0.0)


def test_assign_takes_tensorflows_argument_list(strategy):
    """resource_variable_ops.py, ``assign(value, use_locking=False, name=None, read_value=True)`` and friends."""
    mirrored_var = _mirrored(strategy, 1.0)
    # TF's second positional argument is use_locking, not read_value: the variable comes back
    assert mirrored_var.assign(3.0, False) is mirrored_var
    assert mirrored_var.assign_add(1.0, False, "add") is mirrored_var
    assert mirrored_var.assign_sub(2.0, use_locking=True, name="sub", read_value=False) is None
    assert local(strategy, mirrored_var) == [2.0, 2.0]
    plain = dd.Variable(1.0)
    assert plain.assign(4.0, False) is plain and plain.assign_add(1.0, False, None, False) is None
    assert float(plain.numpy()) == 5.0


def test_reduce_of_a_non_distributed_value_with_sum_raises(strategy):
    """cross_device_ops.py, ``reduce_non_distributed_value``: SUM raises, MEAN gives the value (TF 2.21)."""
    with pytest.raises(ValueError, match="A non-DistributedValues value 1.0 cannot be reduced"):
        strategy.reduce("SUM", 1.0, axis=None)
    assert float(strategy.reduce("MEAN", np.float32(1.0), axis=None)) == 1.0


# ---------------------------------------------------------------------------------------------
# strategy_test_lib.py
# ---------------------------------------------------------------------------------------------


def test_two_device_run(strategy):
    """strategy_test_lib.py, ``TwoDeviceDistributionTestBase._test_run``: [1, 2], then {a: [2, 4], b: [1, 4]}, [6, 14]."""
    out1 = strategy.run(lambda: distribute.get_replica_context().replica_id_in_sync_group + 1)
    assert local(strategy, out1) == [1, 2]
    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    assert local(strategy, out2["a"]) == [2, 4]
    assert local(strategy, out2["b"]) == [1, 4]
    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    assert local(strategy, out3) == [6, 14]


def _all_sum(value):
    return distribute.get_replica_context().all_reduce(ReduceOp.SUM, value)


def _all_mean(value):
    return distribute.get_replica_context().all_reduce(ReduceOp.MEAN, value)


@pytest.mark.parametrize(
    ("comm_fn", "expected"),
    [(_all_sum, (4.0, [42.0, 43.0])), (_all_mean, (2.0, [21.0, 21.5]))],
    ids=["_test_all_reduce_sum", "_test_all_reduce_mean"],
)
def test_two_device_all_reduce(strategy, comm_fn, expected):
    """strategy_test_lib.py, ``TwoDeviceDistributionTestBase._test_all_reduce_sum`` / ``_test_all_reduce_mean``.

    ``Dataset.from_tensor_slices(([1., 3.], [[39., 2.], [3., 41.]]))`` gives
    replica 0 ``(1., [39., 2.])`` and replica 1 ``(3., [3., 41.])``.
    """
    inputs = ([1.0, 3.0], [[39.0, 2.0], [3.0, 41.0]])
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: (np.float32(inputs[0][ctx.replica_id_in_sync_group]),
                     np.asarray(inputs[1][ctx.replica_id_in_sync_group], np.float32))
    )
    outputs = strategy.run(comm_fn, args=(per_replica,))
    assert local(strategy, outputs[0]) == [expected[0]] * 2
    assert local(strategy, outputs[1]) == [expected[1]] * 2


def test_replica_id(strategy):
    """strategy_test_lib.py, ``_test_replica_id``: every replica id below the device count, each exactly once."""
    ids = strategy.experimental_local_results(strategy.run(replica_id))
    assert sorted(ids) == list(range(len(strategy.extended.worker_devices)))


class _TestError(Exception):
    pass


def _raise_exception_fn(_=None):
    raise _TestError()


def _merge_raises_fn():
    distribute.get_replica_context().merge_call(_raise_exception_fn)


@pytest.mark.parametrize("fn", [_raise_exception_fn, _merge_raises_fn], ids=["call", "merge_call"])
def test_call_and_merge_exceptions(strategy, fn):
    """strategy_test_lib.py, ``_test_call_and_merge_exceptions`` (the cases without a nested call_for_each_replica)."""
    with pytest.raises(_TestError):
        strategy.run(fn)
    assert local(strategy, strategy.run(replica_id)) == [0, 1]  # the strategy goes on working


def test_global_step_update(strategy):
    """strategy_test_lib.py, ``_test_global_step_update``: ONLY_FIRST_REPLICA int64 step reads (1, 1)."""
    with strategy.scope():
        global_step = dd.Variable(np.int64(0), name="global_step", trainable=False,
                                  aggregation=dd.VariableAggregation.ONLY_FIRST_REPLICA)

    def model_fn():
        train_op = global_step.assign_add(1)
        value = global_step.read_value()
        return train_op, value

    train_ops, value = strategy.run(model_fn)
    assert train_ops is global_step
    assert local(strategy, value) == [1, 1]


def test_trainable_variable(strategy):
    """strategy_test_lib.py, ``_test_trainable_variable``: True, False, True, False."""
    with strategy.scope():
        assert dd.Variable(1.0).trainable is True
        assert dd.Variable(1.0, synchronization=dd.VariableSynchronization.ON_READ).trainable is False
        assert dd.Variable(1.0, synchronization=dd.VariableSynchronization.ON_READ, trainable=True).trainable is True
        assert dd.Variable(1.0, synchronization=dd.VariableSynchronization.ON_READ, trainable=False).trainable is False


# ---------------------------------------------------------------------------------------------
# collective_util.py
# ---------------------------------------------------------------------------------------------


def test_communication_options_docstring(strategy):
    """collective_util.py, ``CommunicationOptions`` docstring: the options of an all-reduce (NCCL falls back on CPU)."""
    options = distribute.experimental.CommunicationOptions(
        bytes_per_pack=50 * 1024 * 1024,
        timeout_seconds=120.0,
        implementation=distribute.experimental.CommunicationImplementation.NCCL,
    )

    def step():
        grads = [np.full(3, replica_id() + 1.0, np.float32), np.ones((2, 2), np.float32)]
        return distribute.get_replica_context().all_reduce("sum", grads, options=options)

    for grads in strategy.experimental_local_results(strategy.run(step)):
        assert grads[0].tolist() == [3.0, 3.0, 3.0] and grads[1].tolist() == [[2.0, 2.0], [2.0, 2.0]]
    assert distribute.experimental.CollectiveCommunication is distribute.experimental.CommunicationImplementation


def test_communication_options_refuse_a_negative_pack_size():
    """collective_util.py, ``_OptionsExported.__init__``: ``bytes_per_pack`` must be >= 0."""
    with pytest.raises(ValueError):
        distribute.experimental.CommunicationOptions(bytes_per_pack=-1)


# ---------------------------------------------------------------------------------------------
# input_lib_test.py and the distributed-input tutorial (tensorflow.org/tutorials/distribute/input)
# ---------------------------------------------------------------------------------------------


def test_tutorial_get_next_as_optional_with_a_partial_last_batch(strategy):
    """Distributed-input tutorial, "get_next_as_optional": ``range(9).batch(4)`` gives ([0 1], [2 3]) ... ([8], [])."""
    global_batch_size = 4
    steps_per_loop = 5
    dataset = Dataset.range(9).batch(global_batch_size)
    distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))
    printed = []
    for _ in range(steps_per_loop):
        optional_data = distributed_iterator.get_next_as_optional()
        if not optional_data.has_value():
            break
        per_replica_results = strategy.run(lambda x: x, args=(optional_data.get_value(),))
        printed.append(local(strategy, per_replica_results))
    assert printed == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]


def test_tutorial_experimental_distribute_dataset_loop(strategy):
    """Distributed-input tutorial, "tf.distribute.Strategy.experimental_distribute_dataset": ``labels - 0.3 * features``.

    The tutorial's ``Dataset.from_tensors(([1.], [1.])).repeat(100)`` is
    written ``from_tensor_slices`` of 100 such rows.
    """
    global_batch_size = 16
    dataset = Dataset.from_tensor_slices((np.ones((100, 1), np.float32), np.ones((100, 1), np.float32)))
    dataset = dataset.batch(global_batch_size)

    def train_step(inputs):
        features, labels = inputs
        return labels - 0.3 * features

    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    rows = []
    for dist_inputs in dist_dataset:
        parts = strategy.experimental_local_results(strategy.run(train_step, args=(dist_inputs,)))
        rows.append([len(p) for p in parts])
        for p in parts:
            np.testing.assert_allclose(p, 0.7, rtol=1e-6)
    assert rows == [[8, 8]] * 6 + [[2, 2]]  # 100 = 6 * 16 + 4: the last global batch of 4 is split 2 / 2


def test_tutorial_distribute_datasets_from_function_and_iter_next(strategy):
    """Distributed-input tutorial, "distribute_datasets_from_function" and "Use iter to create an explicit iterator"."""
    global_batch_size = 16
    seen = []

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = Dataset.from_tensor_slices((np.ones((64, 1), np.float32), np.ones((64, 1), np.float32)))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        dataset = dataset.batch(batch_size)
        dataset = dataset.prefetch(2)
        return dataset

    dist_dataset = strategy.distribute_datasets_from_function(dataset_fn)

    def train_step(inputs):
        features, labels = inputs
        return labels - 0.3 * features

    num_epochs = 2
    steps_per_epoch = 2
    for _ in range(num_epochs):
        dist_iterator = iter(dist_dataset)
        for _ in range(steps_per_epoch):
            loss = strategy.run(train_step, args=(next(dist_iterator),))
            seen.append([p.shape for p in strategy.experimental_local_results(loss)])
    assert seen == [[(8, 1), (8, 1)]] * 4


def test_seed_mirrored_strategy_custom_loop(strategy):
    """Seed page tf.distribute.MirroredStrategy (mirrored_strategy.py docstring): ``distribute_train_epoch``.

    ``replica_fn`` "processes input and returns result": here the
    mean-squared error of ``daskdist.keras.losses`` against a zero target;
    each epoch's total is the SUM over steps of the replicas' results.
    """
    EPOCHS = 2
    my_strategy = strategy
    features = np.arange(32, dtype=np.float32).reshape(16, 2)
    dataset = Dataset.from_tensor_slices(features).batch(8)
    loss = keras.losses.MeanSquaredError()

    with my_strategy.scope():

        def distribute_train_epoch(dataset):
            def replica_fn(input):
                # process input and return result
                result = np.float32(loss(np.zeros_like(input), input))
                return result

            total_result = 0
            for x in dataset:
                per_replica_result = my_strategy.run(replica_fn, args=(x,))
                total_result += my_strategy.reduce(distribute.ReduceOp.SUM, per_replica_result, axis=None)
            return total_result

        dist_dataset = my_strategy.experimental_distribute_dataset(dataset)
        train_results = [distribute_train_epoch(dist_dataset) for _ in range(EPOCHS)]

    # two global batches of 8 rows, 4 rows per replica: the sum of each replica's mean of squares
    expected = sum(float(np.mean(features[i : i + 4] ** 2)) for i in range(0, 16, 4))
    assert train_results == pytest.approx([expected] * EPOCHS, rel=1e-5)


def test_namespace_is_laid_out_like_tf_distribute():
    """tf.distribute's public names that daskdist implements are where TensorFlow has them."""
    for name in ("MirroredStrategy", "OneDeviceStrategy", "ReduceOp", "InputOptions", "InputContext",
                 "ReplicaContext", "Strategy", "StrategyExtended", "CrossDeviceOps", "NcclAllReduce",
                 "HierarchicalCopyAllReduce", "ReductionToOneDevice", "DistributedDataset", "DistributedIterator",
                 "DistributedValues", "RunOptions", "get_replica_context", "get_strategy", "has_strategy",
                 "in_cross_replica_context", "experimental_set_strategy"):
        assert hasattr(distribute, name), name
    for name in ("CommunicationOptions", "CommunicationImplementation", "CollectiveCommunication", "ValueContext"):
        assert hasattr(distribute.experimental, name), name
    assert distribute.MirroredStrategy is dd.MirroredStrategy and distribute.ReduceOp is dd.ReduceOp
    assert sorted(distribute.__all__) == list(distribute.__all__)
    assert sorted(distribute.experimental.__all__) == list(distribute.experimental.__all__)


def test_experimental_set_strategy(strategy):
    """distribute_lib.py, ``experimental_set_strategy``: current without a scope; None resets; refused inside a scope."""
    distribute.experimental_set_strategy(strategy)
    try:
        assert distribute.get_strategy() is strategy and distribute.has_strategy()
        with strategy.scope(), pytest.raises(RuntimeError, match="Must not be called inside"):
            distribute.experimental_set_strategy(None)
    finally:
        distribute.experimental_set_strategy(None)
    assert not distribute.has_strategy()


def test_run_accepts_run_options(strategy):
    """distribute_lib.py, ``Strategy.run(fn, args=(), kwargs=None, options=None)`` with a ``tf.distribute.RunOptions``."""
    options = distribute.RunOptions(experimental_enable_dynamic_batch_size=False)
    assert local(strategy, strategy.run(replica_id, options=options)) == [0, 1]
    with pytest.raises(TypeError, match="RunOptions"):
        strategy.run(replica_id, options={"dynamic": True})


def test_batch_splitting(strategy):
    """input_lib_test.py, ``testBatchSplitting`` (``split_batch_by=2``): ``range(100).batch(10)`` gives 5 + 5 in order."""
    dataset = Dataset.range(100).batch(10)
    expected = [[list(range(i, i + 5)), list(range(i + 5, i + 10))] for i in range(0, 100, 10)]
    got = [local(strategy, strategy.run(lambda x: x, args=(batch,)))
           for batch in strategy.experimental_distribute_dataset(dataset)]
    assert got == expected


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_uneven_dataset_batches(strategy, drop_remainder):
    """input_lib_test.py, ``testUnevenDatasetBatches``: ``[[0, 1], [2, 3]], [[4, 5], [6, 7]]`` then ``[[8], []]``
    unless ``drop_remainder``.

    TF's test feeds the two replicas batches of 2 from one pipeline; through
    ``experimental_distribute_dataset`` the same values are the halves of
    global batches of 4.
    """
    dataset = Dataset.range(9).batch(4, drop_remainder=drop_remainder)
    expected_values = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]] + ([] if drop_remainder else [[[8], []]])
    got = [local(strategy, strategy.run(lambda x: x, args=(batch,)))
           for batch in strategy.experimental_distribute_dataset(dataset)]
    assert got == expected_values


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_dense_part_of_ragged_sparse(strategy, drop_remainder):
    """input_lib_test.py, ``DistributedIteratorTensorTypeTest.testRaggedSparse``, its dense tensors.

    Global batch 8 of 20 rows ``i`` repeated ``i % 4`` times (padded): replica 0's first batch is rows 0-3,
    replica 1's rows 4-7; the sum over every batch is 310, 200 with ``drop_remainder`` (16 rows).
    """
    global_batch_size = 8
    row_lengths = np.mod(np.arange(20), 4)
    dense = np.zeros((20, 3), np.float32)
    for i, length in enumerate(row_lengths):
        dense[i, :length] = i
    dataset = Dataset.from_tensor_slices({"dense": dense}).batch(global_batch_size, drop_remainder=drop_remainder)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    per_replica_batch = next(iter(dist_dataset))
    first = strategy.experimental_local_results(per_replica_batch["dense"])
    assert np.asarray(first[0]).tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [2.0, 2.0, 0.0], [3.0, 3.0, 3.0]]
    assert np.asarray(first[1]).tolist() == [[0.0, 0.0, 0.0], [5.0, 0.0, 0.0], [6.0, 6.0, 0.0], [7.0, 7.0, 7.0]]
    total = 0.0
    for batch in dist_dataset:
        per_replica_sums = strategy.run(lambda x: np.float32(np.sum(x["dense"])), args=(batch,))
        total += float(strategy.reduce(ReduceOp.SUM, per_replica_sums, axis=None))
    assert total == (200.0 if drop_remainder else 310.0)


def test_iterable_iterator_on_one_device(process_client):
    """input_lib_test.py, ``testIterableIterator``: OneDeviceStrategy over ``range(10)`` yields 0 .. 9 in order."""
    with distribute.OneDeviceStrategy("/cpu:0", client=process_client) as strategy:
        dist_dataset = strategy.experimental_distribute_dataset(Dataset.range(10).batch(1))
        seen = [int(np.asarray(strategy.run(lambda x: x, args=(element,)))[0]) for element in dist_dataset]
    assert seen == list(range(10))


# ---------------------------------------------------------------------------------------------
# distribute_utils_test.py, RegroupAndSelectDeviceTest (regroup / select_replica as pure functions)
# ---------------------------------------------------------------------------------------------


def _nested_value(d):
    return ("a" + d, ["b" + d, {"c": "d" + d, "e": "f" + d}, "g" + d], "h" + d)


def test_regroup_nested():
    """distribute_utils_test.py, ``testNested``: regroup, then select_replica undoes it."""
    from daskdist.values import PerReplica, regroup, select_replica

    result = regroup((_nested_value("1"), _nested_value("2")))
    assert isinstance(result, tuple) and len(result) == 3
    assert isinstance(result[0], PerReplica) and result[0].values == ("a1", "a2")
    assert result[2].values == ("h1", "h2")
    assert isinstance(result[1], list) and len(result[1]) == 3
    assert result[1][0].values == ("b1", "b2") and result[1][2].values == ("g1", "g2")
    assert isinstance(result[1][1], dict) and set(result[1][1]) == {"c", "e"}
    assert result[1][1]["c"].values == ("d1", "d2") and result[1][1]["e"].values == ("f1", "f2")
    assert select_replica(0, result) == _nested_value("1")
    assert select_replica(1, result) == _nested_value("2")


def test_regroup_a_list_of_two_tuples():
    """distribute_utils_test.py, ``testWrapAListOfTwoTuples``."""
    from daskdist.values import regroup

    result = regroup([("1", "2"), ("3", "4")])
    assert isinstance(result, tuple) and len(result) == 2
    assert result[0].values == ("1", "3") and result[1].values == ("2", "4")


def test_regroup_one_device_is_identity():
    """distribute_utils_test.py, ``testOneDevice``."""
    from daskdist.values import regroup, select_replica

    result = regroup((_nested_value("1"),))
    assert result == _nested_value("1")
    assert select_replica(0, result) == _nested_value("1")


def test_regroup_same_id_is_a_documented_difference():
    """distribute_utils_test.py, ``testSameId``: TF unwraps any object every replica returned.

    Replicas here are processes whose results arrive as copies, so daskdist
    unwraps only what CPython shares between copies (``None``, bools, small
    ints) and distributed variables, whatever the cluster (docs/strategies.md,
    "Deliberate differences"); an arbitrary object stays per replica.
    """
    from daskdist.values import PerReplica, regroup, select_replica

    foo = object()
    result = regroup((("a", foo), ("b", foo)))
    assert result[0].values == ("a", "b")
    assert isinstance(result[1], PerReplica) and result[1].values == (foo, foo)
    assert select_replica(0, result) == ("a", foo) and select_replica(1, result)[1] is foo
    shared = regroup((("a", None, 7, True), ("b", None, 7, True)))
    assert shared[1] is None and shared[2] == 7 and shared[3] is True


def test_default_strategy_outside_any_scope():
    """distribute_lib.py, ``_DefaultDistributionStrategy`` (TF 2.21): one replica; values and datasets as they are."""
    from daskdist.strategy.extended.options import ValueContext

    strategy = distribute.get_strategy()
    assert strategy.num_replicas_in_sync == 1 and not distribute.has_strategy()
    assert strategy.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync)) == (0, 1)
    assert ValueContext() == distribute.experimental.ValueContext(0, 1)
    dataset = Dataset.range(4).batch(2)
    assert strategy.experimental_distribute_dataset(dataset) is dataset
    made = strategy.distribute_datasets_from_function(
        lambda ctx: Dataset.range(ctx.num_input_pipelines * 3 + ctx.input_pipeline_id))
    assert [int(x) for x in made] == [0, 1, 2]
    assert distribute.get_replica_context().merge_call(lambda s, x: x + 1, args=(1,)) == 2
    assert float(strategy.reduce("SUM", 3.0, axis=None)) == 3.0
    assert strategy.run(lambda: None) is None


# ---------------------------------------------------------------------------------------------
# values_test.py, DistributedValuesTest (``ds_test_util.gather`` stacks the replicas' components)
# ---------------------------------------------------------------------------------------------


def _stacked(strategy, value):
    """``distribute/test_util.py``'s ``gather``: every leaf's components stacked along a new first axis."""
    import optree

    return optree.tree_map(lambda leaf: np.stack([np.asarray(p) for p in strategy.experimental_local_results(leaf)]),
                           value, is_leaf=lambda x: isinstance(x, distribute.DistributedValues))


def test_make_distributed_value_single_numpy_array_constant(strategy):
    """values_test.py, ``testMakeDistributedValueSingleNumpyArrayConstant``: [[1, 2, 3]] * 2."""
    array_value = np.array([1.0, 2.0, 3.0])
    distributed_values = strategy.experimental_distribute_values_from_function(lambda ctx: array_value)
    assert _stacked(strategy, distributed_values).tolist() == [[1.0, 2.0, 3.0]] * 2


def test_make_distributed_value_tuple_constant(strategy):
    """values_test.py, ``testMakeDistributedValueTupleConstant``: ([1, 1], [2, 2], [3, 3]), a tuple of PerReplica."""
    tuple_value = (1.0, 2.0, 3.0)
    distributed_values = strategy.experimental_distribute_values_from_function(lambda ctx: tuple_value)
    assert isinstance(distributed_values, tuple)
    assert all(isinstance(v, distribute.DistributedValues) for v in distributed_values)
    assert tuple(v.tolist() for v in _stacked(strategy, distributed_values)) == ([1.0, 1.0], [2.0, 2.0], [3.0, 3.0])


def test_make_distributed_value_nested_structure_per_replica(strategy):
    """values_test.py, ``testMakeDistributedValueNestedStructurePerReplica``: ([0, 1], [0, 2], [0, 3])."""
    tuple_value = (1.0, 2.0, 3.0)

    def value_fn(ctx):
        return tuple(val * ctx.replica_id_in_sync_group for val in tuple_value)

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn)
    assert tuple(v.tolist() for v in _stacked(strategy, distributed_values)) == ([0.0, 1.0], [0.0, 2.0], [0.0, 3.0])


def test_make_distributed_value_extract_from_array(strategy):
    """values_test.py, ``testMakeDistributedValueExtractFromArray``: range(num_replicas)."""
    multiple_values = range(strategy.num_replicas_in_sync)
    distributed_values = strategy.experimental_distribute_values_from_function(
        lambda ctx: multiple_values[ctx.replica_id_in_sync_group])
    assert _stacked(strategy, distributed_values).tolist() == list(range(strategy.num_replicas_in_sync))


def test_make_distributed_value_and_run(strategy):
    """values_test.py, ``testMakeDistributedValueAndRun``: squares of the replica ids."""
    multiple_values = range(strategy.num_replicas_in_sync)
    distributed_values = strategy.experimental_distribute_values_from_function(
        lambda ctx: multiple_values[ctx.replica_id_in_sync_group])
    outputs = strategy.run(np.square, args=(distributed_values,))
    assert _stacked(strategy, outputs).tolist() == [i**2 for i in range(strategy.num_replicas_in_sync)]


# ---------------------------------------------------------------------------------------------
# cross_device_ops.py docstrings
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_ops", [distribute.ReductionToOneDevice, distribute.NcclAllReduce,
                                      distribute.HierarchicalCopyAllReduce],
                         ids=["ReductionToOneDevice", "NcclAllReduce", "HierarchicalCopyAllReduce"])
def test_cross_device_ops_docstrings(process_client, make_ops):
    """cross_device_ops.py, ``ReductionToOneDevice`` / ``NcclAllReduce`` / ``HierarchicalCopyAllReduce`` docstrings.

    ``tf.distribute.MirroredStrategy(cross_device_ops=...)``; the all-reduce
    then gives every replica the sum, whichever algorithm runs it.
    """
    with distribute.MirroredStrategy(cross_device_ops=make_ops(), client=process_client) as strategy:
        assert isinstance(strategy.extended.cross_device_ops, distribute.CrossDeviceOps)
        out = strategy.run(lambda: distribute.get_replica_context().all_reduce(
            "sum", np.full(4, replica_id() + 1.0, np.float32)))
        assert local(strategy, out) == [[3.0] * 4] * 2


# ---------------------------------------------------------------------------------------------
# distribute_lib_test.py, DefaultDistributionStrategyTest (and TestStrategyTest on a one-replica strategy)
# ---------------------------------------------------------------------------------------------


def _assert_in_default_state():
    """distribute_lib_test.py, ``_assert_in_default_state``."""
    from daskdist.strategy.extended.default import default_replica_context, default_strategy

    assert distribute.get_replica_context() is default_replica_context()
    assert not distribute.in_cross_replica_context()
    assert distribute.get_strategy() is default_strategy() and not distribute.has_strategy()


def test_default_strategy_merge_call_runs_in_cross_replica_context():
    """distribute_lib_test.py, ``DefaultDistributionStrategyTest.testMergeCall``: ``"foo_bar"``.

    Inside ``merge_fn``: the default strategy, no replica context, cross-replica
    context, ``get_strategy()`` the default strategy, ``has_strategy()`` False.
    """
    _assert_in_default_state()
    seen = {}

    def merge_fn(dist, s):
        seen.update(dist=dist, replica_context=distribute.get_replica_context(),
                    cross_replica=distribute.in_cross_replica_context(), strategy=distribute.get_strategy(),
                    has_strategy=distribute.has_strategy())
        return "foo_" + s

    replica_ctx = distribute.get_replica_context()
    assert replica_ctx.merge_call(merge_fn, args=("bar",)) == "foo_bar"
    default = distribute.get_strategy()
    assert seen == {"dist": default, "replica_context": None, "cross_replica": True, "strategy": default,
                    "has_strategy": False}
    _assert_in_default_state()


@pytest.mark.parametrize("op", ["mean", "MEAN", "sum", "SUM"])
def test_default_strategy_reductions_accept_string_ops(op):
    """distribute_lib_test.py, ``testReductions_acceptStringOps`` (``reduce``, ``reduce_to``, ``batch_reduce_to``).

    One replica: every reduction gives its input back.
    """
    dist = distribute.get_strategy()
    x, y = np.float32(1.0), np.float32(2.0)
    assert dist.reduce(op, x, axis=None) == x
    assert dist.extended.reduce_to(op, x, "/CPU:0") == x
    x_r, y_r = dist.extended.batch_reduce_to(op, ((x, "/CPU:0"), (y, "/CPU:0")))
    assert (x_r, y_r) == (x, y)


def test_default_strategy_reduce_along_axes():
    """distribute_lib_test.py, ``testReduceMeanAxis`` / ``testReduceSumAxis`` (one replica).

    MEAN: ``x``, ``[2, 3]``, ``2.5``; SUM: ``x``, ``[4, 6]``, ``10``.
    """
    dist = distribute.get_strategy()
    x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    assert np.asarray(dist.reduce(ReduceOp.MEAN, x, axis=None)).tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert np.asarray(dist.reduce(ReduceOp.MEAN, x, axis=0)).tolist() == [2.0, 3.0]
    assert float(dist.reduce(ReduceOp.MEAN, x, axis=(0, 1))) == 2.5
    assert np.asarray(dist.reduce(ReduceOp.SUM, x, axis=None)).tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert np.asarray(dist.reduce(ReduceOp.SUM, x, axis=0)).tolist() == [4.0, 6.0]
    assert float(dist.reduce(ReduceOp.SUM, x, axis=(0, 1))) == 10.0


# ---------------------------------------------------------------------------------------------
# values.py, DistributedValues docstring; values_test.py, DistributedDelegateTest (TF's Mirrored is a delegate)
# ---------------------------------------------------------------------------------------------


def test_distributed_values_docstring_reduce_a_dataset_element(strategy):
    """values.py, ``DistributedValues`` docstring, example 4: the first element of ``[5., 6., 7., 8.]`` by 2 sums to 11."""
    dataset = Dataset.from_tensor_slices(np.array([5.0, 6.0, 7.0, 8.0], np.float32)).batch(2)
    dataset_iterator = iter(strategy.experimental_distribute_dataset(dataset))
    distributed_values = next(dataset_iterator)
    reduced_value = strategy.reduce(ReduceOp.SUM, distributed_values, axis=0)
    assert float(reduced_value) == 11.0


def test_distributed_values_docstring_local_results_of_a_dataset_element(strategy):
    """values.py, ``DistributedValues`` docstring, example 5: ``([5.], [6.])``."""
    dataset = Dataset.from_tensor_slices(np.array([5.0, 6.0, 7.0, 8.0], np.float32)).batch(2)
    distributed_values = next(iter(strategy.experimental_distribute_dataset(dataset)))
    per_replica_values = strategy.experimental_local_results(distributed_values)
    assert [np.asarray(v).tolist() for v in per_replica_values] == [[5.0], [6.0]]


def test_distributed_delegate_get_attr():
    """values_test.py, ``DistributedDelegateTest.testGetAttr``: ``v.x`` is 7; ``v.y`` raises ``AttributeError``."""
    from daskdist.values import Mirrored

    class Foo:
        def __init__(self, x):
            self.x = x

    v = Mirrored((Foo(7), Foo(8)))
    assert v.x == 7
    with pytest.raises(AttributeError):
        _ = v.y


def test_distributed_delegate_operator_override():
    """values_test.py, ``DistributedDelegateTest.testOperatorOverride``: ``Mirrored((7, 8))`` acts like ``int(7)``."""
    from daskdist.values import Mirrored

    v = Mirrored((7, 8))
    assert (v + 1, 3 + v, v + v, v - 2, 13 - v, v - v) == (8, 10, 14, 5, 6, 0)
    assert (v * 2, 3 * v, v * v, v / 2, 10.5 / v, v // 2, 15 // v, v % 2, 16 % v) == (14, 21, 49, 3.5, 1.5, 3, 2, 1, 2)
    assert (v < 12, v <= 12, v > 12, v >= 12, 12 < v, 12 <= v, 12 > v, 12 >= v) == (
        True, True, False, False, False, False, True, True)
    assert (v & 3, 11 & v, v | 8, 16 | v, v ^ 3, 11 ^ v) == (3, 3, 15, 23, 4, 12)
    assert (pow(v, 3), pow(v, 3, 10), pow(2, v), -v, ~v, abs(v)) == (343, 3, 128, -7, ~7, 7)
    with pytest.raises(TypeError):
        _ = v[2]


def test_distributed_delegate_copy():
    """values_test.py, ``DistributedDelegateTest.testCopy``: shallow and deep copies keep ``x``."""
    import copy

    from daskdist.values import Mirrored

    class Foo:
        def __init__(self, x):
            self.x = x

    v = Mirrored((Foo(7), Foo(8)))
    assert copy.copy(v).x == v.x == copy.deepcopy(v).x == 7


def test_mirrored_acts_like_its_value_and_per_replica_refuses():
    """values.py, ``Mirrored`` / ``DistributedDelegate``: a ``Mirrored`` of ``[1, 2]`` plus 1 is ``[2, 3]`` (TF 2.21).

    Negation, comparison and ``np.asarray`` go to the value too; a ``PerReplica``
    is no delegate and keeps refusing arithmetic (``TypeError``), as in TF.
    """
    from daskdist.values import Mirrored, PerReplica

    mirrored = Mirrored([np.array([1, 2]), np.array([1, 2])])
    assert (mirrored + 1).tolist() == [2, 3]
    assert (-mirrored).tolist() == [-1, -2]
    assert (mirrored > 1).tolist() == [False, True]
    assert np.asarray(mirrored).tolist() == [1, 2] and mirrored.shape == (2,)
    with pytest.raises(TypeError):
        _ = PerReplica([np.array([1, 2]), np.array([3, 4])]) + 1


def test_mirrored_inside_a_replica_is_that_replicas_component(strategy):
    """values.py, ``DistributedValues._get``: in replica context a ``Mirrored`` is the current replica's component."""
    from daskdist.values import Mirrored

    mirrored = Mirrored([np.float32(10.0), np.float32(20.0)])
    out = strategy.run(lambda: float(mirrored + replica_id()))
    assert local(strategy, out) == [10.0, 21.0]


# ---------------------------------------------------------------------------------------------
# cross_device_ops.py: CrossDeviceOps.reduce / batch_reduce / broadcast (cross_device_ops_test.py)
# ---------------------------------------------------------------------------------------------


_CROSS_DEVICE_OPS = pytest.mark.parametrize(
    "make_ops", [distribute.ReductionToOneDevice, distribute.NcclAllReduce, distribute.HierarchicalCopyAllReduce],
    ids=["ReductionToOneDevice", "NcclAllReduce", "HierarchicalCopyAllReduce"])


@_CROSS_DEVICE_OPS
def test_cross_device_ops_reduce_to_per_replica_destinations_is_mirrored(make_ops):
    """cross_device_ops.py, ``CrossDeviceOps.reduce``: onto two devices a ``Mirrored`` of the sum (TF 2.21: ``[3., 3.]``).

    cross_device_ops_test.py ``testReduce``: SUM and MEAN onto each destination device.
    """
    from daskdist.values import Mirrored, PerReplica

    per_replica = PerReplica([np.float32(1.0), np.float32(2.0)])
    ops = make_ops()
    reduced = ops.reduce(ReduceOp.SUM, per_replica, destinations=per_replica)
    assert isinstance(reduced, Mirrored) and [float(v) for v in reduced.values] == [3.0, 3.0]
    mean = ops.reduce("MEAN", per_replica, destinations=per_replica)
    assert isinstance(mean, Mirrored) and [float(v) for v in mean.values] == [1.5, 1.5]
    assert float(ops.reduce(ReduceOp.SUM, per_replica, destinations="/cpu:0")) == 3.0  # one device: the value


@pytest.mark.parametrize("make_ops", [
    distribute.ReductionToOneDevice,
    lambda: distribute.ReductionToOneDevice(reduce_to_device="/cpu:0"),
    lambda: distribute.ReductionToOneDevice(accumulation_fn=lambda values: np.sum(values, axis=0)),
    lambda: AllReduceCrossDeviceOps("nccl", 1),
    lambda: AllReduceCrossDeviceOps("nccl", 0),
    distribute.NcclAllReduce,
    lambda: distribute.HierarchicalCopyAllReduce(8),
], ids=["DefaultReductionToOneDevice", "ReductionToCPUDeviceCrossDeviceOps", "AccumulateNCrossDeviceOp", "AllReduce",
        "AllReduceNoGradientRepacking", "NcclAllReduce", "HierarchicalCopy"])
def test_cross_device_ops_reduction_and_broadcast(make_ops):
    """cross_device_ops_test.py, ``SingleWorkerCrossDeviceOpsTest.testReductionAndBroadcast`` on two devices.

    ``reduce`` / ``batch_reduce`` of ``[0., 1.]`` and ``[1., 2.]`` (MEAN 0.5 and 1.5, SUM 1 and 3) and
    ``broadcast(1.)`` onto a ``Mirrored`` over both devices (a ``Mirrored`` result), an array on one device
    and a device string (the value itself: TF's regroup unwraps one copy). ``validate_destinations``
    refuses ``None`` with ``ValueError``.
    """
    import itertools

    from daskdist.values import Mirrored, PerReplica

    cross_device_ops = make_ops()
    devices = ["/cpu:0", "/cpu:1"]
    per_replica = PerReplica([np.float32(d) for d in range(len(devices))])
    mean = (len(devices) - 1.0) / 2.0
    per_replica_2 = PerReplica([np.float32(d + 1.0) for d in range(len(devices))])
    mean_2 = mean + 1.0
    destination_mirrored = Mirrored([np.float32(1.0)] * len(devices))
    destination_different = np.float32(1.0)  # TF's _fake_mirrored on one device: the value itself
    destination_str = "/device:CPU:0"
    all_destinations = [destination_mirrored, destination_different, destination_str]

    def fake_mirrored(value, destinations):
        return [value] * len(destinations) if isinstance(destinations, Mirrored) else value

    def plain(result):
        if isinstance(result, Mirrored):
            return [float(v) for v in result.values]
        assert not isinstance(result, PerReplica)
        return float(result)

    for destinations in all_destinations:
        assert plain(cross_device_ops.reduce(ReduceOp.MEAN, per_replica, destinations=destinations)) == fake_mirrored(
            mean, destinations)
        assert plain(cross_device_ops.reduce(ReduceOp.MEAN, per_replica_2, destinations=destinations)) == \
            fake_mirrored(mean_2, destinations)
        assert plain(cross_device_ops.reduce(ReduceOp.SUM, per_replica, destinations=destinations)) == fake_mirrored(
            mean * len(devices), destinations)
        assert plain(cross_device_ops.reduce(ReduceOp.SUM, per_replica_2, destinations=destinations)) == \
            fake_mirrored(mean_2 * len(devices), destinations)
    for d1, d2 in itertools.product(all_destinations, all_destinations):
        results = cross_device_ops.batch_reduce(ReduceOp.MEAN, [(per_replica, d1), (per_replica_2, d2)])
        assert isinstance(results, list)
        assert [plain(r) for r in results] == [fake_mirrored(mean, d1), fake_mirrored(mean_2, d2)]
        results = cross_device_ops.batch_reduce(ReduceOp.SUM, [(per_replica, d1), (per_replica_2, d2)])
        assert [plain(r) for r in results] == [fake_mirrored(mean * len(devices), d1),
                                               fake_mirrored(mean_2 * len(devices), d2)]
    for destinations in all_destinations:
        assert plain(cross_device_ops.broadcast(np.float32(1.0), destinations)) == fake_mirrored(1.0, destinations)
    with pytest.raises(ValueError, match="destinations must be one of"):
        cross_device_ops.reduce(ReduceOp.SUM, per_replica, destinations=None)
