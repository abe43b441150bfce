"""The strategy contract: ``strategy.extended``'s TF verbs from the client, and keras/data speaking only the contract.

Cases marked with a TF source port TensorFlow's own examples and tests with
TensorFlow's expected values (two replicas where TF's example has two
devices). Sources are under ``tensorflow/python/distribute/``.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import daskdist as dd
from daskdist.group.service import MODEL, VARIABLE
from daskdist.strategy.base import Strategy
from daskdist.strategy.extended.contract import StrategyExtended
from daskdist.strategy.extended.mirrored import MirroredExtended

TWO_DEVICES = ["/cpu:0", "/cpu:1"]


@pytest.fixture
def two(threaded_client):
    """A MirroredStrategy over two replicas, as TF's two-device examples."""
    with dd.MirroredStrategy(devices=TWO_DEVICES, client=threaded_client) as strategy:
        yield strategy


def _floats(strategy, value):
    return [float(np.asarray(x)) for x in strategy.experimental_local_results(value)]


# -- variable_created_in_scope -----------------------------------------------------------


def test_variables_created_in_the_scope_are_owned_by_the_strategy_and_others_are_not(two, threaded_client):
    # distribute_lib.py, StrategyExtendedV2.variable_created_in_scope docstring
    with two.scope():
        v = dd.Variable(1.0)
    assert two.extended.variable_created_in_scope(v) is True
    outside = dd.Variable(1.0)
    assert two.extended.variable_created_in_scope(outside) is False
    inside_run = two.run(lambda: dd.Variable(2.0))  # created collectively inside a replica function
    assert two.extended.variable_created_in_scope(inside_run) is True
    with dd.OneDeviceStrategy("/cpu:2", client=threaded_client) as other:
        with other.scope():
            foreign = dd.Variable(1.0)
        assert two.extended.variable_created_in_scope(foreign) is False
        assert other.extended.variable_created_in_scope(foreign) is True
    with pytest.raises(TypeError, match="takes a variable"):
        two.extended.variable_created_in_scope(np.ones(2))


# -- update ------------------------------------------------------------------------------


def test_update_from_the_client_runs_fn_on_every_copy(two):
    # distribute_lib.py, StrategyExtendedV2.update docstring: v = Variable(5.0, aggregation=SUM),
    # update(v, lambda v: v.assign(1.0)) -> Mirrored {0: 1.0, 1: 1.0}
    with two.scope():
        v = dd.Variable(5.0, aggregation=dd.VariableAggregation.SUM)
    result = two.extended.update(v, lambda v: v.assign(1.0))
    assert result is v  # fn returned each copy: regrouped into the variable, as TF's regroup does
    assert _floats(two, result) == [1.0, 1.0]
    values = two.extended.update(v, lambda v: v.assign(1.0).read_value())
    assert isinstance(values, dd.Mirrored) and _floats(two, values) == [1.0, 1.0]


def test_update_unwraps_distributed_arguments_per_copy_and_group_false_gives_one_element_per_copy(two):
    # mirrored_strategy.py, MirroredExtended._update: fn(v_i, *select_replica(i, args));
    # distribute_utils.update_regroup with group=False: a nest of per-replica tuples
    with two.scope():
        v = dd.Variable(np.zeros(2, np.float32))
    per = dd.PerReplica([np.full(2, 1.0, np.float32), np.full(2, 2.0, np.float32)])
    out = two.extended.update(v, lambda c, delta, scale=1.0: c.assign_add(delta * scale).read_value(),
                              args=(per,), kwargs={"scale": 10.0}, group=False)
    assert isinstance(out, tuple) and len(out) == 2
    assert [x.tolist() for x in out] == [[10.0, 10.0], [20.0, 20.0]]
    assert [x.tolist() for x in v.local_results()] == [[10.0, 10.0], [20.0, 20.0]]
    with pytest.raises(ValueError, match="2 replicas"):
        two.extended.update(v, lambda c, d: c.assign(d), args=(dd.PerReplica([1.0, 2.0, 3.0]),))


def test_update_needs_a_variable_of_this_strategy(two):
    # mirrored_strategy.py, MirroredExtended._update asserts a DistributedVariable
    with pytest.raises(ValueError, match="created in this strategy's scope"):
        two.extended.update(dd.Variable(1.0), lambda v: v.assign(2.0))
    with two.scope():
        v = dd.Variable(1.0)
    with pytest.raises(TypeError, match="callable"):
        two.extended.update(v, "assign")


# -- reduce_to / batch_reduce_to ---------------------------------------------------------


@pytest.mark.parametrize("client_name, batched",
                         [("threaded_client", False), ("threaded_client", True), ("process_client", False)])
def test_reduce_to_example_gives_two_on_two_replicas_and_one_on_one_device(request, client_name, batched):
    # distribute_lib.py, StrategyExtendedV2.reduce_to and batch_reduce_to docstrings, driven from the
    # client: every replica's value is 1.0; reduced with SUM to the variable and assigned.
    # MirroredStrategy(["GPU:0", "GPU:1"]) -> 2.0 on both copies; OneDeviceStrategy -> 1.0
    def run(strategy):
        with strategy.scope():
            v = dd.Variable(0.0)
        value = strategy.run(lambda: np.array(1.0, np.float32))
        if batched:
            reduced = strategy.extended.batch_reduce_to(dd.ReduceOp.SUM, [(value, v)])[0]
        else:
            reduced = strategy.extended.reduce_to(dd.ReduceOp.SUM, value, destinations=v)
        strategy.extended.update(v, lambda var, value: var.assign(value), args=(reduced,))
        return v

    client = request.getfixturevalue(client_name)
    with dd.MirroredStrategy(devices=TWO_DEVICES, client=client) as two:
        assert _floats(two, run(two)) == [2.0, 2.0]
    with dd.OneDeviceStrategy("/cpu:0", client=client) as one:
        assert _floats(one, run(one)) == [1.0]


def test_reduce_to_places_the_result_on_the_destinations(two):
    # mirrored_strategy.py, MirroredExtended._reduce_to via CrossDeviceOps.reduce: the result lives on the
    # destinations' devices (Mirrored over a variable's or a distributed value's devices, one value on one device)
    with two.scope():
        v = dd.Variable(np.zeros(3))
    value = two.run(lambda: np.arange(3.0) * (dd.get_replica_context().replica_id_in_sync_group + 1))
    to_variable = two.extended.reduce_to("SUM", value, v)
    assert isinstance(to_variable, dd.Mirrored) and [x.tolist() for x in to_variable.values] == [[0, 3, 6]] * 2
    assert v.numpy().tolist() == [0, 0, 0]  # "this method doesn't update the variable"
    all_reduced = two.extended.reduce_to("MEAN", value, value)  # "to perform an all-reduce, pass the same"
    assert isinstance(all_reduced, dd.Mirrored) and [x.tolist() for x in all_reduced.values] == [[0, 1.5, 3]] * 2
    on_one_device = two.extended.reduce_to(dd.ReduceOp.SUM, value, "/cpu:0")
    assert isinstance(on_one_device, np.ndarray) and on_one_device.tolist() == [0, 3, 6]
    structured = two.extended.reduce_to("SUM", {"a": value, "b": [value]}, "/cpu:0")
    assert structured["a"].tolist() == [0, 3, 6] and structured["b"][0].tolist() == [0, 3, 6]


def test_reduce_to_of_non_distributed_and_mirrored_values_follows_tf(two, threaded_client):
    # cross_device_ops.py, reduce_non_distributed_value; mirrored_strategy.py, MirroredExtended._reduce_to
    with two.scope():
        v = dd.Variable(np.ones(2))
    assert two.extended.reduce_to("SUM", 0, v) == 0  # "a single value equal to 0"
    plain = np.array([4.0, 5.0])
    assert two.extended.reduce_to("MEAN", plain, v) is plain  # MEAN of one value on every replica: the value
    with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
        two.extended.reduce_to("SUM", plain, v)
    mirrored = dd.Mirrored([plain, plain])
    assert two.extended.reduce_to(dd.ReduceOp.MEAN, mirrored, v) is mirrored
    assert two.extended.reduce_to(dd.ReduceOp.MEAN, v, v) is v  # a mirrored variable is mirrored
    with pytest.raises(ValueError, match="Mirrored"):
        two.extended.reduce_to(dd.ReduceOp.SUM, mirrored, v)
    with dd.OneDeviceStrategy("/cpu:0", client=threaded_client) as one:
        # one_device_strategy.py, OneDeviceExtended._reduce_to: the value itself
        assert one.extended.reduce_to("SUM", plain, "/cpu:0") is plain


def test_reduce_to_reduces_the_copies_of_a_sync_on_read_variable(two):
    # distribute_lib.py reduce_to: "aggregates DistributedValues and distributed variables"
    with two.scope():
        v = dd.Variable(0.0, synchronization="ON_READ", aggregation="SUM")
    two.run(lambda: v.assign(dd.get_replica_context().replica_id_in_sync_group + 1.0))
    assert float(two.extended.reduce_to("SUM", v, "/cpu:0")) == 3.0
    assert float(two.extended.reduce_to("MEAN", v, "/cpu:0")) == 1.5


def test_reduce_to_rejects_bad_arguments_with_tf_messages(two):
    # distribute_lib.py reduce_to / batch_reduce_to; cross_device_ops.py validate_destinations
    value = two.run(lambda: np.ones(2))
    with pytest.raises(ValueError, match="destinations can not be empty"):
        two.extended.reduce_to("SUM", value, "")
    with pytest.raises(ValueError, match="destinations must be one of"):
        two.extended.reduce_to("SUM", value, object())
    with pytest.raises(ValueError, match="not a list"):
        two.extended.reduce_to("SUM", value, ["/cpu:0", "/cpu:1"])
    with pytest.raises(TypeError, match="VariableAggregation"):
        two.extended.reduce_to(dd.VariableAggregation.SUM, value, "/cpu:0")
    with pytest.raises(ValueError, match="Unknown|reduce"):
        two.extended.reduce_to("PLUS", value, "/cpu:0")
    with pytest.raises(ValueError, match="2 replicas"):
        two.extended.reduce_to("SUM", dd.PerReplica([np.ones(2)] * 3), "/cpu:0")
    with pytest.raises(ValueError, match="value_destination_pairs"):
        two.extended.batch_reduce_to("SUM", [value])
    assert two.extended.batch_reduce_to("SUM", []) == []


def test_cross_replica_verbs_refuse_another_strategys_scope(two, threaded_client):
    # distribute_lib.py, _require_cross_replica_or_default_context_extended -> _wrong_strategy_scope
    with dd.OneDeviceStrategy("/cpu:2", client=threaded_client) as other:
        value = two.run(lambda: np.ones(2))
        with other.scope(), pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy"):
            two.extended.reduce_to("SUM", value, "/cpu:0")
        with two.scope():
            assert two.extended.reduce_to("SUM", value, "/cpu:0").tolist() == [2.0, 2.0]


# -- read_var ----------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation, first, after_assign", [("SUM", 2.0, 6.0), ("MEAN", 1.0, 6.0)])
def test_read_var_aggregates_a_sync_on_read_variable(two, aggregation, first, after_assign):
    # mirrored_strategy_test.py, SyncOnReadVariableAssignTest.testAssignReplicaLocalVar{Sum,Mean}Aggregation:
    # each replica holds 1.0 -> read_var gives 2.0 (SUM) / 1.0 (MEAN); assign(6.0) in cross-replica
    # context -> read_var gives 6.0
    def model_fn():
        return dd.Variable(1.0, synchronization=dd.VariableSynchronization.ON_READ, aggregation=aggregation)

    with two.scope():
        sync_on_read_var = two.extended.call_for_each_replica(model_fn)
        assert isinstance(sync_on_read_var, dd.SyncOnReadVariable)
        assert float(two.extended.read_var(sync_on_read_var)) == first
        sync_on_read_var.assign(6.0)
        assert float(two.extended.read_var(sync_on_read_var)) == after_assign


def test_read_var_and_variable_created_in_scope_work_inside_merge_call(two):
    # distribute_lib.py: merge_fn runs in cross-replica context, where strategy.extended's verbs apply
    # (TF's ReplicaContext.merge_call docstring); read_var as MirroredExtended.read_var
    with two.scope():
        sync_on_read = two.run(lambda: dd.Variable(0.0, synchronization=dd.VariableSynchronization.ON_READ,
                                                   aggregation="SUM"))
        mirrored = dd.Variable(np.array([1.0, 2.0]))

    def merge_fn(strategy, s, m):
        return (float(strategy.extended.read_var(s)), strategy.extended.read_var(m).tolist(),
                strategy.extended.variable_created_in_scope(s), strategy.extended.variable_created_in_scope(dd.Variable(0.0)))

    def step():
        ctx = dd.get_replica_context()
        sync_on_read.assign(float(ctx.replica_id_in_sync_group + 1))  # each replica its own copy (ON_READ)
        return ctx.merge_call(merge_fn, args=(sync_on_read, mirrored))

    for result in two.experimental_local_results(two.run(step)):
        assert result == (3.0, [1.0, 2.0], True, False)  # 1.0 + 2.0 across the two replicas


def test_read_var_of_a_mirrored_variable_is_its_value_and_other_values_are_refused(two, threaded_client):
    # mirrored_strategy.py, MirroredExtended.read_var: identity(v._get()) for mirrored, else an assertion
    with two.scope():
        v = dd.Variable(np.array([1.0, 2.0]))
    assert two.extended.read_var(v).tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="created in this strategy's scope"):
        two.extended.read_var(dd.Variable(1.0))
    with dd.OneDeviceStrategy("/cpu:0", client=threaded_client) as one:
        # one_device_strategy.py, OneDeviceExtended.read_var: identity of any variable
        assert float(one.extended.read_var(dd.Variable(3.0))) == 3.0


def test_minimize_loss_with_read_var_reduce_to_and_update_lowers_the_error(two):
    # strategy_test_lib.py, DistributionTestBase._test_minimize_loss_eager: per-replica gradients from
    # call_for_each_replica, then for each (g, v): read_var, reduce_to(SUM, g, destinations=v),
    # update(v, update, args=(g,), group=False), read_var; the error after is below the error before
    with two.scope():
        kernel = dd.Variable(np.array([[3.0]], np.float32), name="kernel")

    def grad_fn(x):
        y = (x @ kernel.value()).reshape(()) - 1.0
        return [(2.0 * y * x.T, kernel)]  # d/dk (x k - 1)^2

    def update(v, g):
        return v.assign_sub(0.05 * g)

    one = np.array([[1.0]], np.float32)
    before = after = None
    for i in range(10):
        g_v = two.extended.call_for_each_replica(grad_fn, args=(one,))
        for g, v in g_v:
            assert v is kernel
            fetched = two.extended.read_var(v)
            g = two.extended.reduce_to(dd.ReduceOp.SUM, g, destinations=v)
            two.extended.update(v, update, args=(g,), group=False)
            if i == 0:
                before = fetched
            after = two.extended.read_var(v)
    error_before = abs(float(before.reshape(())) - 1)
    error_after = abs(float(after.reshape(())) - 1)
    assert error_after < error_before
    # with SUM over 2 replicas each step multiplies the error by 1 - 0.05 * 2 * 2 = 0.8
    assert error_after == pytest.approx(2.0 * 0.8**10, rel=1e-5)
    assert [x.tolist() for x in kernel.local_results()] == [after.tolist()] * 2


# -- colocate_vars_with and placement ---------------------------------------------------


def test_colocate_vars_with_places_new_variables_with_the_given_one(two):
    # distribute_lib.py, StrategyExtendedV2.colocate_vars_with; distribute_utils.validate_colocate_distributed_variable
    with two.scope():
        v = dd.Variable(1.0)
        with two.extended.colocate_vars_with(v):
            w = dd.Variable(2.0)
    assert _floats(two, w) == [2.0, 2.0]
    with pytest.raises(ValueError, match="colocate_vars_with"), two.extended.colocate_vars_with(dd.Variable(1.0)):
        pass


class _OneHolderExtended(MirroredExtended):
    """A strategy whose variables live on replica 0 only (the placement hook CentralStorage will use)."""

    def _variable_placement(self, spec):
        return [0]


class _OneHolderStrategy(Strategy):
    def __init__(self, client):
        super().__init__(_OneHolderExtended(self, TWO_DEVICES, None, client))


def test_create_variable_places_copies_where_the_strategy_says(threaded_client):
    with _OneHolderStrategy(threaded_client) as strategy:
        assert isinstance(strategy.extended, StrategyExtended)
        assert strategy.extended.parameter_devices == (strategy.extended.worker_devices[0],)
        with strategy.scope():
            v = dd.Variable(np.ones(2))
        assert len(v.local_results()) == 1
        v.assign_add(np.ones(2))
        assert v.numpy().tolist() == [2.0, 2.0]
        out = strategy.extended.update(v, lambda c: c.assign(c.value() * 3).read_value())
        assert out.tolist() == [6.0, 6.0]  # one copy: the result itself
        value = strategy.run(lambda: np.ones(2))
        assert strategy.extended.reduce_to("SUM", value, v).tolist() == [2.0, 2.0]  # one destination device
        assert strategy.extended.run_on_replicas(_holds, (v._var_id,)) == [True, False]


def test_an_extended_with_its_own_placement_must_define_its_step_driver(threaded_client):
    """The all-reduce driver cannot train parameters placed elsewhere: a developer error, said at once."""
    with _OneHolderStrategy(threaded_client) as strategy, pytest.raises(TypeError, match="define step_driver"):
        strategy.extended.step_driver()


def _holds(service, var_id):
    return service.objects.find(VARIABLE, var_id) is not None


# -- the verbs keras and data use ---------------------------------------------------------


def _rank_plus(service, offset):
    return service.rank + offset


def test_commands_run_on_every_replica_or_one(two):
    assert two.extended.run_on_replicas(_rank_plus, (10,)) == [10, 11]
    assert two.extended.run_on_replicas(_rank_plus, args_per_replica=[(1,), (2,)]) == [1, 3]
    assert two.extended.run_on_replica(1, _rank_plus, (5,)) == 6
    with pytest.raises(ValueError, match="2 replicas"):
        two.extended.run_on_replicas(_rank_plus, args_per_replica=[(1,)])
    with pytest.raises(ValueError, match="not one of"):
        two.extended.run_on_replica(2, _rank_plus, (0,))


def _installed(service, key):
    return service.objects.get(MODEL, key)["rank"]


def test_installed_residents_are_found_on_every_replica(two):
    two.extended.install_resident(MODEL, "k1", {"rank": "installed"})
    assert two.extended.run_on_replicas(_installed, ("k1",)) == ["installed", "installed"]
    two.extended.install_resident(MODEL, "k1", {"rank": "replaced"})
    assert two.extended.run_on_replica(0, _installed, ("k1",)) == "replaced"
    with pytest.raises(ValueError, match="resident kind"):
        two.extended.install_resident("thing", "k1", {})


def test_keras_and_data_never_reach_past_the_contract():
    package = pathlib.Path(dd.__file__).parent
    offenders = []
    for sub in ("keras", "data"):
        for path in sorted((package / sub).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in ("group", "_group"):
                    offenders.append(f"{path.name}:{node.lineno}")
                module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
                reaches_past = module.startswith(
                    ("daskdist.cluster", "daskdist.group", "daskdist.strategy.extended.spmd", "daskdist.strategy.mirrored")
                )
                # allowed: the replica service protocol, and the scheduler's view of its workers asked now
                if reaches_past and module not in ("daskdist.group.service", "daskdist.cluster.identity"):
                    offenders.append(f"{path.name}:{node.lineno} imports {module}")
    assert offenders == []


def test_the_client_initialises_checkpoints_and_writes_summaries(two):
    # mirrored_strategy.py, MirroredExtended: experimental_between_graph False, experimental_should_init,
    # should_checkpoint and should_save_summary True (one program drives every replica)
    extended = two.extended
    assert (extended.experimental_between_graph, extended.experimental_should_init) == (False, True)
    assert (extended.should_checkpoint, extended.should_save_summary) == (True, True)
    assert extended.worker_devices == extended.parameter_devices == (
        "/job:localhost/replica:0/task:0/device:CPU:0",
        "/job:localhost/replica:0/task:0/device:CPU:1",
    )


# -- private names and the parameter-server service ------------------------------------------------

#: ``obj._name`` reached from a package that does not define ``_name``, and why it stays for now.
#: Each entry is (module, attribute): a new one needs a reason here, or a public name.
PRIVATE_ACCESS_ALLOWED = {
    # Dask offers no public hook for these
    ("dashboard/bokeh_apps.py", "_applications"): "adds the daskdist page to the scheduler's running Bokeh server",
    ("dashboard/event_log.py", "_topics"): "bounds the scheduler's event log of the step topic",
    ("data/replica.py", "_get_client"): "the worker's client, made on demand (worker.client would start one)",
    # the replica's strategy view reads its own variables' copies (replica and variables are one contract)
    ("replica/strategy_view.py", "_token"): "which strategy a variable belongs to",
    ("replica/strategy_view.py", "_value"): "the replica's copy of a variable",
    ("plugins/keras3/payload.py", "_flatten_layers"): "Keras 3's own walk of a model's layers (pinned keras==3.15.1)",
    ("plugins/keras3/resident.py", "_flatten_layers"): "Keras 3's own walk of a model's layers (pinned keras==3.15.1)",
    ("plugins/keras3/backend_jax.py", "_symbolic_build"): "Keras 3's own build of a model's metrics, loss and "
                                                            "optimizer before its JAX step is traced (as its fit "
                                                            "does; pinned keras==3.15.1)",
    ("plugins/torch/backend.py", "_plugins"): "torch.distributed's registry of backends (is 'daskdist' registered)",
    ("plugins/torch/model.py", "_remove_autograd_hooks"): "DDP's own removal of its reducer's hooks (re-wrap per "
                                                          "generation; torch 2.13 has no public one)",
    ("plugins/torch/model.py", "_version"): "a tensor's in-place version counter (whether a loop wrote weights outside "
                                             "optimizer.step() during an off-path commit copy; torch 2.13 has no "
                                             "public one)",
    ("plugins/torch/process_group.py", "_Work"): "torch.distributed's subclassable Work (torch 2.13 has no public one)",
}


def _package_of(path: pathlib.Path, root: pathlib.Path) -> str:
    """A module's package for the private-name rule: its top-level subpackage of daskdist, or the root."""
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else "<root>"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_access_across_packages(root: pathlib.Path) -> set[tuple[str, str]]:
    """``(module path, name)`` for every ``x._name`` under ``root`` whose name its package does not define.

    Defined: a function, method or class of that name, or an assignment to
    it (``self._name = ...``, a class attribute), in any module of the
    accessing module's package (its top-level subpackage, e.g.
    ``daskdist.ps``; the modules at the top level form one). Access on
    ``self`` and ``cls`` is the class's own.
    """
    trees = {path: ast.parse(path.read_text()) for path in sorted(root.rglob("*.py"))}
    defined: dict[str, set[str]] = {}
    for path, tree in trees.items():
        names = defined.setdefault(_package_of(path, root), set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    found = set()
    for path, tree in trees.items():
        names = defined[_package_of(path, root)]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr) or node.attr in names:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.add((path.relative_to(root).as_posix(), node.attr))
    return found


def test_no_private_name_is_reached_across_packages():
    """``x._name`` (one leading underscore) on anything but ``self``/``cls`` must be defined in the same package.

    Names of other packages and of third-party objects are reached through
    public, documented names; the few exceptions are listed with a reason.
    """
    found = private_access_across_packages(pathlib.Path(dd.__file__).parent)
    assert sorted(found - set(PRIVATE_ACCESS_ALLOWED)) == []  # new cross-package private access
    assert sorted(set(PRIVATE_ACCESS_ALLOWED) - found) == []  # an exception no longer needed: remove it


def test_the_rule_catches_a_private_name_of_another_package(tmp_path):
    """The scan above, on a small tree: another package's private attribute, method and function are caught.

    Not caught: ``self``/``cls`` access, a name the same package defines (in
    another module too), a dunder, and a module-level private in the root package.
    """
    (tmp_path / "ps").mkdir()
    (tmp_path / "strategy").mkdir()
    (tmp_path / "ps" / "store.py").write_text(
        "class Store:\n    def __init__(self):\n        self._entries = {}\n\n    def _flush(self):\n"
        "        pass\n\n\ndef _helper():\n    pass\n")
    (tmp_path / "ps" / "user.py").write_text("def count(store):\n    return len(store._entries), store._flush()\n")
    (tmp_path / "strategy" / "holder.py").write_text(
        "import ps.store as s\n\n\ndef count(store):\n    return len(store._entries), store.__dict__\n\n\n"
        "class H:\n    _z = 1\n\n    def f(self):\n        return self._y, H._z, store_of(self)._flush(), s._helper()\n")
    (tmp_path / "top.py").write_text("_cache = {}\n")
    (tmp_path / "strategy" / "cached.py").write_text("import top\n\n\ndef get():\n    return top._cache\n")
    assert private_access_across_packages(tmp_path) == {
        ("strategy/holder.py", "_entries"), ("strategy/holder.py", "_flush"), ("strategy/holder.py", "_helper"),
        ("strategy/cached.py", "_cache")}


def test_the_contract_keeping_strategy_to_ps_client_names_every_other_ps_module():
    """``pyproject.toml``'s contract forbids every module of daskdist.ps but ``client`` to daskdist.strategy.

    A new module of daskdist.ps is private to the service until it is added
    there (``lint-imports`` then checks strategy's imports).
    """
    import re

    root = pathlib.Path(dd.__file__).parent
    text = (root.parent / "pyproject.toml").read_text()
    block = text.split('name = "strategy reaches the parameter-server service only through daskdist.ps.client"')[1]
    block = block.split("[[tool.importlinter.contracts]]")[0]
    forbidden = re.search(r"forbidden_modules = \[(.*?)\]", block, re.S).group(1)
    named = set(re.findall(r'"(daskdist\.ps\.[a-z_]+)"', forbidden))
    modules = {f"daskdist.ps.{p.stem}" for p in (root / "ps").glob("*.py") if p.stem not in ("__init__", "client")}
    assert named == modules
    assert re.search(r'source_modules = \["daskdist.strategy"\]', block)


def _child_of(package: str, module: str) -> str | None:
    """The child of ``package`` that is or holds ``module``, or ``None`` when ``module`` is outside it."""
    if not module.startswith(package + "."):
        return None
    return f"{package}.{module[len(package) + 1:].split('.')[0]}"


def _circles(graph, package: str) -> set[frozenset[str]]:
    """The circles among ``package``'s children (a child package counts with all its modules).

    Each circle is the set of children that reach each other through imports
    between children of ``package`` (its strongly connected components of
    more than one child): what import-linter's ``acyclic_siblings`` forbids.
    """
    children = graph.find_children(package)
    imports: dict[str, set[str]] = {child: set() for child in children}
    for child in children:
        for module in {child} | graph.find_descendants(child):
            for imported in graph.find_modules_directly_imported_by(module):
                target = _child_of(package, imported)
                if target is not None and target != child:
                    imports[child].add(target)
    reach: dict[str, set[str]] = {}
    for child in children:
        seen, todo = set(), [child]
        while todo:
            for target in imports[todo.pop()] - seen:
                seen.add(target)
                todo.append(target)
        reach[child] = seen
    return {frozenset(other for other in children if other in reach[child] and child in reach[other]) | {child}
            for child in children if child in reach[child]}


def test_the_import_graph_has_no_circle():
    """No package of daskdist has a circle among its children; function-level and ``TYPE_CHECKING`` imports count.

    ``pyproject.toml``'s contract "no import circle in daskdist" (``lint-imports``,
    ``make check``) keeps it so. Its allowances are the circles the trainer
    (``daskdist/training/``) removes: packages whose children are not checked
    (``skip_descendants``) and imports that close a circle (``ignore_imports``).
    They may only shrink: this test fails on an allowance no longer needed.
    """
    import grimp
    from importlinter.api import read_configuration

    root = pathlib.Path(dd.__file__).parent
    contracts = read_configuration(str(root.parent / "pyproject.toml"))["contracts_options"]
    [contract] = [c for c in contracts if c["type"] == "acyclic_siblings"]
    assert contract["ancestors"] == ["daskdist"]
    skipped = set(contract.get("skip_descendants", []))
    ignored = [tuple(entry.split(" -> ")) for entry in contract.get("ignore_imports", [])]

    graph = grimp.build_graph("daskdist")  # every import statement: in functions and TYPE_CHECKING blocks too
    packages = sorted(m for m in graph.modules if graph.find_children(m))
    for package in sorted(skipped):
        assert _circles(graph, package), f"{package} has no circle any more: take it out of skip_descendants"
    for importer, imported in ignored:
        assert graph.direct_import_exists(importer=importer, imported=imported), (
            f"{importer} no longer imports {imported}: take it out of ignore_imports")
        common = max((p for p in packages if _child_of(p, importer) and _child_of(p, imported)), key=len)
        sides = {_child_of(common, importer), _child_of(common, imported)}
        assert any(sides <= circle for circle in _circles(graph, common)), (
            f"{importer} -> {imported} closes no circle any more: take it out of ignore_imports")
    for importer, imported in ignored:
        graph.remove_import(importer=importer, imported=imported)
    circles = {package: sorted(sorted(circle) for circle in found) for package in packages
               if not any(package == s or package.startswith(s + ".") for s in skipped)
               and (found := _circles(graph, package))}
    assert circles == {}


# -- strict typing ------------------------------------------------------------------------------------------------

#: mypy's --strict flags, as pyproject.toml sets them per module (``strict = true`` is global only).
STRICT_FLAGS = ("disallow_untyped_defs", "disallow_incomplete_defs", "disallow_untyped_calls", "disallow_any_generics",
                "disallow_untyped_decorators", "disallow_subclassing_any", "warn_return_any", "warn_unused_ignores",
                "no_implicit_reexport", "strict_equality", "extra_checks")


def test_every_module_is_type_checked_strictly():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = pathlib.Path(dd.__file__).parent
    overrides = tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]

    def matches(module: str, pattern: str) -> bool:
        return module == pattern or (pattern.endswith(".*") and (module + ".").startswith(pattern[:-1]))

    def patterns(override: dict) -> list[str]:
        module = override["module"]
        return [module] if isinstance(module, str) else list(module)

    modules = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    strict = [p for o in overrides if all(o.get(flag) is True for flag in STRICT_FLAGS) for p in patterns(o)]
    assert [m for m in modules if not any(matches(m, p) for p in strict)] == []
    # and no other override takes a module out again (a flag turned off, its errors ignored)
    loosened = {(p, key) for o in overrides for p in patterns(o) for key, value in o.items()
                if any(matches(m, p) for m in modules)
                and ((key in STRICT_FLAGS and value is not True) or (key == "ignore_errors" and value))}
    assert loosened == set()
