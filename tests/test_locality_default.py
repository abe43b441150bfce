"""Dask data keeps its locality by default; in-memory rows keep TF's exact split.

Real Dask workers (threads of this process; the layout of persisted partitions is pinned per worker).
"""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers

Dataset = dd.data.Dataset

# partitions of uneven sizes, two per worker: workers hold 55, 100 and 95 rows
LAYOUT = [(25, 0), (30, 0), (40, 1), (60, 1), (45, 2), (50, 2)]


def _pinned_table(client):
    workers = sorted(scheduler_workers(client))
    starts = np.cumsum([0] + [rows for rows, _ in LAYOUT])
    blocks = [client.submit(lambda a, b: np.column_stack([np.arange(a, b), np.zeros(b - a)]), int(starts[i]),
                            int(starts[i + 1]), workers=[workers[w]], pure=False) for i, (_, w) in enumerate(LAYOUT)]
    table = da.concatenate([da.from_delayed(b, shape=(rows, 2), dtype=float) for b, (rows, _) in zip(blocks, LAYOUT)])
    return client.persist(table), int(starts[-1])


def _steps(strategy, dist):
    """Per step, each replica's ids."""
    steps = []
    for batch in dist:
        parts = strategy.experimental_local_results(strategy.run(lambda b: b[1], args=(batch,)))
        steps.append([[int(v) for v in p] for p in parts])
    return steps


def test_dask_data_is_read_where_it_lives_by_default(threaded_client):
    table, n = _pinned_table(threaded_client)
    ds = Dataset.from_dask(table).map(lambda row: (row[1:], row[0])).batch(12)
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        default = strategy.experimental_distribute_dataset(ds)
        exact = strategy.experimental_distribute_dataset(ds, dd.InputOptions(experimental_split="global"))
        plan, exact_plan = default.plan(), exact.plan()
        assert plan.split == "balanced" and "balanced split" in repr(plan)
        assert exact_plan.split == "global"
        # only the short worker's missing rows move (84 - 55 = 29 rows of 16 bytes), against 2/3 of all under TF's
        assert plan.bytes_to_move == 29 * 16
        assert exact_plan.bytes_to_move > 4 * plan.bytes_to_move
        steps, exact_steps = _steps(strategy, default), _steps(strategy, exact)
        # every step still one global batch of the same size, split with TF's per-replica sizes
        assert [[len(p) for p in s] for s in steps] == [[len(p) for p in s] for s in exact_steps]
        assert [sum(len(p) for p in s) for s in steps] == [12] * 20 + [10]
        assert sorted(i for s in steps for p in s for i in p) == list(range(n))  # every row exactly once
        # TF's exact split: step k is the undistributed batch k; the default's steps are other rows
        assert [sorted(i for p in s for i in p) for s in exact_steps] == [
            list(range(k, min(k + 12, n))) for k in range(0, n, 12)]


def test_in_memory_rows_keep_tensorflows_exact_split_by_default(threaded_client):
    x = np.arange(40.0).reshape(20, 2)
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        dist = strategy.experimental_distribute_dataset(Dataset.from_tensor_slices((x, np.arange(20))).batch(8))
        assert dist.plan().split == "global"
        steps = _steps(strategy, dist)
        assert steps == [[[0, 1, 2], [3, 4, 5], [6, 7]], [[8, 9, 10], [11, 12, 13], [14, 15]],
                         [[16, 17], [18, 19], []]]


@pytest.mark.parametrize("split", [None, "global", "balanced", "local"])
def test_the_split_option_accepts_none_and_the_three_rules_and_the_plan_follows_it(threaded_client, split):
    x = np.arange(40.0).reshape(20, 2)
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        dist = strategy.experimental_distribute_dataset(Dataset.from_tensor_slices((x, np.arange(20))).batch(8),
                                                        dd.InputOptions(experimental_split=split))
        assert dist.plan().split == (split or "global")  # None: the source chooses (in-memory rows: TF's exact)
