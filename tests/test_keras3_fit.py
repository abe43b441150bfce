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


@pytest.mark.parametrize("build", [functional, subclassed], ids=["functional", "subclassed"])
def test_functional_and_subclassed_models_fit_as_one_process_on_the_same_global_batches(forked_process_client, build):
    """Keras 3's model kinds beyond ``Sequential`` (which ``tests/test_matrix_fit.py`` runs on every strategy)."""
    x, y = dense_data(rows=80)  # 3 global batches of 32, 32, 16
    with _strategy("multi_worker", forked_process_client) as strategy:
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


def test_batchnorm_moving_mean_is_the_global_batchs_as_one_process(forked_process_client):
    """Without dropout, one step over a global batch of 32 split 16/16: the replicas' moving means, averaged, are
    the one-process moving mean of the whole batch exactly (the mean of two equal halves' means), not merely moved.
    (The variance is not: the mean of the halves' variances is not the batch's.)"""
    x, y = dense_data(rows=32)

    def build():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                                 keras.layers.Dense(4)])

    with _strategy("mirrored", forked_process_client) as strategy:
        with strategy.scope():
            model = compile_model(build())
        plain = twin(model, build)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        assert_replicas_identical(strategy, model)
    mean, expected = model.layers[1].moving_mean.numpy(), plain.layers[1].moving_mean.numpy()
    assert np.any(expected != 0)
    np.testing.assert_allclose(mean, expected, rtol=1e-5, atol=1e-7)


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
        # Dask arrays: their partitions are read where they live (main's default split of Dask data), so a
        # global batch's rows need not be numpy's sequential ones; with one global batch of all 64 rows per step
        # (32 per replica) every step holds the same rows in any split, and plain Keras gives the same losses
        # and weights
        dx, dy = da.from_array(x, chunks=16), da.from_array(y, chunks=16)
        history = model.fit(dx, dy, batch_size=64, epochs=3, verbose=0)
        expected = plain.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
        np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=RTOL)
        _assert_same_weights(model, plain)
        assert_replicas_identical(strategy, model)
        np.testing.assert_allclose(model.predict(dx, verbose=0), model.predict(x, verbose=0), rtol=RTOL, atol=ATOL)
