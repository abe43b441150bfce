"""Elastic ``fit`` (MirroredStrategy over every worker) on every in-process adapter: no failure, a worker
killed mid-epoch or while the model installs, a free worker admitted mid-epoch, a member retired.

One body per behaviour, run once per adapter of the suite's process (Keras 3 on JAX: its elastic kill in
``tests/test_keras3_jax.py``) (a kill costs a fresh worker set: not multiplied by strategy
combinations; MultiWorkerMirrored's elastic runs are in ``tests/test_elastic_multi_worker.py``). Each ends
with the weights and logs of the numpy reference on the same global batches (``tests/support/adapters.py``:
SGD, so a gradient off by the number of replicas shows as a factor, not Adam's fraction of a percent), every
row of each epoch in exactly one committed step, the optimizer's step count once per step, and identical
replicas. The workers are fresh processes (``process_workers``): a kill leaves nothing to replace them.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers
from daskdist.training.progress import PROGRESS_TOPIC
from tests.support.adapters import FORKED_ADAPTERS, assert_weights, data, reference_evaluate, reference_fit
from tests.support.killers import FreeAtStep, RetireAtStep, kill_at_step, killed_at
from tests.support.models import slow_batch

pytestmark = pytest.mark.timeout(600)

BATCH = 24


@pytest.fixture(scope="module")
def initial():
    rng = np.random.default_rng(14)
    return [rng.uniform(-0.5, 0.5, shape).astype(np.float32) for shape in ((8, 16), (16,), (16, 4), (4,))]


def _train_set(rows: int, slow: bool = False):
    x, y = data(rows=rows)
    dataset = dd.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    return x, y, dataset.map(slow_batch) if slow else dataset


def _assert_as_one_process(adapter, strategy, model, history, expected, rows: int, epochs: int) -> None:
    steps = -(-rows // BATCH)
    for e in range(epochs):  # every row of each epoch in exactly one committed step
        assert history.elastic.ledger.steps(e) == list(range(steps))
        assert sorted(history.elastic.ledger.positions(e, history.elastic.rows).tolist()) == list(range(rows))
    assert_weights(model.get_weights(), expected.weights)
    assert history.history["loss"] == pytest.approx(expected.loss, rel=1e-5)
    assert history.history["accuracy"] == pytest.approx(expected.accuracy, rel=1e-5)
    assert adapter.iterations(model) == epochs * steps  # the replayed steps counted once
    adapter.assert_replicas_identical(strategy, model)


@pytest.mark.parametrize("adapter", FORKED_ADAPTERS, ids=str)
def test_an_elastic_fit_without_failures_trains_and_validates_as_one_process(adapter, forked_process_client,
                                                                           initial):
    x, y, train = _train_set(120)
    expected = reference_fit(initial, x, y, BATCH, epochs=2)
    # the client's third worker is free: max_replicas keeps it out (free workers join at the start of fit)
    options = dd.ElasticOptions(min_replicas=1, max_replicas=2, commit_every=2)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=forked_process_client, elastic=options) as strategy:
        assert strategy.extended.group.spec.policy == "elastic"
        with strategy.scope():
            model = adapter.model(initial)
        history = model.fit(train, epochs=2, verbose=0, validation_data=(x[:40], y[:40]))
        assert history.elastic.events == []
        _assert_as_one_process(adapter, strategy, model, history, expected, rows=120, epochs=2)
    # each epoch's validation (the trainer's EpochRunner over the elastic runner): every row once, with the
    # epoch's weights
    want = [reference_evaluate(weights, x[:40], y[:40]) for weights in expected.epoch_weights]
    assert history.history["val_loss"] == pytest.approx([w[0] for w in want], rel=1e-5)
    assert history.history["val_accuracy"] == pytest.approx([w[1] for w in want], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", FORKED_ADAPTERS, ids=str)
def test_a_worker_killed_mid_epoch_fit_finishes_with_the_uninterrupted_weights(adapter, process_workers, initial):
    workers = process_workers(3)
    adapter.prepare_workers(workers.client)
    x, y, train = _train_set(240, slow=True)  # 10 steps per epoch
    expected = reference_fit(initial, x, y, BATCH, epochs=2)
    options = dd.ElasticOptions(min_replicas=2, commit_every=2)
    with dd.MirroredStrategy(client=workers.client, elastic=options) as strategy:
        assert strategy.num_replicas_in_sync == 3
        with strategy.scope():
            model = adapter.model(initial)
        model.evaluate(x[:BATCH], y[:BATCH], verbose=0)  # the model on the replicas before the kill's clock starts
        victim = strategy.extended.worker_addresses[1]
        thread, record = kill_at_step(workers, victim, step=5)  # once replica 0 reported step 5 of epoch 0
        history = model.fit(train, epochs=2, verbose=0)
        thread.join(5)
        assert "killed" in record, "the worker was never killed"
        assert strategy.num_replicas_in_sync == 2 and victim not in strategy.extended.worker_addresses
        (event,) = history.elastic.events
        assert event.lost == [victim] and event.generation == 1 and len(event.members) == 2
        _, epoch, step = event.commit
        assert epoch == 0 and 0 < step < 10 and step % 2 == 0  # back to a commit mid-epoch
        assert history.elastic_events[0]["lost"] == [victim]
        _assert_as_one_process(adapter, strategy, model, history, expected, rows=240, epochs=2)
        # the scheduler logged the new generation and the restore as Dask events
        assert any(m.get("action") == "generation" for _, m in workers.client.get_events("daskdist"))
        assert any(m.get("action") == "restored" for _, m in workers.client.get_events("daskdist-elastic"))


@pytest.mark.slow
@pytest.mark.parametrize("adapter", FORKED_ADAPTERS, ids=str)
def test_a_worker_lost_while_fit_installs_the_model_is_recovered_and_fit_trains_on_the_others(
        adapter, process_workers, initial, tmp_path):
    """Rank 1 killed at fault point ``install``: it holds the model, the client has no answer. ``fit`` re-forms
    the group on the two left, installs the model there and trains as one process.

    Shown failing: with ``prepare_members`` calling ``prepare()`` once (no recovery), ``fit`` raises the
    install's ``ReplicaLostError`` and nothing trains.
    """
    workers = process_workers(3)
    adapter.prepare_workers(workers.client)
    x, y, train = _train_set(240)
    expected = reference_fit(initial, x, y, BATCH, epochs=2)
    changes, told = [], []

    class Told(adapter.keras.callbacks.Callback):
        def on_membership_change(self, event):
            told.append(event["action"])

    options = dd.ElasticOptions(min_replicas=2, commit_every=2,
                                on_membership_change=lambda old, new: changes.append((old, new)))
    with dd.MirroredStrategy(client=workers.client, elastic=options) as strategy:
        with strategy.scope():
            model = adapter.model(initial)
        victim = strategy.extended.worker_addresses[1]
        with killed_at(workers, tmp_path / "paused.json", "install", step=0, rank=1) as killer:
            history = model.fit(train, epochs=2, verbose=0, callbacks=[Told()])  # the install: fit's first command
        assert (killer.join()["address"], killer.record["phase"]) == (victim, "install")
        assert strategy.num_replicas_in_sync == 2 and victim not in strategy.extended.worker_addresses
        (event,) = history.elastic.events
        assert (event.action, event.lost, event.commit, event.generation) == ("reinstalled", [victim], (0, 0, 0), 1)
        assert history.elastic.failures == 1 and changes == [(3, 2)] and told == ["reinstalled"]
        assert history.elastic_events[0]["lost"] == [victim]
        _assert_as_one_process(adapter, strategy, model, history, expected, rows=240, epochs=2)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", FORKED_ADAPTERS, ids=str)
def test_a_free_worker_joins_mid_epoch_at_a_commit_and_the_weights_are_the_uninterrupted_ones(
        adapter, process_workers, initial):
    """A third worker, busy (Dask's ``paused``) until replica 0 reported step 1, joins at the next commit: it is
    given the model, then the commit; the epoch goes on over 3 replicas with the same global batches.

    Shown failing: with the elastic epoch sending ``room=False`` (no look for free workers mid-epoch) the worker
    joins only at the epoch boundary (commit step 10).
    """
    workers = process_workers(3)
    adapter.prepare_workers(workers.client)
    x, y, train = _train_set(240, slow=True)  # 10 steps of about 0.12 s
    expected = reference_fit(initial, x, y, BATCH, epochs=2)
    options = dd.ElasticOptions(min_replicas=2, max_replicas=3, commit_every=2, admit_every="0.3s", max_failures=0)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=workers.client, elastic=options) as strategy:
        (free,) = set(scheduler_workers(workers.client)) - set(strategy.extended.worker_addresses)
        with strategy.scope():
            model = adapter.model(initial)
        # free only once the epoch runs; the steps slowed until it joined
        arrival = FreeAtStep(workers.client, free, step=1, since=time.time(), workers=workers)
        workers.watch(arrival)
        history = model.fit(train, epochs=2, verbose=0)
        assert arrival.released
        (event,) = history.elastic.events
        assert (event.action, event.admitted, event.lost) == ("grew", [free], [])
        assert event.commit[1] == 0 and 0 < event.commit[2] < 10 and event.commit[2] % 2 == 0  # a commit mid-epoch
        assert strategy.num_replicas_in_sync == 3 and free in strategy.extended.worker_addresses
        assert history.elastic.failures == 0
        _assert_as_one_process(adapter, strategy, model, history, expected, rows=240, epochs=2)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", FORKED_ADAPTERS, ids=str)
def test_a_retired_member_leaves_at_a_commit_with_nothing_replayed_and_no_failure_counted(
        adapter, process_workers, initial, caplog):
    """``retire_workers`` of rank 0 once replica 0 reported step 3: the replicas stop at the next commit, the
    group re-forms without it (event ``left``, no rollback), ``max_failures=0`` is not spent, and the strategy
    then closes cleanly.

    Shown failing: with the retiring flag left out of the commit's sums nothing stops mid-epoch: the member
    leaves only at the epoch's end.
    """
    workers = process_workers(3)
    adapter.prepare_workers(workers.client)
    rows = 960  # 40 steps of about 0.12 s: a retirement asked at step 3 lands within the epoch under load
    x, y, train = _train_set(rows, slow=True)  # slowed until the member has left
    expected = reference_fit(initial, x, y, BATCH, epochs=1)
    strategy = dd.MirroredStrategy(client=workers.client,
                                   elastic=dd.ElasticOptions(min_replicas=2, commit_every=2, max_failures=0))
    with strategy.scope():
        model = adapter.model(initial)
    model.evaluate(x[:BATCH], y[:BATCH], verbose=0)  # the model on the replicas before the retirement's clock
    victim = strategy.extended.worker_addresses[0]  # rank 0: the new rank 0 goes on from the same commit
    since = time.time()
    retirer = RetireAtStep(workers, victim, step=3)  # slowed steps turned off once it has left
    history = model.fit(train, epochs=1, verbose=0)
    retirer.join()
    (event,) = history.elastic.events
    assert (event.action, event.left, event.lost, len(event.members)) == ("left", [victim], [], 2)
    assert event.commit[1] == 0 and 3 <= event.commit[2] < rows // BATCH and event.commit[2] % 2 == 0
    assert history.elastic.failures == 0
    assert strategy.num_replicas_in_sync == 2 and victim not in strategy.extended.worker_addresses
    elastic_events = [m for t, m in workers.client.get_events("daskdist-elastic") if t > since]
    assert [m["action"] for m in elastic_events] == ["left"]  # no rollback ("restored") at all
    steps = [m["step"] for t, m in workers.client.get_events(PROGRESS_TOPIC)
             if t > since and m.get("epoch") == 0 and m.get("step", -1) >= 0]
    assert steps and steps == sorted(steps)  # replica 0's step never went back: nothing replayed
    _assert_as_one_process(adapter, strategy, model, history, expected, rows=rows, epochs=1)
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="daskdist.group.handle"):
        strategy.close()
    assert time.monotonic() - start < 20
    assert "did not all stop cleanly" not in caplog.text
