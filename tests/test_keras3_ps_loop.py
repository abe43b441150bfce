"""TensorFlow's parameter-server custom-training pattern with a Keras 3 model (torch backend): a function
scheduled with ``ClusterCoordinator.schedule`` runs ``strategy.run`` of a step using the model and optimizer made
in the scope, on per-worker datasets; the parameter servers hold the parameters and apply each push once.

With one worker the closures run one after another, so the run is compared with one process on the same
batches; with two, rows that move only their own weight make the result exact too. The workers and ps are
processes (``forked_process_client``): one Keras runtime per process, as users run it.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported, here and in the workers
torch = pytest.importorskip("torch")
pytest.importorskip("keras")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import daskdist as dd  # noqa: E402
from tests.keras3_models import average_loss, dense_data, sequential, torch_train_step  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ClusterCoordinator = dd.experimental.coordinator.ClusterCoordinator
BATCH = 16
RTOL = 1e-5


def _replica_step(model, optimizer):
    """TF's ``replica_fn``: Keras' forward, torch's backward, ``optimizer.apply`` (on a ps worker: a push)."""
    return torch_train_step(model, optimizer, average_loss(BATCH))


def _dataset_fn(x, y):
    def dataset_fn(ctx):
        return (dd.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
                .batch(BATCH))

    return dataset_fn


def test_a_ps_custom_loop_with_a_keras3_model_equals_one_process_on_the_same_batches(forked_process_client):
    x, y = dense_data(rows=96, seed=3)  # six batches of 16
    resolver = dd.cluster_resolver.DaskClusterResolver(forked_process_client, num_ps=2)  # 2 ps, 1 worker: in order
    with dd.ParameterServerStrategy(resolver) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            model = sequential()
            optimizer = keras.optimizers.Adam(1e-2)  # slots held on the ps
        plain = sequential()
        plain.set_weights(model.get_weights())
        plain_step = _replica_step(plain, keras.optimizers.Adam(1e-2))
        replica_fn = _replica_step(model, optimizer)

        def step_fn(it):
            return strategy.run(replica_fn, args=(next(it),))

        for _ in range(2):  # epochs: each worker's dataset read from its start
            iterator = iter(coordinator.create_per_worker_dataset(_dataset_fn(x, y)))
            values = [coordinator.schedule(step_fn, args=(iterator,)) for _ in range(len(x) // BATCH)]
            coordinator.join()
            losses = [float(v) for v in coordinator.fetch(values)]
            expected = [plain_step((x[k:k + BATCH], y[k:k + BATCH])) for k in range(0, len(x), BATCH)]
            np.testing.assert_allclose(losses, expected, rtol=RTOL)
            for got, want in zip(model.get_weights(), plain.get_weights()):  # the client takes the stored state
                np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6)
        assert int(optimizer.iterations.numpy()) == 12  # the stores' step count: each push applied once


def _linear_step(model, optimizer):
    """One-hot rows, a linear model without bias, MSE: row ``i`` moves only weight ``i``, by its own gradient."""
    mse = keras.losses.MeanSquaredError()
    return torch_train_step(model, optimizer, lambda targets, predictions: mse(targets, predictions))


def _linear_model():
    return keras.Sequential([keras.Input((60,)),
                             keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])


def test_two_workers_pull_what_the_other_pushed_before_each_closure_and_every_push_applies_once(forked_process_client):
    """Two workers take the closures as they come; each closure carries its batch, so every row is used once per
    epoch whichever worker runs it. Row ``i`` in the second epoch needs the weight its first-epoch push left, which
    the other worker may have pushed: only a pull at the closure's start gives it; closures that only read the
    model see what the stores hold. Shown failing: without ``custom_closure_began``'s pull, the read closures of the
    worker that did not push last see its stale copy (predictions of the other's last rows differ).
    """
    ids = np.arange(60)
    x, y = np.eye(60, dtype=np.float32), np.ones((60, 1), np.float32)
    batches = [(x[k:k + 6], y[k:k + 6]) for k in range(0, 60, 6)]
    resolver = dd.cluster_resolver.DaskClusterResolver(forked_process_client, num_ps=1)  # 1 ps, 2 workers
    with dd.ParameterServerStrategy(resolver) as strategy:
        coordinator = ClusterCoordinator(strategy)
        assert len(coordinator.workers) == 2
        with strategy.scope():
            model = _linear_model()
            optimizer = keras.optimizers.SGD(0.3)
        replica_fn = _linear_step(model, optimizer)

        def step_fn(batch):
            from distributed import get_worker

            return strategy.run(replica_fn, args=(batch,)), get_worker().address

        ran_on = set()
        for _ in range(3):  # epochs: each row's update of the epoch before must be seen by whichever worker runs it
            values = [coordinator.schedule(step_fn, args=(batch,)) for batch in batches]
            coordinator.join()
            ran_on |= {address for _, address in coordinator.fetch(values)}
        plain = _linear_model()
        plain_step = _linear_step(plain, keras.optimizers.SGD(0.3))
        for _ in range(3):
            for batch in batches:
                plain_step(batch)

        def read_fn():  # reads the weights only: what the stores hold now, whichever worker pushed last
            from distributed import get_worker

            return keras.ops.convert_to_numpy(model(x, training=False)), get_worker().address

        values = [coordinator.schedule(read_fn) for _ in range(10)]
        coordinator.join()
        for predictions, address in coordinator.fetch(values):
            ran_on.add(address)
            np.testing.assert_allclose(predictions, plain.predict(x, verbose=0), rtol=1e-6)
        assert ran_on == set(coordinator.workers)  # both workers took closures
        np.testing.assert_allclose(model.get_weights()[0], plain.get_weights()[0], rtol=1e-6)
        w = 0.0
        for _ in range(3):  # one MSE step of one row per epoch: w -= 0.3 * 2 (w - 1) / 6
            w -= 0.3 * 2 * (w - 1) / 6
        np.testing.assert_allclose(model.get_weights()[0][ids, 0], np.full(60, w, np.float32), rtol=1e-6)
        assert int(optimizer.iterations.numpy()) == 30  # every push applied once


def test_a_model_with_no_optimizer_to_pair_is_refused_naming_what_works_and_nothing_is_held(forked_process_client):
    resolver = dd.cluster_resolver.DaskClusterResolver(forked_process_client, num_ps=1)
    with dd.ParameterServerStrategy(resolver) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            model = sequential()
            other = keras.optimizers.Adam(1e-2)  # noqa: F841 (kept: a recorded optimizer lives as long as its object)
            optimizer = keras.optimizers.SGD(0.1)  # two free optimizers: which one the loop applies is unknown
        replica_fn = _replica_step(model, optimizer)
        x, y = dense_data(rows=16)
        before = model.get_weights()
        value = coordinator.schedule(lambda: strategy.run(replica_fn, args=((x, y),)))
        with pytest.raises(ValueError, match=r"2 optimizers .* compile model .* with the optimizer its loop applies"):
            coordinator.join()
        with pytest.raises(ValueError, match="2 optimizers"):
            value.fetch()
        assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
        from daskdist.plugins.keras3 import registry

        assert registry.lookup(model).driver is None  # nothing held on the stores

        # compiled with the loop's optimizer it is held and trains; a model whose optimizer the ps cannot run
        # (Adagrad) is left out, refused only where a scheduled function uses it
        with strategy.scope():
            odd = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
            odd.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
        model.compile(optimizer=optimizer, loss="mse")
        value = coordinator.schedule(lambda: strategy.run(replica_fn, args=((x, y),)))
        coordinator.join()
        plain = sequential()  # the one step in one process from the same weights: its loss and the weights after
        plain.set_weights(before)
        expected = torch_train_step(plain, keras.optimizers.SGD(0.1), average_loss(BATCH))((x, y))
        assert value.fetch() == pytest.approx(expected, rel=1e-5)
        for a, b in zip(model.get_weights(), plain.get_weights()):  # the stored, trained ones
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        coordinator.schedule(lambda: odd(x))
        with pytest.raises(ValueError, match=r"model 'sequential_\d+' cannot be used .*keras.optimizers.SGD"):
            coordinator.join()


def _metered_step(model, optimizer, accuracy, mean_loss):
    """``_replica_step`` that also updates two Keras metrics created in the scope, as TF's PS tutorial does."""
    import torch

    compute_loss = average_loss(BATCH)

    def train_step(inputs):
        features, labels = inputs
        predictions = model(features, training=True)
        loss = compute_loss(labels, predictions)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            optimizer.apply([v.value.grad for v in model.trainable_variables], model.trainable_variables)
            accuracy.update_state(labels, predictions)
            mean_loss.update_state(loss)
        return float(loss)

    return train_step


def test_keras_metrics_updated_in_closures_read_on_the_client_as_one_process_on_the_same_batches(
        forked_process_client):
    """TF's PS custom loop: metrics created in the scope, ``update_state`` in the closures, ``result()`` on the
    coordinator after ``join``. One worker (closures in order): the results equal one process's on the same batches,
    each epoch after ``reset_state()``; then two workers evaluate read-only closures, each batch counted once.
    Shown failing: with the client's commit of a closure's change left out, every result stays 0."""
    x, y = dense_data(rows=96, seed=3)
    resolver = dd.cluster_resolver.DaskClusterResolver(forked_process_client, num_ps=2)  # 2 ps, 1 worker
    with dd.ParameterServerStrategy(resolver) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            model = sequential()
            optimizer = keras.optimizers.Adam(1e-2)
            accuracy = keras.metrics.SparseCategoricalAccuracy()
            mean_loss = keras.metrics.Mean()
        plain = sequential()
        plain.set_weights(model.get_weights())
        plain_accuracy, plain_loss = keras.metrics.SparseCategoricalAccuracy(), keras.metrics.Mean()
        plain_step = _metered_step(plain, keras.optimizers.Adam(1e-2), plain_accuracy, plain_loss)
        replica_fn = _metered_step(model, optimizer, accuracy, mean_loss)

        def step_fn(it):
            return strategy.run(replica_fn, args=(next(it),))

        for _ in range(2):
            for metric in (accuracy, mean_loss, plain_accuracy, plain_loss):
                metric.reset_state()
            iterator = iter(coordinator.create_per_worker_dataset(_dataset_fn(x, y)))
            values = [coordinator.schedule(step_fn, args=(iterator,)) for _ in range(len(x) // BATCH)]
            coordinator.join()
            for k in range(0, len(x), BATCH):
                plain_step((x[k:k + BATCH], y[k:k + BATCH]))
            np.testing.assert_allclose(float(mean_loss.result()), float(plain_loss.result()), rtol=RTOL)
            np.testing.assert_allclose(float(accuracy.result()), float(plain_accuracy.result()), rtol=RTOL)
            assert float(mean_loss.count.numpy()) == len(x) // BATCH  # each closure's update once
            assert float(accuracy.count.numpy()) == len(x)
            np.testing.assert_allclose(np.mean(coordinator.fetch(values)), float(mean_loss.result()), rtol=RTOL)


def test_two_workers_evaluate_into_a_scope_metric_each_batch_once(forked_process_client, tmp_path):
    """TF's inline evaluation in a custom loop: ``eval_accuracy`` created in the scope, read-only closures on two
    workers; the result is plain Keras' on the same weights and the count is every row once. A closure waits until
    both workers began one (a file each), so both take closures however loaded the machine is."""
    x, y = dense_data(rows=200, seed=5)
    batches = [(x[k:k + 20], y[k:k + 20]) for k in range(0, 200, 20)]
    resolver = dd.cluster_resolver.DaskClusterResolver(forked_process_client, num_ps=1)  # 1 ps, 2 workers
    with dd.ParameterServerStrategy(resolver) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            model = sequential()
            optimizer = keras.optimizers.SGD(0.1)  # noqa: F841 (the model's loop optimizer: placing it needs one)
            eval_accuracy = keras.metrics.SparseCategoricalAccuracy()

        def eval_fn(batch):
            import time

            from distributed import get_worker

            (tmp_path / str(os.getpid())).touch()
            deadline = time.monotonic() + 60
            while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:  # both workers are in one
                time.sleep(0.01)
            features, labels = batch
            eval_accuracy.update_state(labels, model(features, training=False))
            return get_worker().address

        addresses = coordinator.fetch([coordinator.schedule(eval_fn, args=(batch,)) for batch in batches])
        assert len(set(addresses)) == 2  # both workers took closures
        plain = sequential()
        plain.set_weights(model.get_weights())
        expected = keras.metrics.SparseCategoricalAccuracy()
        expected.update_state(y, plain.predict(x, verbose=0))
        assert float(eval_accuracy.count.numpy()) == 200  # every row once
        np.testing.assert_allclose(float(eval_accuracy.result()), float(expected.result()), rtol=RTOL)


def _batchnorm_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                             keras.layers.ReLU(), keras.layers.Dense(4)])


def _moving_statistics(model):
    """The client's moving mean and variance, after its ``get_weights`` took the stored state."""
    model.get_weights()
    return [np.asarray(v.numpy()) for v in model.layers[1].non_trainable_variables]


def test_batchnorm_moving_statistics_a_closure_updates_are_written_back_to_the_ps(forked_process_client):
    """A custom loop's forward passes with ``training=True`` update BatchNormalization's moving statistics on the
    worker; they are assigned on the ps when the closure returns, as ``fit``'s closures assign them. One worker:
    every weight and statistic equals one process's on the same batches. Shown failing: without the write-back
    (``KerasPsWorker.closure_ended``), the client reads the initial statistics (mean 0, variance 1)."""
    x, y = dense_data(rows=96, seed=3)
    resolver = dd.cluster_resolver.DaskClusterResolver(forked_process_client, num_ps=2)  # 2 ps, 1 worker: in order
    with dd.ParameterServerStrategy(resolver) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            model = _batchnorm_model()
            optimizer = keras.optimizers.Adam(1e-2)
        plain = _batchnorm_model()
        plain.set_weights(model.get_weights())
        plain_step = _replica_step(plain, keras.optimizers.Adam(1e-2))
        replica_fn = _replica_step(model, optimizer)

        def step_fn(it):
            return strategy.run(replica_fn, args=(next(it),))

        for _ in range(2):
            iterator = iter(coordinator.create_per_worker_dataset(_dataset_fn(x, y)))
            values = [coordinator.schedule(step_fn, args=(iterator,)) for _ in range(len(x) // BATCH)]
            coordinator.join()
            expected = [plain_step((x[k:k + BATCH], y[k:k + BATCH])) for k in range(0, len(x), BATCH)]
            np.testing.assert_allclose([float(v) for v in coordinator.fetch(values)], expected, rtol=RTOL)
            for got, want in zip(model.get_weights(), plain.get_weights()):  # moving statistics included
                np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6)
        mean, variance = _moving_statistics(model)
        assert not np.allclose(mean, 0.0) and not np.allclose(variance, 1.0)


def test_two_workers_write_their_batchnorm_statistics_back_and_reading_closures_leave_them(forked_process_client):
    """Two asynchronous workers: the statistics on the client are the stores' (the last closure's), updated and
    sane; closures that only read the model (``training=False``) write nothing back, so the stores keep them."""
    from daskdist.plugins.keras3 import registry

    x, y = dense_data(rows=192, seed=4)
    batches = [(x[k:k + BATCH], y[k:k + BATCH]) for k in range(0, len(x), BATCH)]
    resolver = dd.cluster_resolver.DaskClusterResolver(forked_process_client, num_ps=1)  # 1 ps, 2 workers
    with dd.ParameterServerStrategy(resolver) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            model = _batchnorm_model()
            optimizer = keras.optimizers.SGD(0.05)
        replica_fn = _replica_step(model, optimizer)
        values = [coordinator.schedule(lambda batch: strategy.run(replica_fn, args=(batch,)), args=(b,))
                  for b in batches]
        coordinator.join()
        assert all(np.isfinite(coordinator.fetch(values)))
        mean, variance = _moving_statistics(model)
        assert np.all(np.isfinite(mean)) and np.all(variance > 0)
        assert not np.allclose(mean, 0.0) and not np.allclose(variance, 1.0)  # the workers' statistics came back
        driver = registry.lookup(model).driver
        held = driver.stored_held_state(forked_process_client, 2)
        np.testing.assert_array_equal(held[0], mean)
        np.testing.assert_array_equal(held[1], variance)

        def read_fn(batch):
            return keras.ops.convert_to_numpy(model(batch[0], training=False))

        coordinator.fetch([coordinator.schedule(read_fn, args=(b,)) for b in batches])
        held = driver.stored_held_state(forked_process_client, 2)
        np.testing.assert_array_equal(held[0], mean)
        np.testing.assert_array_equal(held[1], variance)


class _MeanAggregated(keras.metrics.Metric):
    """A metric whose variable is averaged, not summed, over replicas: closures' changes cannot be added up."""

    def __init__(self, name="mean_aggregated", **kwargs):
        super().__init__(name=name, **kwargs)
        self.value = self.add_variable(shape=(), initializer="zeros", aggregation="mean", name="value")

    def update_state(self, values):
        self.value.assign(keras.ops.mean(values))

    def result(self):
        return self.value


def test_metrics_whose_changes_cannot_be_added_are_refused_naming_the_way_and_count_nothing(forked_process_client):
    """A metric variable that is not a sum is refused when the function is pickled; a metric that builds its
    variables on its first update (F1Score) raises in the closure until it is built on the client. Neither
    changes the client's metric, and a built one then counts."""
    x, y = dense_data(rows=16, seed=2)
    onehot = np.eye(4, dtype=np.float32)[y]
    resolver = dd.cluster_resolver.DaskClusterResolver(forked_process_client, num_ps=1)
    with dd.ParameterServerStrategy(resolver) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            averaged = _MeanAggregated()
            f1 = keras.metrics.F1Score(average="macro")
        coordinator.schedule(lambda: averaged.update_state(x))
        with pytest.raises(ValueError, match=r"\['value'\] are not sums .* return the values from the function"):
            coordinator.join()
        assert float(averaged.value.numpy()) == 0.0
        assert not f1.variables  # F1Score creates its variables on its first update_state
        coordinator.schedule(lambda: f1.update_state(onehot, onehot))
        with pytest.raises(ValueError, match=r"build it on the client before scheduling"):
            coordinator.join()
        assert not f1.variables
        f1.update_state(onehot[:1], onehot[:1])
        f1.reset_state()
        # imperfect predictions (each row's class shifted by one for every third row), so the counts show:
        # a commit counted twice or lost changes the true/false positives, which are compared as counts
        guessed = np.eye(4, dtype=np.float32)[np.where(np.arange(len(y)) % 3 == 0, (y + 1) % 4, y)]
        coordinator.fetch(coordinator.schedule(lambda: f1.update_state(onehot, guessed)))
        coordinator.join()
        expected = keras.metrics.F1Score(average="macro")
        expected.update_state(onehot, guessed)
        for name in ("true_positives", "false_positives", "false_negatives"):
            np.testing.assert_array_equal(getattr(f1, name).numpy(), getattr(expected, name).numpy())
        np.testing.assert_allclose(float(f1.result()), float(expected.result()), rtol=RTOL)
        assert float(expected.result()) < 0.9  # not the 1.0 of perfect predictions, whatever the counts
