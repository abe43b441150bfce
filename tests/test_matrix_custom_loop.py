"""TF's custom-training loop (``strategy.run`` of a step, ``strategy.reduce`` of its loss) on strategy
combinations x in-process adapters, against the numpy reference on the same global batches.

Each replica's loss is its per-example losses summed over the global batch size, its gradients are summed
over the replicas: the reduced loss is the global batch's mean and the step the one-process step, for any
split (3 replicas: 16 rows split 6/5/5, the last batch of 8 3/3/2). A mean in place of the sum, or the local
batch size in place of the global one, changes the step by the number of replicas.
"""

from __future__ import annotations

import numpy as np
import pytest

import daskdist as dd
from tests.support.adapters import ADAPTERS, assert_weights, data, reference_fit
from tests.support.strategies import SYNCHRONOUS

pytestmark = pytest.mark.timeout(600)

GLOBAL_BATCH = 16


@pytest.fixture(scope="module")
def initial():
    rng = np.random.default_rng(13)
    return [rng.uniform(-0.5, 0.5, shape).astype(np.float32) for shape in ((8, 16), (16,), (16, 4), (4,))]


@pytest.mark.parametrize("adapter", ADAPTERS, ids=str)
@pytest.mark.parametrize("combination", SYNCHRONOUS, ids=str)
def test_custom_loop_with_strategy_run_equals_one_process(combination, adapter, matrix_client, initial):
    x, y = data(rows=40)  # global batches of 16, 16, 8
    expected = reference_fit(initial, x, y, GLOBAL_BATCH, epochs=2, learning_rate=0.1, divide_by=GLOBAL_BATCH)
    with combination.strategy(matrix_client) as strategy:
        with strategy.scope():
            model = adapter.model(initial)
            optimizer = adapter.keras.optimizers.SGD(0.1)  # made in the scope: one per replica
        step = adapter.custom_step(model, optimizer, GLOBAL_BATCH)
        dist = strategy.experimental_distribute_dataset(dd.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
        losses = []
        for _ in range(2):
            for batch in dist:
                per_replica = strategy.run(step, args=(batch,))
                losses.append(float(strategy.reduce(dd.ReduceOp.SUM, per_replica, axis=None)))
        np.testing.assert_allclose(losses, expected.batch_losses, rtol=1e-5)
        assert_weights(model.get_weights(), expected.weights)  # the client takes the replicas' weights
        adapter.assert_replicas_identical(strategy, model)
