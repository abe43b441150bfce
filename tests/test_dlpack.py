"""The DLPack branch of ``daskdist.arrays.as_array``: tensors of other frameworks (torch, jax) in collectives.

A wrapper exposing a numpy array's ``__dlpack__`` reaches the branch without any framework; torch (in the
test extra) checks the zero-copy view and the conversion back, also through an all-reduce on a cluster.
"""

from __future__ import annotations

import numpy as np
import pytest

import daskdist as dd
from daskdist.arrays import as_array


class DLPackOnly:
    """An object that is no array: only ``__dlpack__`` and ``__dlpack_device__`` (a CPU tensor)."""

    def __init__(self, array: np.ndarray):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_a_dlpack_tensor_is_viewed_without_a_copy():
    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    array, back = as_array(DLPackOnly(base))
    assert isinstance(array, np.ndarray) and array.shape == (2, 3) and array.dtype == np.float32
    assert np.shares_memory(array, base)  # a view, not a copy
    result = back(array * 2)  # the wrapper's module has no from_dlpack: the result stays numpy
    np.testing.assert_array_equal(result, base * 2)


def test_a_torch_tensor_is_viewed_and_results_come_back_as_torch():
    torch = pytest.importorskip("torch")
    tensor = torch.arange(6, dtype=torch.float64).reshape(3, 2)
    array, back = as_array(tensor)
    assert isinstance(array, np.ndarray) and array.dtype == np.float64
    array[0, 0] = 42.0  # shares the tensor's memory
    assert tensor[0, 0].item() == 42.0
    result = back(array + 1)
    assert isinstance(result, torch.Tensor) and result.dtype == torch.float64
    assert result.tolist() == [[43.0, 2.0], [3.0, 4.0], [5.0, 6.0]]


def test_an_all_reduce_of_dlpack_tensors_on_a_cluster_returns_the_callers_framework(threaded_client):
    torch = pytest.importorskip("torch")

    def fn():
        ctx = dd.get_replica_context()
        rank = ctx.replica_id_in_sync_group
        tensors = ctx.all_reduce("SUM", {"t": torch.full((4,), rank + 1.0), "d": DLPackOnly(np.full(3, rank))})
        return type(tensors["t"]).__name__, tensors["t"].tolist(), np.asarray(tensors["d"]).tolist()

    with dd.MirroredStrategy(client=threaded_client) as strategy:
        n = strategy.num_replicas_in_sync
        for kind, summed, plain in strategy.experimental_local_results(strategy.run(fn)):
            assert kind == "Tensor"
            assert summed == [n * (n + 1) / 2] * 4
            assert plain == [n * (n - 1) // 2] * 3
