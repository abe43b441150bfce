"""Elastic training of the built-in layers on real processes: losses, admissions and departures, fit finishes
exactly once. The behaviours every adapter shares (no failure, a kill mid-epoch or at the install, a worker
admitted mid-epoch, a retirement) are in ``tests/test_matrix_elastic.py``.

Workers here are ``dask worker`` processes (each with its own nanny process)
started by the test, so that a kill -9 of both leaves nothing to replace the
worker, as when a machine goes away.
"""

from __future__ import annotations

import threading
import time

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist import keras
from daskdist.cluster.identity import scheduler_workers
from daskdist.training.progress import PROGRESS_TOPIC
from tests.support import models
from tests.support.killers import RetireAtStep, killed_at
from tests.support.models import slow_batch

Dataset = dd.data.Dataset

pytestmark = pytest.mark.timeout(240)



def test_elastic_options_are_checked_and_opt_in():
    with pytest.raises(ValueError, match="min_replicas"):
        dd.ElasticOptions(min_replicas=0)
    with pytest.raises(ValueError, match="max_replicas"):
        dd.ElasticOptions(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="commit_every"):
        dd.ElasticOptions(commit_every=0)
    with pytest.raises(ValueError, match="wait_timeout"):
        dd.ElasticOptions(wait_timeout="soon")
    assert dd.ElasticOptions(2, wait_timeout="10min").wait_seconds == 600
    with pytest.raises(TypeError, match="ElasticOptions"):
        dd.MirroredStrategy(devices=["/cpu:0"], elastic={"min_replicas": 1})


def ids_as_one_hot(ids, target):
    return np.eye(60, dtype=np.float32)[ids], target


@pytest.mark.slow
def test_the_ledger_holds_every_sample_once_per_epoch_across_a_loss_with_commit_every_3(process_workers, tmp_path):
    """One-hot samples and a linear model: each weight moves only when its sample trains, so the weights show
    how many times every sample contributed to a committed update."""
    workers = process_workers(3)
    ids = np.arange(60)
    train = (Dataset.from_tensor_slices((ids, np.ones((60, 1), np.float32))).map(ids_as_one_hot)
             .batch(6))  # 10 steps per epoch
    lr = 0.3
    with dd.MirroredStrategy(client=workers.client,
                             elastic=dd.ElasticOptions(min_replicas=2, commit_every=3)) as strategy:
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros",
                                                         input_shape=(60,))])
            model.compile(loss=keras.losses.MeanSquaredError(), optimizer=keras.optimizers.SGD(lr))
        victim = strategy.extended.worker_addresses[2]
        with killed_at(workers, tmp_path / "paused.json", "forward", step=5, rank=2) as killer:
            history = model.fit(train, epochs=1, verbose=0)
        assert killer.join()["address"] == victim
        (event,) = history.elastic.events
        assert event.commit[1:] == (0, 3)  # the last commit boundary of commit_every=3 before step 5
        ledger = history.elastic.ledger
        assert ledger.steps(0) == list(range(10))
        committed = ids[ledger.positions(0, history.elastic.rows)]
        assert sorted(committed.tolist()) == ids.tolist()  # no repeats, no gaps
        # the training itself: one MSE step on sample i moves w_i from 0 to 2 * lr / 6; twice would move it more
        w = model.get_weights()[0][:, 0]
        np.testing.assert_allclose(w, np.full(60, 2 * lr / 6), rtol=1e-6)


@pytest.mark.slow
def test_below_min_replicas_the_strategy_waits_then_raises_naming_the_lost_worker(process_workers, tmp_path):
    workers = process_workers(2)
    x, y = models.data(240)
    train = Dataset.from_tensor_slices((x, y)).batch(24)
    with dd.MirroredStrategy(client=workers.client,
                             elastic=dd.ElasticOptions(min_replicas=2, wait_timeout="1s")) as strategy:
        with strategy.scope():
            model = models.model()
        victim = strategy.extended.worker_addresses[1]
        start = time.monotonic()
        with killed_at(workers, tmp_path / "paused.json", "forward", step=2, rank=1) as killer, \
                pytest.raises(dd.ReplicaLostError, match="min_replicas=2") as info:
            model.fit(train, epochs=1, verbose=0)
        waited = time.time() - killer.join()["killed"]
        assert victim in str(info.value) and "wait_timeout" in str(info.value)
        assert 1 <= waited < 30, waited
        assert time.monotonic() - start < 60


@pytest.mark.slow
def test_a_new_worker_is_admitted_when_the_group_is_below_min_replicas_and_gets_the_survivors_state(
        process_workers, tmp_path):
    """Rank 0 is lost with the Dask partitions it held: they are computed again from their graph."""
    import dask.array as da

    workers = process_workers(3)
    x, y = models.data(240)
    x_d, y_d = da.from_array(x, chunks=(40, 4)), da.from_array(y, chunks=40)
    x_d, y_d = workers.client.persist([x_d, y_d])  # six partitions spread over the three workers
    train = Dataset.from_dask((x_d, y_d)).batch(24)
    weights = models.model().get_weights()
    # the uninterrupted run on the same global batches: elastic epochs split them as TF does ("global"), the
    # split of in-memory rows (Dask data alone defaults to "balanced", which keeps rows where they live)
    in_memory = Dataset.from_tensor_slices((x, y)).batch(24)
    expected = models.one_process_fit(weights, in_memory, epochs=1).weights

    # the kill -9 closes the victim's connections at once; a long heartbeat timeout keeps a loaded machine's late
    # scheduler heartbeat from declaring another worker lost during the install (this test is not about stalls)
    with dask.config.set({"daskdist.elastic.heartbeat-timeout": "60s"}), \
            dd.MirroredStrategy(client=workers.client,
                                elastic=dd.ElasticOptions(min_replicas=3, wait_timeout="90s")) as strategy:
        with strategy.scope():
            model = models.model(weights)
        before = set(strategy.extended.worker_addresses)
        victim = strategy.extended.worker_addresses[0]  # rank 0 too: a new rank 0 is chosen
        with killed_at(workers, tmp_path / "paused.json", "forward", step=3, rank=0) as killer:
            adder = threading.Thread(target=lambda: (killer.thread.join(120), workers.add()), daemon=True)
            adder.start()  # a worker started once the kill landed
            history = model.fit(train, epochs=1, verbose=0)
        adder.join(5)
        assert killer.join()["address"] == victim
        (event,) = history.elastic.events
        (newcomer,) = event.admitted
        assert newcomer not in before and event.lost == [victim]
        assert strategy.num_replicas_in_sync == 3 and newcomer in strategy.extended.worker_addresses
        assert sorted(history.elastic.ledger.positions(0, history.elastic.rows).tolist()) == list(range(240))
        assert len(history.elastic.rows.ranges) == 6
        # the newcomer trained with the others from the survivors' commit: every replica holds rank 0's weights
        from daskdist.training.commands import model_weights

        copies = strategy.extended.group.call(model_weights, (model._model_id,))
        assert len(copies) == 3
        for copy in copies[1:]:
            assert all(np.array_equal(a, b) for a, b in zip(copy, copies[0]))
        for got, want in zip(model.get_weights(), expected):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)  # float32 summed in another order than one process


@pytest.mark.slow
def test_an_elastic_custom_loop_survives_a_loss_and_counts_every_row_once(process_workers):
    workers = process_workers(3)
    values = np.arange(1, 121, dtype=np.float64)
    dataset = Dataset.from_tensor_slices(values).batch(12)  # 10 steps per epoch
    with dd.MirroredStrategy(client=workers.client, elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
        with strategy.scope():
            total = dd.Variable(np.zeros((), np.float64), aggregation=dd.VariableAggregation.ONLY_FIRST_REPLICA)
        resets = []

        def step(rows):
            summed = dd.get_replica_context().all_reduce("SUM", rows.sum())
            total.assign_add(summed)

        @dd.elastic.run
        def train(state):
            while state.epoch < 2:
                for batch in state.batches(dataset):
                    if (state.epoch, state.batch) == (0, 5) and not killed:
                        workers.kill(victim)  # between two steps, after 5 commits: the next run fails
                        killed.append(state.steps)  # 4 steps done: state.batch counts the one taken
                    strategy.run(step, args=(batch,))
                    state.steps += 1
                    state.commit()
                state.epoch += 1

        state = dd.elastic.State(strategy, epoch=0, steps=0)
        state.register_reset_callbacks([lambda: resets.append(strategy.num_replicas_in_sync)])
        victim = strategy.extended.worker_addresses[1]
        killed = []
        train(state)
        (event,) = state.events
        assert event.lost == [victim] and resets == [2] and killed == [4]
        assert state.steps == 20 and state.epoch == 2
        # each row added exactly once per epoch, on every replica's copy: no replayed step, no skipped one
        assert total.read_value() == 2 * values.sum()
        assert [float(v) for v in strategy.extended.read_variable(total._var_id, all_replicas=True)] == \
            [2 * values.sum()] * 2
        for epoch in (0, 1):
            assert sorted(state.ledger.positions(epoch, state._rows).tolist()) == list(range(120))


@pytest.mark.slow
def test_a_loss_beyond_max_failures_raises_naming_the_worker(process_workers, tmp_path):
    workers = process_workers(3)
    x, y = models.data(240)
    train = Dataset.from_tensor_slices((x, y)).batch(24)
    with dd.MirroredStrategy(client=workers.client,
                             elastic=dd.ElasticOptions(min_replicas=1, max_failures=0)) as strategy:
        with strategy.scope():
            model = models.model()
        victim = strategy.extended.worker_addresses[2]
        with killed_at(workers, tmp_path / "paused.json", "forward", step=2, rank=2) as killer, \
                pytest.raises(dd.ReplicaLostError, match="max_failures=0 is exhausted") as info:
            model.fit(train, epochs=1, verbose=0)
        assert killer.join()["address"] == victim
        assert victim in str(info.value)


@pytest.mark.slow
def test_a_free_worker_is_admitted_at_the_start_of_fit_and_trains_with_the_same_arithmetic(process_workers):
    workers = process_workers(3)
    x, y = models.data(240)
    train = Dataset.from_tensor_slices((x, y)).batch(24)
    weights = models.model().get_weights()
    reference = models.one_process_fit(weights, train, epochs=2)
    expected = reference.weights
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=workers.client,
                             elastic=dd.ElasticOptions(min_replicas=2, max_replicas=3)) as strategy:
        (free,) = set(scheduler_workers(workers.client)) - set(strategy.extended.worker_addresses)
        with strategy.scope():
            model = models.model(weights)
        changes = []

        class Watch(keras.callbacks.Callback):
            def on_membership_change(self, event):
                changes.append((event["action"], len(event["members"]), strategy.num_replicas_in_sync))

        history = model.fit(train, epochs=2, verbose=0, callbacks=[Watch()])
        assert changes == [("grew", 3, 3)]  # told once the newcomer is in, before the epoch it trains in
        (event,) = history.elastic.events
        # free workers join at the start of every fit, at its first commit
        assert event.admitted == [free] and event.lost == [] and event.commit[1:] == (0, 0)
        assert strategy.num_replicas_in_sync == 3
        assert history.elastic_events[0]["action"] == "grew" and history.elastic_events[0]["admitted"] == [free]
        assert sorted(history.elastic.ledger.positions(1, history.elastic.rows).tolist()) == list(range(240))
        for got, want in zip(model.get_weights(), expected):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)  # float32 summed in another order than one process
        assert history.history["loss"] == pytest.approx(reference.history["loss"], rel=1e-5)
        assert any(m.get("action") == "grew" for _, m in workers.client.get_events("daskdist-elastic"))


@pytest.mark.slow
def test_two_workers_killed_at_once_fit_finishes_on_the_other_two(process_workers):
    workers = process_workers(4)
    x, y = models.data(240)
    train = Dataset.from_tensor_slices((x, y)).batch(24).map(slow_batch)
    weights = models.model().get_weights()
    with dd.MirroredStrategy(client=workers.client, elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
        with strategy.scope():
            model = models.model(weights)
        victims = list(strategy.extended.worker_addresses[1:3])
        record = {}
        since = time.time()

        def watch():
            while time.time() < since + 120:
                events = workers.client.get_events(PROGRESS_TOPIC)
                if any(t > since and m.get("step", -1) >= 4 for t, m in events):
                    for victim in victims:
                        workers.kill(victim)
                    record["killed"] = True
                    workers.slow_steps(False)  # the survivors cannot finish a step without them
                    return
                time.sleep(0.02)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        history = model.fit(train, epochs=1, verbose=0)
        thread.join(5)
        assert record.get("killed")
        lost = sorted(a for event in history.elastic.events for a in event.lost)
        assert lost == sorted(victims)
        assert strategy.num_replicas_in_sync == 2
        assert sorted(history.elastic.ledger.positions(0, history.elastic.rows).tolist()) == list(range(240))
        trained = model.get_weights()

    # the uninterrupted run (the switch is off since the kill: no slowing)
    for got, want in zip(trained, models.one_process_fit(weights, train, epochs=1).weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)  # float32 summed in another order than one process


def test_the_row_map_cuts_global_batches_across_partitions_and_the_ledger_rolls_back():
    from daskdist.data.plan import Plan, PlannedRead
    from daskdist.elastic.ledger import DataLedger, RowMap

    # partitions of 5, 7 and 4 rows, the first two rows of partition 0 skipped: 14 rows, batches of 4
    reads = [PlannedRead(0, r, "w", 2, 5, 1, 1, 0) for r in range(2)] + [
        PlannedRead(1, 0, "w", 0, 7, 3, 1, 0), PlannedRead(2, 1, "w", 0, 4, 2, 1, 0)]
    rows = RowMap.from_plan(Plan(reads, ["a", "b"], [2, 2], "AUTO", "global", steps=4), batch_size=4)
    assert rows.ranges == ((0, 2, 5), (1, 0, 7), (2, 0, 4)) and rows.total_rows == 14
    assert rows.rows_of_step(0) == [(0, 2, 5), (1, 0, 1)]
    assert rows.rows_of_step(1) == [(1, 1, 5)]
    assert rows.rows_of_step(3) == [(2, 2, 4)]  # the partial last batch
    ledger = DataLedger()
    ledger.record(0, range(0, 3), rows)
    ledger.rollback(0, 2)  # step 2 was not committed everywhere: replayed
    ledger.record(0, range(2, 4), rows)
    assert sorted(ledger.positions(0, rows).tolist()) == list(range(14))
    with pytest.raises(RuntimeError, match="committed twice"):
        ledger.record(0, range(3, 4), rows)


def test_the_commit_ring_keeps_the_two_newest_and_forgets_replayed_ones():
    from daskdist.elastic.replica import Commit, CommitRing, state_digest

    ring = CommitRing()
    for step in (1, 2, 3):
        ring.add(Commit((1, 0, step), {("variable", "c1"): np.full(3, step, np.float32)}, {}))
    assert list(ring.commits) == [(1, 0, 2), (1, 0, 3)]
    ring.drop_after((1, 0, 2))
    assert list(ring.commits) == [(1, 0, 2)]
    with pytest.raises(KeyError, match="no commit"):
        ring.get((1, 0, 1))
    same = {("variable", "c1"): np.full(3, 2, np.float32)}
    assert state_digest(ring.get((1, 0, 2)).state) == state_digest(same)
    assert state_digest(same) != state_digest({("variable", "c1"): np.full(3, 2, np.float64)})


@pytest.mark.slow
@pytest.mark.parametrize("how", ["lifetime"])  # retire_workers on every adapter: tests/test_matrix_elastic.py
def test_a_retired_member_leaves_at_a_commit_with_no_rollback_and_the_strategy_then_closes_cleanly(
        process_workers, caplog, how):
    workers = process_workers(3)
    rows = 960  # 40 steps of about 0.12 s: a graceful close asked at step 3 lands within the epoch under load
    x, y = models.data(rows)
    plain = Dataset.from_tensor_slices((x, y)).batch(24)
    train = plain.map(slow_batch)  # slowed until the member has left
    weights = models.model().get_weights()
    expected = models.one_process_fit(weights, plain, epochs=1).weights
    strategy = dd.MirroredStrategy(client=workers.client, elastic=dd.ElasticOptions(min_replicas=2))
    with strategy.scope():
        model = models.model(weights)
    victim = strategy.extended.worker_addresses[0]  # rank 0: the new rank 0 goes on from the same commit
    since = time.time()
    retirer = RetireAtStep(workers, victim, step=3, how=how)  # slowed steps turned off once it has left
    history = model.fit(train, epochs=1, verbose=0)
    retirer.join()
    (event,) = history.elastic.events
    assert event.action == "left" and event.left == [victim] and event.lost == [] and len(event.members) == 2
    assert 3 <= event.commit[2] < rows // 24  # left at a commit mid-epoch
    assert strategy.num_replicas_in_sync == 2 and victim not in strategy.extended.worker_addresses
    elastic_events = [m for t, m in workers.client.get_events("daskdist-elastic") if t > since]
    assert [m["action"] for m in elastic_events] == ["left"]  # no rollback ("restored") at all
    # the step counter never went back: replica 0's progress over the epoch only goes up, each step applied once
    steps = [m["step"] for t, m in workers.client.get_events(PROGRESS_TOPIC) if t > since]
    assert steps and steps == sorted(steps)
    assert int(model._optimizer_state()["iterations"]) == rows // 24
    assert history.elastic.ledger.steps(0) == list(range(rows // 24))
    assert sorted(history.elastic.ledger.positions(0, history.elastic.rows).tolist()) == list(range(rows))
    for got, want in zip(model.get_weights(), expected):  # the same arithmetic: the global batch is kept
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)  # float32 summed in another order than one process
    deadline = time.monotonic() + 30
    while victim in scheduler_workers(workers.client) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert victim not in scheduler_workers(workers.client)  # and then Dask's retirement went on
    assert any(m.get("action") == "left" and list(m.get("workers", ())) == [victim]
               for _, m in workers.client.get_events("daskdist"))
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="daskdist.group.handle"):
        strategy.close()
    assert time.monotonic() - start < 10
    assert "did not all stop cleanly" not in caplog.text


def _commit_digests(service):
    """Per commit this replica holds, the digest of its copied state (every commit a full copy here)."""
    from daskdist.elastic.replica import commit_ring, state_digest

    return {key: state_digest(commit.state) for key, commit in commit_ring(service).commits.items()}


def test_a_commit_copied_slowly_holds_its_own_step_not_the_next_ones(threaded_client, tmp_path):
    """Replica 0's copy of the commit after step 3 pauses (the ``commit`` fault point, in the copying thread)
    while step 4 runs: step 4's apply waits for the copy, so the commit holds step 3's state, as the others'."""
    rng = np.random.default_rng(0)
    x = rng.random((32, 3)).astype(np.float32)
    train = Dataset.from_tensor_slices((x, x @ np.ones((3, 1), np.float32))).batch(8)  # 4 steps
    settings = {"daskdist.testing.pause-at": "commit:2:0", "daskdist.testing.pause-file": str(tmp_path / "p.json"),
                "daskdist.testing.pause-seconds": "1s", "daskdist.elastic.replayed-commits": 1}
    with dask.config.set(settings), dd.MirroredStrategy(
            client=threaded_client, elastic=dd.ElasticOptions(commit_every=1)) as strategy:
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(1, input_shape=(3,))])
            model.compile(loss=keras.losses.MeanSquaredError(), optimizer=keras.optimizers.SGD(0.1))
        model.fit(train, epochs=1, verbose=0)
        assert (tmp_path / "p.json").exists()  # replica 0 paused in the copy of the commit after step 3
        first, *others = strategy.extended.group.call(_commit_digests)
        assert [key[2] for key in first] == [3, 4]  # the paused commit and the epoch's end
        assert all(other == first for other in others)  # each commit holds the same state on every replica
        assert len(set(first.values())) == 2  # step 4 changed the state
