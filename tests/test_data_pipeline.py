"""Dataset transformations and partition planning, on the client (no cluster needed)."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest

import daskdist as dd
from daskdist.data.plan import assign_partitions

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


class TestAssignPartitions:
    def test_local_partitions_stay(self):
        local = [{"a": 10}, {"b": 10}, {"a": 10}, {"b": 10}]
        replicas, moved = assign_partitions([10, 10, 10, 10], local, ["a", "b"])
        assert replicas == [0, 1, 0, 1] and not any(moved)

    def test_balancing_moves_only_what_it_must(self):
        replicas, moved = assign_partitions([10, 10, 10, 10], [{"a": 10}] * 4, ["a", "b"])  # all on a
        assert sorted(replicas) == [0, 0, 1, 1]
        assert sum(moved) == 20

    def test_partitions_split_across_workers_count_only_the_missing_bytes(self):
        # x of partition 0 on a (6 bytes), its y on b (4 bytes)
        replicas, moved = assign_partitions([10, 10], [{"a": 6, "b": 4}, {"b": 10}], ["a", "b"])
        assert replicas == [0, 1] and moved == [4, 0]

    def test_uncomputed_partitions_go_where_load_is_lowest_and_move_nothing(self):
        replicas, moved = assign_partitions([30, 10, 10, 10], [{}] * 4, ["a", "b"])
        assert sorted(replicas) == [0, 0, 0, 1] or sorted(replicas) == [0, 1, 1, 1]
        assert not any(moved)

    def test_uneven_sizes_are_balanced_by_bytes(self):
        replicas, _ = assign_partitions([50, 10, 10, 10, 10, 10], [{"a": 50}] + [{"b": 10}] * 5, ["a", "b"])
        load = [sum(s for s, r in zip([50, 10, 10, 10, 10, 10], replicas) if r == k) for k in range(2)]
        assert load == [50, 50]
