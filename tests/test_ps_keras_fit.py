"""Keras fit and evaluate under ParameterServerStrategy, on real Dask workers (threads of this process)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import daskdist as dd
from daskdist import keras

ClusterCoordinator = dd.experimental.coordinator.ClusterCoordinator


@pytest.fixture(scope="module")
def four_workers():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=4, threads_per_worker=1, processes=False, dashboard_address=":0",
                      silence_logs=logging.ERROR) as cluster, Client(cluster, set_as_default=False) as client:
        yield client


def _digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    return (x[:split], y[:split]), (x[split:], y[split:])


def _model(steps_per_execution=1):
    model = keras.Sequential([keras.layers.Dense(32, activation="relu", input_shape=(64,)), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  steps_per_execution=steps_per_execution)
    return model


class EpochRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((epoch, dict(logs)))


@pytest.mark.timeout(240)
def test_fit_under_ps_trains_digits_to_92_percent_with_the_parameters_and_optimizer_on_the_ps(four_workers):
    (x_train, y_train), (x_test, y_test) = _digits()
    resolver = dd.cluster_resolver.DaskClusterResolver(four_workers, num_ps=2)  # 2 ps, 2 workers
    with dd.ParameterServerStrategy(resolver) as strategy:
        assert len(strategy.extended.ps_addresses) == 2 and len(strategy.extended.worker_addresses) == 2
        with strategy.scope():
            model = _model(steps_per_execution=5)

        def dataset_fn(ctx):
            return (dd.data.Dataset.from_tensor_slices((x_train, y_train))
                    .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
                    .shuffle(1000, seed=ctx.input_pipeline_id).batch(32).repeat())

        recorder = EpochRecorder()
        history = model.fit(dd.experimental.DatasetCreator(dataset_fn), epochs=10, steps_per_epoch=50, verbose=0,
                            callbacks=[recorder])
        assert history.epoch == list(range(10)) and len(history.history["loss"]) == 10
        assert history.history["loss"][-1] < history.history["loss"][0] / 2
        assert [e for e, _ in recorder.epochs] == list(range(10)) and "accuracy" in recorder.epochs[-1][1]
        assert ClusterCoordinator(strategy) is strategy._coordinator  # fit made the strategy's coordinator

        # the parameters and Adam's slots live on the ps: two trainable arrays per store, pushed once per step
        stores = strategy.extended.stores
        states = [s.call_from_client(four_workers, "params_state", key=model._ps_key) for s in stores]
        assert [len(st["params"]) for st in states] == [2, 2]  # kernel/bias of 2 layers, round-robin
        assert [int(st["rule_state"]["iterations"]) for st in states] == [500, 500]  # 10 x 50 steps, once each
        assert {"m/0", "v/0", "m/1", "v/1"} <= set(states[0]["rule_state"])
        weights = model.get_weights()
        # the model's parameter order is (bias, kernel) per layer: store 0 holds both biases, store 1 both kernels
        np.testing.assert_array_equal(weights[1], states[0]["params"][0])
        np.testing.assert_array_equal(weights[2], states[1]["params"][1])

        logs = model.evaluate(x_test, y_test, return_dict=True, verbose=0)  # exact shards of the test set
        assert logs["accuracy"] >= 0.92, logs  # asynchronous updates: 0.944-0.97 seen
        logits = np.maximum(x_test @ weights[0] + weights[1], 0) @ weights[2] + weights[3]
        assert abs(float((logits.argmax(axis=1) == y_test).mean()) - logs["accuracy"]) < 1e-9  # every row once
        import dask.array as da  # the same test set as Dask collections: shards of whole partitions, each once

        test_dask = four_workers.persist([da.from_array(x_test, chunks=(50, 64)), da.from_array(y_test, chunks=50)])
        dask_logs = model.evaluate(dd.data.Dataset.from_dask(tuple(test_dask)).batch(16), return_dict=True,
                                   verbose=0)
        assert dask_logs["accuracy"] == pytest.approx(logs["accuracy"]) and dask_logs["loss"] == pytest.approx(
            logs["loss"], rel=1e-5)
        # predict runs on the workers with the stored parameters (tests/test_ps_trainer.py counts where)
        np.testing.assert_allclose(model.predict(x_test), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(120)
def test_fit_under_ps_follows_tensorflows_rules(four_workers):
    (x_train, y_train), _ = _digits()
    resolver = dd.cluster_resolver.DaskClusterResolver(four_workers, num_ps=1)
    with dd.ParameterServerStrategy(resolver) as strategy:
        with strategy.scope():
            model = _model()
        with pytest.raises(ValueError, match="`steps_per_epoch` must be specified with `ParameterServerStrategy`"):
            model.fit(x_train, y_train, epochs=1, verbose=0)

        class PerBatch(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                pass

        with pytest.raises(ValueError, match="Batch-level `Callback`s are not supported"):
            model.fit(x_train, y_train, epochs=1, steps_per_epoch=2, callbacks=[PerBatch()], verbose=0)
        with pytest.raises(TypeError, match="must be a `callable`"):
            dd.experimental.DatasetCreator(42)
        with pytest.raises(ValueError, match="`steps` must be specified"):
            model.evaluate(dd.experimental.DatasetCreator(lambda ctx: dd.data.Dataset.range(4).batch(2)), verbose=0)

        # arrays are repeated per worker; a dataset_fn works as a DatasetCreator; validation per epoch
        history = model.fit(x_train, y_train, batch_size=64, epochs=2, steps_per_epoch=6, verbose=0,
                            validation_data=(x_train[:200], y_train[:200]))
        assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
        state = strategy.extended.stores[0].call_from_client(four_workers, "params_state", key=model._ps_key)
        assert int(state["rule_state"]["iterations"]) == 12

        # a DatasetCreator over Dask collections: each worker reads the partitions its Dask worker holds
        import dask.array as da

        workers = list(strategy.extended.worker_addresses)
        x_dask, y_dask = four_workers.persist([da.from_array(x_train, chunks=(180, 64)),
                                               da.from_array(y_train, chunks=180)], workers=workers[:1])
        coordinator = ClusterCoordinator(strategy)
        before = len(coordinator.data_ledger.entries)
        model.fit(dd.experimental.DatasetCreator(
            lambda ctx: dd.data.Dataset.from_dask((x_dask, y_dask)).shard(ctx.num_input_pipelines,
                                                                          ctx.input_pipeline_id).batch(32).repeat()),
            epochs=1, steps_per_epoch=12, verbose=0)
        entries = coordinator.data_ledger.entries[before:]
        assert entries and {e.rows for e in entries} <= {180, 1437 - 7 * 180}
        first_pass = [e.partition for e in entries if e.pass_index == 0]
        assert len(first_pass) == len(set(first_pass))  # no partition read twice in a pass

        def with_errors(ctx):
            def fail(x, y):
                raise RuntimeError("bad batch in the input pipeline")
            return dd.data.Dataset.from_tensor_slices((x_train, y_train)).batch(8).map(fail).repeat()

        with pytest.raises(RuntimeError, match="bad batch in the input pipeline"):
            model.fit(with_errors, epochs=1, steps_per_epoch=4, verbose=0)


@pytest.mark.timeout(120)
def test_weights_and_optimizer_state_round_trip_through_the_ps(four_workers, tmp_path):
    (x_train, y_train), _ = _digits()
    with dd.ParameterServerStrategy(dd.cluster_resolver.DaskClusterResolver(four_workers, num_ps=2)) as strategy:
        with strategy.scope():
            model = _model()
        model.fit(x_train, y_train, epochs=1, steps_per_epoch=5, verbose=0)
        path = str(tmp_path / "ckpt")
        model.save_weights(path)
        before = model.get_weights()
        model.set_weights([np.zeros_like(w) for w in before])
        assert all(not w.any() for w in model.get_weights())  # read back from the ps
        model.load_weights(path)
        for a, b in zip(model.get_weights(), before):
            np.testing.assert_array_equal(a, b)
        state = model._optimizer_state()
        assert int(state["iterations"]) == 5 and {"m/0", "m/1", "m/2", "m/3"} <= set(state)
        # compiled again: a new optimizer on the ps, training goes on from the weights so far
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        model.fit(x_train, y_train, epochs=1, steps_per_epoch=3, verbose=0)
        after = model._optimizer_state()
        assert int(after["iterations"]) == 3 and not any(k.startswith("m/") for k in after)  # SGD: no Adam slots
        assert not np.allclose(model.get_weights()[0], 0.0)  # went on from the loaded weights, not zeros
