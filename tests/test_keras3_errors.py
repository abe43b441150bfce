"""Bad input for Keras 3 models under daskdist: a clear error, on every replica, nothing hangs."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")
torch = pytest.importorskip("torch")
pytest.importorskip("keras")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import daskdist as dd  # noqa: E402
from daskdist.cluster.identity import scheduler_workers  # noqa: E402
from daskdist.plugins import keras3  # noqa: E402
from tests.keras3_models import NoisyRestore, compile_model, dense_data, sequential, twin  # noqa: E402

pytestmark = pytest.mark.timeout(600)
TWO = ["/cpu:0", "/cpu:1"]


def test_neither_a_keras3_nor_a_builtin_model_is_refused():
    for obj in (torch.nn.Linear(2, 2), "model", None):
        with pytest.raises(TypeError, match="neither a Keras 3 model .* nor a daskdist.keras model"):
            keras3.check_model(obj)
    keras3.check_model(sequential())
    keras3.check_model(dd.keras.Sequential([dd.keras.layers.Dense(2)]))


def test_unsupported_backends_are_refused_naming_the_one_that_works():
    with pytest.raises(keras3.UnsupportedBackendError, match="bound to TensorFlow's own .*KERAS_BACKEND=torch"):
        keras3.check_backend("tensorflow")
    keras3.check_backend("torch")
    with pytest.raises(keras3.UnsupportedBackendError, match="the 'numpy' backend cannot compute gradients"):
        keras3.check_backend("numpy")


def test_model_created_outside_the_scope_is_refused_inside_it(forked_process_client):
    x, y = dense_data(rows=32)
    model = sequential()
    with dd.MirroredStrategy(devices=TWO, client=forked_process_client) as strategy:
        with strategy.scope(), pytest.raises(keras3.OutsideScopeError, match="created outside it"):
            compile_model(model)
        compile_model(model)  # outside any scope: plain Keras, in this process
        with strategy.scope(), pytest.raises(keras3.OutsideScopeError, match="`fit` of model"):
            model.fit(x, y, verbose=0)
        model.fit(x, y, verbose=0, epochs=1)  # plain Keras still works


def test_parameter_server_fit_takes_tensorflows_inputs_only(forked_process_client):
    x, y = dense_data(rows=32)
    workers = sorted(scheduler_workers(forked_process_client))
    resolver = dd.cluster_resolver.SimpleClusterResolver(
        dd.cluster_resolver.ClusterSpec({"ps": workers[:1], "worker": workers[1:]}))
    with dd.ParameterServerStrategy(resolver, client=forked_process_client) as strategy:
        with strategy.scope():
            model = compile_model(sequential())
        with pytest.raises(ValueError, match="takes a `DatasetCreator`"):
            model.fit(x, y, steps_per_epoch=2, verbose=0)
        with pytest.raises(keras3.UnsupportedOptimizerError, match="keras.optimizers.SGD"):
            with strategy.scope():
                other = compile_model(sequential(), keras.optimizers.Adagrad(0.1))
            other.fit(lambda ctx: None, steps_per_epoch=2, verbose=0)
        # evaluation without steps reads the dataset_fn's dataset once (every row once): one that is not a dataset,
        # or never ends, is refused before anything runs
        before = model.get_weights()
        with pytest.raises(TypeError, match="must return a Dataset"):
            model.fit(lambda ctx: None, steps_per_epoch=2, verbose=0, validation_data=lambda ctx: None)
        with pytest.raises(TypeError, match="must return a Dataset"):
            model.evaluate(lambda ctx: None, verbose=0)
        with pytest.raises(ValueError, match=r"it repeats: drop repeat\(\) .* or give `steps`"):
            model.evaluate(lambda ctx: dd.data.Dataset.range(4).batch(2).repeat(), verbose=0)
        with pytest.raises(ValueError, match=r"give the evaluation data's shuffle\(\) a seed"):
            model.evaluate(lambda ctx: dd.data.Dataset.range(4).shuffle(4).batch(2), verbose=0)
        for a, b in zip(before, model.get_weights()):
            np.testing.assert_array_equal(a, b)


def test_weights_that_differ_across_replicas_at_the_start_raise_on_every_replica(forked_process_client):
    x, y = dense_data(rows=32)
    with dd.MirroredStrategy(devices=TWO, client=forked_process_client) as strategy:
        with strategy.scope():
            model = compile_model(keras.Sequential([keras.Input((8,)), NoisyRestore(4)]))
        with pytest.raises(keras3.WeightsDifferError, match=r"replicas \[1\] differ from replica 0"):
            model.fit(x, y, verbose=0)
        # nothing hangs and the strategy still works: a well-behaved model trains afterwards
        with strategy.scope():
            good = compile_model(sequential())
        plain = twin(good, sequential)
        good.fit(x, y, shuffle=False, verbose=0)
        plain.fit(x, y, shuffle=False, verbose=0)
        for a, b in zip(good.get_weights(), plain.get_weights()):  # as plain Keras, not just finite
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
