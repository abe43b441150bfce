"""TensorFlow's custom-training tutorial with a Keras 3 model and optimizer created in the scope (torch backend)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")
torch = pytest.importorskip("torch")
pytest.importorskip("keras")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import daskdist as dd  # noqa: E402
from tests.keras3_models import (  # noqa: E402
    assert_replicas_identical,
    average_loss,
    dense_data,
    sequential,
    torch_train_step,
)

pytestmark = pytest.mark.timeout(600)

GLOBAL_BATCH_SIZE = 16


def _tutorial_objects():
    model = sequential()
    optimizer = keras.optimizers.SGD(0.1)
    train_step = torch_train_step(model, optimizer, average_loss(GLOBAL_BATCH_SIZE))
    return model, train_step


def test_the_adapter_reaches_keras_only_through_recorded_models_and_the_extended(forked_process_client):
    import daskdist.strategy.extended.contract as extended_module

    assert not hasattr(extended_module, "BEFORE_CALL_HOOKS")  # a verb of the Extended, not a module-level list
    assert not hasattr(keras.layers.Layer.get_weights, "__daskdist_original__")  # every layer: Keras' own
    plain = sequential()
    assert "get_weights" not in vars(plain)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=forked_process_client) as strategy:
        with strategy.scope():
            model, train_step = _tutorial_objects()
        assert "get_weights" in vars(model)  # bound on the recorded model alone
        assert "get_weights" not in vars(model.layers[0])
        x, y = dense_data(rows=16)
        start = model.get_weights()
        # strategy.run ships train_step, which captures the model: the Extended's resident provider placed it
        strategy.run(train_step, args=(dd.PerReplica([(x[:8], y[:8]), (x[8:], y[8:])]),))
        states = assert_replicas_identical(strategy, model)
        after = model.get_weights()  # the model's own get_weights: the replicas' weights now
        assert not np.array_equal(after[0], start[0])
        for got, replica in zip(after, states[0]["variables"]):
            np.testing.assert_array_equal(got, replica)
