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
    from daskdist.keras.models import _replica_get_weights

    return strategy.extended.group.call(_replica_get_weights, (model._model_id,))


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


def test_distributed_step_equals_one_device_step(threaded_client):
    """One full-batch SGD step on 2 replicas gives the weights one device gets from the same batch."""
    x, y = _digits(128)

    def build():
        model = keras.Sequential([keras.layers.Dense(16, activation="relu", input_shape=(64,)), keras.layers.Dense(10)])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=keras.optimizers.SGD(0.5))
        return model

    data = Dataset.from_tensor_slices((x.reshape(128, 64), y), num_partitions=2).batch(128)
    local = build()
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        with strategy.scope():
            distributed = build()
        local.set_weights(distributed.get_weights())
        distributed.fit(data, epochs=1, verbose=0)
        local.fit(data, epochs=1, verbose=0)
        for a, b in zip(distributed.get_weights(), local.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_callbacks_checkpoints_and_tensorboard(threaded_client, tmp_path):
    x, y = _digits(400)
    checkpoint_dir = tmp_path / "ckpts"
    log_dir = tmp_path / "logs"
    seen_lr = []

    class RecordLR(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen_lr.append(float(self.model.optimizer.lr.numpy()))

    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        with strategy.scope():
            model = _cnn()
        train = Dataset.from_tensor_slices((x, y)).batch(64)
        callbacks = [
            keras.callbacks.TensorBoard(log_dir=str(log_dir)),
            keras.callbacks.ModelCheckpoint(filepath=str(checkpoint_dir / "ckpt_{epoch}"), save_weights_only=True),
            keras.callbacks.LearningRateScheduler(lambda epoch: 0.01 if epoch < 2 else 0.001),
            RecordLR(),
        ]
        model.fit(train, epochs=3, callbacks=callbacks, validation_data=Dataset.from_tensor_slices((x, y)).batch(64),
                  verbose=0)
        assert seen_lr == [0.01, 0.01, 0.001]
        latest = dd.train.latest_checkpoint(str(checkpoint_dir))
        assert latest.endswith("ckpt_3")
        assert {f for f in os.listdir(checkpoint_dir) if f.endswith(".safetensors")} == {
            "ckpt_1.safetensors", "ckpt_2.safetensors", "ckpt_3.safetensors"}
        weights = model.get_weights()
        model.set_weights([w * 0 for w in weights])
        model.load_weights(latest)
        for a, b in zip(model.get_weights(), weights):
            np.testing.assert_array_equal(a, b)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_events = EventAccumulator(str(log_dir / "train"))
    train_events.Reload()
    assert [e.step for e in train_events.Scalars("epoch_loss")] == [0, 1, 2]
    val_events = EventAccumulator(str(log_dir / "validation"))
    val_events.Reload()
    assert len(val_events.Scalars("epoch_accuracy")) == 3


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


def test_early_stopping_and_backup_and_restore(threaded_client, tmp_path):
    x, y = _digits(200)
    train = Dataset.from_tensor_slices((x, y)).batch(50)
    backup = str(tmp_path / "backup")

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt("preempted")

    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        with strategy.scope():
            model = _cnn()
        with pytest.raises(KeyboardInterrupt):
            model.fit(train, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()], verbose=0)
        saved = model.get_weights()  # those of the end of epoch 1, which the backup holds
        with strategy.scope():
            resumed = _cnn()
        resumed.build((8, 8, 1))
        fresh = resumed.get_weights()

        class FirstEpoch(keras.callbacks.Callback):
            """The weights the resumed fit starts its first epoch from."""

            def on_epoch_begin(self, epoch, logs=None):
                if not hasattr(self, "start"):
                    self.start = (epoch, self.model.get_weights())

        first = FirstEpoch()
        history = resumed.fit(train, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(backup), first], verbose=0)
        assert history.epoch == [2, 3]  # epochs 0 and 1 were done before the interruption
        epoch, start = first.start
        assert epoch == 2 and len(start) == len(saved) == len(fresh)
        for got, backed_up, initial in zip(start, saved, fresh):  # it resumed from the backup, not from its init
            np.testing.assert_array_equal(got, backed_up)
            assert not np.array_equal(got, initial) or not initial.any()
        assert not os.path.exists(backup)  # removed once training finished

        stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=100.0)
        history = resumed.fit(train, epochs=10, callbacks=[stopper], verbose=0)
        assert len(history.epoch) == 2 and resumed.stop_training


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
