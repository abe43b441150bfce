"""Distributed datasets on real clusters: locality, exactly-once, sharding policies, bad input."""

from __future__ import annotations

import collections
import json
import time

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import futures_of

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers

Dataset = dd.data.Dataset


def _ids_dataset(chunks, batch, *, client=None, persist=True):
    n = sum(chunks)
    x = da.from_array(np.random.default_rng(0).random((n, 4)).astype("float32"), chunks=(tuple(chunks), 4))
    y = da.from_array(np.arange(n), chunks=(tuple(chunks),))
    if persist:
        x, y = client.persist([x, y])
    return Dataset.from_dask((x, y)).map(lambda a, b: (a * 2, b)).batch(batch), n


def _seen_ids(strategy, dist):
    """Iterate from the client; return every replica's ids and the rows of each replica per step."""
    ids, rows_per_step = [], []

    def labels(batch):
        return batch[1]

    for batch in dist:
        out = strategy.run(labels, args=(batch,))
        parts = strategy.experimental_local_results(out)
        rows_per_step.append([len(p) for p in parts])
        for p in parts:
            ids.extend(int(v) for v in p)
    return ids, rows_per_step


def _transferred_bytes(client):
    return sum(client.run(lambda dask_worker: dask_worker.transfer_outgoing_bytes_total).values())


def _block(i: int) -> np.ndarray:
    return np.column_stack([np.arange(250.0) + 250 * i, np.random.default_rng(i).random((250, 3))])


def test_an_epoch_moves_no_data_when_partitions_are_spread_evenly(process_client):
    workers = sorted(scheduler_workers(process_client))
    for _ in range(3):  # Dask usually computes each partition where its block is; retry the rare time it did not
        blocks = [process_client.submit(_block, i, workers=[workers[i % 2]], pure=False) for i in range(8)]
        rows = da.concatenate([da.from_delayed(b, shape=(250, 4), dtype=float) for b in blocks])
        rows = process_client.persist(rows)
        del blocks
        for future in futures_of(rows):  # wait without pulling the data anywhere
            future.exception()
        holders = process_client.who_has(rows)
        if sorted(collections.Counter(w for ws in holders.values() for w in ws).values()) == [4, 4]:
            break  # 4 partitions on each worker: spread evenly
    else:
        pytest.fail(f"could not spread the partitions evenly: {holders}")
    with dd.MirroredStrategy(client=process_client) as strategy:
        ds = Dataset.from_dask(rows).map(lambda row: (row[1:], row[0])).batch(64)
        for split in ("balanced", "local"):
            before = _transferred_bytes(process_client)
            dist = strategy.experimental_distribute_dataset(ds, dd.InputOptions(experimental_split=split))
            plan = dist.plan()
            assert f"{split} split" in repr(plan) and plan.bytes_to_move == 0, plan
            ids, rows_per_step = _seen_ids(strategy, dist)
            moved = _transferred_bytes(process_client) - before
            assert sorted(ids) == list(range(2000))  # every element exactly once
            assert moved < 200, f"{moved} bytes moved between workers"  # only the one-row element_spec sample
            assert len(rows_per_step) == 32 and all(r == [32, 32] for r in rows_per_step[:-1])  # TF's steps and sizes


def test_each_step_is_the_undistributed_batch_and_the_plan_says_what_moves(process_client):
    with dd.MirroredStrategy(client=process_client) as strategy:
        ds, n = _ids_dataset([250] * 8, 64, client=process_client)  # x and y chunks land independently
        before = _transferred_bytes(process_client)
        dist = strategy.experimental_distribute_dataset(ds, dd.InputOptions(experimental_split="global"))
        steps = []
        for batch in dist:
            parts = strategy.experimental_local_results(strategy.run(lambda b: b[1], args=(batch,)))
            steps.append([p.tolist() for p in parts])
        moved = _transferred_bytes(process_client) - before
    expected = []
    for k in range(0, n, 64):  # global batch k, split with TF's rule: 32 + 32, the last 16 rows 8 + 8
        half = -(-(min(k + 64, n) - k) // 2)
        expected.append([list(range(k, k + half)), list(range(k + half, min(k + 64, n)))])
    assert steps == expected
    plan = dist.plan()
    assert plan.bytes_to_move > 0
    # slices cut where the rows are; each transfer carries a few hundred bytes of framing
    assert abs(moved - plan.bytes_to_move) < 0.05 * plan.bytes_to_move + 400 * len(plan.reads), (moved, plan)


def test_uneven_partitions_every_element_once_and_replicas_stop_together(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        ds, n = _ids_dataset([10, 37, 5, 100, 48, 3, 1], 12, client=threaded_client)
        dist = strategy.experimental_distribute_dataset(ds)
        ids, rows = _seen_ids(strategy, dist)
        assert sorted(ids) == list(range(n))
        assert all(len(r) == 3 for r in rows)
        assert rows[-1] != [4, 4, 4] or sum(map(sum, rows)) == n  # the last step may be partial or empty
        assert all(r <= 4 for step in rows for r in step)  # 12 global -> 4 per replica

        # inside the replicas: every replica runs the same number of steps
        def loop():
            steps, seen = 0, []
            for _, labels in dist:
                steps += 1
                seen.extend(int(v) for v in labels)
            return np.array([steps, *seen])  # one array: its first number is the count of steps

        results = strategy.experimental_local_results(strategy.run(loop))
        assert len({int(r[0]) for r in results}) == 1
        everything = [int(v) for r in results for v in r[1:]]
        assert sorted(everything) == list(range(n))


def test_data_not_yet_computed_is_computed_by_dask_then_read_where_it_is(process_client):
    with dd.MirroredStrategy(client=process_client) as strategy:
        ds, n = _ids_dataset([100] * 6, 50, persist=False)
        before = _transferred_bytes(process_client)
        dist = strategy.experimental_distribute_dataset(ds, dd.InputOptions(experimental_split="balanced"))
        ids, _ = _seen_ids(strategy, dist)
        assert sorted(ids) == list(range(n))
        moved = _transferred_bytes(process_client) - before
        assert moved < dist.plan().bytes_to_move + 400 * len(dist.plan().reads) + 200  # what balance needs, no more


def test_sharding_policies(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        few, n = _ids_dataset([30, 30], 6, client=threaded_client)  # 2 partitions, 3 replicas: rows are split
        dist = strategy.experimental_distribute_dataset(few, dd.InputOptions(experimental_split="global"))
        assert "AUTO sharding, global split" in repr(dist.plan())
        ids, rows = _seen_ids(strategy, dist)
        assert sorted(ids) == list(range(n)) and rows == [[2, 2, 2]] * 10

        off = strategy.experimental_distribute_dataset(few, dd.InputOptions(auto_shard_policy="OFF"))
        ids, _ = _seen_ids(strategy, off)
        assert sorted(ids) == sorted(list(range(n)) * 3)  # every replica reads everything

        with pytest.raises(ValueError, match="FILE sharding needs"):
            strategy.experimental_distribute_dataset(few, dd.InputOptions(auto_shard_policy="FILE"))
        with pytest.raises(ValueError, match="experimental_split must be"):
            dd.InputOptions(experimental_split="nearest")

        small = Dataset.from_tensor_slices(np.arange(40), num_partitions=4).batch(9)
        ids = []
        for batch in strategy.experimental_distribute_dataset(small):
            parts = strategy.experimental_local_results(strategy.run(lambda b: b, args=(batch,)))
            ids.extend(int(v) for p in parts for v in p)
        assert ids == list(range(40))  # global batches in order, each split in order


@pytest.mark.parametrize(
    "dataset, expected",
    [  # TF 2.21, MirroredStrategy over 3 CPU devices (benchmarks/tf_split_reference.py)
        (lambda: Dataset.range(8).batch(4), [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]]),
        (lambda: Dataset.range(9).batch(4), [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []], [[8], [], []]]),
        (lambda: Dataset.range(10).batch(7), [[[0, 1, 2], [3, 4, 5], [6]], [[7], [8], [9]]]),
        (lambda: Dataset.range(11).batch(7), [[[0, 1, 2], [3, 4, 5], [6]], [[7, 8], [9, 10], []]]),
        (lambda: Dataset.range(9).batch(4, drop_remainder=True), [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]]),
        (lambda: Dataset.range(2).batch(2), [[[0], [1], []]]),
        (lambda: Dataset.range(9).batch(4).repeat(2),
         [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []], [[8], [], []]] * 2),
    ],
)
def test_global_batches_are_split_as_tensorflow_splits_them(threaded_client, dataset, expected):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        steps = []
        for batch in strategy.experimental_distribute_dataset(dataset()):
            parts = strategy.experimental_local_results(strategy.run(lambda b: b, args=(batch,)))
            steps.append([p.tolist() for p in parts])
        assert steps == expected

        def loop(dist):  # inside the replicas (fit's path): the same steps
            # one leaf per replica: lists of different lengths would be results of different structures,
            # which strategy.run refuses as TF's regroup does
            return json.dumps([b.tolist() for b in dist])

        dist = strategy.experimental_distribute_dataset(dataset())
        inside = [json.loads(r) for r in strategy.experimental_local_results(strategy.run(loop, args=(dist,)))]
        assert [[inside[r][k] for r in range(3)] for k in range(len(expected))] == expected


def test_tuple_elements_give_a_per_replica_at_each_leaf(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        ds = Dataset.from_tensor_slices((np.arange(6), np.arange(6) * 10)).batch(3)
        dist = strategy.experimental_distribute_dataset(ds)
        seen = []
        for x, y in dist:  # TF's tutorial loop
            assert isinstance(x, dd.PerReplica) and isinstance(y, dd.PerReplica)
            sums = strategy.run(lambda a, b: a + b, args=(x, y))
            whole = strategy.run(lambda batch: batch[0] + batch[1], args=((x, y),))
            assert [s.tolist() for s in strategy.experimental_local_results(sums)] == \
                [w.tolist() for w in strategy.experimental_local_results(whole)]
            seen.extend(int(v) for s in strategy.experimental_local_results(sums) for v in s)
        assert seen == [11 * i for i in range(6)]
        timings = strategy.step_timings(last=1)
        assert [steps[-1]["samples"] for steps in timings] == [1, 1, 1]  # the leaves count as the batch's rows

        frames = Dataset.from_tensor_slices({"a": np.arange(4), "b": np.ones(4)}).batch(4)
        element = next(iter(strategy.experimental_distribute_dataset(frames)))
        assert set(element) == {"a", "b"} and all(isinstance(v, dd.PerReplica) for v in element.values())


def test_distribute_datasets_from_function(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:

        def dataset_fn(ctx: dd.InputContext):
            batch = ctx.get_per_replica_batch_size(12)
            return Dataset.range(100).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(batch)

        dist = strategy.distribute_datasets_from_function(dataset_fn)
        assert dist.element_spec == dd.data.TensorSpec((None,), np.dtype("int64"))  # also where shard leaves 0 rows first
        pairs = strategy.distribute_datasets_from_function(
            lambda ctx: Dataset.range(12).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).map(lambda v: (v, -v))
            .batch(2))
        x, y = next(iter(pairs))
        assert isinstance(x, dd.PerReplica) and isinstance(y, dd.PerReplica)
        ids = []
        for batch in dist:
            parts = strategy.experimental_local_results(strategy.run(lambda b: b, args=(batch,)))
            assert all(len(p) <= 4 for p in parts)
            ids.extend(int(v) for p in parts for v in p)
        assert sorted(ids) == list(range(100))

        def bad_fn(ctx):
            if ctx.input_pipeline_id == 1:
                raise RuntimeError("no files for pipeline 1")
            return Dataset.range(10).batch(2)

        start = time.monotonic()
        with pytest.raises(RuntimeError, match="no files for pipeline 1"):
            strategy.distribute_datasets_from_function(bad_fn)
        with pytest.raises(TypeError, match="must return a daskdist.data.Dataset"):
            strategy.distribute_datasets_from_function(lambda ctx: [1, 2, 3])
        with pytest.raises(ValueError, match="not divisible"):
            strategy.distribute_datasets_from_function(lambda ctx: Dataset.range(4).batch(ctx.get_per_replica_batch_size(10)))
        assert time.monotonic() - start < 10


def test_iterator_api(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        dist = strategy.experimental_distribute_dataset(Dataset.range(9).batch(9))
        iterator = iter(dist)
        first = iterator.get_next()
        assert isinstance(first, dd.PerReplica) and "on the replica" in repr(first.values[0])
        assert iterator.get_next_as_optional().has_value() is False
        with pytest.raises(dd.OutOfRangeError):
            iterator.get_next()
        out = strategy.run(lambda b: b, args=(first,))
        assert sorted(int(v) for part in strategy.experimental_local_results(out) for v in part) == list(range(9))
        timings = strategy.step_timings(last=1)
        assert all(steps[-1]["input_wait"] > 0 for steps in timings)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: np.arange(10), TypeError, "takes a daskdist.data.Dataset"),
        (lambda: Dataset.range(10), ValueError, "batch the dataset"),
        (lambda: Dataset.range(10).batch(2).unbatch(), ValueError, "batch the dataset"),
    ],
)
def test_bad_input_is_refused_on_the_client(threaded_client, make, error, message):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        with pytest.raises(error, match=message):
            strategy.experimental_distribute_dataset(make())


def test_dataframe_partitions(threaded_client):
    pd = pytest.importorskip("pandas")
    ddf = pytest.importorskip("dask.dataframe")
    frame = ddf.from_pandas(pd.DataFrame({"id": np.arange(60), "x": np.arange(60) * 0.5}), npartitions=6)
    frame = threaded_client.persist(frame)
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        dist = strategy.experimental_distribute_dataset(Dataset.from_dask(frame).batch(9))
        ids = []
        for batch in dist:
            parts = strategy.experimental_local_results(strategy.run(lambda b: b["id"], args=(batch,)))
            ids.extend(int(v) for p in parts for v in p)
        assert sorted(ids) == list(range(60))


def _pinned_blocks(client, layout):
    """A persisted (rows, 2) array whose partition ``i`` has ``layout[i][0]`` rows on worker ``layout[i][1]``."""
    workers = sorted(scheduler_workers(client))
    starts = np.cumsum([0] + [rows for rows, _ in layout])
    blocks = [client.submit(lambda a, b: np.column_stack([np.arange(a, b), np.zeros(b - a)]), int(starts[i]),
                            int(starts[i + 1]), workers=[workers[w]], pure=False) for i, (_, w) in enumerate(layout)]
    table = da.concatenate([da.from_delayed(b, shape=(rows, 2), dtype=float) for b, (rows, _) in zip(blocks, layout)])
    return client.persist(table), int(starts[-1])


def test_balanced_and_local_splits_of_uneven_partitions(threaded_client):
    table, n = _pinned_blocks(threaded_client, [(25, 0), (30, 0), (40, 1), (60, 1), (45, 2), (50, 2)])
    ds = Dataset.from_dask(table).map(lambda row: (row[1:], row[0])).batch(12)
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        balanced = strategy.experimental_distribute_dataset(ds, dd.InputOptions(experimental_split="balanced"))
        ids, rows = _seen_ids(strategy, balanced)
        assert sorted(ids) == list(range(n))
        assert rows == [[4, 4, 4]] * 20 + [[4, 4, 2]]  # 250 rows: TF's sizes, the undistributed number of steps
        plan = balanced.plan()
        # workers hold 55, 100 and 95 rows; the replicas need 84, 84 and 82: only the short one's rows move
        short = plan.workers.index(min(scheduler_workers(threaded_client)))
        moved_rows = sum(p.rows for p in plan.reads if p.moved)
        assert moved_rows == [84, 84, 82][short] - 55
        assert plan.bytes_to_move == moved_rows * 16  # slices of a neighbour's partitions, not whole partitions

        local = strategy.experimental_distribute_dataset(ds, dd.InputOptions(experimental_split="local"))
        ids, rows = _seen_ids(strategy, local)
        assert local.plan().bytes_to_move == 0 and sorted(ids) == list(range(n))
        assert len(rows) == 25 and rows[-1] in ([0, 4, 0], [4, 0, 0], [0, 0, 4])  # 100 rows at 4 a step; others ran out


def _assert_on_readers(client, dist) -> None:
    """Every task holding a replica's rows is on that replica's worker."""
    holders = client.who_has([future for _, future in dist._pinned])
    assert dist._pinned
    for worker, future in dist._pinned:
        assert worker in holders[future.key], (worker, holders[future.key])


def test_distributions_of_the_same_data_survive_the_memory_manager(make_cluster):
    """Copies one distribution makes must not be what another relies on: Dask may drop extra copies."""
    # the memory manager runs only where the test says, so the copies are there when the plans are made
    with dask.config.set({"distributed.scheduler.active-memory-manager.start": False}):
        client = make_cluster(2, processes=True)
    workers = sorted(scheduler_workers(client))
    blocks = [client.submit(_block, i, workers=[workers[0]], pure=False) for i in range(8)]
    rows = client.persist(da.concatenate([da.from_delayed(b, shape=(250, 4), dtype=float) for b in blocks]))
    del blocks
    ds = Dataset.from_dask(rows).map(lambda row: (row[1:], row[0])).batch(50)
    balanced = dd.InputOptions(experimental_split="balanced")
    with dd.MirroredStrategy(client=client) as both, dd.MirroredStrategy(devices=["/cpu:1"], client=client) as one:
        first = both.experimental_distribute_dataset(ds, balanced)
        assert first.plan().bytes_to_move > 0  # half of the partitions had to go to the second worker
        second = both.experimental_distribute_dataset(ds, balanced)
        assert second.plan().bytes_to_move == 0  # the copies are there already
        third = one.experimental_distribute_dataset(ds, balanced)  # everything on the second worker: more copies
        client.amm.run_once()  # Dask's active memory manager drops the extra copies it finds
        time.sleep(0.5)
        for dist in (first, second, third):
            _assert_on_readers(client, dist)
        before = _transferred_bytes(client)
        ids, _ = _seen_ids(both, first)
        moved = _transferred_bytes(client) - before
    assert sorted(ids) == list(range(2000))
    assert moved < 200, f"{moved} bytes moved while reading the first distribution"
