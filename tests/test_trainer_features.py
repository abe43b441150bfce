"""Fit features the trainer writes once, run on every adapter: the built-in layers and Keras 3 (torch backend).

Each test runs one body over both adapters (``adapter`` fixture): the same
small classifier, the same data, the same strategy, the same callbacks.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import daskdist as dd
from daskdist.training.progress import PROGRESS_TOPIC

pytestmark = pytest.mark.timeout(300)
TWO = ["/cpu:0", "/cpu:1"]


class _Builtin:
    name = "builtin"

    def __init__(self):
        from daskdist import keras

        self.keras = keras
        self.Callback = keras.callbacks.Callback

    def model(self):
        keras = self.keras
        model = keras.Sequential([keras.layers.Dense(16, activation="relu", input_shape=(8,)), keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def history(self, history):
        return history.history

    def dropout_model(self):
        keras = self.keras
        model = keras.Sequential([keras.layers.Dense(16, input_shape=(8,)), keras.layers.BatchNormalization(),
                                  keras.layers.Dropout(0.3, seed=3), keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.build((8,))
        return model

    def trainable(self, model):
        from daskdist.keras.trainable import BuiltinTrainable

        return BuiltinTrainable(model)


class _Keras3:
    name = "keras3-torch"

    def __init__(self):
        os.environ.setdefault("KERAS_BACKEND", "torch")
        pytest.importorskip("torch")
        keras = pytest.importorskip("keras")
        self.keras = keras
        self.Callback = keras.callbacks.Callback

    def model(self):
        keras = self.keras
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def history(self, history):
        return history.history

    def dropout_model(self):
        keras = self.keras
        from daskdist.plugins.keras3 import hooks

        hooks.install()
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                                  keras.layers.Dropout(0.3, seed=3), keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = _data(24)
        model.fit(x, y, verbose=0)  # built, Adam's slots made
        return model

    def trainable(self, model):
        from daskdist.plugins.keras3.resident import KerasTrainable

        return KerasTrainable(model)


@pytest.fixture(params=["builtin", "keras3-torch"])
def adapter(request):
    return _Builtin() if request.param == "builtin" else _Keras3()


def _data(rows: int = 80):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 8)).astype("float32")
    y = (np.argmax(x[:, :4], axis=1)).astype("int64")
    return x, y


def test_per_batch_callbacks_see_every_batch_with_the_epochs_running_global_logs(threaded_client, adapter):
    x, y = _data()  # 5 global batches of 16

    class Recorder(adapter.Callback):
        def __init__(self):
            super().__init__()
            self.calls = []

        def on_train_batch_begin(self, batch, logs=None):
            self.calls.append(("begin", batch))

        def on_train_batch_end(self, batch, logs=None):
            self.calls.append(("end", batch, float(logs["loss"])))

    with dd.MirroredStrategy(devices=TWO, client=threaded_client) as strategy:
        with strategy.scope():
            model = adapter.model()
        recorder = Recorder()
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[recorder])
    assert [c[:2] for c in recorder.calls] == [(kind, b) for _ in range(2) for b in range(5)
                                                 for kind in ("begin", "end")]
    ends = [c[2] for c in recorder.calls if c[0] == "end"]
    # the last batch's running loss is the epoch's loss: every replica's rows of the whole epoch
    losses = adapter.history(history)["loss"]
    np.testing.assert_allclose([ends[4], ends[9]], losses, rtol=1e-5)


def test_replica_zero_sends_live_progress_and_each_epochs_end_to_the_dashboard(threaded_client, adapter):
    x, y = _data()
    with dd.MirroredStrategy(devices=TWO, client=threaded_client) as strategy:
        with strategy.scope():
            model = adapter.model()
        since = threaded_client.run_on_scheduler(lambda: __import__("time").time())
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        deadline = time.monotonic() + 10  # events reach the scheduler asynchronously (Worker.log_event)
        while True:
            events = [m for t, m in threaded_client.get_events(PROGRESS_TOPIC) if t >= since]
            ends = [m for m in events if m["step"] == -1]
            if len(ends) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert [m["epoch"] for m in ends] == [0, 1]
    assert len({m["tag"] for m in ends}) == 1
    np.testing.assert_allclose([m["logs"]["loss"] for m in ends], adapter.history(history)["loss"], rtol=1e-5)
    assert any(m["step"] >= 1 for m in events if m["step"] != -1)  # and at least one event while an epoch ran


def _leaves(state):
    import optree

    return [np.asarray(leaf) for key, value in state.items() if key not in ("rng", "metrics")
            for leaf in optree.tree_leaves(value)]


def test_a_replayed_commit_rebuilds_bit_for_bit_what_a_full_copy_holds(adapter):
    """A commit kept as the full commit before it plus its steps' reduced gradients is rebuilt to the very
    weights, moving statistics and optimizer slots a copy at that step holds, for every adapter's model.

    Shown failing for the built-in layers with ``step_state`` keeping no moving statistics: the rebuilt
    BatchNormalization moving mean is the full commit's, not the step's."""
    from daskdist.elastic.replica import Commit
    from daskdist.group.service import MODEL, ResidentStore
    from daskdist.strategy.drivers.contract import SpmdStepDriver
    from daskdist.training.commits import ReplayedCommit

    x, y = _data(96)
    resident = adapter.trainable(adapter.dropout_model())
    store = ResidentStore()
    store.install(MODEL, "m", resident)
    base = Commit((1, 0, 0), store.snapshot((MODEL,)), {})
    log = []

    def keep(inner):
        def exchanged(gradients, rows, sums=(), summed=False):
            reduced = inner(gradients, rows, sums, summed)
            log.append([np.array(g, copy=True) for g in reduced])
            return reduced
        return exchanged

    resident.exchange_hook = keep
    driver = SpmdStepDriver()
    for i in range(0, 72, 24):
        assert resident.train_batch((x[i:i + 24], y[i:i + 24]), driver) == 24
    resident.exchange_hook = None
    full = store.snapshot((MODEL,))[(MODEL, "m")]
    replayed = ReplayedCommit((1, 0, 3), base, list(log), resident.step_state(), store, (MODEL, "m"), None)
    resident.train_batch((x[72:], y[72:]), driver)  # the live model moves on
    rebuilt = replayed.state[(MODEL, "m")]
    got, want = _leaves(rebuilt), _leaves(full)
    assert len(got) == len(want) > 2
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(_leaves(base.state[(MODEL, "m")]), want))


def test_an_epochs_commits_go_with_their_last_reference_at_the_commands_end(adapter):
    """An elastic epoch's ``Commits`` hold the reduced gradients kept since the full commit and that commit's
    copy; when the epoch command ends they go at once, not at a later garbage collection (a cycle through the
    exchange function they hand the resident each step would keep them: the next steps then fault fresh memory
    in). Shown failing with that function cached and not let go at ``finish``."""
    import gc
    import types
    import weakref

    from daskdist.elastic.boundary import FreeWorkerWatch
    from daskdist.group.service import MODEL, ResidentStore
    from daskdist.strategy.drivers.contract import SpmdStepDriver
    from daskdist.training.commits import Commits, ReplayedCommit

    x, y = _data(96)
    service = types.SimpleNamespace(objects=ResidentStore(), rank=0, worker=None, group_id=None)
    resident = adapter.trainable(adapter.dropout_model())
    service.objects.install(MODEL, "m", resident)
    driver = SpmdStepDriver()
    resident.train_batch((x[:24], y[:24]), driver)  # a first step: the optimizer's slots exist
    commits = Commits(service, "m", resident, driver, FreeWorkerWatch(service, None, False), (1, 0, 0), None)
    resident.exchange_hook = commits.exchange
    for step in range(4):
        commits.before_step(at_commit=step < 3)
        resident.train_batch((x[24 * step:24 * step + 24], y[24 * step:24 * step + 24]), driver)
        commits.after_step((1, 0, step + 1))
    resident.exchange_hook = None
    commits.finish()
    ring = commits.ring
    assert isinstance(ring.get((1, 0, 3)), ReplayedCommit) and len(commits.log) == 3
    kept = weakref.ref(commits.log[0][0])
    gone = weakref.ref(commits)
    gc.disable()
    try:
        del commits
        assert gone() is None
    finally:
        gc.enable()
    ring.commits.clear()
    assert kept() is None  # the kept gradients went with them (the all-reduce's arrays alone: copies)
    ring.copier.shutdown()


def test_an_elastic_fit_committing_every_step_keeps_replayed_commits_and_trains_as_a_plain_fit(
        threaded_client, adapter):
    """At ``commit_every=1`` most commits are replayed (no copy of the state), and the fit's weights and
    logs are those of the same fit without elasticity."""

    x, y = _data(96)
    train = dd.data.Dataset.from_tensor_slices((x, y)).batch(24)
    results, initial = [], None
    for elastic in (None, dd.ElasticOptions(min_replicas=2, commit_every=1)):
        with dd.MirroredStrategy(client=threaded_client, elastic=elastic) as strategy:
            with strategy.scope():
                model = adapter.model()
            if initial is None:
                initial = [np.array(w, copy=True) for w in model.get_weights()]
            else:
                model.set_weights(initial)
            history = model.fit(train, epochs=2, verbose=0)
            results.append((model.get_weights(), adapter.history(history)))
            if elastic is not None:
                kinds = strategy.extended.run_on_replicas(_ring_kinds, ())
    assert all(kinds_of == ["ReplayedCommit", "Commit"] for kinds_of in kinds), kinds
    for a, b in zip(results[0][0], results[1][0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for key in results[0][1]:
        np.testing.assert_allclose(results[0][1][key], results[1][1][key], rtol=1e-5)


def _ring_kinds(service):
    from daskdist.elastic.replica import commit_ring

    return [type(commit).__name__ for commit in commit_ring(service).commits.values()]
