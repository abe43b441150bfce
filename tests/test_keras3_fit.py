"""Real Keras 3 models (torch backend) trained by ``model.fit`` under daskdist's SPMD strategies.

Every test compares with plain Keras in this process on the same global
batches, or checks what only the distributed run shows (identical replicas).
The replicas are worker processes, one each, as users run them: with three
replicas as threads of the pytest process beside the plain model, this module
hung twice in whole-suite runs (once in CI, at the tutorial-callbacks test, for
90 minutes: pytest's timeout never ran, so the main thread was stuck in C; once
with every thread waiting on the GIL), and neither hang came back in 45 runs of
its tests alone; threaded clusters stay covered by the other Keras 3 modules.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported, here and in the workers
pytest.importorskip("torch")
pytest.importorskip("keras")

import dask.array as da  # noqa: E402
import keras  # noqa: E402  (tests.keras3_models set KERAS_BACKEND=torch first)
import numpy as np  # noqa: E402

import daskdist as dd  # noqa: E402
from tests.keras3_models import (  # noqa: E402
    assert_replicas_identical,
    bn_dropout,
    compile_model,
    dense_data,
    functional,
    sequence_data,
    sequence_model,
    sequential,
    subclassed,
    twin,
)

pytestmark = pytest.mark.timeout(600)

RTOL = 1e-5
ATOL = 1e-6


def _assert_same_weights(a, b):
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL)


def _strategy(kind, client):
    if kind == "mirrored":
        return dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=client)
    if kind == "one_device":
        return dd.OneDeviceStrategy("/cpu:0", client=client)
    return dd.MultiWorkerMirroredStrategy(client=client)  # 3 replicas: a global batch of 32 splits 11/11/10


@pytest.mark.parametrize("kind", ["mirrored", "one_device", "multi_worker"])
@pytest.mark.parametrize("build", [sequential, functional, subclassed], ids=["sequential", "functional", "subclassed"])
def test_fit_equals_one_process_on_the_same_global_batches(forked_process_client, kind, build):
    x, y = dense_data(rows=80)  # 3 global batches of 32, 32, 16
    with _strategy(kind, forked_process_client) as strategy:
        with strategy.scope():
            model = compile_model(build())
        plain = twin(model, build)
        history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        expected = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        _assert_same_weights(model, plain)
        assert_replicas_identical(strategy, model)
        for key in ("loss", "accuracy"):  # global logs: the loss and accuracy of every row, as one process
            np.testing.assert_allclose(history.history[key], expected.history[key], rtol=RTOL)
        assert model.evaluate(x, y, batch_size=32, verbose=0) == pytest.approx(
            plain.evaluate(x, y, batch_size=32, verbose=0), rel=RTOL)
        np.testing.assert_allclose(model.predict(x, verbose=0), plain.predict(x, verbose=0), rtol=RTOL, atol=ATOL)


def test_embedding_lstm_gru_attention_with_adam_equal_one_process(forked_process_client):
    x, y = sequence_data()
    with _strategy("mirrored", forked_process_client) as strategy:
        with strategy.scope():
            model = compile_model(sequence_model(), keras.optimizers.Adam(1e-2))
        plain = twin(model, sequence_model, keras.optimizers.Adam(1e-2))
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        plain.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        _assert_same_weights(model, plain)
        assert_replicas_identical(strategy, model)
        # the optimizer's state reached the client too (Adam's moments, its step count)
        assert int(model.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == 4


def test_batchnorm_moving_statistics_and_dropout_streams(forked_process_client):
    x, y = dense_data(rows=64)
    weights = []
    with _strategy("mirrored", forked_process_client) as strategy:
        for _ in range(2):  # the same seed twice: the same run
            keras.utils.set_random_seed(3)
            with strategy.scope():
                model = compile_model(bn_dropout())
            model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
            states = assert_replicas_identical(strategy, model)  # moving statistics averaged: identical copies
            weights.append(model.get_weights())
        seeds = [s["rng"].states for s in states]
        assert not np.array_equal(seeds[0][0], seeds[1][0])  # each replica its own dropout stream
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)
    bn = model.layers[1]
    mean = bn.moving_mean.numpy()
    assert np.all(np.isfinite(mean)) and np.any(mean != 0)  # the statistics moved


def test_tutorial_callbacks_run_on_the_client_with_global_logs(forked_process_client, tmp_path):
    x, y = dense_data(rows=64)

    def decay(epoch):
        return 0.1 if epoch < 1 else 0.01

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.logs = []

        def on_epoch_end(self, epoch, logs=None):
            self.logs.append((epoch, dict(logs), float(self.model.optimizer.learning_rate)))

    with _strategy("mirrored", forked_process_client) as strategy:
        with strategy.scope():
            model = compile_model(sequential())
        plain = twin(model, sequential)
        recorder, plain_recorder = Recorder(), Recorder()
        checkpoint = str(tmp_path / "ckpt" / "ckpt_{epoch}.weights.h5")
        callbacks = [keras.callbacks.TensorBoard(log_dir=str(tmp_path / "logs")),
                     keras.callbacks.ModelCheckpoint(filepath=checkpoint, save_weights_only=True),
                     keras.callbacks.LearningRateScheduler(decay), recorder]
        history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, validation_data=(x[:40], y[:40]),
                            callbacks=callbacks)
        expected = plain.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, validation_data=(x[:40], y[:40]),
                             callbacks=[keras.callbacks.LearningRateScheduler(decay), plain_recorder])
        np.testing.assert_allclose(history.history["val_loss"], expected.history["val_loss"], rtol=RTOL)
        _assert_same_weights(model, plain)  # the schedule's rates reached the replicas
        assert [r[0] for r in recorder.logs] == [0, 1, 2]
        for (_, logs, lr), (_, plain_logs, plain_lr) in zip(recorder.logs, plain_recorder.logs):
            assert lr == pytest.approx(plain_lr)
            assert logs["loss"] == pytest.approx(plain_logs["loss"], rel=RTOL)
            assert logs["accuracy"] == pytest.approx(plain_logs["accuracy"], rel=RTOL)
        assert sorted(os.listdir(tmp_path / "ckpt")) == [f"ckpt_{e}.weights.h5" for e in (1, 2, 3)]
        restored = sequential()
        restored.load_weights(str(tmp_path / "ckpt" / "ckpt_3.weights.h5"))
        _assert_same_weights(restored, plain)
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "logs" / "train"))
        events.Reload()
        if "epoch_loss" in events.Tags()["scalars"]:  # tensorboardX (no TensorFlow installed): scalar events
            logged = [e.value for e in events.Scalars("epoch_loss")]
        else:  # TensorFlow installed: Keras writes tf.summary's tensor events
            from tensorboard.util import tensor_util

            logged = [float(tensor_util.make_ndarray(e.tensor_proto)) for e in events.Tensors("epoch_loss")]
        np.testing.assert_allclose(logged, [r[1]["loss"] for r in recorder.logs], rtol=1e-6)


def test_save_loads_in_plain_keras_and_load_model_in_scope_trains_on(forked_process_client, tmp_path):
    x, y = dense_data(rows=64)
    path = str(tmp_path / "model.keras")
    with _strategy("mirrored", forked_process_client) as strategy:
        with strategy.scope():
            model = compile_model(functional())
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        model.save(path)
        expected = model.predict(x, verbose=0)
        np.save(tmp_path / "x.npy", x)
        code = ("import os, sys, numpy as np; os.environ['KERAS_BACKEND'] = 'torch'; import keras; "
                f"m = keras.models.load_model({path!r}); "
                f"np.save({str(tmp_path / 'out.npy')!r}, m.predict(np.load({str(tmp_path / 'x.npy')!r}), verbose=0)); "
                "assert 'daskdist' not in sys.modules, 'daskdist was imported'")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=str(tmp_path), timeout=300)
        np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=RTOL, atol=ATOL)
        with strategy.scope():
            loaded = keras.models.load_model(path)
        plain = keras.models.load_model(path)
        loaded.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        _assert_same_weights(loaded, plain)  # weights and optimizer state came back from the file
        assert_replicas_identical(strategy, loaded)


def test_dask_arrays_and_daskdist_datasets_as_input(forked_process_client):
    x, y = dense_data(rows=64)
    with _strategy("mirrored", forked_process_client) as strategy:
        with strategy.scope():
            model = compile_model(sequential())
        plain = twin(model, sequential)
        dataset = dd.data.Dataset.from_tensor_slices((x, y)).batch(32)
        model.fit(dataset, epochs=1, verbose=0)
        plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        _assert_same_weights(model, plain)
        # Dask arrays: their partitions are read where they live (main's default split of Dask data), so the
        # global batches need not be numpy's sequential ones: the run trains and the copies stay identical
        dx, dy = da.from_array(x, chunks=16), da.from_array(y, chunks=16)
        history = model.fit(dx, dy, batch_size=32, epochs=3, verbose=0)
        assert history.history["loss"][-1] < history.history["loss"][0]
        assert_replicas_identical(strategy, model)
        np.testing.assert_allclose(model.predict(dx, verbose=0), model.predict(x, verbose=0), rtol=RTOL, atol=ATOL)
