"""Keras-style training on real replicas: fit/evaluate/predict, callbacks, checkpoints, saving."""

from __future__ import annotations

import os

import numpy as np
import pytest

import daskdist as dd
from daskdist import keras
from daskdist.keras import saving

Dataset = dd.data.Dataset


def _digits(n=600):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images[:n] / 16.0).astype(np.float32)[..., None]
    y = digits.target[:n].astype(np.int64)
    return x, y


def _cnn(input_shape=(8, 8, 1)):
    model = keras.Sequential([
        keras.layers.Conv2D(8, 3, activation="relu", input_shape=input_shape),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"])
    return model


def _replica_weights(strategy, model):
    from daskdist.training.commands import model_weights

    return strategy.extended.group.call(model_weights, (model._model_id,))


def test_fit_evaluate_predict_on_replicas(threaded_client, tmp_path):
    x, y = _digits()
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        with strategy.scope():
            model = _cnn()
        train = Dataset.from_tensor_slices((x, y)).shuffle(600, seed=0).batch(64)
        history = model.fit(train, epochs=6, verbose=0)
        losses = history.history["loss"]
        assert len(losses) == 6 and losses[-1] < losses[0] * 0.5
        assert history.history["accuracy"][-1] > 0.85
        first, second = _replica_weights(strategy, model)
        for a, b in zip(first, second):
            np.testing.assert_array_equal(a, b)  # the copies stay identical
        loss, accuracy = model.evaluate(Dataset.from_tensor_slices((x, y)).batch(100))
        assert accuracy > 0.85
        predictions = model.predict(x[:20])
        assert predictions.shape == (20, 10)
        assert (predictions.argmax(1) == y[:20]).mean() > 0.7


def test_save_and_load_model_with_and_without_a_scope(threaded_client, tmp_path):
    x, y = _digits(300)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        with strategy.scope():
            model = _cnn()
        model.fit(Dataset.from_tensor_slices((x, y)).batch(50), epochs=2, verbose=0)
        expected = model.evaluate(Dataset.from_tensor_slices((x, y)).batch(100), return_dict=True)
        path = str(tmp_path / "saved_model")
        model.save(path)
        unreplicated = keras.models.load_model(path)
        assert unreplicated._strategy is None
        got = unreplicated.evaluate(Dataset.from_tensor_slices((x, y)).batch(100), return_dict=True)
        assert got["accuracy"] == pytest.approx(expected["accuracy"])
        with strategy.scope():
            replicated = keras.models.load_model(path)
        assert replicated._strategy is strategy
        got = replicated.evaluate(Dataset.from_tensor_slices((x, y)).batch(100), return_dict=True)
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        np.testing.assert_allclose(replicated.predict(x[:5]), unreplicated.predict(x[:5]), rtol=1e-5)


def test_checkpoints_are_atomic_and_verified(tmp_path, monkeypatch):
    prefix = str(tmp_path / "ckpt")
    saving.write_checkpoint(prefix, {"w": np.arange(4.0)}, {})
    real_replace = os.replace

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        saving.write_checkpoint(prefix, {"w": np.full(4, 9.0)}, {})
    monkeypatch.setattr(os, "replace", real_replace)
    tensors, _ = saving.read_checkpoint(prefix)  # the previous checkpoint is intact
    assert tensors["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]
    with open(prefix + ".safetensors", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(saving.CheckpointError, match="checksum"):
        saving.read_checkpoint(prefix)


def test_custom_training_loop_with_compute_average_loss(threaded_client):
    x, y = _digits(256)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        with strategy.scope():
            w = dd.Variable(np.zeros((64, 10), np.float32), aggregation="SUM")
        dist = strategy.experimental_distribute_dataset(
            Dataset.from_tensor_slices((x.reshape(-1, 64), y)).batch(64))
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def train_step(batch):
            images, labels = batch
            logits = images @ w.value()
            per_example = loss_fn.per_example(labels, logits)
            loss = dd.nn.compute_average_loss(per_example, global_batch_size=64)
            grad = images.T @ (loss_fn.gradient(labels, logits) / 64)
            w.assign_sub(0.5 * grad)  # SUM aggregation: the replicas' partial gradients add up
            return loss

        losses = []
        for _ in range(5):
            for batch in dist:
                per_replica = strategy.run(train_step, args=(batch,))
                losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
        trained = np.asarray(w.read_value())

    # the same 20 steps on one device over each whole global batch of 64: the per-replica losses scaled by the
    # global batch size add up to the batch's mean loss, and the SUM-aggregated partial gradients to its gradient
    # (a MEAN aggregation, or a per-replica batch size in place of 64, halves the step and fails here)
    features, reference_w, reference_losses = x.reshape(-1, 64), np.zeros((64, 10), np.float32), []
    for _ in range(5):
        for start in range(0, 256, 64):
            images, labels = features[start:start + 64], y[start:start + 64]
            logits = images @ reference_w
            reference_losses.append(float(loss_fn.per_example(labels, logits).mean()))
            reference_w = reference_w - 0.5 * (images.T @ (loss_fn.gradient(labels, logits) / 64))
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    np.testing.assert_allclose(trained, reference_w, rtol=1e-4, atol=1e-6)
    assert losses[-1] < losses[0] * 0.7  # and it learns
