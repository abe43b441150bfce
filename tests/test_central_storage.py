"""CentralStorageStrategy on real Dask workers: one stored copy, TF's errors, Mirrored's losses."""

from __future__ import annotations

import numpy as np
import pytest

import daskdist as dd
from daskdist import keras
from daskdist.cluster.identity import scheduler_workers
from daskdist.ps.store import STORE_EXTENSION

Dataset = dd.data.Dataset
TWO = ["/cpu:0", "/cpu:1"]


@pytest.fixture
def central(threaded_client):
    with dd.experimental.CentralStorageStrategy(TWO, client=threaded_client) as strategy:
        yield strategy


def _store_versions(client, strategy):
    """``{var_id: version}`` of the strategy's store, read on the holder's worker."""
    store = strategy.extended.stores[0]
    return store.call_from_client(client, "versions")


def _holds_copy(service, var_id):
    """Whether this replica holds a copy of its own (a mirrored variable) rather than a view of the store."""
    from daskdist.group.service import VARIABLE
    from daskdist.ps.values import AggregatingVariable

    return not isinstance(service.objects.get(VARIABLE, var_id), AggregatingVariable)


# -- one copy, in the holder's store -----------------------------------------------------------


def test_a_variable_has_one_copy_on_the_parameter_device(central, threaded_client):
    with central.scope():
        v = dd.Variable(np.ones(3), aggregation="MEAN", name="v")
    assert len(central.experimental_local_results(v)) == 1
    assert v.device == "/device:CPU:0" and central.extended.parameter_devices == ("/device:CPU:0",)
    assert central.extended.run_on_replicas(_holds_copy, (v._var_id,)) == [False, False]
    holder = central.extended.worker_addresses[0]
    assert threaded_client.run(lambda dask_worker: STORE_EXTENSION in dask_worker.extensions,
                               workers=[holder])[holder]
    v.assign_add(np.ones(3))  # cross-replica: applied once
    assert v.numpy().tolist() == [2.0, 2.0, 2.0]
    assert _store_versions(threaded_client, central) == {v._var_id: 1}


def test_replica_updates_are_aggregated_and_applied_once(central, threaded_client):
    with central.scope():
        mean = dd.Variable(np.zeros(2), aggregation="MEAN")
        total = dd.Variable(np.zeros(2), aggregation="SUM")
        first = dd.Variable(np.zeros(2), aggregation=dd.VariableAggregation.ONLY_FIRST_REPLICA)

    def step():
        r = dd.get_replica_context().replica_id_in_sync_group
        mean.assign_add(np.full(2, r + 1.0))    # (1 + 2) / 2
        total.assign_add(np.full(2, r + 1.0))   # 1 + 2
        first.assign(np.full(2, 10.0 + r))      # replica 0's value
        return mean.read_value()

    out = central.run(step)
    assert [x.tolist() for x in out.values] == [[1.5, 1.5], [1.5, 1.5]]  # every replica reads the new value
    assert mean.numpy().tolist() == [1.5, 1.5]
    assert total.numpy().tolist() == [3.0, 3.0]
    assert first.numpy().tolist() == [10.0, 10.0]
    versions = _store_versions(threaded_client, central)
    assert versions == {mean._var_id: 1, total._var_id: 1, first._var_id: 1}  # one update each, not one per replica


def test_merge_call_updates_apply_once(central):
    with central.scope():
        v = dd.Variable(np.zeros(2))

    def merge_fn(strategy, value):
        reduced = strategy.extended.reduce_to(dd.ReduceOp.SUM, value, v)
        return strategy.extended.update(v, lambda var, x: var.assign_add(x), args=(reduced,))

    central.run(lambda: dd.get_replica_context().merge_call(merge_fn, args=(np.ones(2),)))
    assert v.numpy().tolist() == [2.0, 2.0]  # SUM of two replicas' ones, added once


def test_client_reads_see_updates_made_between_steps(central):
    with central.scope():
        v = dd.Variable(np.array([1.0]))
    assert central.run(lambda: v.value() * 1).values[1].tolist() == [1.0]
    v.assign(np.array([5.0]))
    assert central.run(lambda: v.value() * 1).values[1].tolist() == [5.0]  # the compute copy is refreshed
    out = central.extended.update(v, lambda c: c.assign(c.value() * 3).read_value())
    assert out.tolist() == [15.0]
    assert central.extended.read_var(v).tolist() == [15.0]


# -- TensorFlow's errors ------------------------------------------------------------------


def test_assign_in_replica_context_with_aggregation_none_raises(central):
    with central.scope():
        v = dd.Variable(np.zeros(2))
    with pytest.raises(ValueError, match="You must specify an aggregation method to update a AggregatingVariable"):
        central.run(lambda: v.assign(np.ones(2)))
    assert v.numpy().tolist() == [0.0, 0.0]  # nothing applied


def test_an_update_with_a_per_replica_value_raises(central):
    with central.scope():
        v = dd.Variable(np.zeros(2))
    per_replica = central.run(lambda: np.ones(2))
    with pytest.raises(ValueError, match="You cannot update variable with a PerReplica object"):
        central.extended.update(v, lambda c, x: c.assign(x), args=(per_replica,))
    with pytest.raises(ValueError, match="You cannot update variable with a PerReplica object"):
        v.assign(per_replica)
    with pytest.raises(ValueError, match="Mirrored object with multiple components"):
        v.assign(dd.Mirrored([np.ones(2), np.ones(2)]))
    v.assign(central.extended.reduce_to("SUM", per_replica, v))  # reduce first, as TF says
    assert v.numpy().tolist() == [2.0, 2.0]


def test_an_aggregation_outside_the_four_raises(central):
    with central.scope(), pytest.raises(ValueError, match="Invalid variable aggregation mode: MAX for variable: w"):
        dd.Variable(np.zeros(2), name="w", aggregation="MAX")


def test_parameter_device_must_be_a_cpu_or_a_worker(threaded_client):
    with pytest.raises(ValueError, match="host memory"):
        dd.experimental.CentralStorageStrategy(TWO, parameter_device="/gpu:0", client=threaded_client)
    with pytest.raises(ValueError, match="not a worker of this cluster"):
        dd.experimental.CentralStorageStrategy(TWO, parameter_device="tcp://10.255.255.1:1", client=threaded_client)


# -- where the parameters live ------------------------------------------------------------


def test_parameters_on_another_worker_over_process_workers(make_cluster):
    client = make_cluster(3, processes=True)
    workers = scheduler_workers(client)
    holder = max(workers, key=lambda a: workers[a]["name"])  # replicas go to the first workers by name
    strategy = dd.experimental.CentralStorageStrategy(
        TWO, parameter_device=holder, client=client)
    with strategy:
        assert holder not in strategy.extended.worker_addresses
        with strategy.scope():
            v = dd.Variable(np.zeros(4, np.float32), aggregation="SUM")
        for _ in range(3):
            strategy.run(lambda: v.assign_add(np.ones(4, np.float32)))
        assert v.device == holder
        assert v.numpy().tolist() == [6.0] * 4
        held = client.run(lambda dask_worker: STORE_EXTENSION in dask_worker.extensions)
        assert held[holder] and not any(held[w] for w in strategy.extended.worker_addresses)


# -- Keras fit and custom loops give Mirrored's numbers ------------------------------------


def _digits(n=256):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images[:n] / 16.0).astype(np.float32).reshape(n, -1)
    y = digits.target[:n].astype(np.int64)
    return x, y


def _mlp():
    model = keras.Sequential([keras.layers.Dense(32, activation="relu", input_shape=(64,)), keras.layers.Dense(10)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"])
    return model


def _fit_step_by_step(strategy, weights=None):
    x, y = _digits()
    with strategy.scope():
        model = _mlp()
    model.build((None, 64))
    if weights is not None:
        model.set_weights(weights)
    data = Dataset.from_tensor_slices((x, y)).batch(64)
    history = model.fit(data, epochs=6, steps_per_epoch=1, verbose=0)  # one step per epoch: a loss per step
    return model, history.history["loss"]


def test_fit_gives_mirrored_losses_step_by_step(threaded_client):
    with dd.MirroredStrategy(TWO, client=threaded_client) as mirrored:  # one set of initial weights for both
        with mirrored.scope():
            start = _mlp()
        start.build((None, 64))
        initial = start.get_weights()
    with dd.MirroredStrategy(TWO, client=threaded_client) as mirrored:
        m_model, m_losses = _fit_step_by_step(mirrored, initial)
        m_weights = m_model.get_weights()
        m_eval = m_model.evaluate(Dataset.from_tensor_slices(_digits()).batch(128), verbose=0)
    with dd.experimental.CentralStorageStrategy(TWO, client=threaded_client) as central:
        c_model, c_losses = _fit_step_by_step(central, initial)
        c_weights = c_model.get_weights()
        c_eval = c_model.evaluate(Dataset.from_tensor_slices(_digits()).batch(128), verbose=0)
        from daskdist.training.commands import model_weights

        first, second = central.extended.run_on_replicas(model_weights, (c_model._model_id,))
        for a, b in zip(first, second):
            np.testing.assert_array_equal(a, b)  # every replica computes with the stored values
        # one optimizer state, at the store: the replicas' optimizers never ran
        assert central.extended.run_on_replicas(_optimizer_slots, (c_model._model_id,)) == [0, 0]
        state = c_model._optimizer_state()
        assert int(state["iterations"]) == 6
    assert c_losses[-1] < c_losses[0]
    np.testing.assert_allclose(c_losses, m_losses, rtol=1e-5)
    for a, b in zip(c_weights, m_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c_eval, m_eval, rtol=1e-5)


def _optimizer_slots(service, model_id):
    from daskdist.keras.runner import _replica_model

    return sum(len(s) for s in _replica_model(service, model_id).optimizer._slots.values())


def _custom_loop(strategy, steps=5):
    x, y = _digits(128)
    target = (y % 2).astype(np.float32)[:, None]
    with strategy.scope():
        w = dd.Variable(np.zeros((64, 1), np.float32), aggregation="MEAN")
    shards = dd.PerReplica([(x[:64], target[:64]), (x[64:], target[64:])])
    losses = []

    def step(batch):
        xb, yb = batch
        error = xb @ w.value() - yb
        w.assign_sub(0.1 * (xb.T @ error) / len(xb))  # MEAN over the replicas: the global-batch gradient
        return float((error ** 2).mean())

    for _ in range(steps):
        losses.append(float(strategy.reduce("MEAN", strategy.run(step, args=(shards,)), axis=None)))
    return losses, w.numpy()


def test_custom_loop_gives_mirrored_losses_step_by_step(threaded_client):
    with dd.MirroredStrategy(TWO, client=threaded_client) as mirrored:
        m_losses, m_w = _custom_loop(mirrored)
    with dd.experimental.CentralStorageStrategy(TWO, client=threaded_client) as central:
        c_losses, c_w = _custom_loop(central)
    assert c_losses[-1] < c_losses[0]
    np.testing.assert_allclose(c_losses, m_losses, rtol=1e-6)
    np.testing.assert_allclose(c_w, m_w, rtol=1e-6)


def test_a_step_that_fails_on_one_replica_leaves_no_half_round_behind(central):
    with central.scope():
        v = dd.Variable(np.zeros(2), aggregation="MEAN")

    def step(fail):
        if fail and dd.get_replica_context().replica_id_in_sync_group == 1:
            raise KeyError("replica 1 fails before it updates")
        v.assign_add(np.ones(2))  # replica 0 has contributed and waits at the store

    with pytest.raises(KeyError, match="replica 1 fails"):
        central.run(step, args=(True,))
    assert v.numpy().tolist() == [0.0, 0.0]  # the half round was never applied
    central.run(step, args=(False,))  # the next command's rounds meet
    assert v.numpy().tolist() == [1.0, 1.0]
