"""Small Keras 3 models and helpers shared by the tests/test_keras3_*.py files (torch backend; JAX in a subprocess)."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from daskdist.plugins.keras3 import registry  # noqa: E402
from daskdist.training import commands  # noqa: E402


@keras.saving.register_keras_serializable(package="daskdist_tests")
class SmallNet(keras.Model):
    """A subclassed model (its own ``call``), as in Keras' "making new layers and models" guide."""

    def __init__(self, units: int = 16, classes: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.units, self.classes = units, classes
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.out = keras.layers.Dense(classes)

    def call(self, x, training=False):
        return self.out(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units, "classes": self.classes}


def dense_data(rows: int = 96, features: int = 8, classes: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0).astype(np.int64)
    return x, y % classes


def sequential(features: int = 8, classes: int = 4):
    return keras.Sequential([keras.Input((features,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(classes)])


def functional(features: int = 8, classes: int = 4):
    inputs = keras.Input((features,))
    a = keras.layers.Dense(16, activation="relu")(inputs)
    b = keras.layers.Dense(16, activation="tanh")(inputs)
    outputs = keras.layers.Dense(classes)(keras.layers.Add()([a, b]))  # a residual-style join
    return keras.Model(inputs, outputs)


def subclassed(features: int = 8, classes: int = 4):
    model = SmallNet(classes=classes)
    model(np.zeros((1, features), np.float32))
    return model


def sequence_model(vocab: int = 50, length: int = 6, classes: int = 4):
    """Embedding, LSTM, GRU and MultiHeadAttention in one functional model."""
    inputs = keras.Input((length,), dtype="int32")
    e = keras.layers.Embedding(vocab, 8)(inputs)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(e, e)
    h = keras.layers.LSTM(8, return_sequences=True)(attended)
    h = keras.layers.GRU(8)(h)
    return keras.Model(inputs, keras.layers.Dense(classes)(h))


def sequence_data(rows: int = 64, vocab: int = 50, length: int = 6, classes: int = 4, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, size=(rows, length)).astype(np.int32)
    return x, (x[:, 0] % classes).astype(np.int64)


def tutorial_cnn():
    """The TF distributed-training tutorial's model, on 28x28x1 input."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def mnist_shaped(rows=80, seed=3):
    """MNIST-shaped random images and labels (0 or 3) that the CNN can learn."""
    rng = np.random.default_rng(seed)
    x = rng.random((rows, 28, 28, 1), dtype=np.float32)
    return x, (x[:, :14].sum(axis=(1, 2, 3)) > x[:, 14:].sum(axis=(1, 2, 3))).astype(np.int64) * 3


def bn_dropout(seed=7):
    """BatchNormalization (moving statistics) and a seeded Dropout (a random stream per replica)."""
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                             keras.layers.Dropout(0.3, seed=seed), keras.layers.Dense(4)])


def compile_model(model, optimizer=None, metrics=("accuracy",)):
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=list(metrics))
    return model


def twin(model, build, optimizer=None):
    """A plain Keras model (no strategy) with the same architecture, weights and compile settings."""
    plain = build()
    plain.set_weights(model.get_weights())
    return compile_model(plain, optimizer)


def replica_states(strategy, model):
    """Every replica's (weights + optimizer variables) of a distributed model, in replica order."""
    record = registry.lookup(model)
    return strategy.extended.run_on_replicas(commands.model_state, (record.object_id,))


def assert_replicas_identical(strategy, model):
    states = replica_states(strategy, model)
    for state in states[1:]:
        for a, b in zip(states[0]["variables"], state["variables"]):
            if a.dtype.kind == "f":
                np.testing.assert_array_equal(a, b)
    return states


@keras.saving.register_keras_serializable(package="daskdist_tests")
class NoisyRestore(keras.layers.Dense):
    """A Dense layer whose restore adds unseeded noise: each replica ends up with different weights."""

    def load_own_variables(self, store):
        super().load_own_variables(store)
        self.kernel.assign(self.kernel.numpy() + np.random.default_rng().normal(size=self.kernel.shape)
                           .astype(np.float32))


def average_loss(global_batch: int, loss_object=None):
    """TF's ``compute_average_loss`` for its custom-training tutorial: the per-example losses summed over the
    global batch size (sparse categorical cross-entropy on logits unless ``loss_object`` is given)."""
    if loss_object is None:
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def compute_loss(labels, predictions):
        return keras.ops.sum(loss_object(labels, predictions)) / global_batch

    return compute_loss


def torch_train_step(model, optimizer, compute_loss):
    """TF's custom-training step on the torch backend: Keras' forward, torch's backward, ``optimizer.apply``.

    The loss is computed in ``compute_loss``, not here: ``keras.ops`` and ``torch`` in one function's code make
    cloudpickle take ``torch.ops`` for a submodule of ``torch`` the function uses, which it cannot pickle.
    """
    import torch

    def train_step(inputs):
        features, labels = inputs
        loss = compute_loss(labels, model(features, training=True))
        model.zero_grad()
        loss.backward()
        with torch.no_grad():  # in a replica: summed over the replicas; on a ps worker: pushed to the ps
            optimizer.apply([v.value.grad for v in model.trainable_variables], model.trainable_variables)
        return float(loss)

    return train_step
