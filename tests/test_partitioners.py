"""Partitioners with TensorFlow's exact numbers, ShardedVariable's semantics, and lookups on stored shards."""

from __future__ import annotations

import numpy as np
import pytest

import daskdist as dd
from daskdist.variables.partitioners import shard_sizes

partitioners = dd.experimental.partitioners
ShardedVariable = dd.experimental.ShardedVariable


# -- partitioners: TF's docstring examples and sharded_variable_test.py values ----------------


def test_fixed_shards_partitioner_takes_at_most_the_rows():
    assert partitioners.FixedShardsPartitioner(num_shards=2)((10, 3), "float32") == [2, 1]
    assert partitioners.FixedShardsPartitioner(num_shards=5)((13, 4), "float32") == [5, 1]
    assert partitioners.FixedShardsPartitioner(num_shards=5)((3, 4), "float32") == [3, 1]


def test_min_size_partitioner_as_in_tensorflow():
    assert partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), "float32") == [2, 1]
    assert partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), "float32") == [6, 1]
    # partitioned_variables docstring: float32 [1024, 1024] over 256 KiB slices -> 16
    assert partitioners.MinSizePartitioner(max_shards=100)((1024, 1024), "float32") == [16, 1]
    assert partitioners.MinSizePartitioner(max_shards=4)((1024, 1024), "float32") == [4, 1]
    assert partitioners.MinSizePartitioner()((1024, 1024), "float32") == [1, 1]  # max_shards defaults to 1
    # strings count bytes_per_string per element: 10 x 2 x 16 = 320 bytes, 100-byte shards -> 4
    assert partitioners.MinSizePartitioner(min_shard_bytes=100, max_shards=10)((10, 2), np.str_) == [4, 1]


def test_max_size_partitioner_as_in_tensorflow():
    assert partitioners.MaxSizePartitioner(max_shard_bytes=4)((6, 1), "float32") == [6, 1]
    assert partitioners.MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), "float32") == [2, 1]
    assert partitioners.MaxSizePartitioner(max_shard_bytes=1024)((6, 1), "float32") == [1, 1]
    # a row of 3 float64 is 24 bytes; 50-byte shards hold 2 rows -> ceil(13 / 2) = 7
    assert partitioners.MaxSizePartitioner(max_shard_bytes=50)((13, 3), "float64") == [7, 1]
    # one row larger than a shard: one row per shard
    assert partitioners.MaxSizePartitioner(max_shard_bytes=8)((5, 10), "float32") == [5, 1]


def test_partitioners_refuse_non_positive_arguments_with_tensorflows_messages():
    with pytest.raises(ValueError, match=r"Argument `min_shard_bytes` must be positive. Received: 0"):
        partitioners.MinSizePartitioner(min_shard_bytes=0)
    with pytest.raises(ValueError, match=r"Argument `max_shards` must be positive. Received: -1"):
        partitioners.MinSizePartitioner(max_shards=-1)
    with pytest.raises(ValueError, match=r"Argument `bytes_per_string` must be positive. Received: 0"):
        partitioners.MinSizePartitioner(bytes_per_string=0)
    with pytest.raises(ValueError, match=r"Argument `max_shard_bytes` must be positive. Received 0"):
        partitioners.MaxSizePartitioner(max_shard_bytes=0)
    with pytest.raises(ValueError, match=r"Argument `max_shards` must be positive. Received -2"):
        partitioners.MaxSizePartitioner(max_shard_bytes=10, max_shards=-2)
    with pytest.raises(ValueError, match=r"Argument `num_shards` must be positive"):
        partitioners.FixedShardsPartitioner(num_shards=0)
    assert partitioners.MaxSizePartitioner(max_shard_bytes=4, max_shards=0)((6, 1), "float32") == [6, 1]  # TF: 0 = no limit


def test_div_split_gives_the_first_shards_one_row_more():
    assert shard_sizes(13, 5) == [3, 3, 3, 2, 2]
    assert shard_sizes(10, 4) == [3, 3, 2, 2]  # PSV2's comment: offsets 0, 3, 6, 8, 10
    assert shard_sizes(6, 3) == [2, 2, 2]


# -- ShardedVariable: TF's semantics on ordinary variables ------------------------------------------


def _sharded(rows=(3, 3, 3, 2, 2), cols=2):
    full = np.arange(sum(rows) * cols, dtype=np.float32).reshape(sum(rows), cols)
    offsets = np.concatenate([[0], np.cumsum(rows)])
    shards = [dd.Variable(full[offsets[i]:offsets[i + 1]]) for i in range(len(rows))]
    return ShardedVariable(shards, name="emb"), full


def test_sharded_variable_reads_the_concatenation_and_rows_from_their_shard():
    sharded, full = _sharded()
    assert sharded.shape == (13, 2) and sharded.dtype == np.float32
    np.testing.assert_array_equal(sharded.numpy(), full)
    np.testing.assert_array_equal(sharded[4], full[4])
    np.testing.assert_array_equal(sharded[-1], full[-1])
    np.testing.assert_array_equal(sharded[2:9:3], full[2:9:3])
    np.testing.assert_array_equal(sharded[::-2], full[::-2])
    with pytest.raises(IndexError, match="out of bounds"):
        sharded[13]
    np.testing.assert_array_equal(sharded + 1, full + 1)


def test_sharded_variable_assign_slices_the_value_and_refuses_another_shape():
    sharded, full = _sharded()
    sharded.assign(full * 2)
    np.testing.assert_array_equal(sharded.variables[1].numpy(), full[3:6] * 2)
    sharded.assign_add(np.ones_like(full))
    sharded.assign_sub(np.full_like(full, 2))
    np.testing.assert_array_equal(sharded.numpy(), full * 2 - 1)
    with pytest.raises(ValueError, match=r"shape \(12, 2\) to ShardedVariable 'emb' of shape \(13, 2\)"):
        sharded.assign(full[:12])
    with pytest.raises(TypeError, match="slice assignment"):
        sharded[0] = np.zeros(2)
    np.testing.assert_array_equal(sharded.numpy(), full * 2 - 1)  # nothing changed


def test_sharded_variable_checks_its_shards():
    with pytest.raises(TypeError, match="non-empty list"):
        ShardedVariable([])
    with pytest.raises(ValueError, match="same dtype"):
        ShardedVariable([dd.Variable(np.zeros((2, 2), np.float32)), dd.Variable(np.zeros((2, 2), np.float64))])
    with pytest.raises(ValueError, match="same shapes except for the first axis"):
        ShardedVariable([dd.Variable(np.zeros((2, 2))), dd.Variable(np.zeros((2, 3)))])


def test_embedding_lookup_gathers_rows_across_shards():
    sharded, full = _sharded()
    ids = np.array([[0, 12], [3, 3], [8, 9]])
    np.testing.assert_array_equal(dd.nn.embedding_lookup(sharded, ids), full[ids])
    np.testing.assert_array_equal(dd.nn.embedding_lookup(sharded.variables, ids), full[ids])  # a list of shards
    np.testing.assert_array_equal(sharded.sparse_read([5, 0]), full[[5, 0]])
    clipped = dd.nn.embedding_lookup(sharded, np.array([12]), max_norm=1.0)
    assert np.linalg.norm(clipped) == pytest.approx(1.0, rel=1e-6)
    with pytest.raises(IndexError):
        dd.nn.embedding_lookup(sharded, np.array([13]))


# -- stored shards on a real cluster -------------------------------------------------------------


def test_sharded_variable_of_stored_shards_pulls_only_the_rows_touched(threaded_client):
    rows = shard_sizes(1000, 4)
    full = np.arange(1000 * 8, dtype=np.float32).reshape(1000, 8)
    with dd.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        with strategy.scope():
            offsets = np.concatenate([[0], np.cumsum(rows)])
            shards = [dd.Variable(full[offsets[i]:offsets[i + 1]], name=f"emb/part_{i}", aggregation="SUM")
                      for i in range(4)]
        table = ShardedVariable(shards, name="emb")
        ids = dd.PerReplica([np.array([1, 999, 500]), np.array([250, 251, 1])])

        def lookup(i):
            return dd.nn.embedding_lookup(table, i)

        store = strategy.extended.stores[0]
        before = store.call_from_client(threaded_client, "bytes_served")
        out = strategy.run(lookup, args=(ids,))
        assert store.call_from_client(threaded_client, "bytes_served") - before == 6 * 8 * 4  # 6 rows, not 1000
        np.testing.assert_array_equal(out.values[0], full[[1, 999, 500]])
        np.testing.assert_array_equal(out.values[1], full[[250, 251, 1]])
        table.assign_add(np.ones_like(full))  # from the client: each shard once
        np.testing.assert_array_equal(table.numpy(), full + 1)
        np.testing.assert_array_equal(dd.nn.embedding_lookup(table, np.array([7])), full[[7]] + 1)
        with pytest.raises(ValueError, match="Cannot assign a value of shape"):
            table.assign(np.zeros((999, 8), np.float32))
        np.testing.assert_array_equal(table.numpy(), full + 1)


def test_scatter_updates_go_to_the_shards_holding_the_rows():
    sharded, full = _sharded()
    sharded.scatter_add(dd.IndexedSlices(values=np.ones((3, 2), np.float32), indices=np.array([0, 12, 0])))
    expected = full.copy()
    np.add.at(expected, [0, 12, 0], 1.0)  # repeated rows add up, as TF's scatter_add
    np.testing.assert_array_equal(sharded.numpy(), expected)
    sharded.scatter_update(dd.IndexedSlices(values=np.zeros((1, 2), np.float32), indices=np.array([5])))
    expected[5] = 0
    np.testing.assert_array_equal(sharded.numpy(), expected)
    with pytest.raises(ValueError, match="values of shape"):
        sharded.scatter_sub(dd.IndexedSlices(values=np.ones((2, 2), np.float32), indices=np.array([1])))
