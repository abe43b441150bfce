"""Elastic input: shuffled epochs re-planned after a loss, random state in commits, keep="per_replica".

The slow tests run ``dask worker`` processes that are killed with their
nannies (``ProcessWorkers`` of ``test_elastic.py``).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import daskdist as dd
from daskdist import keras
from daskdist.cluster.identity import scheduler_workers
from daskdist.data import ops
from daskdist.data.split import replica_split
from tests.support import models
from tests.support.killers import FreeAtStep, killed_at
from tests.support.models import slow_batch

Dataset = dd.data.Dataset

pytestmark = pytest.mark.timeout(240)


def _replica_rows(strategy, dist):
    """Every step's rows as the replicas hold them (concatenated in replica order) and each replica's count."""
    steps = []
    for batch in dist:
        parts = [np.asarray(p) for p in strategy.experimental_local_results(strategy.run(lambda b: b, args=(batch,)))]
        steps.append((np.concatenate(parts), [len(p) for p in parts]))
    return steps


# -- the planner: a gathered order, split by global batch ---------------------------------------------------


@pytest.mark.parametrize("source", ["local", "dask"])
def test_a_gathered_dataset_distributes_each_gathered_batch_exactly(threaded_client, source):
    import dask.array as da

    ids = np.arange(50)
    if source == "dask":
        base = Dataset.from_dask(threaded_client.persist(da.from_array(ids, chunks=12)))
    else:
        base = Dataset.from_tensor_slices(ids, num_partitions=4)
    order = np.random.default_rng(3).permutation(47)  # rows 3 ... 49 (skip(3) is folded), in a random order
    dataset = Dataset(base.source, (ops.Skip(3), ops.Gather(order[5:]), ops.Batch(8)))
    expected = [batch for batch in dataset]
    assert np.concatenate(expected).tolist() == (3 + order[5:]).tolist()
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        dist = strategy.experimental_distribute_dataset(dataset)
        assert dist.plan().split == "global" and dist.plan().steps == 6
        got = _replica_rows(strategy, dist)
    assert len(got) == len(expected)
    for (rows, sizes), batch in zip(got, expected):  # each step holds the gathered batch, in TF's shares
        np.testing.assert_array_equal(np.sort(rows), np.sort(batch))
        assert sizes == replica_split(len(batch), 3)


def test_each_row_of_a_gathered_batch_goes_to_a_replica_that_holds_it_when_it_can():
    from daskdist.data.split import assign_by_locality

    owner = np.array([0, 0, 0, 0, 1, 2,  2, 2, 1, 1, 1, 1,  0, 1])  # batches of 6, then a partial one of 2
    assigned = assign_by_locality(owner, 6, False, 3)
    # batch 0: replica 0 keeps two of its four rows (TF's share is 2), the others fill the short replicas
    assert assigned[:6].tolist() == [0, 0, 1, 2, 1, 2]
    assert assigned[6:12].tolist() == [2, 2, 1, 1, 0, 0]
    assert assigned[12:].tolist() == [0, 1]
    for first, size in ((0, 6), (6, 6), (12, 2)):
        counts = np.bincount(assigned[first:first + size], minlength=3).tolist()
        assert counts == replica_split(size, 3)
    assert assign_by_locality(owner, 6, True, 3)[12:].tolist() == [-1, -1]  # dropped with the partial batch


def test_a_shuffled_order_of_dask_partitions_moves_few_rows(threaded_client):
    import dask.array as da

    ids = np.arange(6000)
    base = Dataset.from_dask(threaded_client.persist(da.from_array(ids, chunks=500)))
    order = np.random.default_rng(3).permutation(6000)
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        plan = strategy.experimental_distribute_dataset(Dataset(base.source, (ops.Gather(order), ops.Batch(60)))).plan()
    # TF's contiguous split of random rows would move about 2/3 of them; by locality about a tenth moves
    assert plan.bytes_to_move < 0.25 * plan.bytes_total, plan


def test_a_gather_is_checked():
    with pytest.raises(ValueError, match="non-negative"):
        ops.Gather([0, -1])
    with pytest.raises(IndexError, match="out of range"):
        list(Dataset(Dataset.range(4).source, (ops.Gather([5]), ops.Batch(2))))


def test_an_epoch_schedule_follows_its_order_across_a_change_of_batch_size():
    from daskdist.elastic.ledger import DataLedger, EpochSchedule, RowMap

    order = np.random.default_rng(1).permutation(20)
    schedule = EpochSchedule(20, order)
    schedule.start(0, 0, 6)  # 3 replicas of 2 rows
    assert schedule.positions_of_step(1).tolist() == order[6:12].tolist()
    schedule.start(2, schedule.row_of_step(2), 4)  # from step 2 on, 2 replicas of 2 rows
    assert schedule.row_of_step(2) == 12
    assert [len(schedule.positions_of_step(s)) for s in range(4)] == [6, 6, 4, 4]
    ledger = DataLedger()
    ledger.record(0, range(4), schedule)
    np.testing.assert_array_equal(ledger.positions(0), order)
    rows = RowMap(((0, 0, 10), (1, 5, 15)), 6, 4)
    assert rows.rows_of_positions(np.array([3, 4, 12, 13, 2])) == [(0, 3, 5), (1, 7, 9), (0, 2, 3)]


# -- which pipelines an elastic fit takes ---------------------------------------------------------------------


def _linear_model():
    model = keras.Sequential([keras.layers.Dense(1, input_shape=(3,))])
    model.compile(loss=keras.losses.MeanSquaredError(), optimizer=keras.optimizers.SGD(0.1))
    return model


@pytest.mark.parametrize("pipeline, message", [
    (lambda d: d.filter(lambda x, y: True).batch(4), "filter"),
    (lambda d: d.repeat(2).batch(4), "repeat"),
    (lambda d: d.shuffle(8).take(6).batch(4), "take"),
    (lambda d: d.batch(4).shuffle(3), "after the batch"),
    (lambda d: d.shuffle(8).shuffle(8).batch(4), "one shuffle"),
])
def test_an_elastic_fit_refuses_what_it_cannot_replan_naming_the_op(threaded_client, pipeline, message):
    x = np.ones((16, 3), np.float32)
    train = pipeline(Dataset.from_tensor_slices((x, x[:, :1])))
    with dd.MirroredStrategy(client=threaded_client, elastic=dd.ElasticOptions()) as strategy:
        with strategy.scope():
            model = _linear_model()
        with pytest.raises(ValueError, match=message):
            model.fit(train, epochs=1, verbose=0)


def test_elastic_options_check_keep_and_the_membership_callback():
    with pytest.raises(ValueError, match="keep"):
        dd.ElasticOptions(keep="everything")
    with pytest.raises(TypeError, match="on_membership_change"):
        dd.ElasticOptions(on_membership_change=3)
    assert dd.ElasticOptions().keep == "global_batch"


def test_a_shuffled_elastic_epoch_is_a_seeded_permutation_trained_in_the_ledgers_order(threaded_client):
    """Without failures: each epoch's steps hold the seeded permutation's batches, reshuffled every epoch, and
    the weights are those of training on exactly those batches in this process."""
    rng = np.random.default_rng(0)
    x = rng.random((60, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
    train = Dataset.from_tensor_slices((x, y)).shuffle(16, seed=7).batch(12)
    reference = _linear_model()
    reference.build((3,))
    weights = reference.get_weights()
    with dd.MirroredStrategy(client=threaded_client, elastic=dd.ElasticOptions(commit_every=2)) as strategy:
        with strategy.scope():
            model = _linear_model()
            model.build((3,))
            model.set_weights(weights)
        history = model.fit(train, epochs=2, verbose=0)
        # each epoch was a new plan; the replicas keep only the last one's rows (no other copy of the training
        # data is distributed: the elastic fit plans its epochs itself)
        assert strategy.extended.group.call(_datasets_held) == [1, 1, 1]
        elastic = history.elastic
        orders = [elastic.input.order(e) for e in (0, 1)]
        assert orders[0].tolist() != orders[1].tolist()  # reshuffle_each_iteration
        assert orders[0].tolist() == np.random.default_rng([7, 0]).permutation(60).tolist()
        for epoch in (0, 1):
            assert elastic.ledger.steps(epoch) == [0, 1, 2, 3, 4]
            np.testing.assert_array_equal(elastic.ledger.positions(epoch), orders[epoch])
        trained = model.get_weights()
    for order in orders:  # the same batches, in this process
        reference.fit(Dataset(train.source, (ops.Gather(order), ops.Batch(12))), epochs=1, verbose=0)
    for got, want in zip(trained, reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_elastic_fit_on_arrays_shuffles_them_with_a_seed_drawn_once_per_fit(threaded_client):
    x = np.random.default_rng(2).random((30, 3)).astype(np.float32)
    with dd.MirroredStrategy(client=threaded_client, elastic=dd.ElasticOptions()) as strategy:
        with strategy.scope():
            model = _linear_model()
        history = model.fit(x, x[:, :1], batch_size=10, epochs=2, verbose=0)  # Keras' shuffle=True, no seed
        elastic = history.elastic
        assert elastic.input.seed is not None
        first, second = elastic.ledger.positions(0), elastic.ledger.positions(1)
        assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(30))
        assert first.tolist() != second.tolist() and first.tolist() != list(range(30))


def _datasets_held(service):
    from daskdist.group.service import DATASET

    return len(service.objects.ids(DATASET))


def test_a_shuffle_without_reshuffling_or_with_a_cache_after_it_keeps_one_order(threaded_client):
    x = np.ones((20, 3), np.float32)
    for train in (Dataset.from_tensor_slices((x, x[:, :1])).shuffle(20, reshuffle_each_iteration=False).batch(5),
                  Dataset.from_tensor_slices((x, x[:, :1])).shuffle(20).cache().batch(5)):
        with dd.MirroredStrategy(client=threaded_client, elastic=dd.ElasticOptions()) as strategy:
            with strategy.scope():
                model = _linear_model()
            history = model.fit(train, epochs=2, verbose=0)
            ledger = history.elastic.ledger
            np.testing.assert_array_equal(ledger.positions(0), ledger.positions(1))
            assert sorted(ledger.positions(0).tolist()) == list(range(20))
            assert ledger.positions(0).tolist() != list(range(20))


# -- random state in commits ----------------------------------------------------------------------------------


def test_a_model_snapshot_puts_back_the_dropout_generator():
    from daskdist.keras.trainable import BuiltinTrainable

    model = keras.Sequential([keras.layers.Dense(4, input_shape=(3,)), keras.layers.Dropout(0.5, seed=2)])
    model.build((3,))
    x = np.ones((6, 3), np.float32)
    resident = BuiltinTrainable(model)
    before = resident.snapshot()  # before the first draw: the generator starts again from its seed
    first = model._forward(x, training=True)
    resident.restore(before)
    np.testing.assert_array_equal(model._forward(x, training=True), first)
    middle = resident.snapshot()
    second = model._forward(x, training=True)
    assert not np.array_equal(first, second)
    model._forward(x, training=True)
    resident.restore(middle)
    np.testing.assert_array_equal(model._forward(x, training=True), second)


class _SlowToCopy:
    """A resident whose snapshot waits for a signal: holds a commit's copy thread back."""

    def __init__(self):
        self.go = threading.Event()

    def snapshot(self):
        assert self.go.wait(10)
        return {}

    def restore(self, state):
        pass


def test_a_commit_copied_off_the_step_path_keeps_the_random_state_of_the_commit_point():
    """The next step's forward draws dropout masks while the commit is still being copied."""
    from daskdist.elastic.replica import Commit
    from daskdist.group.service import MODEL, VARIABLE, ResidentStore
    from daskdist.keras.trainable import BuiltinTrainable

    model = keras.Sequential([keras.layers.Dense(4, input_shape=(3,)), keras.layers.Dropout(0.5, seed=2)])
    model.build((3,))
    x = np.ones((6, 3), np.float32)
    model._forward(x, training=True)  # the generator exists and has drawn
    objects = ResidentStore()
    slow = _SlowToCopy()
    objects.install(VARIABLE, "slow", slow)  # copied first: the thread waits here
    objects.install(MODEL, "m", BuiltinTrainable(model))
    commit = Commit.copying((1, 0, 1), objects, {})
    replayed = model._forward(x, training=True)  # the next step, during the copy
    slow.go.set()
    model._forward(x, training=True)
    objects.get(MODEL, "m").restore(commit.state[(MODEL, "m")])
    np.testing.assert_array_equal(model._forward(x, training=True), replayed)


def test_the_state_digest_ignores_random_state_but_not_weights():
    from daskdist.elastic.replica import state_digest
    from daskdist.keras.trainable import RandomStates

    a = {("model", "m"): {"weights": [np.ones(3)], "rng": RandomStates({"dropout": {"numpy": {"state": 1}}})}}
    b = {("model", "m"): {"weights": [np.ones(3)], "rng": RandomStates({"dropout": {"numpy": {"state": 2}}})}}
    c = {("model", "m"): {"weights": [np.zeros(3)], "rng": RandomStates({})}}
    assert state_digest(a) == state_digest(b) != state_digest(c)


def _dropout_model(weights=None):
    model = keras.Sequential([keras.layers.Dense(16, activation="relu", input_shape=(4,)),
                              keras.layers.Dropout(0.5, seed=11), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(0.2))
    model.build((4,))
    if weights is not None:
        model.set_weights(weights)
    return model


@pytest.mark.slow
def test_after_a_restore_a_dropout_model_trains_as_the_uninterrupted_run(process_workers, tmp_path):
    """A worker killed mid-epoch and replaced: the replayed steps draw the dropout masks they drew before."""
    workers = process_workers(3)
    x, y = models.data(240)
    train = Dataset.from_tensor_slices((x, y)).batch(24)  # 10 steps of 8 rows per replica
    weights = _dropout_model().get_weights()
    with dd.MirroredStrategy(client=workers.client) as strategy:
        with strategy.scope():
            model = _dropout_model(weights)
        model.fit(train, epochs=1, verbose=0)
        expected = model.get_weights()
    with dd.MirroredStrategy(client=workers.client, elastic=dd.ElasticOptions(
            min_replicas=3, commit_every=3, wait_timeout="90s")) as strategy:
        with strategy.scope():
            model = _dropout_model(weights)
        victim = strategy.extended.worker_addresses[2]
        with killed_at(workers, tmp_path / "paused.json", "forward", step=5, rank=2) as killer:
            adder = threading.Thread(target=lambda: (killer.thread.join(120), workers.add()), daemon=True)
            adder.start()  # a worker started once the kill landed
            history = model.fit(train, epochs=1, verbose=0)
        adder.join(5)
        assert killer.join()["address"] == victim
        (event,) = history.elastic.events
        assert event.lost == [victim] and len(event.admitted) == 1 and 0 < event.commit[2] < 10
        assert sorted(history.elastic.ledger.positions(0).tolist()) == list(range(240))
        for got, want in zip(model.get_weights(), expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# -- shuffled input across a loss -----------------------------------------------------------------------------


def ids_as_one_hot(ids, target):
    return np.eye(60, dtype=np.float32)[ids], target


@pytest.mark.slow
def test_shuffled_sample_ids_are_each_committed_once_per_epoch_across_a_kill_with_commit_every_5(process_workers,
                                                                                                 tmp_path):
    """One-hot samples and a linear model: each weight moves only when its sample trains, so the weights show
    how many times every sample contributed to a committed update, whatever the order."""
    import dask.array as da

    workers = process_workers(3)
    ids = np.arange(60)
    ids_d = workers.client.persist(da.from_array(ids, chunks=15))  # four partitions spread over the workers
    train = (Dataset.from_dask((ids_d, da.ones((60, 1), chunks=15, dtype=np.float32)))
             .shuffle(20, seed=5).map(ids_as_one_hot).batch(6))  # 10 steps per epoch
    lr = 0.3
    with dd.MirroredStrategy(client=workers.client,
                             elastic=dd.ElasticOptions(min_replicas=2, commit_every=5)) as strategy:
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros",
                                                         input_shape=(60,))])
            model.compile(loss=keras.losses.MeanSquaredError(), optimizer=keras.optimizers.SGD(lr))
        victim = strategy.extended.worker_addresses[1]
        with killed_at(workers, tmp_path / "paused.json", "forward", step=7, rank=1) as killer:
            history = model.fit(train, epochs=2, verbose=0)
        assert killer.join()["address"] == victim
        (event,) = history.elastic.events
        assert event.commit[1:] == (0, 5)  # back to the commit_every=5 boundary mid-epoch
        ledger, elastic = history.elastic.ledger, history.elastic
        for epoch in (0, 1):
            assert ledger.steps(epoch) == list(range(10))
            committed = ids[ledger.positions(epoch)]
            assert sorted(committed.tolist()) == ids.tolist()  # no repeats, no gaps
            np.testing.assert_array_equal(ledger.positions(epoch), elastic.input.order(epoch))  # the seeded order
        assert ledger.positions(0).tolist() != ledger.positions(1).tolist()
        # one MSE step on sample i moves w_i by lr/3 * (1 - w_i): 0.1 after one epoch, 0.19 after two
        w = model.get_weights()[0][:, 0]
        np.testing.assert_allclose(w, np.full(60, 1 - (1 - lr / 3) ** 2), rtol=1e-6)


def _small_model(weights=None):
    model = keras.Sequential([keras.layers.Dense(8, activation="relu", input_shape=(4,)), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"])
    model.build((4,))
    if weights is not None:
        model.set_weights(weights)
    return model


@pytest.mark.slow
def test_a_shuffled_fit_that_loses_a_worker_ends_with_the_uninterrupted_shuffled_runs_weights(process_workers,
                                                                                               tmp_path):
    workers = process_workers(3)
    x, y = models.data(240)
    train = Dataset.from_tensor_slices((x, y)).shuffle(64, seed=9).batch(24)
    weights = _small_model().get_weights()
    with dd.MirroredStrategy(client=workers.client, elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
        with strategy.scope():
            model = _small_model(weights)
        reference = model.fit(train, epochs=2, verbose=0)  # uninterrupted, the same seeded orders
        expected = model.get_weights()
    with dd.MirroredStrategy(client=workers.client,
                             elastic=dd.ElasticOptions(min_replicas=2, commit_every=2)) as strategy:
        with strategy.scope():
            model = _small_model(weights)
        victim = strategy.extended.worker_addresses[0]  # rank 0, with the rows its worker held
        # step 13: the fourth of the second epoch (steps count on across epochs)
        with killed_at(workers, tmp_path / "paused.json", "forward", step=13, rank=0) as killer:
            history = model.fit(train, epochs=2, verbose=0)
        assert killer.join()["address"] == victim
        (event,) = history.elastic.events
        assert event.commit[1] == 1 and strategy.num_replicas_in_sync == 2
        for epoch in (0, 1):
            np.testing.assert_array_equal(history.elastic.ledger.positions(epoch), history.elastic.input.order(epoch))
        for got, want in zip(model.get_weights(), expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert history.history["loss"] == pytest.approx(reference.history["loss"], rel=1e-5)
        assert history.history["accuracy"] == pytest.approx(reference.history["accuracy"], rel=1e-5)


# -- keep="per_replica" ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_keep_per_replica_shrinks_the_global_batch_and_lets_the_user_rescale_the_learning_rate(process_workers,
                                                                                              tmp_path):
    workers = process_workers(3)
    x, y = models.data(240)
    train = Dataset.from_tensor_slices((x, y)).shuffle(240, seed=1).batch(24)  # 8 per replica
    changes = []
    holder = {}

    def rescale(old, new):  # linear scaling: the learning rate follows the global batch
        changes.append((old, new))
        optimizer = holder["model"].optimizer
        optimizer.learning_rate = float(optimizer.learning_rate) * new / old

    options = dd.ElasticOptions(min_replicas=2, keep="per_replica", on_membership_change=rescale)
    with dd.MirroredStrategy(client=workers.client, elastic=options) as strategy:
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(8, activation="relu", input_shape=(4,)),
                                      keras.layers.Dense(3)])
            model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          optimizer=keras.optimizers.SGD(0.3))
        holder["model"] = model
        victim = strategy.extended.worker_addresses[0]
        with killed_at(workers, tmp_path / "paused.json", "forward", step=4, rank=0) as killer:
            history = model.fit(train, epochs=2, verbose=0)
        assert killer.join()["address"] == victim
        (event,) = history.elastic.events
        restored = event.commit[2]
        assert event.commit[1] == 0 and 0 < restored < 10
        assert changes == [(3, 2)]
        assert float(model.optimizer.learning_rate) == pytest.approx(0.3 * 2 / 3)
        ledger = history.elastic.ledger
        sizes = [len(ledger.epochs[0][s]) for s in ledger.steps(0)]
        rest = 240 - 24 * restored
        assert sizes == [24] * restored + [16] * (rest // 16) + ([rest % 16] if rest % 16 else [])
        assert [len(ledger.epochs[1][s]) for s in ledger.steps(1)] == [16] * 15  # the next epoch: 8 x 2
        for epoch in (0, 1):
            assert sorted(ledger.positions(epoch).tolist()) == list(range(240))
            np.testing.assert_array_equal(ledger.positions(epoch), history.elastic.input.order(epoch))
        assert np.isfinite(history.history["loss"]).all()


@pytest.mark.slow
def test_an_elastic_custom_loop_reads_a_shuffled_dataset_once_per_epoch_across_a_kill(process_workers):
    workers = process_workers(3)
    values = np.arange(1, 121, dtype=np.float64)
    dataset = Dataset.from_tensor_slices(values).shuffle(50, seed=3).batch(12)  # 10 steps
    with dd.MirroredStrategy(client=workers.client, elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
        with strategy.scope():
            total = dd.Variable(np.zeros((), np.float64), aggregation=dd.VariableAggregation.ONLY_FIRST_REPLICA)
        seen = []

        def step(rows):
            summed = dd.get_replica_context().all_reduce("SUM", rows.sum())
            total.assign_add(summed)

        @dd.elastic.run
        def train(state):
            while state.epoch < 2:
                for batch in state.batches(dataset):
                    if (state.epoch, state.batch) == (0, 5) and not killed:
                        workers.kill(victim)  # between two steps, after 5 commits: the next run fails
                        killed.append(state.batch)  # the fifth batch, taken after 4 commits
                    strategy.run(step, args=(batch,))
                    state.draws.append(float(state.rng.random()))  # client-side randomness, committed too
                    state.commit()
                state.epoch += 1

        state = dd.elastic.State(strategy, epoch=0, rng=np.random.default_rng(4), draws=[])
        victim = strategy.extended.worker_addresses[1]
        killed = []
        train(state)
        (event,) = state.events
        assert event.lost == [victim] and killed == [5]
        assert total.read_value() == 2 * values.sum()  # each row added exactly once per epoch
        assert state.draws == np.random.default_rng(4).random(20).tolist()  # the generator went back with the rest
        (epoch_input,) = [known for _, known in state._inputs.values()]
        for epoch in (0, 1):
            positions = state.ledger.positions(epoch)
            np.testing.assert_array_equal(positions, epoch_input.order(epoch))
            seen.append(positions.tolist())
        assert seen[0] != seen[1] and sorted(seen[0]) == list(range(120))


@pytest.mark.slow
def test_keep_per_replica_grows_the_global_batch_when_a_worker_is_admitted_mid_epoch(process_workers):
    workers = process_workers(3)
    x, y = models.data(240)
    train = Dataset.from_tensor_slices((x, y)).shuffle(240, seed=2).batch(16).map(slow_batch)  # 8 per replica
    changes = []
    options = dd.ElasticOptions(min_replicas=2, max_replicas=3, commit_every=2, admit_every="0.3s",
                                keep="per_replica", on_membership_change=lambda old, new: changes.append((old, new)))
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=workers.client, elastic=options) as strategy:
        (free,) = set(scheduler_workers(workers.client)) - set(strategy.extended.worker_addresses)
        with strategy.scope():
            model = _small_model()
        # free only once the epoch runs; the steps slowed until it joined
        arrival = FreeAtStep(workers.client, free, step=1, since=time.time(), workers=workers)
        workers.watch(arrival)
        history = model.fit(train, epochs=1, verbose=0)
        assert arrival.released
        (event,) = history.elastic.events
        assert event.action == "grew" and changes == [(2, 3)]
        stop = event.commit[2]
        assert 0 < stop < 15 and stop % 2 == 0
        ledger = history.elastic.ledger
        sizes = [len(ledger.epochs[0][s]) for s in ledger.steps(0)]
        rest = 240 - 16 * stop
        assert sizes == [16] * stop + [24] * (rest // 24) + ([rest % 24] if rest % 24 else [])
        np.testing.assert_array_equal(ledger.positions(0), history.elastic.input.order(0))
