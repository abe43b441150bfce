"""A Keras 3 model (torch backend) under ParameterServerStrategy with a worker and its nanny killed mid-closure.

The workers are ``dask worker`` processes started by the test (``process_workers``): a kill -9 of a worker and its
nanny leaves nothing to replace it, so the closures lost with it run again on the worker left. The kill lands at a
fault point inside a closure (the victim writes its pids to a file and waits there; ``Killer`` kills it), never
after a sleep; the other worker waits in its first closure until the victim reached its point, so the victim has
taken a closure however loaded the machine is. What counts: every row evaluated exactly once, by the runs the
coordinator kept.
"""

from __future__ import annotations

import json
import os
import time

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported, here and in the workers
pytest.importorskip("torch")
pytest.importorskip("keras")

import dask  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import daskdist as dd  # noqa: E402
from daskdist.plugins.keras3.backend import prepare_replica  # noqa: E402
from tests.keras3_models import compile_model, dense_data, sequential  # noqa: E402
from tests.support.killers import Killer  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ClusterCoordinator = dd.experimental.coordinator.ClusterCoordinator
RTOL = 1e-5


def _fault_point(marker, victim_pid, here):
    """In a closure: on the victim, once ``here`` is true, write its pids to ``marker`` and wait to be killed; on
    another worker, wait until the victim is at its point (so the victim took a closure)."""
    if marker.exists():
        return
    if os.getpid() == victim_pid:
        if here:
            marker.write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid()}))
            time.sleep(600)  # killed here
        return
    deadline = time.monotonic() + 300
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _strategy(workers):
    workers.client.run(prepare_replica, "torch")  # Keras imported on the workers' backend before the groups start
    resolver = dd.cluster_resolver.DaskClusterResolver(workers.client, num_ps=1)  # 1 ps, 2 workers
    return dd.ParameterServerStrategy(resolver)


def test_a_worker_killed_mid_shard_of_an_exactly_once_evaluation_the_evaluation_counts_every_row_once(
        process_workers, tmp_path):
    """``model.evaluate(DatasetCreator)`` without ``steps``: 10 batches cut into 4 shards, one closure each. The
    victim is killed (with its nanny) inside a shard, after it evaluated one of its batches at least; its closure
    runs again on the other worker, which builds the shard again. The logs are plain Keras' over the 160 rows, and
    the loss counted 160 rows: the lost run's batches count nowhere, the re-run's once. Shown failing: with the
    coordinator not queueing a closure lost with its worker again, ``evaluate`` raises ``CancelledError``."""
    workers = process_workers(3)
    x, y = dense_data(rows=160, seed=8)
    marker = tmp_path / "paused.json"
    with _strategy(workers) as strategy:
        coordinator = ClusterCoordinator(strategy)
        victim = coordinator.workers[0]
        victim_pid, _ = workers.pids(victim)
        with strategy.scope():
            model = compile_model(sequential(), keras.optimizers.SGD(0.1))
        plain = compile_model(sequential(), keras.optimizers.SGD(0.1))
        plain.set_weights(model.get_weights())
        expected = plain.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
        batches_read = []  # per closure: each closure unpickles its own copy of the dataset function

        def pause(features, labels):  # the 6th batch a shard's pipeline reads: past one of the shard's own at least
            batches_read.append(1)
            _fault_point(marker, victim_pid, len(batches_read) == 6)
            return features, labels

        def dataset_fn(ctx):
            return (dd.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
                    .batch(16).map(pause))

        killer = Killer(marker, workers=workers)
        with dask.config.set({"daskdist.parameter-store.evaluation-shards": 4}):
            logs = model.evaluate(dd.experimental.DatasetCreator(dataset_fn), verbose=0, return_dict=True)
        assert killer.join()["pid"] == victim_pid
        assert coordinator.live_workers == (coordinator.workers[1],)  # it finished on the worker left
        loss_tracker = next(m for m in model.metrics if m.name == "loss")
        assert float(np.asarray(loss_tracker.count.numpy())) == 160  # every row once
        np.testing.assert_allclose([logs["loss"], logs["accuracy"]], [expected["loss"], expected["accuracy"]],
                                   rtol=RTOL)


def test_a_scope_metric_counts_a_closure_re_run_after_its_worker_was_killed_once(process_workers, tmp_path):
    """TF's custom-loop evaluation into a metric created in the scope: the victim updates the metric in its first
    closure and is killed (with its nanny) before the closure returns. The closure runs again on the other worker;
    the metric counts each of the 200 rows once and equals plain Keras on the same weights.
    Shown failing: with the coordinator committing a closure's parts from its first attempt only, the re-run's
    update is lost (count 180)."""
    workers = process_workers(3)
    x, y = dense_data(rows=200, seed=5)
    batches = [(x[k:k + 20], y[k:k + 20]) for k in range(0, 200, 20)]
    marker = tmp_path / "paused.json"
    with _strategy(workers) as strategy:
        coordinator = ClusterCoordinator(strategy)
        victim = coordinator.workers[0]
        victim_pid, _ = workers.pids(victim)
        with strategy.scope():
            model = sequential()
            optimizer = keras.optimizers.SGD(0.1)  # noqa: F841 (the model's loop optimizer: placing it needs one)
            eval_accuracy = keras.metrics.SparseCategoricalAccuracy()

        def eval_fn(batch):
            features, labels = batch
            eval_accuracy.update_state(labels, model(features, training=False))
            _fault_point(marker, victim_pid, True)  # the update made on the worker, the closure not returned
            return len(labels)

        killer = Killer(marker, workers=workers)
        values = [coordinator.schedule(eval_fn, args=(batch,)) for batch in batches]
        coordinator.join()
        assert killer.join()["pid"] == victim_pid
        assert coordinator.fetch(values) == [20] * 10
        assert victim not in coordinator.live_workers
        plain = sequential()
        plain.set_weights(model.get_weights())
        expected = keras.metrics.SparseCategoricalAccuracy()
        expected.update_state(y, plain.predict(x, verbose=0))
        assert float(eval_accuracy.count.numpy()) == 200  # every row once: the lost run's update nowhere
        np.testing.assert_allclose(float(eval_accuracy.result()), float(expected.result()), rtol=RTOL)
