"""Dataset transformations and partition planning, on the client (no cluster needed)."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest

import daskdist as dd
from daskdist.data import ops
from daskdist.data.split import (
    GlobalBatchRows,
    Piece,
    balanced_pieces,
    homes,
    local_pieces,
    replica_split,
    replica_step_sizes,
)

Dataset = dd.data.Dataset


def test_transformations_follow_tf_semantics():
    ds = Dataset.from_tensor_slices((np.arange(10.0), np.arange(10)))
    assert [int(y) for _, y in ds] == list(range(10))
    mapped = ds.map(lambda x, y: (x * 2, y)).filter(lambda x, y: y % 2 == 0)
    assert [float(x) for x, _ in mapped] == [0.0, 4.0, 8.0, 12.0, 16.0]
    batches = list(ds.batch(4))
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    assert [len(b[1]) for b in ds.batch(4, drop_remainder=True)] == [4, 4]
    assert [int(y) for _, y in ds.batch(3).unbatch()] == list(range(10))
    assert [int(v) for v in Dataset.range(5).repeat(2)] == [0, 1, 2, 3, 4] * 2
    assert [int(v) for v in Dataset.range(10).skip(3).take(4)] == [3, 4, 5, 6]
    assert [int(v) for v in Dataset.range(10).shard(3, 1)] == [1, 4, 7]
    assert [int(v) for v in Dataset.range(2, 11, 3)] == [2, 5, 8]
    assert [int(v) for v in Dataset.range(6).prefetch(2)] == list(range(6))
    assert list(Dataset.range(3).skip(-1)) == []


def test_shuffle_is_a_permutation_seeded_and_reshuffled():
    ds = Dataset.range(100).shuffle(10, seed=1)
    first = [int(v) for v in ds]
    assert sorted(first) == list(range(100)) and first != list(range(100))
    second = [int(v) for v in ds]
    assert sorted(second) == list(range(100)) and second != first  # each iteration reshuffles, as in tf.data
    again = Dataset.range(100).shuffle(10, seed=1)
    assert [int(v) for v in again] == first  # the seed makes the order reproducible
    two_epochs = [int(v) for v in Dataset.range(100).shuffle(10, seed=1).repeat(2)]
    assert two_epochs[:100] == first and two_epochs[100:] != first  # reshuffled in epoch 1
    fixed = [int(v) for v in Dataset.range(100).shuffle(10, seed=1, reshuffle_each_iteration=False).repeat(2)]
    assert fixed[:100] == fixed[100:]


def test_cache_replays_the_first_pass():
    calls = []

    def record(v):
        calls.append(int(v))
        return v

    ds = Dataset.range(5).map(record).cache().repeat(3)
    assert [int(v) for v in ds] == list(range(5)) * 3
    assert calls == list(range(5))  # the map ran only in the first pass


def test_element_spec_and_dask_sources():
    x = da.from_array(np.arange(40.0).reshape(20, 2), chunks=(6, 1))  # chunked on both axes
    y = da.arange(20, chunks=5)  # other boundaries: rechunked to x's
    ds = Dataset.from_dask((x, y)).batch(4)
    spec = ds.element_spec
    assert spec[0].shape == (None, 2) and spec[0].dtype == np.float64
    assert spec[1].shape == (None,)
    batches = list(ds)
    assert np.concatenate([b[1] for b in batches]).tolist() == list(range(20))
    assert len(ds.source.partitions) == 4
    with pytest.raises(ValueError, match="different lengths"):
        Dataset.from_dask((x, da.arange(19, chunks=5)))
    with pytest.raises(TypeError, match="dask arrays, dataframes"):
        Dataset.from_dask(np.arange(5))
    with pytest.raises(ValueError, match="different lengths"):
        Dataset.from_tensor_slices((np.arange(3), np.arange(4)))


def test_dask_dataframe_rows_are_dicts_of_columns():
    pd = pytest.importorskip("pandas")
    ddf = pytest.importorskip("dask.dataframe")
    frame = ddf.from_pandas(pd.DataFrame({"a": np.arange(10), "b": np.arange(10) * 0.5}), npartitions=3)
    rows = list(Dataset.from_dask(frame))
    assert [int(r["a"]) for r in rows] == list(range(10)) and float(rows[3]["b"]) == 1.5


def test_input_context_and_options():
    ctx = dd.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16
    with pytest.raises(ValueError, match="not divisible"):
        ctx.get_per_replica_batch_size(30)
    assert dd.InputOptions(auto_shard_policy="data").auto_shard_policy is dd.data.AutoShardPolicy.DATA


class TestSplitOverReplicas:
    """TF's split, as TF 2.21's MirroredStrategy on 3 CPU devices prints it (benchmarks/tf_split_reference.py)."""

    def test_each_global_batch_gives_ceil_to_the_first_replicas_and_the_rest_what_is_left(self):
        assert replica_split(4, 3) == [2, 2, 0]  # range(8).batch(4): [[0, 1], [2, 3], []]
        assert replica_split(7, 3) == [3, 3, 1]
        assert replica_split(4, 3) == [2, 2, 0] and replica_split(1, 3) == [1, 0, 0]  # range(9).batch(4), last
        assert replica_split(3, 3) == [1, 1, 1]  # range(10).batch(7), last batch: [[7], [8], [9]]
        assert replica_split(2, 3) == [1, 1, 0] and replica_split(0, 3) == [0, 0, 0]

    def test_steps_and_sizes_are_those_of_the_undistributed_batches(self):
        assert replica_step_sizes(11, 7, False, 3) == [[3, 2], [3, 2], [1, 0]]
        assert replica_step_sizes(9, 4, True, 3) == [[2, 2], [2, 2], [0, 0]]

    def test_the_global_rule_picks_each_replicas_part_of_every_batch(self):
        rows = np.arange(11)
        parts = [rows[GlobalBatchRows(11, 7, False, 3, r).mask(rows)].tolist() for r in range(3)]
        assert parts == [[0, 1, 2, 7, 8], [3, 4, 5, 9, 10], [6]]
        dropped = [rows[GlobalBatchRows(11, 7, True, 3, r).mask(rows)].tolist() for r in range(3)]
        assert dropped == [[0, 1, 2], [3, 4, 5], [6]]


class TestRowRanges:
    def test_local_partitions_stay_whole(self):
        shares = local_pieces([10, 20, 30], [0, 1, 0], 2)
        assert shares == [[Piece(0, 0, 10), Piece(2, 0, 30)], [Piece(1, 0, 20)]]

    def test_a_short_replica_reads_only_the_rows_it_needs_from_a_neighbour(self):
        # 6 partitions of 2,500-6,000 rows, two per worker: the benchmark's layout
        rows = [2500, 3000, 6000, 4000, 4500, 5000]
        home = [0, 0, 1, 1, 2, 2]
        targets = [8334, 8333, 8333]
        shares = balanced_pieces(rows, home, targets)
        assert [sum(p.rows for p in share) for share in shares] == targets
        moved = sum(p.rows for r, share in enumerate(shares) for p in share if home[p.partition] != r)
        assert moved == 8334 - 5500  # only replica 0's shortfall moves, as slices
        covered = sorted((p.partition, p.start, p.stop) for share in shares for p in share)
        for index, count in enumerate(rows):  # every row exactly once
            ranges = [(a, b) for i, a, b in covered if i == index]
            assert ranges[0][0] == 0 and ranges[-1][1] == count
            assert all(ranges[k][1] == ranges[k + 1][0] for k in range(len(ranges) - 1))

    def test_homes_follow_the_bytes_then_the_load(self):
        assert homes([{0: 10}, {1: 10}, {0: 6, 1: 4}, {}], [10, 10, 10, 10], 2) in ([0, 1, 0, 1], [0, 1, 0, 0])
        assert homes([{}, {}, {}], [30, 10, 10], 2) == [0, 1, 1]


def test_element_spec_comes_from_the_pipeline_not_from_the_first_partition():
    assert Dataset.range(9).batch(4, drop_remainder=True).element_spec == dd.data.TensorSpec((4,), np.dtype("int64"))
    assert Dataset.range(9).batch(4).element_spec == dd.data.TensorSpec((None,), np.dtype("int64"))
    nothing_first = Dataset.range(100).shard(3, 2).filter(lambda v: v > 1000).batch(4)  # no partition yields one
    assert nothing_first.element_spec == dd.data.TensorSpec((None,), np.dtype("int64"))
    pairs = Dataset.from_tensor_slices((np.zeros((5, 3), "float32"), np.arange(5))).batch(2)
    spec = pairs.map(lambda a, b: {"a": a, "total": a.sum()}).element_spec
    assert spec == {"a": dd.data.TensorSpec((None, 3), np.dtype("float32")),
                    "total": dd.data.TensorSpec((), np.dtype("float32"))}
    assert Dataset.range(9).batch(3).unbatch().element_spec == dd.data.TensorSpec((), np.dtype("int64"))


def test_split_batch_gives_empty_batches_so_replicas_stay_in_step_across_repeat():
    ds = Dataset(Dataset.range(3).source, (ops.SplitBatch([2, 1, 0]), ops.Repeat(2)))
    assert [b.tolist() for b in ds] == [[0, 1], [2], [], [0, 1], [2], []]
