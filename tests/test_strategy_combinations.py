"""The core behaviours on every strategy facade (``tests/support/strategies.py``), on one threaded cluster.

Scope and variables, run / reduce / gather and distributed input: the same test body and the same expected
values for the default strategy, OneDevice, Mirrored (two devices, every worker), MultiWorkerMirrored,
CentralStorage and (for scope and variables) ParameterServer. ``fit`` and save / load on every combination and
every model kind: ``tests/test_matrix_fit.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

import daskdist as dd
from tests.support.strategies import COMBINATIONS, SYNCHRONOUS

Dataset = dd.data.Dataset


@pytest.mark.parametrize("combination", COMBINATIONS, ids=str)
def test_variables_made_in_the_scope_belong_to_the_strategy_and_take_updates(combination, threaded_client):
    with combination.strategy(threaded_client) as strategy:
        with strategy.scope():
            assert dd.get_strategy() is strategy
            v = dd.Variable(np.array([1.0, 2.0]), aggregation=dd.VariableAggregation.MEAN)
        v.assign_add(np.array([1.0, 1.0]))  # from the client: every copy, or the parameter server's
        np.testing.assert_array_equal(v.numpy(), [2.0, 3.0])
        v.assign(np.array([5.0, 6.0]))
        np.testing.assert_array_equal(v.read_value(), [5.0, 6.0])


@pytest.mark.parametrize("combination", SYNCHRONOUS, ids=str)
def test_run_reduce_and_gather_see_every_replica(combination, threaded_client):
    with combination.strategy(threaded_client) as strategy:
        n = strategy.num_replicas_in_sync
        assert n == combination.replicas

        def fn():
            ctx = dd.get_replica_context()
            mine = np.full(2, ctx.replica_id_in_sync_group + 1.0)
            return mine, ctx.all_reduce("SUM", mine)

        mine, summed = strategy.run(fn)
        total = n * (n + 1) / 2
        assert [s.tolist() for s in strategy.experimental_local_results(summed)] == [[total] * 2] * n
        assert strategy.reduce("SUM", mine, axis=None).tolist() == [total] * 2
        assert strategy.reduce("MEAN", mine, axis=0).tolist() == pytest.approx((n + 1) / 2)
        assert strategy.gather(mine, axis=0).tolist() == [r + 1.0 for r in range(n) for _ in range(2)]


@pytest.mark.parametrize("combination", SYNCHRONOUS, ids=str)
def test_distributed_input_splits_each_global_batch_over_the_replicas(combination, threaded_client):
    with combination.strategy(threaded_client) as strategy:
        n = strategy.num_replicas_in_sync
        rows = np.arange(12 * n, dtype=np.float64)
        dist = strategy.experimental_distribute_dataset(Dataset.from_tensor_slices(rows).batch(4 * n))
        seen = []
        for batch in dist:
            parts = strategy.run(lambda part: np.asarray(part) + 0.0, args=(batch,))  # each replica its part
            assert [len(p) for p in strategy.experimental_local_results(parts)] == [4] * n
            seen.append(strategy.gather(parts, axis=0).tolist())  # in replica order: the global batch
        assert seen == [rows[i:i + 4 * n].tolist() for i in range(0, 12 * n, 4 * n)]
