"""Custom training loops over the built-in layers: ``dd.GradientTape``.

The gradients are checked against central finite differences of the same
loss, and a distributed custom loop (``strategy.run`` + ``strategy.reduce``,
loss scaled by the global batch) against one process on the global batch:
a wrong gradient scale (per-replica mean instead of the global one, or no
all-reduce) changes the weights and fails it.
"""

from __future__ import annotations

import numpy as np
import pytest

import daskdist as dd
from daskdist import keras

GLOBAL_BATCH = 16


def _model(units=3, seed_layers=None):
    return keras.Sequential([keras.layers.Dense(6, activation="tanh", input_shape=(4,)), keras.layers.Dense(units)])


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 4)).astype(np.float32), rng.integers(0, 3, n)


def _numeric_gradients(loss_of, params, eps=1e-3):
    out = []
    for p in params:
        g = np.zeros(p.shape, np.float64)
        for i in np.ndindex(p.shape):
            old = p[i]
            p[i] = old + eps
            up = loss_of()
            p[i] = old - eps
            down = loss_of()
            p[i] = old
            g[i] = (up - down) / (2 * eps)
        out.append(g)
    return out


@pytest.mark.parametrize("loss_name, targets", [
    ("sparse_categorical_crossentropy", "labels"),
    ("mse", "dense"),
    ("mae", "dense"),
    ("huber", "dense"),
    ("categorical_crossentropy", "onehot"),
])
def test_gradients_match_finite_differences(loss_name, targets):
    x, labels = _data(12)
    model = _model()
    model.build((4,))
    noise = np.random.default_rng(1).standard_normal((12, 3)).astype(np.float32)
    # dense targets sit at least 0.5 from the starting prediction: a residual within the finite-difference step
    # of 0 would put MAE's kink inside the difference and make the numeric gradient wrong, not the tape's
    y = {"labels": labels, "onehot": np.eye(3, dtype=np.float32)[labels],
         "dense": np.asarray(model(x)) + np.sign(noise) * (0.5 + np.abs(noise))}[targets]
    loss_object = keras.losses.get(loss_name)
    if targets in ("onehot", "labels"):  # probabilities, as these losses expect without from_logits
        model.layers.append(keras.layers.Softmax())
        model.built = False
        model.build((4,))
    with dd.GradientTape() as tape:
        pred = model(x, training=True)
        loss = loss_object(y, pred) * 2.0 - 1.0  # arithmetic on the recorded loss is differentiated too
    grads = tape.gradient(loss, model.trainable_variables)
    assert [g.shape for g in grads] == [p.shape for p in model.trainable_variables]
    numeric = _numeric_gradients(lambda: loss_object(y, np.asarray(model(x))) * 2.0 - 1.0,
                                 model.trainable_variables)
    for analytic, expected in zip(grads, numeric):
        np.testing.assert_allclose(analytic, expected, rtol=2e-2, atol=2e-3)
    assert np.abs(numeric[0]).max() > 1e-3  # the check is not vacuous


def test_per_example_losses_compute_average_loss_and_sample_weights():
    x, y = _data(8)
    model = _model()
    model.build((4,))
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    weights = np.linspace(0.0, 2.0, 8).astype(np.float32)
    with dd.GradientTape(persistent=True) as tape:
        logits = model(x, training=True)
        per_example = loss_object(y, logits)
        loss = dd.nn.compute_average_loss(per_example, sample_weight=weights, global_batch_size=32)
    assert per_example.shape == (8,)
    grads = tape.gradient(loss, model.trainable_variables)
    plain = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    numeric = _numeric_gradients(lambda: float((plain(y, np.asarray(model(x))) * weights).sum() / 32),
                                 model.trainable_variables)
    for analytic, expected in zip(grads, numeric):
        np.testing.assert_allclose(analytic, expected, rtol=2e-2, atol=1e-4)
    # the gradient with respect to the logits is the loss's own: softmax - one_hot, scaled
    d_logits = tape.gradient(loss, logits)
    probs = np.exp(np.asarray(logits)) / np.exp(np.asarray(logits)).sum(-1, keepdims=True)
    expected = (probs - np.eye(3)[y]) * weights[:, None] / 32
    np.testing.assert_allclose(d_logits, expected, rtol=1e-4, atol=1e-7)


def test_tape_refusals_are_clear():
    x, y = _data(4)
    model = _model()
    with dd.GradientTape() as tape:
        logits = model(x, training=True)
        untracked = float(np.asarray(logits).sum())
    with pytest.raises(ValueError, match="not computed under this tape"):
        tape.gradient(np.float32(untracked), model.trainable_variables)
    with dd.GradientTape() as tape:
        loss = keras.losses.get("mse")(np.zeros((4, 3)), model(x, training=True))
    tape.gradient(loss, model.trainable_variables)
    with pytest.raises(RuntimeError, match="non-persistent"):
        tape.gradient(loss, model.trainable_variables)
    with dd.GradientTape() as tape:  # two calls: the layers keep the last call's values only
        first = model(x, training=True)
        model(x, training=True)
        loss = keras.losses.get("mse")(np.zeros((4, 3)), first)
    with pytest.raises(ValueError, match="called 2 times"):
        tape.gradient(loss, model.trainable_variables)
    # an unconnected source gets None, as in TF (or zeros on request)
    other = _model()
    other.build((4,))
    with dd.GradientTape(persistent=True) as tape:
        loss = keras.losses.get("mse")(np.zeros((4, 3)), model(x, training=True))
    assert tape.gradient(loss, other.trainable_variables) == [None] * 4
    zeros = tape.gradient(loss, other.trainable_variables, unconnected_gradients="zero")
    assert all(not z.any() for z in zeros)
    with pytest.raises(ValueError, match="No gradients"):
        keras.optimizers.SGD().apply_gradients(zip([None, None], other.trainable_variables[:2]))


def _train_step(model, optimizer, loss_object, global_batch):
    def step(batch):
        x, y = batch
        with dd.GradientTape() as tape:
            loss = dd.nn.compute_average_loss(loss_object(y, model(x, training=True)), global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def _one_process(init, x, y, epochs):
    model = _model()
    model.build((4,))
    model.set_weights(init)
    optimizer = keras.optimizers.Adam(0.01)
    step = _train_step(model, optimizer, keras.losses.SparseCategoricalCrossentropy(True, reduction="none"),
                       GLOBAL_BATCH)
    losses = []
    for _ in range(epochs):
        for i in range(0, len(x), GLOBAL_BATCH):
            losses.append(float(step((x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]))))
    return model.get_weights(), losses


def test_a_custom_loop_with_adam_made_in_the_scope_equals_one_process_on_the_global_batch(process_client):
    """Adam's slots persist on the replicas between steps (the loop under SGD on every strategy and adapter:
    ``tests/test_matrix_custom_loop.py``)."""
    client = process_client
    x, y = _data(64)
    with dd.MirroredStrategy(client=client) as strategy:
        assert strategy.num_replicas_in_sync >= 2
        with strategy.scope():
            model = _model()
            model.build((4,))
            optimizer = keras.optimizers.Adam(0.01)  # made in the scope: its slots persist on the replicas
            loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        init = model.get_weights()
        dataset = strategy.experimental_distribute_dataset(
            dd.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
        step = _train_step(model, optimizer, loss_object, GLOBAL_BATCH)
        losses = []
        for _ in range(2):
            for batch in dataset:
                per_replica = strategy.run(step, args=(batch,))
                losses.append(float(strategy.reduce(dd.ReduceOp.SUM, per_replica, axis=None)))
        weights = model.get_weights()
        replica_weights = strategy.extended.run_on_replicas(_weights_of, (model._model_id,))
    expected_weights, expected_losses = _one_process(init, x, y, epochs=2)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    for got, want in zip(weights, expected_weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    for other in replica_weights[1:]:  # the replicas' copies stayed identical
        for a, b in zip(other, replica_weights[0]):
            np.testing.assert_array_equal(a, b)
    assert any(np.abs(a - b).max() > 1e-3 for a, b in zip(weights, init))  # it trained


def _weights_of(service, model_id):
    from daskdist.group.service import MODEL

    return service.objects.get(MODEL, model_id).model.get_weights()


def test_a_wrong_gradient_scale_is_caught(threaded_client):
    """The same loop with the loss scaled by the local batch (each replica's mean) trains differently."""
    x, y = _data(64)
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        with strategy.scope():
            model = _model()
            model.build((4,))
            optimizer = keras.optimizers.SGD(0.5)
            loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        init = model.get_weights()
        local_batch = GLOBAL_BATCH // strategy.num_replicas_in_sync
        step = _train_step(model, optimizer, loss_object, local_batch)  # the mistake
        for batch in strategy.experimental_distribute_dataset(
                dd.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)):
            strategy.run(step, args=(batch,))
        wrong = model.get_weights()
    reference = _model()
    reference.build((4,))
    reference.set_weights(init)
    sgd = keras.optimizers.SGD(0.5)
    ref_step = _train_step(reference, sgd, keras.losses.SparseCategoricalCrossentropy(True, reduction="none"),
                           GLOBAL_BATCH)
    for i in range(0, 64, GLOBAL_BATCH):
        ref_step((x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]))
    assert max(np.abs(a - b).max() for a, b in zip(wrong, reference.get_weights())) > 1e-3
