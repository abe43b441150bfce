"""Keras' per-batch callbacks during a distributed ``fit``/``evaluate``/``predict`` of a Keras 3 model (torch backend).

Each test runs the same callbacks under plain Keras in this process on the same global batches and compares
what they saw: which hooks ran with which batch index, and the running logs.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")
pytest.importorskip("torch")
pytest.importorskip("keras")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import daskdist as dd  # noqa: E402
from tests.keras3_models import compile_model, dense_data, sequential, twin  # noqa: E402

pytestmark = pytest.mark.timeout(600)
TWO = ["/cpu:0", "/cpu:1"]
RTOL = 1e-5


class BatchRecorder(keras.callbacks.Callback):
    """Records every per-batch hook: (hook, batch, loss or the outputs' rows)."""

    def __init__(self, stop_at=None):
        super().__init__()
        self.calls = []
        self.stop_at = stop_at

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("train_begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("train_end", batch, float(logs["loss"]), float(logs["accuracy"])))
        if self.stop_at is not None and batch >= self.stop_at:
            self.model.stop_training = True

    def on_test_batch_begin(self, batch, logs=None):
        self.calls.append(("test_begin", batch))

    def on_test_batch_end(self, batch, logs=None):
        self.calls.append(("test_end", batch, float(logs["loss"]), float(logs["accuracy"])))

    def on_predict_batch_end(self, batch, logs=None):
        self.calls.append(("predict_end", batch, int(np.asarray(logs["outputs"]).shape[0])))


def _assert_same_calls(got, want):
    assert [c[:2] for c in got] == [c[:2] for c in want]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a[2:], b[2:], rtol=RTOL)


def test_evaluate_and_predict_batch_hooks_see_the_batches_and_running_global_logs_of_one_process(
        forked_process_client):
    """The training hooks on every adapter: ``tests/test_matrix_callbacks.py``; evaluation and prediction hooks
    are Keras 3's (the built-in ``evaluate`` and ``predict`` take no callbacks)."""
    x, y = dense_data(rows=80)
    with dd.MirroredStrategy(devices=TWO, client=forked_process_client) as strategy:
        with strategy.scope():
            model = compile_model(sequential())
        plain = twin(model, sequential)
        got, want = BatchRecorder(), BatchRecorder()
        assert model.evaluate(x, y, batch_size=32, verbose=0, callbacks=[got]) == pytest.approx(
            plain.evaluate(x, y, batch_size=32, verbose=0, callbacks=[want]), rel=RTOL)
        _assert_same_calls(got.calls, want.calls)
        assert [c[0] for c in got.calls] == ["test_begin", "test_end"] * 3

        got, want = BatchRecorder(), BatchRecorder()
        model.predict(dd.data.Dataset.from_tensor_slices(x).batch(32), verbose=0, callbacks=[got])
        plain.predict(x, batch_size=32, verbose=0, callbacks=[want])
        assert got.calls == want.calls == [("predict_end", 0, 32), ("predict_end", 1, 32), ("predict_end", 2, 16)]


def test_steps_per_execution_runs_the_hooks_every_n_steps_as_tensorflow(forked_process_client):
    x, y = dense_data(rows=80)
    with dd.MirroredStrategy(devices=TWO, client=forked_process_client) as strategy:
        with strategy.scope():
            model = sequential()
            model.compile(optimizer=keras.optimizers.SGD(0.1), steps_per_execution=2, metrics=["accuracy"],
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        plain = twin(model, sequential)  # plain Keras on torch refuses steps_per_execution > 1: it runs 1
        got, want = BatchRecorder(), BatchRecorder()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[got])
        plain.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[want])
        # TF: on_train_batch_begin(first step of the execution), on_train_batch_end(its last step, logs)
        assert [c[:2] for c in got.calls] == [("train_begin", 0), ("train_end", 1), ("train_begin", 2),
                                              ("train_end", 3), ("train_begin", 4), ("train_end", 4)]
        ends = {c[1]: c[2:] for c in want.calls if c[0] == "train_end"}
        for call in got.calls:
            if call[0] == "train_end":
                np.testing.assert_allclose(call[2:], ends[call[1]], rtol=RTOL)
        for a, b in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6)


def test_stop_training_in_a_batch_hook_and_checkpoints_every_n_batches_hold_the_current_weights(
        forked_process_client, tmp_path):
    x, y = dense_data(rows=80)
    with dd.MirroredStrategy(devices=TWO, client=forked_process_client) as strategy:
        with strategy.scope():
            model = compile_model(sequential())
        plain = twin(model, sequential)
        for run, where in ((model, "dist"), (plain, "plain")):
            run.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[
                BatchRecorder(stop_at=2),  # stops the first epoch after its third step
                keras.callbacks.ModelCheckpoint(str(tmp_path / where / "b{batch}.weights.h5"), save_freq=2,
                                                save_weights_only=True)])
        assert run.optimizer.iterations.numpy() == model.optimizer.iterations.numpy() == 3
        (name,) = os.listdir(tmp_path / "plain")  # saved once, after the second step
        assert os.listdir(tmp_path / "dist") == [name]
        saved, expected = sequential(), sequential()
        saved.load_weights(str(tmp_path / "dist" / name))
        expected.load_weights(str(tmp_path / "plain" / name))
        for a, b in zip(saved.get_weights(), expected.get_weights()):  # the weights after step 2, not the start's
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6)
        assert not np.allclose(saved.get_weights()[0], model.get_weights()[0])  # and not the final ones
        for a, b in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6)
