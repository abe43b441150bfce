"""Keras 3 models (torch backend) under CentralStorageStrategy: the parameters and optimizer state held once.

Every replica runs Keras' forward and backward; the gradients go to the
parameter holder, which applies Keras' update rule once on the one stored
copy; the replicas' own optimizers never run. The result must be plain Keras
in one process on the same global batches.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported, here and in the workers
torch = pytest.importorskip("torch")
pytest.importorskip("keras")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import daskdist as dd  # noqa: E402
from daskdist.plugins.keras3 import UnsupportedOptimizerError, registry  # noqa: E402
from tests.keras3_models import (  # noqa: E402
    average_loss,
    compile_model,
    dense_data,
    mnist_shaped,
    replica_states,
    sequential,
    torch_train_step,
    tutorial_cnn,
    twin,
)

pytestmark = pytest.mark.timeout(600)

RTOL = 1e-5
ATOL = 1e-6
TWO = ["/cpu:0", "/cpu:1"]


def _optimizer(kind):
    return keras.optimizers.Adam(0.001) if kind == "adam" else keras.optimizers.SGD(0.05, momentum=0.9)


def _assert_same_weights(a, b):
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_central_storage_fit_evaluate_predict_equal_one_process(forked_process_client, kind):
    x, y = mnist_shaped()  # 3 global batches of 32, 32, 16: each replica 16, 16, 8
    with dd.experimental.CentralStorageStrategy(TWO, client=forked_process_client) as strategy:
        with strategy.scope():
            model = compile_model(tutorial_cnn(), _optimizer(kind))
        plain = twin(model, tutorial_cnn, _optimizer(kind))
        history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        expected = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        _assert_same_weights(model, plain)
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(history.history[key], expected.history[key], rtol=RTOL)
        # the optimizer state the client's model shows (checkpoints, save) is plain Keras' own
        assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 6
        for a, b in zip(model.optimizer.variables, plain.optimizer.variables):
            np.testing.assert_allclose(np.asarray(a.numpy()), np.asarray(b.numpy()), rtol=1e-4, atol=ATOL)

        # held once: the store has the parameters and the slots; the replicas' optimizers never run (unbuilt
        # copies: no slots)
        record = registry.lookup(model)
        driver = strategy.extended.step_driver(record.object_id)
        stored = driver.stored_state(forked_process_client, len(model.trainable_variables))
        for held, weight in zip(stored["params"], model.trainable_variables):
            np.testing.assert_array_equal(held, np.asarray(weight.numpy()))
        slots = [name for name in stored["rule_state"] if "/" in name]
        assert len(slots) == (2 if kind == "adam" else 1) * len(model.trainable_variables)
        for state in replica_states(strategy, model):
            assert int(state["optimizer"][0]) == 6  # the steps taken (on the holder)
            assert len(state["optimizer"]) == 2  # iterations and the learning rate: the slots are the holder's
            for a, b in zip(state["variables"], model.get_weights()):
                np.testing.assert_array_equal(a, b)

        assert model.evaluate(x, y, batch_size=32, verbose=0) == pytest.approx(
            plain.evaluate(x, y, batch_size=32, verbose=0), rel=RTOL)
        # logits up to ~12: an atol of 1e-5 is 1e-6 of their scale (torch's reductions vary in the last ulp)
        np.testing.assert_allclose(model.predict(x, verbose=0), plain.predict(x, verbose=0), rtol=RTOL, atol=1e-5)

        # set_weights on the client replaces the held copy: the next fit trains from it, as plain Keras does
        plain.set_weights([w * 0.5 for w in plain.get_weights()])
        model.set_weights(plain.get_weights())
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        # what this checks is where training started (the halved weights, a 0.5x difference if not); after 9 steps
        # of SGD with momentum 0.9 at lr 0.05 the order of the replicas' gradient sums shows in a few elements at
        # 2e-5 (seen once in a full run), so the tolerance is the noise's, not the first epochs' 1e-5
        for a, b in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def _schedules():
    """Each schedule changes the learning rate within the 15 steps of the test (a rate never evaluated fails it)."""
    return {
        "exponential": keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=3, decay_rate=0.5),
        "piecewise": keras.optimizers.schedules.PiecewiseConstantDecay([4, 9], [0.05, 0.02, 0.005]),
        "cosine": keras.optimizers.schedules.CosineDecay(0.0, decay_steps=10, warmup_target=0.05, warmup_steps=4),
        "inverse_time": keras.optimizers.schedules.InverseTimeDecay(0.05, decay_steps=2, decay_rate=1.0),
    }


@pytest.mark.parametrize("name", ["exponential", "piecewise", "cosine", "inverse_time", "callback"])
def test_central_storage_learning_rate_schedules_equal_one_process(forked_process_client, name):
    """A LearningRateSchedule evaluated on the holder at its step count, and LearningRateScheduler's rate reaching
    it, give plain Keras' weights in one process on the same global batches (5 steps an epoch, 3 epochs)."""
    x, y = dense_data(rows=80, seed=4)

    def optimizer():
        if name == "callback":
            return keras.optimizers.SGD(0.05, momentum=0.9)
        return keras.optimizers.Adam(_schedules()[name])

    def callbacks():
        if name != "callback":
            return []
        return [keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 * 0.3 ** epoch)]

    with dd.experimental.CentralStorageStrategy(TWO, client=forked_process_client) as strategy:
        with strategy.scope():
            model = compile_model(sequential(), optimizer())
        plain = twin(model, sequential, optimizer())
        history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=callbacks())
        expected = plain.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=callbacks())
        _assert_same_weights(model, plain)
        np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=RTOL)
        assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 15
        if name == "callback":
            assert history.history["learning_rate"] == pytest.approx([0.05, 0.015, 0.0045])
            assert float(model.optimizer.learning_rate) == pytest.approx(0.0045)


def test_a_schedule_keras_cannot_rebuild_is_refused_before_anything_runs(forked_process_client):
    class Halving(keras.optimizers.schedules.LearningRateSchedule):  # not registered: no from_config by name
        def __call__(self, step):
            return 0.1 * 0.5 ** keras.ops.cast(step, "float32")

        def get_config(self):
            return {}

    x, y = dense_data(rows=32)
    with dd.experimental.CentralStorageStrategy(TWO, client=forked_process_client) as strategy:
        with strategy.scope():
            model = compile_model(sequential(), keras.optimizers.SGD(Halving()))
        before = model.get_weights()
        with pytest.raises(UnsupportedOptimizerError, match="register_keras_serializable"):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        for a, b in zip(before, model.get_weights()):
            np.testing.assert_array_equal(a, b)


def test_central_storage_custom_loop_then_fit_equal_one_process(forked_process_client):
    """TF's custom-training tutorial under CentralStorage (the optimizer made in the scope sums the replicas'
    gradients, every replica applies the same update), then a `fit` that goes on from the loop's weights; the
    replicas' optimizers, which never apply under the holder, carry no slots."""
    global_batch = 16
    x, y = dense_data(rows=48, seed=9)

    def tutorial():
        model = sequential()
        optimizer = keras.optimizers.SGD(0.1)
        return model, torch_train_step(model, optimizer, average_loss(global_batch))

    with dd.experimental.CentralStorageStrategy(TWO, client=forked_process_client) as strategy:
        with strategy.scope():
            model, train_step = tutorial()
            compile_model(model, keras.optimizers.Adam(0.01))
        plain, plain_step = tutorial()
        plain.set_weights(model.get_weights())
        dist = strategy.experimental_distribute_dataset(dd.data.Dataset.from_tensor_slices((x, y)).batch(global_batch))
        losses = [strategy.reduce(dd.ReduceOp.SUM, strategy.run(train_step, args=(batch,)), axis=None)
                  for batch in dist]
        expected = [plain_step((x[k:k + global_batch], y[k:k + global_batch])) for k in range(0, len(x), global_batch)]
        np.testing.assert_allclose(losses, expected, rtol=RTOL)
        _assert_same_weights(model, plain)

        compile_model(plain, keras.optimizers.Adam(0.01))
        model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)
        plain.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)
        _assert_same_weights(model, plain)  # fit started from the custom loop's weights, held on the holder
        for state in replica_states(strategy, model):
            assert len(state["optimizer"]) == 2  # iterations and the learning rate: no slots on the replicas
            assert int(state["optimizer"][0]) == 3


def test_unsupported_optimizers_are_refused_naming_the_supported_ones(forked_process_client):
    x, y = dense_data(rows=32)
    with dd.experimental.CentralStorageStrategy(TWO, client=forked_process_client) as strategy:
        for optimizer, match in [(keras.optimizers.Adagrad(0.1), "run keras.optimizers.SGD, keras.optimizers.Adam, "
                                  "keras.optimizers.RMSprop .*got keras.*Adagrad"),
                                 (keras.optimizers.Adam(0.1, clipnorm=1.0), r"without \['clipnorm'\]"),
                                 (keras.optimizers.Adam(0.1, amsgrad=True), r"without \['amsgrad'\]")]:
            with strategy.scope():
                model = compile_model(sequential(), optimizer)
            before = model.get_weights()
            with pytest.raises(UnsupportedOptimizerError, match=match):
                model.fit(x, y, batch_size=16, epochs=1, verbose=0)
            for a, b in zip(before, model.get_weights()):  # nothing trained, nothing lost
                np.testing.assert_array_equal(a, b)
        with strategy.scope():
            model = compile_model(sequential(), keras.optimizers.RMSprop(0.01, momentum=0.5))
        plain = twin(model, sequential, keras.optimizers.RMSprop(0.01, momentum=0.5))
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # RMSprop is held too
        plain.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        _assert_same_weights(model, plain)
