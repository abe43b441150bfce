"""Elastic ``fit`` of a Keras 3 model (torch backend): a worker and its nanny killed mid-epoch, the run finishes.

The workers are ``dask worker`` processes started by the test (``process_workers``), so a kill -9 of a worker
and its nanny leaves nothing to replace it. The reference is plain Keras in this process on the same global
batches: the SPMD driver's gradient is the global batch's whatever its split over the replicas left.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")
pytest.importorskip("torch")
pytest.importorskip("keras")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import daskdist as dd  # noqa: E402
from daskdist.cluster.identity import scheduler_workers  # noqa: E402
from daskdist.keras.models import PROGRESS_TOPIC  # noqa: E402
from daskdist.plugins.keras3.backend import prepare_replica  # noqa: E402
from tests.keras3_models import assert_replicas_identical, compile_model, dense_data, sequential, twin  # noqa: E402
from tests.support.killers import FreeAtStep, kill_at_step, killed_at, reported_step  # noqa: E402
from tests.support.models import slow_batch  # noqa: E402

pytestmark = pytest.mark.timeout(600)
RTOL = 1e-5


def _adam():
    return keras.optimizers.Adam(1e-2)


def _assert_as_uninterrupted(strategy, model, history, plain, expected, steps=10, rows=240):
    """Two epochs of ``steps`` steps over ``rows`` rows trained as the uninterrupted one-process run ``plain``."""
    for e in (0, 1):  # every row of each epoch in exactly one committed step
        assert history.elastic.ledger.steps(e) == list(range(steps))
        assert sorted(history.elastic.ledger.positions(e).tolist()) == list(range(rows))
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 2 * steps  # Adam's step count: the replayed steps once
    assert history.history["loss"] == pytest.approx(expected.history["loss"], rel=RTOL)
    assert history.history["accuracy"] == pytest.approx(expected.history["accuracy"], rel=RTOL)
    assert_replicas_identical(strategy, model)


def test_an_elastic_keras3_fit_without_failures_trains_as_one_process(forked_process_client):
    x, y = dense_data(rows=96)
    train = dd.data.Dataset.from_tensor_slices((x, y)).batch(24)
    # the client's third worker is free: max_replicas keeps it out (free workers join at the start of fit)
    options = dd.ElasticOptions(min_replicas=1, max_replicas=2, commit_every=2)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=forked_process_client, elastic=options) as strategy:
        with strategy.scope():
            model = compile_model(sequential(), _adam())
        plain = twin(model, sequential, _adam())
        history = model.fit(train, epochs=2, verbose=0)
        expected = plain.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
        for a, b in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6)
        assert history.history["loss"] == pytest.approx(expected.history["loss"], rel=RTOL)
        ledger = history.elastic.ledger
        assert ledger.steps(0) == ledger.steps(1) == [0, 1, 2, 3]
        assert sorted(ledger.positions(1).tolist()) == list(range(96))
        assert history.elastic.events == []


@pytest.mark.slow
def test_a_worker_killed_mid_epoch_keras3_fit_finishes_with_the_uninterrupted_weights(process_workers):
    workers = process_workers(3)
    # Keras and torch imported on the workers before the elastic group starts: an import that holds a loaded
    # worker's GIL for seconds would miss the group's heartbeats (daskdist.group.heartbeat-timeout)
    workers.client.run(prepare_replica, "torch")
    x, y = dense_data(rows=240)
    train = dd.data.Dataset.from_tensor_slices((x, y)).batch(24).map(slow_batch)  # 10 steps per epoch
    options = dd.ElasticOptions(min_replicas=2, commit_every=2)
    with dd.MirroredStrategy(client=workers.client, elastic=options) as strategy:
        assert strategy.num_replicas_in_sync == 3
        with strategy.scope():
            model = compile_model(sequential(), _adam())
        plain = twin(model, sequential, _adam())  # the uninterrupted run: the same global batches, one process
        model.evaluate(x[:24], y[:24], verbose=0)  # the model on the replicas before the kill watcher's clock starts
        plain.evaluate(x[:24], y[:24], verbose=0)
        victim = strategy.extended.worker_addresses[1]
        thread, record = kill_at_step(workers, victim, step=5)
        history = model.fit(train, epochs=2, verbose=0)
        thread.join(5)
        assert "killed" in record, "the worker was never killed"
        expected = plain.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
        assert strategy.num_replicas_in_sync == 2 and victim not in strategy.extended.worker_addresses
        (event,) = history.elastic.events
        assert event.lost == [victim] and len(event.members) == 2
        _, epoch, step = event.commit
        assert epoch == 0 and 0 < step < 10 and step % 2 == 0  # back to a commit mid-epoch
        assert history.elastic_events[0]["lost"] == [victim]
        _assert_as_uninterrupted(strategy, model, history, plain, expected)


@pytest.mark.slow
def test_a_worker_lost_while_keras3_fit_installs_the_model_is_recovered_and_fit_trains_on_the_others(
        process_workers, tmp_path):
    """The replica of rank 1 killed (with its nanny) at fault point ``install``: it holds the model, the client
    has no answer. ``fit`` re-forms the group on the two left, installs the model there and trains as one process.

    Shown failing: with ``KerasElasticFit.prepare`` calling ``prepare()`` once (no ``prepare_members``), ``fit``
    raises the install's ``ReplicaLostError`` and nothing trains.
    """
    workers = process_workers(3)
    workers.client.run(prepare_replica, "torch")  # Keras imported before the group starts (see above)
    x, y = dense_data(rows=240)
    train = dd.data.Dataset.from_tensor_slices((x, y)).batch(24)  # 10 steps per epoch
    changes = []
    told = []

    class Told(keras.callbacks.Callback):
        def on_membership_change(self, event):
            told.append(event["action"])

    options = dd.ElasticOptions(min_replicas=2, commit_every=2,
                                on_membership_change=lambda old, new: changes.append((old, new)))
    with dd.MirroredStrategy(client=workers.client, elastic=options) as strategy:
        assert strategy.num_replicas_in_sync == 3
        with strategy.scope():
            model = compile_model(sequential(), _adam())
        plain = twin(model, sequential, _adam())  # the uninterrupted run: the same global batches, one process
        victim = strategy.extended.worker_addresses[1]
        with killed_at(workers, tmp_path / "paused.json", "install", step=0, rank=1) as killer:
            history = model.fit(train, epochs=2, verbose=0, callbacks=[Told()])  # the install: fit's first command
        assert (killer.join()["address"], killer.record["phase"]) == (victim, "install")
        expected = plain.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
        assert strategy.num_replicas_in_sync == 2 and victim not in strategy.extended.worker_addresses
        (event,) = history.elastic.events
        assert (event.action, event.lost, event.commit, event.generation) == ("reinstalled", [victim], (0, 0, 0), 1)
        assert history.elastic.failures == 1 and changes == [(3, 2)] and told == ["reinstalled"]
        assert history.elastic_events[0]["lost"] == [victim]
        _assert_as_uninterrupted(strategy, model, history, plain, expected)


@pytest.mark.slow
def test_a_free_worker_joins_a_keras3_fit_mid_epoch_at_a_commit_and_the_weights_are_the_uninterrupted_ones(
        process_workers):
    """A third worker, busy (Dask's ``paused``) until replica 0 reported step 1, joins at the next commit: it is
    given the model, then the commit; the epoch goes on from there over 3 replicas with the same global batches.

    Shown failing: with ``KerasElasticFit.train_epoch`` sending ``room=False`` (no look for free workers
    mid-epoch) the worker joins only at the epoch boundary (commit step 10): ``assert 10 < 10`` fails.
    """
    workers = process_workers(3)
    workers.client.run(prepare_replica, "torch")  # Keras imported everywhere before the group starts (see above)
    x, y = dense_data(rows=240)
    train = dd.data.Dataset.from_tensor_slices((x, y)).batch(24).map(slow_batch)  # 10 steps per epoch
    options = dd.ElasticOptions(min_replicas=2, max_replicas=3, commit_every=2, admit_every="0.3s", max_failures=0)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=workers.client, elastic=options) as strategy:
        (free,) = set(scheduler_workers(workers.client)) - set(strategy.extended.worker_addresses)
        with strategy.scope():
            model = compile_model(sequential(), _adam())
        plain = twin(model, sequential, _adam())
        arrival = FreeAtStep(workers.client, free, step=1, since=time.time())  # free only once the epoch runs
        workers.watch(arrival)
        history = model.fit(train, epochs=2, verbose=0)
        assert arrival.released
        expected = plain.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
        (event,) = history.elastic.events
        assert (event.action, event.admitted, event.lost) == ("grew", [free], [])
        assert 0 < event.commit[2] < 10 and event.commit[2] % 2 == 0  # at a commit mid-epoch
        assert strategy.num_replicas_in_sync == 3 and free in strategy.extended.worker_addresses
        assert history.elastic.failures == 0
        _assert_as_uninterrupted(strategy, model, history, plain, expected)


@pytest.mark.slow
def test_a_retired_member_leaves_a_keras3_fit_at_a_commit_with_nothing_replayed_and_no_failure_counted(
        process_workers):
    """``retire_workers`` of rank 0 once replica 0 reported step 3: the replicas stop at the next commit, the
    group re-forms without it (event ``left``, no rollback: no ``restored`` event, replica 0's steps only go up),
    and ``max_failures=0`` is not spent.

    Shown failing: with the retiring flag left out of the commit's sums (``boundary_flags`` reporting 0 for it
    in ``KerasCommits``) nothing stops mid-epoch: the member leaves only at the epoch's end (commit step 40).
    """
    workers = process_workers(3)
    workers.client.run(prepare_replica, "torch")
    rows = 960  # 40 steps: a retirement asked at step 3 lands within the epoch under load
    x, y = dense_data(rows=rows)
    train = dd.data.Dataset.from_tensor_slices((x, y)).batch(24).map(slow_batch)  # slowed until it has left
    options = dd.ElasticOptions(min_replicas=2, commit_every=2, max_failures=0)
    with dd.MirroredStrategy(client=workers.client, elastic=options) as strategy:
        assert strategy.num_replicas_in_sync == 3
        with strategy.scope():
            model = compile_model(sequential(), _adam())
        plain = twin(model, sequential, _adam())
        model.evaluate(x[:24], y[:24], verbose=0)  # the model on the replicas before the retirement's clock
        plain.evaluate(x[:24], y[:24], verbose=0)
        victim = strategy.extended.worker_addresses[0]  # rank 0: the new rank 0 goes on from the same commit
        since = time.time()
        retired = {}

        def retire():
            deadline = time.monotonic() + 120
            while not reported_step(workers.client, since, 3) and time.monotonic() < deadline:
                time.sleep(0.02)
            retired["answer"] = workers.client.retire_workers(workers=[victim], close_workers=True)
            deadline = time.monotonic() + 60
            while victim in scheduler_workers(workers.client) and time.monotonic() < deadline:
                time.sleep(0.05)
            workers.slow_steps(False)  # it has left: the rest needs no slowing

        thread = threading.Thread(target=retire, daemon=True)
        thread.start()
        history = model.fit(train, epochs=2, verbose=0)
        thread.join(60)
        assert "answer" in retired, "the member was never retired"
        expected = plain.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
        (event,) = history.elastic.events
        assert (event.action, event.left, event.lost, len(event.members)) == ("left", [victim], [], 2)
        assert event.commit[1] == 0 and 3 <= event.commit[2] < rows // 24 and event.commit[2] % 2 == 0
        assert history.elastic.failures == 0
        assert strategy.num_replicas_in_sync == 2 and victim not in strategy.extended.worker_addresses
        elastic_events = [m for t, m in workers.client.get_events("daskdist-elastic") if t > since]
        assert [m["action"] for m in elastic_events] == ["left"]  # no rollback ("restored") at all
        steps = [m["step"] for t, m in workers.client.get_events(PROGRESS_TOPIC)
                 if t > since and m.get("epoch") == 0 and m.get("step", -1) >= 0]
        assert steps and steps == sorted(steps)  # replica 0's step never went back: nothing replayed
        _assert_as_uninterrupted(strategy, model, history, plain, expected, steps=rows // 24, rows=rows)


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
    compile_model(model, _adam())
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
