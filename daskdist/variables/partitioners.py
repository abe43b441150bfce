"""Variable partitioners (TF's ``tf.distribute.experimental.partitioners``) and TF's "div" split.

A partitioner maps a variable's ``(shape, dtype)`` to the number of shards
per axis, ``[k, 1, 1, ...]``; variables are only split along the first axis.
The numbers follow TensorFlow exactly (``sharded_variable.py`` over
``partitioned_variables.min_max_variable_partitioner`` and
``variable_axis_size_partitioner``); ``shard_sizes`` is TF's "div" split: the
first ``rows % k`` shards get one row more (13 rows over 5 shards:
``[3, 3, 3, 2, 2]``).

Examples
--------
>>> FixedShardsPartitioner(num_shards=2)((10, 3), "float32")
[2, 1]
>>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), "float32")
[2, 1]
>>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), "float32")
[6, 1]
>>> shard_sizes(13, 5)
[3, 3, 3, 2, 2]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner", "shard_sizes"]


class Partitioner:
    """Base class: ``partitioner(shape, dtype, axis=0)`` returns the number of partitions on each axis."""

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        raise NotImplementedError


def _positive(name: str, value: Any, separator: str = ": ") -> None:
    """TF's check and message (``MaxSizePartitioner`` writes "Received 0", the others "Received: 0")."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"Argument `{name}` must be an int. Received: {value!r}")
    if value < 1:
        raise ValueError(f"Argument `{name}` must be positive. Received{separator}{value}")


def _element_bytes(dtype: Any, bytes_per_string: int) -> int:
    """TF: ``bytes_per_string`` for string variables, else the dtype's size."""
    dtype = np.dtype(dtype)
    if dtype.kind in ("U", "S", "O"):
        return int(bytes_per_string)
    return int(dtype.itemsize)


def _shape(shape: Sequence[int], axis: int) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    if axis >= len(dims):
        raise ValueError(f"Can not partition variable along axis {axis} when shape is only {dims}")
    return dims


class FixedShardsPartitioner(Partitioner):
    """A fixed number of shards: ``min(num_shards, shape[axis])`` (TF's ``FixedShardsPartitioner``).

    TensorFlow accepts any ``num_shards`` here and refuses a zero split only
    when the variable is created; daskdist refuses a non-positive one at once.
    """

    def __init__(self, num_shards: int):
        _positive("num_shards", num_shards)
        self._num_shards = int(num_shards)

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        dims = _shape(shape, axis)
        result = [1] * len(dims)
        result[axis] = min(self._num_shards, dims[axis])
        return result

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self._num_shards})"


class MinSizePartitioner(Partitioner):
    """As many shards as possible, each at least ``min_shard_bytes``, at most ``max_shards`` (TF's).

    Parameters
    ----------
    min_shard_bytes
        Minimum bytes of each shard (default 256 KiB).
    max_shards
        Upper bound on the number of shards (default 1).
    bytes_per_string
        The size assumed for each element of a string variable.
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16):
        _positive("min_shard_bytes", min_shard_bytes)
        _positive("max_shards", max_shards)
        _positive("bytes_per_string", bytes_per_string)
        self._min_shard_bytes = min_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        # partitioned_variables.min_max_variable_partitioner
        dims = _shape(shape, axis)
        total_bytes = math.prod(dims) * _element_bytes(dtype, self._bytes_per_string)
        partitions = total_bytes / self._min_shard_bytes
        result = [1] * len(dims)
        result[axis] = max(1, min(dims[axis], self._max_shards, math.ceil(partitions)))
        return result

    def __repr__(self) -> str:
        return (f"MinSizePartitioner(min_shard_bytes={self._min_shard_bytes}, max_shards={self._max_shards}, "
                f"bytes_per_string={self._bytes_per_string})")


class MaxSizePartitioner(Partitioner):
    """As few shards as possible, each at most ``max_shard_bytes``; ``max_shards`` takes precedence (TF's).

    Parameters
    ----------
    max_shard_bytes
        The largest a shard may be (unless ``max_shards`` is reached, or one
        row alone is larger).
    max_shards
        The most shards to create; ``None``: no limit.
    bytes_per_string
        The size assumed for each element of a string variable.
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16):
        _positive("max_shard_bytes", max_shard_bytes, " ")
        if max_shards is not None and max_shards != 0:
            _positive("max_shards", max_shards, " ")
        _positive("bytes_per_string", bytes_per_string)
        self._max_shard_bytes = max_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        # partitioned_variables.variable_axis_size_partitioner
        dims = _shape(shape, axis)
        element = _element_bytes(dtype, self._bytes_per_string)
        result = [1] * len(dims)
        if dims[axis] == 0:
            return result
        bytes_per_slice = 1.0 * (math.prod(dims) / dims[axis]) * element
        slices_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_slice)) if bytes_per_slice else dims[axis]
        axis_shards = math.ceil(1.0 * dims[axis] / slices_per_shard)
        if self._max_shards:
            axis_shards = min(self._max_shards, axis_shards)
        result[axis] = axis_shards
        return result

    def __repr__(self) -> str:
        return (f"MaxSizePartitioner(max_shard_bytes={self._max_shard_bytes}, max_shards={self._max_shards}, "
                f"bytes_per_string={self._bytes_per_string})")


def shard_sizes(rows: int, num_shards: int) -> list[int]:
    """TF's "div" split of ``rows`` over ``num_shards``: the first ``rows % num_shards`` get one row more."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be positive, got {num_shards}")
    base, extra = divmod(int(rows), int(num_shards))
    return [base + 1 if i < extra else base for i in range(num_shards)]
