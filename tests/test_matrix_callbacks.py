"""Keras callbacks and checkpoints during a distributed ``fit``, on strategy combinations x in-process adapters.

One body per behaviour: epoch callbacks (a learning-rate schedule, epoch logs, validation, TensorBoard,
``ModelCheckpoint`` files that restore each epoch's weights), per-batch hooks with the running logs, and an
interrupted ``fit`` resumed by ``BackupAndRestore`` then stopped early, and per-batch hooks refused where the
trainer's runner cannot run them (elastic epochs, parameter-server closures). Each is compared with the numpy
reference on the same global batches (``tests/support/adapters.py``). Adapter-specific callbacks
(``steps_per_execution``, checkpoints every n batches) stay in ``tests/test_keras3_callbacks.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import daskdist as dd
from tests.support.adapters import ADAPTERS, assert_weights, data, reference_evaluate, reference_fit
from tests.support.strategies import COMBINATIONS, SYNCHRONOUS

pytestmark = pytest.mark.timeout(600)

#: two replicas of one worker, and three workers (16 rows split 6/5/5)
SPLITS = [c for c in SYNCHRONOUS if c.name in ("mirrored_two_devices", "multi_worker_mirrored")]
BATCH = 16


def _schedule(epoch: int) -> float:
    return 0.1 if epoch < 1 else 0.05


@pytest.fixture(scope="module")
def initial():
    rng = np.random.default_rng(12)
    return [rng.uniform(-0.5, 0.5, shape).astype(np.float32) for shape in ((8, 16), (16,), (16, 4), (4,))]


def _tensorboard_epoch_losses(log_dir: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir)
    events.Reload()
    if "epoch_loss" in events.Tags()["scalars"]:  # tensorboardX (no TensorFlow installed): scalar events
        return [e.value for e in events.Scalars("epoch_loss")]
    from tensorboard.util import tensor_util  # TensorFlow installed: Keras writes tf.summary's tensor events

    return [float(tensor_util.make_ndarray(e.tensor_proto)) for e in events.Tensors("epoch_loss")]


@pytest.mark.parametrize("adapter", ADAPTERS, ids=str)
@pytest.mark.parametrize("combination", SPLITS, ids=str)
def test_epoch_callbacks_see_one_processs_logs_and_rates_and_each_checkpoint_restores_its_epoch(
        combination, adapter, matrix_client, initial, tmp_path):
    keras = adapter.keras
    x, y = data(rows=80)
    expected = reference_fit(initial, x, y, BATCH, epochs=3, learning_rate=_schedule)
    seen = []

    class Recorder(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append((epoch, dict(logs), float(self.model.optimizer.learning_rate)))

    checkpoints = tmp_path / "ckpt"
    callbacks = [keras.callbacks.TensorBoard(log_dir=str(tmp_path / "logs")),
                 keras.callbacks.ModelCheckpoint(str(checkpoints / adapter.checkpoint_pattern), save_weights_only=True),
                 keras.callbacks.LearningRateScheduler(_schedule), Recorder()]
    with combination.strategy(matrix_client) as strategy:
        with strategy.scope():
            model = adapter.model(initial)
        model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, validation_data=(x[:48], y[:48]),
                  callbacks=callbacks)
        assert_weights(model.get_weights(), expected.weights)  # the schedule's rates reached the replicas
        adapter.assert_replicas_identical(strategy, model)
    assert [s[0] for s in seen] == [0, 1, 2]
    assert [s[2] for s in seen] == pytest.approx([0.1, 0.05, 0.05])
    for epoch, logs, _ in seen:
        assert logs["loss"] == pytest.approx(expected.loss[epoch], rel=1e-5)
        assert logs["accuracy"] == pytest.approx(expected.accuracy[epoch], rel=1e-6)
        want = reference_evaluate(expected.epoch_weights[epoch], x[:48], y[:48])
        assert (logs["val_loss"], logs["val_accuracy"]) == pytest.approx(want, rel=1e-5)
    assert set(os.listdir(checkpoints)) == adapter.checkpoint_files([1, 2, 3])
    for epoch in (1, 2, 3):  # each epoch's file holds that epoch's weights, loaded without a strategy
        restored = adapter.model()
        restored.load_weights(str(checkpoints / adapter.checkpoint_pattern.format(epoch=epoch)))
        assert_weights(restored.get_weights(), expected.epoch_weights[epoch - 1])
    np.testing.assert_allclose(_tensorboard_epoch_losses(str(tmp_path / "logs" / "train")),
                               [s[1]["loss"] for s in seen], rtol=1e-6)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=str)
@pytest.mark.parametrize("combination", SPLITS, ids=str)
def test_per_batch_hooks_see_each_global_batch_with_one_processs_running_logs(combination, adapter,
                                                                             matrix_client, initial):
    keras = adapter.keras
    x, y = data(rows=80)
    expected = reference_fit(initial, x, y, BATCH, epochs=2)
    calls = []

    class BatchRecorder(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            calls.append(("begin", batch))

        def on_train_batch_end(self, batch, logs=None):
            calls.append(("end", batch, float(logs["loss"]), float(logs["accuracy"])))

    with combination.strategy(matrix_client) as strategy:
        with strategy.scope():
            model = adapter.model(initial)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[BatchRecorder()])
        assert_weights(model.get_weights(), expected.weights)
    assert [c[:2] for c in calls] == [(hook, b) for _ in range(2) for b in range(5) for hook in ("begin", "end")]
    got = [c[2:] for c in calls if c[0] == "end"]
    np.testing.assert_allclose(got, [log for epoch in expected.batch_logs for log in epoch], rtol=1e-5)


#: where a per-batch hook cannot run: (strategy, the error the trainer's ``choose_runner`` raises)
REFUSING = [
    ("elastic", lambda client: dd.MirroredStrategy(client=client, elastic=dd.ElasticOptions(min_replicas=2)),
     NotImplementedError, r"per-batch callbacks .* do not run under an elastic strategy yet.*Found: \['BatchHook'\]"),
    ("parameter_server", next(c for c in COMBINATIONS if c.name == "parameter_server").make, ValueError,
     r"Batch-level `Callback`s are not supported with `ParameterServerStrategy`. Found: \['BatchHook'\]"),
]


@pytest.mark.parametrize("adapter", ADAPTERS, ids=str)
@pytest.mark.parametrize(("where", "make", "error", "message"), REFUSING, ids=[r[0] for r in REFUSING])
def test_a_per_batch_hook_is_refused_where_the_runner_cannot_run_it_before_anything_trains(
        where, make, error, message, adapter, matrix_client, initial):
    """The same refusal on every adapter, the weights untouched. Shown failing: before the runner was chosen
    in the trainer, the built-in layers ran an elastic fit with the hook fed by progress events instead."""
    keras = adapter.keras
    x, y = data(rows=32)
    calls = []

    class BatchHook(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            calls.append(batch)

    with make(matrix_client) as strategy:
        with strategy.scope():
            model = adapter.model(initial)
        with pytest.raises(error, match=message):
            model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[BatchHook()])
        assert calls == []
        assert_weights(model.get_weights(), [np.asarray(w, np.float64) for w in initial], rtol=0, atol=0)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=str)
def test_an_interrupted_fit_resumes_from_its_backup_and_early_stopping_ends_it(adapter, matrix_client,
                                                                              initial, tmp_path):
    keras = adapter.keras
    x, y = data(rows=48)  # 3 global batches of 16
    expected = reference_fit(initial, x, y, BATCH, epochs=4)
    backup = str(tmp_path / "backup")
    begun = []

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            begun.append(epoch)
            if epoch == 2 and begun.count(2) == 1:
                raise RuntimeError("interrupted")

    combination = next(c for c in SPLITS if c.name == "mirrored_two_devices")
    with combination.strategy(matrix_client) as strategy:
        with strategy.scope():
            model = adapter.model(initial)
        with pytest.raises(RuntimeError, match="interrupted"):
            model.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0,
                      callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()])
        with strategy.scope():  # a new model (other weights): what it trains from is the backup's
            resumed = adapter.model([w * 0 for w in initial])
        history = resumed.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0,
                              callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()])
        assert begun == [0, 1, 2, 2, 3]
        assert history.epoch == [2, 3]
        np.testing.assert_allclose(history.history["loss"], expected.loss[2:], rtol=1e-5)
        assert_weights(resumed.get_weights(), expected.weights)
        adapter.assert_replicas_identical(strategy, resumed)
        assert not os.path.exists(backup)  # removed once training finished

        with strategy.scope():
            stopped = adapter.model(initial)
        stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=100.0)
        history = stopped.fit(x, y, batch_size=BATCH, epochs=10, shuffle=False, verbose=0, callbacks=[stopper])
        assert history.epoch == [0, 1] and stopped.stop_training  # no epoch improved the loss by 100
        assert_weights(stopped.get_weights(), expected.epoch_weights[1])
