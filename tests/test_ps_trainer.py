"""The trainer's parameter-server features on both adapters: moving statistics held on the stores (built-in
BatchNormalization), and ``predict`` run on the workers.

One worker (2 ps, 1 worker) makes the closures run in order, so the built-in model trained under
ParameterServerStrategy equals one process on the same batches; ``predict``'s work is counted on the
workers' own copies (``PsWorker.predicted``, read on each Dask worker).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import daskdist as dd
from daskdist import keras as builtin
from daskdist.group.service import MODEL

pytestmark = pytest.mark.timeout(300)


def _predicted_on_workers(client, model_id: str) -> int:
    """The batches the workers' copies of ``model_id`` predicted, over every Dask worker."""

    def predicted(model_id, dask_worker=None):
        extension = dask_worker.extensions.get("daskdist")
        runtimes = list(extension.replicas.values()) if extension is not None else []
        found = [runtime.objects.find(MODEL, model_id) for runtime in runtimes]
        return sum(getattr(copy, "predicted", 0) for copy in found if copy is not None)

    return sum(client.run(predicted, model_id).values())


def _bn_model():
    model = builtin.Sequential([builtin.layers.Dense(16, input_shape=(8,)), builtin.layers.BatchNormalization(),
                                builtin.layers.ReLU(), builtin.layers.Dense(4)])
    model.compile(optimizer=builtin.optimizers.SGD(0.1),
                  loss=builtin.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  steps_per_execution=2)
    return model


def _data(rows=192, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(rows, 8)) * 3 + 1).astype(np.float32)
    y = rng.integers(0, 4, size=rows).astype(np.int64)
    return x, y


def test_builtin_batchnorm_under_ps_ends_with_the_moving_statistics_of_one_process(threaded_client):
    x, y = _data()  # 6 batches of 32 per epoch, in order

    def dataset_fn(ctx):
        return dd.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()

    resolver = dd.cluster_resolver.DaskClusterResolver(threaded_client, num_ps=2)  # 2 ps, 1 worker
    with dd.ParameterServerStrategy(resolver) as strategy:
        with strategy.scope():
            model = _bn_model()
        reference = _bn_model()  # one process, no strategy
        reference.build((8,))
        model.build((8,))
        reference.set_weights(model.get_weights())
        model.fit(dd.experimental.DatasetCreator(dataset_fn), epochs=2, steps_per_epoch=6, verbose=0)
        reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

        bn = reference.layers[1]
        mean, variance = bn.state["moving_mean"], bn.state["moving_variance"]
        assert not np.allclose(mean, 0.0) and not np.allclose(variance, 1.0)  # the statistics moved
        names = [name for name, _ in model._weight_items()]
        got = dict(zip(names, model.get_weights()))
        np.testing.assert_allclose(got["1/moving_mean"], mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["1/moving_variance"], variance, rtol=1e-5, atol=1e-6)
        for name, expected in zip(names, reference.get_weights()):
            np.testing.assert_allclose(got[name], expected, rtol=1e-4, atol=1e-5, err_msg=name)

        # evaluation on the workers uses the stored statistics: the one-process model's logs
        x_test, y_test = _data(rows=100, seed=1)
        logs = model.evaluate(x_test, y_test, batch_size=32, return_dict=True, verbose=0)
        expected = reference.evaluate(x_test, y_test, batch_size=32, return_dict=True, verbose=0)
        np.testing.assert_allclose([logs["loss"], logs["accuracy"]], [expected["loss"], expected["accuracy"]],
                                   rtol=1e-5)

        # weights set on the client (the moving statistics among them) are what the workers evaluate with next
        changed = [w * 0.5 + 0.25 for w in reference.get_weights()]
        reference.set_weights(changed)
        model.set_weights(changed)
        logs = model.evaluate(x_test, y_test, batch_size=32, return_dict=True, verbose=0)
        expected = reference.evaluate(x_test, y_test, batch_size=32, return_dict=True, verbose=0)
        np.testing.assert_allclose(logs["loss"], expected["loss"], rtol=1e-5)


def test_builtin_predict_under_ps_runs_on_the_workers_and_equals_the_clients_model(threaded_client):
    x, y = _data()
    resolver = dd.cluster_resolver.DaskClusterResolver(threaded_client, num_ps=1)  # 1 ps, 2 workers
    with dd.ParameterServerStrategy(resolver) as strategy:
        with strategy.scope():
            model = _bn_model()

        def dataset_fn(ctx):
            return (dd.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
                    .batch(16).repeat())

        model.fit(dd.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=8, verbose=0)
        x_new, _ = _data(rows=70, seed=2)
        before = _predicted_on_workers(threaded_client, model.model_id)
        predictions = model.predict(x_new, batch_size=16)
        assert _predicted_on_workers(threaded_client, model.model_id) - before == 5  # 70 rows: 5 batches of 16

        plain = _bn_model()  # the client's model, in this process
        plain.build((8,))
        plain.set_weights(model.get_weights())
        assert predictions.shape == (70, 4)
        np.testing.assert_allclose(predictions, plain.predict(x_new, batch_size=16), rtol=1e-5, atol=1e-6)


def test_keras3_predict_under_ps_runs_on_the_workers_and_equals_the_clients_model(forked_process_client):
    os.environ.setdefault("KERAS_BACKEND", "torch")
    pytest.importorskip("torch")
    keras = pytest.importorskip("keras")
    from tests.keras3_models import compile_model, dense_data, sequential

    x, y = dense_data(rows=128, seed=3)

    def dataset_fn(ctx):
        return (dd.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
                .batch(16).repeat())

    resolver = dd.cluster_resolver.DaskClusterResolver(forked_process_client, num_ps=1)  # 1 ps, 2 workers
    with dd.ParameterServerStrategy(resolver) as strategy:
        with strategy.scope():
            model = compile_model(sequential(), keras.optimizers.SGD(0.05))
        model.fit(dd.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=6, verbose=0)
        record_id = _keras3_model_id(model)
        x_new, _ = dense_data(rows=50, seed=4)
        before = _predicted_on_workers(forked_process_client, record_id)
        predictions = model.predict(x_new, batch_size=16, verbose=0)
        assert _predicted_on_workers(forked_process_client, record_id) - before == 4  # 50 rows: 4 batches of 16

        expected = keras.ops.convert_to_numpy(model(x_new, training=False))  # the client's copy, Keras' own call
        assert predictions.shape == expected.shape
        np.testing.assert_allclose(predictions, expected, rtol=1e-5, atol=1e-6)


def _keras3_model_id(model) -> str:
    from daskdist.plugins.keras3 import registry

    record = registry.lookup(model)
    assert record is not None
    return record.object_id
