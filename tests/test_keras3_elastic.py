"""What only the Keras 3 adapter's elastic ``fit`` has (torch backend): a replayed commit rebuilt bit for bit.

Elastic ``fit`` itself (no failure, kills, growth, retirement) runs on every adapter in
``tests/test_matrix_elastic.py``.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")
pytest.importorskip("torch")
pytest.importorskip("keras")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests.keras3_models import compile_model, dense_data  # noqa: E402

pytestmark = pytest.mark.timeout(600)
RTOL = 1e-5


def test_a_replayed_commit_rebuilds_bit_for_bit_the_state_a_full_copy_holds():
    """A commit kept as the full commit before it and its steps' reduced gradients (``ReplayedCommit``) is
    rebuilt to the weights, Adam's slots, moving statistics and random states a copy at that step holds.

    Shown failing: rebuilt from the gradients of all but the last step (``log[:-1]``), the weights differ.
    """
    from daskdist.elastic.replica import Commit
    from daskdist.group.service import MODEL, ResidentStore
    from daskdist.plugins.keras3 import hooks
    from daskdist.plugins.keras3.resident import KerasTrainable
    from daskdist.strategy.drivers.contract import SpmdStepDriver
    from daskdist.training.commits import ReplayedCommit

    hooks.install()
    x, y = dense_data(rows=96)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                              keras.layers.Dropout(0.3, seed=3), keras.layers.Dense(4)])
    compile_model(model, keras.optimizers.Adam(1e-2))
    model.fit(x[:24], y[:24], verbose=0)  # built, Adam's slots made
    store, resident = ResidentStore(), KerasTrainable(model)
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
    full = store.snapshot((MODEL,))[(MODEL, "m")]  # the state after the 3 steps
    replayed = ReplayedCommit((1, 0, 3), base, list(log), resident.step_state(), store, (MODEL, "m"), None)
    resident.train_step((x[72:], y[72:]), lambda g, rows, sums=(), summed=False: g)  # the live model moves on
    rebuilt = replayed.state[(MODEL, "m")]
    for part in ("variables", "optimizer"):
        assert len(rebuilt[part]) == len(full[part])
        for got, want in zip(rebuilt[part], full[part]):
            np.testing.assert_array_equal(got, want)
    for got, want in zip(rebuilt["rng"].states, full["rng"].states):
        np.testing.assert_array_equal(got, want)
    live = store.snapshot((MODEL,))[(MODEL, "m")]  # the rebuild left the model at the commit
    for got, want in zip(live["variables"], full["variables"]):
        np.testing.assert_array_equal(got, want)
