"""``fit`` and ``evaluate`` under ParameterServerStrategy (closures on workers, parameters on a ps) on every
in-process adapter.

With one worker the closures run one after another: the parameters held on the ps take exactly the numpy
reference's steps on the same global batches (``tests/support/adapters.py``). With two workers the updates
are asynchronous, so no reference fixes the weights; what is exact there is each closure's step applied
once (the step count) and an evaluation that counts every row once (the final weights' loss and accuracy).
"""

from __future__ import annotations

import numpy as np
import pytest

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers
from tests.support.adapters import ADAPTERS, assert_weights, data, reference_evaluate, reference_fit

pytestmark = pytest.mark.timeout(600)

BATCH = 16


@pytest.fixture(scope="module")
def initial():
    rng = np.random.default_rng(15)
    return [rng.uniform(-0.5, 0.5, shape).astype(np.float32) for shape in ((8, 16), (16,), (16, 4), (4,))]


def _ps_strategy(client, workers: int):
    info = scheduler_workers(client)
    ordered = sorted(info, key=lambda a: info[a]["name"])
    spec = dd.cluster_resolver.ClusterSpec({"ps": ordered[:1], "worker": ordered[1:1 + workers]})
    return dd.ParameterServerStrategy(dd.cluster_resolver.SimpleClusterResolver(spec), client=client)


def _creator(x, y):
    def dataset_fn(ctx):  # each worker's pipeline: the rows in order, repeated (one worker: the global batches)
        return (dd.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
                .batch(BATCH).repeat())

    return dd.experimental.DatasetCreator(dataset_fn)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=str)
def test_one_worker_trains_the_ps_held_parameters_as_one_process(adapter, matrix_client, initial):
    x, y = data(rows=80)  # 5 global batches of 16 per epoch
    expected = reference_fit(initial, x, y, BATCH, epochs=2)
    with _ps_strategy(matrix_client, workers=1) as strategy:
        with strategy.scope():
            model = adapter.model(initial)
        with pytest.raises(ValueError, match="`steps_per_epoch` must be specified"):  # TF's rule, nothing trained
            model.fit(_creator(x, y), epochs=1, verbose=0)
        history = model.fit(_creator(x, y), epochs=2, steps_per_epoch=5, verbose=0)
        assert_weights(model.get_weights(), expected.weights)
        np.testing.assert_allclose(history.history["loss"], expected.loss, rtol=1e-5)
        assert adapter.iterations(model) == 10
        loss, accuracy = model.evaluate(x, y, batch_size=32, verbose=0)  # shards on the worker, every row once
        assert (loss, accuracy) == pytest.approx(reference_evaluate(expected.weights, x, y), rel=1e-5)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=str)
def test_two_workers_apply_each_closure_once_and_evaluate_counts_every_row_once(adapter, matrix_client,
                                                                              initial):
    x, y = data(rows=160)
    with _ps_strategy(matrix_client, workers=2) as strategy:
        assert len(strategy.extended.worker_addresses) == 2
        with strategy.scope():
            model = adapter.model(initial)
        history = model.fit(_creator(x, y), epochs=3, steps_per_epoch=10, verbose=0)
        assert history.epoch == [0, 1, 2]
        assert adapter.iterations(model) == 30  # 3 x 10 closures, each step applied once on the ps
        weights = model.get_weights()
        assert len(weights) == 4 and not np.array_equal(weights[0], initial[0])
        loss, accuracy = model.evaluate(x, y, batch_size=32, verbose=0)
        assert (loss, accuracy) == pytest.approx(reference_evaluate(weights, x, y), rel=1e-5)
