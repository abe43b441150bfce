"""What a new user tries with real Keras 3 models (torch backend), each compared with plain Keras 3.

Mixed precision, ``BackupAndRestore``, custom-loop metrics, structured
inputs, ``predict`` with ``steps_per_execution``, ``use_ema``,
``validation_freq``, a train step mixing ``keras.ops`` and ``torch``, a
model that cannot be installed, per-batch callbacks under parameter servers,
and elastic growth after a kill and a scale-back. The replicas are worker
processes (``forked_process_client``; ``process_workers`` where a worker is
killed), one replica each, as users run them.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported, here and in the workers
pytest.importorskip("torch")
pytest.importorskip("keras")

import dask.array as da  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import daskdist as dd  # noqa: E402
from tests.keras3_models import (  # noqa: E402
    assert_replicas_identical,
    compile_model,
    dense_data,
    sequential,
    twin,
)

pytestmark = pytest.mark.timeout(600)

RTOL = 1e-5
ATOL = 1e-6


def _assert_same_weights(a, b, rtol=RTOL, atol=ATOL):
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def _mirrored(client):
    return dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=client)


@pytest.fixture(scope="module")
def strategy(forked_process_client):
    with _mirrored(forked_process_client) as mirrored:
        yield mirrored


def test_mixed_float16_fit_exchanges_the_scaled_gradients_and_takes_the_loss_scale_optimizer_state(strategy):
    x, y = dense_data(rows=64)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            model = compile_model(sequential(), keras.optimizers.Adam(1e-2))
        plain = twin(model, sequential, keras.optimizers.Adam(1e-2))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert type(model.optimizer).__name__ == "LossScaleOptimizer"
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    expected = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    _assert_same_weights(model, plain, rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-2)
    assert_replicas_identical(strategy, model)
    for mine, theirs in zip(model.optimizer.variables, plain.optimizer.variables):  # the loss scale, its counter
        np.testing.assert_allclose(np.asarray(mine.numpy(), dtype=np.float64),
                                   np.asarray(theirs.numpy(), dtype=np.float64), rtol=1e-2, atol=1e-3)


def _two_inputs(kind):
    a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
    joined = keras.layers.Concatenate()([keras.layers.Dense(8, activation="relu")(a), b])
    outputs = keras.layers.Dense(4)(joined)
    if kind == "dict":
        return keras.Model({"a": a, "b": b}, outputs)
    return keras.Model([a, b], outputs)


@pytest.mark.parametrize("form", ["dict", "list", "dask dict"])
def test_fit_takes_inputs_as_dicts_lists_and_dask_arrays_as_keras_does(strategy, form):
    x, y = dense_data(rows=48)
    kind = "dict" if "dict" in form else "list"
    inputs = {"a": x[:, :4], "b": x[:, 4:]} if kind == "dict" else [x[:, :4], x[:, 4:]]
    given = {k: da.from_array(v, chunks=16) for k, v in inputs.items()} if form == "dask dict" else inputs
    with strategy.scope():
        model = compile_model(_two_inputs(kind))
    plain = twin(model, lambda: _two_inputs(kind))
    history = model.fit(given, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    if form == "dask dict":  # partitions read where they live: not numpy's batches, but every row once
        assert history.history["loss"][-1] < history.history["loss"][0]
        assert_replicas_identical(strategy, model)
        plain.set_weights(model.get_weights())
    else:
        expected = plain.fit(inputs, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=RTOL)
        _assert_same_weights(model, plain)
    assert model.evaluate(given, y, batch_size=16, verbose=0) == pytest.approx(
        plain.evaluate(inputs, y, batch_size=16, verbose=0), rel=RTOL)


def test_predict_with_steps_per_execution_as_fit_and_evaluate_take_it(strategy):
    x, y = dense_data(rows=40)
    with strategy.scope():
        model = sequential()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=2)
    plain = sequential()
    plain.set_weights(model.get_weights())
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    y_onehot = np.eye(4, dtype=np.float32)[y]
    model.fit(x, y_onehot, batch_size=8, epochs=1, shuffle=False, verbose=0)
    plain.fit(x, y_onehot, batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0), plain.predict(x, batch_size=8, verbose=0),
                               rtol=RTOL, atol=ATOL)
    assert model.steps_per_execution == 2


def test_adam_with_ema_ends_fit_with_the_moving_averages_as_keras_does(strategy):
    x, y = dense_data(rows=32)
    with strategy.scope():
        model = compile_model(sequential(), keras.optimizers.Adam(1e-2, use_ema=True))
    plain = twin(model, sequential, keras.optimizers.Adam(1e-2, use_ema=True))
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    _assert_same_weights(model, plain)
    # the next fit starts from the averages on the replicas too
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(model, plain)



def test_validation_freq_as_keras(strategy):  # validation_split, class_weight: tests/test_fit_sample_weights.py
    x, y = dense_data(rows=32)
    with strategy.scope():
        model = compile_model(sequential())
    plain = twin(model, sequential)
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, validation_data=(x, y),
                        validation_freq=2)
    expected = plain.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, validation_data=(x, y),
                         validation_freq=2)
    assert len(history.history["val_loss"]) == len(expected.history["val_loss"]) == 1
    np.testing.assert_allclose(history.history["val_loss"], expected.history["val_loss"], rtol=RTOL)

GLOBAL_BATCH = 16


def _loss(labels, logits):  # TF's compute_average_loss over the global batch
    per_row = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    return keras.ops.sum(per_row) / GLOBAL_BATCH


def _custom_loop_objects():
    model = sequential()
    optimizer = keras.optimizers.SGD(0.1)
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    mean_loss = keras.metrics.Mean()
    return model, optimizer, accuracy, mean_loss


def _tutorial_step(model, optimizer, accuracy, mean_loss):
    """The TF custom-training tutorial's step, metrics updated in it; ``keras.ops`` and ``torch`` in one function."""
    import torch

    def train_step(inputs):
        features, labels = inputs
        logits = model(features, training=True)
        loss = keras.ops.sum(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        loss = loss / GLOBAL_BATCH
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            optimizer.apply([v.value.grad for v in model.trainable_variables], model.trainable_variables)
        accuracy.update_state(labels, logits)
        mean_loss.update_state(loss * GLOBAL_BATCH / keras.ops.shape(labels)[0], sample_weight=len(labels))
        return float(loss)

    return train_step


def test_custom_loop_metrics_updated_in_strategy_run_are_summed_over_the_replicas_on_the_client(strategy):
    x, y = dense_data(rows=48)
    with strategy.scope():
        model, optimizer, accuracy, mean_loss = _custom_loop_objects()
    plain, plain_optimizer, plain_accuracy, plain_mean = _custom_loop_objects()
    plain.set_weights(model.get_weights())
    step = _tutorial_step(model, optimizer, accuracy, mean_loss)  # keras.ops and torch: shipped by reference
    plain_step = _tutorial_step(plain, plain_optimizer, plain_accuracy, plain_mean)
    dist = strategy.experimental_distribute_dataset(dd.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
    for _epoch in range(2):
        for batch in dist:
            strategy.run(step, args=(batch,))
        for k in range(0, len(x), GLOBAL_BATCH):
            plain_step((x[k:k + GLOBAL_BATCH], y[k:k + GLOBAL_BATCH]))
        assert float(accuracy.result()) > 0
        np.testing.assert_allclose(float(accuracy.result()), float(plain_accuracy.result()), rtol=RTOL)
        np.testing.assert_allclose(float(mean_loss.result()), float(plain_mean.result()), rtol=RTOL)
        for metric in (accuracy, mean_loss, plain_accuracy, plain_mean):  # TF's tutorial resets them each epoch
            metric.reset_state()
    assert float(accuracy.result()) == 0.0
    _assert_same_weights(model, plain)


def test_a_function_using_an_unpicklable_global_names_it(strategy):
    import threading

    lock = threading.Lock()

    def step():
        with lock:
            return 1

    with pytest.raises(TypeError, match=r"function .*step.* uses 'lock' .*cannot be pickled.*Import it inside"):
        strategy.run(step)


@keras.saving.register_keras_serializable(package="daskdist_tests")
class UnloadableDense(keras.layers.Dense):
    """A layer whose ``get_config`` leaves out an argument of its ``__init__``: saved, it cannot be loaded."""

    def __init__(self, units, extra, **kwargs):
        super().__init__(units, **kwargs)
        self.extra = extra


def test_a_model_that_cannot_be_installed_fails_only_the_calls_that_use_it(strategy):
    with strategy.scope():
        broken = keras.Sequential([keras.Input((8,)), UnloadableDense(4, extra=3)])
        working = sequential()
    rows = np.ones((2, 8), np.float32)
    with pytest.raises(RuntimeError, match="could not be installed on the replicas"):
        strategy.run(lambda: broken(rows))
    assert set(strategy.experimental_local_results(strategy.run(lambda: 1))) == {1}
    outputs = strategy.experimental_local_results(strategy.run(lambda: np.asarray(working(rows).detach())))
    np.testing.assert_allclose(outputs[0], np.asarray(working(rows).detach()), rtol=RTOL, atol=ATOL)
    with pytest.raises(RuntimeError, match="could not be installed on the replicas"):  # still that call alone
        strategy.run(lambda: broken(rows))



class _BatchCounter(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        pass


@pytest.mark.parametrize("form", ["subclass", "lambda", "lambda on_batch_end"])
def test_parameter_servers_refuse_every_form_of_per_batch_callback_before_training(threaded_client, form):
    from daskdist.cluster.identity import scheduler_workers

    calls = []
    callback = {"subclass": lambda: _BatchCounter(),
                "lambda": lambda: keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: calls.append(b)),
                "lambda on_batch_end": lambda: keras.callbacks.LambdaCallback(
                    on_batch_end=lambda b, logs: calls.append(b))}[form]()
    workers = sorted(scheduler_workers(threaded_client))
    resolver = dd.cluster_resolver.SimpleClusterResolver(
        dd.cluster_resolver.ClusterSpec({"ps": workers[:1], "worker": workers[1:]}))
    with dd.ParameterServerStrategy(resolver, client=threaded_client) as ps:
        with ps.scope():
            model = compile_model(sequential())
        before = model.get_weights()
        epochs = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: calls.append(epoch))  # allowed
        with pytest.raises(ValueError, match=r"Batch-level `Callback`s are not supported with "
                                             r"`ParameterServerStrategy`. Found: \['(_BatchCounter|LambdaCallback)'\]"):
            model.fit(lambda ctx: dd.data.Dataset.range(8).batch(2).repeat(), steps_per_epoch=2, verbose=0,
                      callbacks=[epochs, callback])
        assert calls == []
        for a, b in zip(before, model.get_weights()):
            np.testing.assert_array_equal(a, b)

@pytest.mark.slow
def test_a_worker_added_after_a_loss_joins_the_next_fit_with_the_model_installed_before_any_restore(
        process_workers):
    """A fit loses a worker (kill -9 with its nanny) and finishes on 2; the cluster is scaled back to 3 (a new
    worker process); the next ``fit`` of the same model with ``initial_epoch`` admits the newcomer at its start:
    it gets the model, then the commit, and trains as one process."""
    from daskdist.cluster.identity import scheduler_workers
    from daskdist.plugins.keras3.backend import prepare_replica
    from tests.support.killers import kill_at_step
    from tests.support.models import slow_batch

    workers = process_workers(3)
    workers.client.run(prepare_replica, "torch")
    x, y = dense_data(rows=240)
    train = dd.data.Dataset.from_tensor_slices((x, y)).batch(24).map(slow_batch)  # 10 steps per epoch
    options = dd.ElasticOptions(min_replicas=2, commit_every=2, cooldown=0)
    with dd.MirroredStrategy(client=workers.client, elastic=options) as elastic:
        with elastic.scope():
            model = compile_model(sequential(), keras.optimizers.Adam(1e-2))
            other = compile_model(sequential())  # another model of the scope, on the replicas too
        plain = twin(model, sequential, keras.optimizers.Adam(1e-2))
        other.evaluate(x[:24], y[:24], verbose=0)
        model.evaluate(x[:24], y[:24], verbose=0)  # installed before the kill watcher's clock starts
        victim = elastic.extended.worker_addresses[1]
        name = scheduler_workers(workers.client)[victim]["name"]
        thread, record = kill_at_step(workers, victim, step=5)
        model.fit(train, epochs=1, verbose=0)
        thread.join(5)
        assert "killed" in record, "the worker was never killed"
        assert elastic.num_replicas_in_sync == 2
        workers.add(name)  # the cluster scaled back to 3: the new worker has the lost one's name, as scale names it
        workers.client.wait_for_workers(3, timeout=120)
        workers.client.run(prepare_replica, "torch")
        history = model.fit(train, epochs=2, initial_epoch=1, verbose=0)
        plain.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0)
        expected = plain.fit(x, y, batch_size=24, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
        assert elastic.num_replicas_in_sync == 3
        assert [len(event.admitted) for event in history.elastic.events] == [1]
        assert history.history["loss"] == pytest.approx(expected.history["loss"], rel=RTOL)
        _assert_same_weights(model, plain)
        assert_replicas_identical(elastic, model)
        assert other.evaluate(x, y, verbose=0) == pytest.approx(  # the other model reaches the newcomer when used
            twin(other, sequential).evaluate(x, y, verbose=0), rel=RTOL)


@pytest.mark.slow
def test_a_parameter_server_lost_during_keras_fit_raises_parameter_server_lost_error_at_once(process_workers):
    """The ps worker and its nanny killed (kill -9) mid-epoch, while the workers' closures push to it."""
    import threading
    import time

    from daskdist.plugins.keras3.backend import prepare_replica
    from tests.support.models import slow_batch

    workers = process_workers(3)
    workers.client.run(prepare_replica, "torch")
    x, y = dense_data(rows=64)

    def dataset_fn(ctx):
        return (dd.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
                .batch(8).map(slow_batch).repeat())

    resolver = dd.cluster_resolver.DaskClusterResolver(workers.client, num_ps=1)  # 1 ps, 2 workers
    with dd.ParameterServerStrategy(resolver) as ps:
        with ps.scope():
            model = compile_model(sequential())
        (ps_address,) = ps.extended.ps_addresses
        killed = []

        def kill_soon():
            time.sleep(1.0)  # a few slow steps into epoch 1
            workers.kill(ps_address)
            killed.append(time.monotonic())

        def at_epoch(epoch, logs):
            if epoch == 1:
                threading.Thread(target=kill_soon, daemon=True).start()

        with pytest.raises(dd.ParameterServerLostError):
            model.fit(dd.experimental.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=20, verbose=0,
                      callbacks=[keras.callbacks.LambdaCallback(on_epoch_begin=at_epoch)])
        assert killed, "the parameter server was never killed"
        assert time.monotonic() - killed[0] < 4  # the coordinator's promise: within about a second
