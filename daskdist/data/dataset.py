"""``Dataset``: a ``tf.data``-style input pipeline over partitions of rows.

A dataset is a recipe: a source (partitions of rows) and a list of
element-level transformations. It runs where it is iterated: on the client
for small data (``for element in dataset``), or on each replica over that
replica's partitions when distributed by a strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree

from daskdist.data import ops
from daskdist.data.sources import DaskSource, LocalSource, Partition, RangeSource, Source

__all__ = ["Dataset", "TensorSpec"]

_SAMPLE_BATCH = 2  # rows of the batches that element_spec builds from one sample row


@dataclass(frozen=True)
class TensorSpec:
    """Shape (``None`` for unknown sizes) and dtype of one component of an element."""

    shape: tuple[Any, ...]
    dtype: np.dtype

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self.shape}, dtype={np.dtype(self.dtype).name})"


class Dataset:
    """An input pipeline (TF's ``tf.data.Dataset`` transformations, over Dask partitions).

    Build one with ``Dataset.from_dask``, ``Dataset.from_tensor_slices`` or
    ``Dataset.range`` and chain transformations; each returns a new dataset.
    """

    def __init__(self, source: Source, transformations: tuple[ops.Op, ...] = ()):
        self._source = source
        self._ops = tuple(transformations)
        self._caches: dict[int, list[Any]] = {}  # cache() contents, kept across iterations as in tf.data
        self._epochs = 0

    # -- sources -------------------------------------------------------------------

    @staticmethod
    def from_dask(collections: Any) -> Dataset:
        """Rows of Dask collections: an array chunked along axis 0, a dataframe, or a tuple/dict of them.

        The partitions stay on the workers that hold them; a strategy reads
        each partition on the replica of that worker.
        """
        return Dataset(DaskSource(collections))

    @staticmethod
    def from_tensor_slices(tensors: Any, num_partitions: int | None = None) -> Dataset:
        """Rows of in-memory arrays (a structure of arrays with equal first dimension)."""
        return Dataset(LocalSource(tensors, num_partitions))

    @staticmethod
    def range(*args: int) -> Dataset:
        """``range(stop)``, ``range(start, stop)`` or ``range(start, stop, step)`` as int64 rows."""
        r = range(*args)
        return Dataset(RangeSource(r.start, r.stop, r.step))

    # -- transformations -------------------------------------------------------------

    def _with(self, op: ops.Op) -> Dataset:
        return Dataset(self._source, self._ops + (op,))

    def map(self, map_func: Callable[..., Any], num_parallel_calls: int | None = None) -> Dataset:
        """Apply ``map_func`` to each element (tuple elements are unpacked into arguments)."""
        return self._with(ops.Map(map_func))

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        return self._with(ops.Filter(predicate))

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        return self._with(ops.Batch(batch_size, drop_remainder))

    def unbatch(self) -> Dataset:
        return self._with(ops.Unbatch())

    def shuffle(self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True) -> Dataset:
        return self._with(ops.Shuffle(buffer_size, seed, reshuffle_each_iteration))

    def cache(self, filename: str = "") -> Dataset:
        """Keep elements in memory after the first complete pass (``filename`` is not supported)."""
        if filename:
            raise NotImplementedError("cache(filename) is not supported; cache() keeps elements in memory")
        return self._with(ops.Cache())

    def prefetch(self, buffer_size: int | None = None) -> Dataset:
        return self._with(ops.Prefetch(buffer_size))

    def repeat(self, count: int | None = None) -> Dataset:
        return self._with(ops.Repeat(count))

    def take(self, count: int) -> Dataset:
        return self._with(ops.Take(count))

    def skip(self, count: int) -> Dataset:
        return self._with(ops.Skip(count))

    def shard(self, num_shards: int, index: int) -> Dataset:
        return self._with(ops.Shard(num_shards, index))

    # -- inspection ------------------------------------------------------------------

    @property
    def source(self) -> Source:
        return self._source

    @property
    def transformations(self) -> tuple[ops.Op, ...]:
        return self._ops

    @property
    def element_spec(self) -> Any:
        """Structure of ``TensorSpec`` of one element (TF's ``element_spec``).

        Found from the pipeline's structure: one row the source really holds
        (only that row is read) is passed through the transformations that
        shape elements (``map``, ``batch``, ``unbatch``); those that only pick
        or reorder rows (``filter``, ``shard``, ``take``, ``shuffle`` ...) do
        not change the spec and are not run, so a pipeline whose first
        partition yields nothing still has a spec. A batch dimension is
        ``None``, or the batch size with ``drop_remainder=True`` (TF's rule).
        """
        return self.element_spec_with()

    def element_spec_with(self, client: Any = None) -> Any:
        """``element_spec``, computing any Dask sample with ``client`` (default: Dask's current scheduler)."""
        sample, batch_dims = self._structure_sample(client)

        def spec(leaf: Any) -> TensorSpec:
            array = np.asarray(leaf)
            shape = list(array.shape)
            for axis, size in enumerate(batch_dims[: len(shape)]):
                if shape[axis] == _SAMPLE_BATCH:
                    shape[axis] = size
            return TensorSpec(tuple(shape), array.dtype)

        return optree.tree_map(spec, sample, none_is_leaf=False)

    def _structure_sample(self, client: Any = None) -> tuple[Any, list[int | None]]:
        """An element built from one real row, and the size of each leading batch dimension it has.

        Batches are built of ``_SAMPLE_BATCH`` copies of the sample, so their
        batch dimensions can be told apart and reported as ``None`` (or the
        fixed size with ``drop_remainder``).
        """
        element = self._source_row(client)
        batch_dims: list[int | None] = []
        for op in self._ops:
            if isinstance(op, ops.Map):
                element = ops._call(op.fn, element)
            elif isinstance(op, ops.Batch):
                element = ops.stack_elements([element] * _SAMPLE_BATCH)
                batch_dims.insert(0, op.batch_size if op.drop_remainder else None)
            elif isinstance(op, ops.Unbatch):
                if not batch_dims:
                    raise ValueError("unbatch() needs a batched dataset")
                element = next(ops.rows_of_block(element))
                batch_dims.pop(0)
        return element, batch_dims

    def _source_row(self, client: Any = None) -> Any:
        """One row of the source: the first row of the first partition that has one."""
        partitions = [p for p in self._source.partitions if p.rows != 0]
        if not partitions:
            raise ValueError("the dataset is empty: its source has no rows")
        if isinstance(self._source, DaskSource):
            block = self._source.sample(client)
        else:
            block = self._source.load(partitions[0])
        if ops.block_rows(block) == 0:  # a source whose sampled partition is empty: a zero row of its dtypes
            return optree.tree_map(lambda leaf: np.zeros(leaf.shape[1:], leaf.dtype), block)
        return next(ops.rows_of_block(block))

    def __repr__(self) -> str:
        steps = " -> ".join([self._source.describe(), *(op.describe() for op in self._ops)])
        return f"<Dataset {steps}>"

    # -- running ---------------------------------------------------------------------

    def _load_locally(self, partition: Partition) -> Any:
        if isinstance(self._source, DaskSource):
            return self._source.compute_partition(partition.index)
        return self._source.load(partition)

    def _iterate(self, partitions: Iterable[Partition], state: ops.PipelineState,
                 load: Callable[[Partition], Any]) -> Iterator[Any]:
        """Run the pipeline over ``partitions`` (loaded with ``load``)."""
        partitions = list(partitions)

        def source_blocks(_: ops.PipelineState) -> Iterator[Any]:
            for partition in partitions:
                block = load(partition)
                if block is not None and ops.block_rows(block):  # None: a source skipping it this time
                    yield block

        upstream: Callable[[ops.PipelineState], Iterator[Any]] = source_blocks
        rows_mode = True
        for op in self._ops:
            upstream = _bind(op, upstream, rows_mode)
            if isinstance(op, ops.Batch) and rows_mode:
                rows_mode = False
            elif isinstance(op, ops.Unbatch):
                rows_mode = True
        if rows_mode:  # an unbatched dataset yields rows
            blocks = upstream
            return (row for block in blocks(state) for row in ops.rows_of_block(block))
        return upstream(state)

    def __iter__(self) -> Iterator[Any]:
        """Iterate on the client (for small data: Dask partitions are computed here)."""
        state = ops.PipelineState(epoch=self._epochs, caches=self._caches)
        self._epochs += 1
        return self._iterate(self._source.partitions, state, load=self._load_locally)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_caches": {}, "_epochs": 0}  # caches stay where they were filled


def _bind(op: ops.Op, upstream: Callable[[ops.PipelineState], Iterator[Any]], rows_mode: bool
          ) -> Callable[[ops.PipelineState], Iterator[Any]]:
    apply = op.apply_rows if rows_mode else op.apply_elements
    return lambda state: apply(upstream, state)
