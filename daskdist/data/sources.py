"""Where a dataset's elements come from: partitions of rows.

A source is a list of partitions; each partition is a nested structure of
arrays sharing their leading dimension (the rows). Local sources
(``from_tensor_slices``, ``range``) hold or generate their rows; a Dask
source refers to the partitions of Dask collections (arrays chunked along
the first axis, dataframes), which stay on the workers that hold them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import optree

from daskdist.dtype_inference import python_value_array

__all__ = ["DaskSource", "LocalSource", "Partition", "RangeSource", "Source"]


@dataclass
class Partition:
    """One partition: how many rows, how many bytes, and how to get its arrays.

    ``data`` is the structure of arrays itself for local sources, or ``None``
    for Dask sources (then ``keys`` name the Dask keys holding its leaves).
    """

    index: int
    rows: int
    nbytes: int
    data: Any = None
    keys: tuple[Any, ...] = ()


class Source:
    """Base: a list of partitions and a way to load one."""

    partitions: list[Partition]

    def load(self, partition: Partition) -> Any:
        """The structure of arrays of ``partition`` (rows along axis 0)."""
        return partition.data

    @property
    def total_rows(self) -> int | None:
        return sum(p.rows for p in self.partitions)

    def describe(self) -> str:
        return f"{type(self).__name__}({len(self.partitions)} partitions)"


def _as_row_arrays(structure: Any) -> Any:
    def convert(leaf: Any) -> Any:
        if hasattr(leaf, "to_numpy"):  # pandas Series / DataFrame column
            return leaf.to_numpy()
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            return leaf
        return python_value_array(leaf)  # TF's inference: Python floats float32, ints int32

    # a list is one array, as in tf.data (tuples and dicts are structures)
    return optree.tree_map(convert, structure, none_is_leaf=False, is_leaf=lambda x: isinstance(x, list))


def _check_lengths(leaves: list[Any], what: str) -> int:
    lengths = {len(leaf) if np.ndim(leaf) else -1 for leaf in leaves}
    if -1 in lengths:
        raise ValueError(f"{what}: every component needs a leading (row) dimension; got a scalar")
    if len(lengths) != 1:
        raise ValueError(f"{what}: components have different lengths {sorted(lengths)}; they must match")
    return lengths.pop()


class LocalSource(Source):
    """Rows held in this process (``Dataset.from_tensor_slices``), split into partitions."""

    def __init__(self, structure: Any, num_partitions: int | None = None):
        structure = _as_row_arrays(structure)
        leaves, treedef = optree.tree_flatten(structure, none_is_leaf=False)
        if not leaves:
            raise ValueError("from_tensor_slices needs at least one array")
        rows = _check_lengths(leaves, "from_tensor_slices")
        count = num_partitions or max(1, min(rows, 64))
        bounds = np.linspace(0, rows, count + 1).astype(int)
        self.partitions = []
        for i in range(count):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            part = optree.tree_unflatten(treedef, [leaf[lo:hi] for leaf in leaves])
            nbytes = sum(getattr(leaf[lo:hi], "nbytes", 0) for leaf in leaves)
            self.partitions.append(Partition(i, hi - lo, nbytes, data=part))


class RangeSource(Source):
    """``Dataset.range(start, stop, step)``: rows generated where they are read."""

    def __init__(self, start: int, stop: int, step: int, num_partitions: int = 16):
        values = range(start, stop, step)
        count = max(1, min(len(values), num_partitions))
        bounds = np.linspace(0, len(values), count + 1).astype(int)
        self.spec = (start, stop, step)
        self.partitions = [
            Partition(i, int(bounds[i + 1] - bounds[i]), int(bounds[i + 1] - bounds[i]) * 8,
                      data=(int(bounds[i]), int(bounds[i + 1])))
            for i in range(count)
        ]

    def load(self, partition: Partition) -> Any:
        start, _, step = self.spec
        lo, hi = partition.data
        return np.arange(start + lo * step, start + hi * step, step, dtype=np.int64)


class DaskSource(Source):
    """Partitions of Dask collections: arrays chunked along axis 0, dataframes, series.

    The collections are given as a structure (a single collection, a tuple
    or dict of them) whose leaves have the same number of rows and the same
    partition boundaries (arrays are rechunked to the first leaf's
    boundaries when they differ; other axes are merged into one chunk).
    """

    def __init__(self, structure: Any):
        import dask.array as da

        leaves, treedef = optree.tree_flatten(structure, none_is_leaf=False)
        if not leaves:
            raise ValueError("from_dask needs at least one Dask collection")
        self.treedef = treedef
        prepared = []
        for leaf in leaves:
            if isinstance(leaf, da.Array):
                if leaf.ndim == 0:
                    raise ValueError("from_dask: a 0-d dask array has no rows")
                if any(len(c) > 1 for c in leaf.chunks[1:]):
                    leaf = leaf.rechunk({i: -1 for i in range(1, leaf.ndim)})  # type: ignore[no-untyped-call]
            elif not _is_dask_dataframe_like(leaf):
                raise TypeError(
                    f"from_dask takes dask arrays, dataframes or series (or a tuple/dict of them), "
                    f"got {type(leaf).__module__}.{type(leaf).__name__}"
                )
            prepared.append(leaf)
        first = prepared[0]
        if isinstance(first, da.Array):
            bounds = first.chunks[0]
            if any(np.isnan(b) for b in bounds):
                raise ValueError("from_dask: the first array has unknown chunk sizes; call compute_chunk_sizes()")
            aligned = [first]
            for leaf in prepared[1:]:
                if not isinstance(leaf, da.Array):
                    raise TypeError("from_dask: mix dask arrays with arrays only (or dataframes with dataframes)")
                if leaf.shape[0] != first.shape[0]:
                    raise ValueError(
                        f"from_dask: components have different lengths ({first.shape[0]} and {leaf.shape[0]}); "
                        "they must match"
                    )
                aligned.append(leaf if leaf.chunks[0] == bounds else leaf.rechunk({0: bounds}))  # type: ignore[no-untyped-call]
            self.collections = aligned
            rows: list[int | None] = [int(b) for b in bounds]
            block_bytes = [sum(int(np.prod((int(b), *leaf.shape[1:]))) * leaf.dtype.itemsize for leaf in aligned)
                           for b in bounds]
        else:
            npart = first.npartitions
            for leaf in prepared[1:]:
                if not _is_dask_dataframe_like(leaf) or leaf.npartitions != npart:
                    raise ValueError("from_dask: dataframes/series must have the same number of partitions")
            self.collections = prepared
            rows = [None] * npart
            block_bytes = [0] * npart
        self.partitions = [Partition(i, r if r is not None else -1, b) for i, (r, b) in enumerate(zip(rows, block_bytes))]

    @property
    def total_rows(self) -> int | None:
        if any(p.rows < 0 for p in self.partitions):
            return None
        return sum(p.rows for p in self.partitions)

    def delayed_partitions(self) -> list[list[Any]]:
        """Per partition, one ``Delayed`` per leaf collection."""
        per_leaf = [list(np.asarray(c.to_delayed()).reshape(-1)) if hasattr(c, "chunks") else list(c.to_delayed())  # type: ignore[no-untyped-call]
                    for c in self.collections]
        return [list(parts) for parts in zip(*per_leaf)]

    def owning_client(self) -> Any:
        """The client whose futures back these collections (persisted data), or ``None``."""
        from distributed import futures_of

        for collection in self.collections:
            futures = futures_of(collection)  # type: ignore[no-untyped-call]
            if futures:
                return futures[0].client
        return None

    def compute_partition(self, index: int) -> Any:
        """One partition's rows, computed here (through the owning client for persisted data)."""
        delayed = self.delayed_partitions()[index]
        client = self.owning_client()
        if client is not None:
            return self.assemble(client.compute(delayed, sync=True))
        import dask

        return self.assemble(list(dask.compute(*delayed)))  # type: ignore[no-untyped-call]

    def sample(self, client: Any = None) -> Any:
        """The first row of the first partition as a one-row structure (only that row is computed)."""
        heads = [c[:1] if hasattr(c, "chunks") else cast(Any, c).head(1, npartitions=1, compute=False)
                 for c in self.collections]
        client = client or self.owning_client()
        # one compute per head: computing dataframe expressions together with array graphs materialises the
        # expressions and can lose a column projection (dask 2026.8)
        if client is not None:
            values = [client.compute(head, sync=True) for head in heads]
        else:
            import dask

            values = [dask.compute(head)[0] for head in heads]  # type: ignore[no-untyped-call]
        return self.assemble(values)

    def assemble(self, leaf_values: list[Any]) -> Any:
        """Turn the loaded values of one partition's leaves into the structure of row arrays."""
        converted: list[Any] = []
        for value in leaf_values:
            if hasattr(value, "columns") and hasattr(value, "to_numpy"):  # a pandas DataFrame: dict of columns
                converted.append({str(c): value[c].to_numpy() for c in value.columns})
            elif hasattr(value, "to_numpy"):
                converted.append(value.to_numpy())
            else:
                converted.append(np.asarray(value))
        return optree.tree_unflatten(self.treedef, converted)


def _is_dask_dataframe_like(x: Any) -> bool:
    return hasattr(x, "npartitions") and hasattr(x, "to_delayed") and hasattr(x, "dtypes" if hasattr(x, "columns") else "dtype")

