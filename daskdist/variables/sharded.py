"""``ShardedVariable``: variables that together are one larger variable, split along the first axis (TF's).

The shards are ordinary or distributed variables (under a parameter-server
style strategy each lives in its own store). Reading the whole value
concatenates them (expensive for a large embedding); ``embedding_lookup``
reads only the rows it needs, shard by shard (a stored shard sends only
those rows); ``assign``/``assign_add``/``assign_sub`` slice the value per
shard, and a value of another shape raises. ``__getitem__`` works as on an
array; slice assignment does not (as in TensorFlow).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from daskdist.arrays import as_array, namespace, to_numpy
from daskdist.variables.distributed import Variable

__all__ = ["IndexedSlices", "ShardedVariable", "embedding_lookup"]


@dataclass(frozen=True)
class IndexedSlices:
    """Rows ``indices`` of a variable with their ``values`` (TF's ``tf.IndexedSlices``): a sparse update."""

    values: Any
    indices: Any
    dense_shape: Any = None


class ShardedVariable:
    """A container of variables treated as shards of one variable along axis 0 (TF's ``ShardedVariable``).

    Parameters
    ----------
    variables
        A non-empty list of variables with one dtype and the same shape
        beyond the first axis.
    name
        The container's name (default ``"ShardedVariable"``).

    Raises
    ------
    TypeError
        ``variables`` is not a non-empty list of variables.
    ValueError
        The shards differ in dtype or in their shape beyond the first axis.
    """

    def __init__(self, variables: Sequence[Any], name: str = "ShardedVariable"):
        if (not isinstance(variables, Sequence) or not variables
                or any(not isinstance(v, Variable) for v in variables)):
            raise TypeError(
                f"Argument `variables` should be a non-empty list of `variables.Variable`s. Received {variables}"
            )
        dtypes = {np.dtype(v.dtype) for v in variables}
        if len(dtypes) > 1:
            raise ValueError("All elements in argument `variables` must have the same dtype. "
                             f"Received dtypes: {[np.dtype(v.dtype).name for v in variables]}")
        if any(len(v.shape) == 0 for v in variables) or len({tuple(v.shape[1:]) for v in variables}) > 1:
            raise ValueError("All elements in argument `variables` must have the same shapes except for the first "
                             f"axis. Received shapes: {[tuple(v.shape) for v in variables]}")
        self._variables = list(variables)
        self._name = name
        self._dtype: np.dtype[Any] = np.dtype(variables[0].dtype)
        rows = [int(v.shape[0]) for v in variables]
        self._shape = (sum(rows), *tuple(variables[0].shape[1:]))
        self._offsets = [int(x) for x in np.concatenate([[0], np.cumsum(rows)])]

    # -- description -----------------------------------------------------------------

    @property
    def variables(self) -> list[Any]:
        """The shard variables, in order."""
        return list(self._variables)

    @property
    def name(self) -> str:
        return self._name

    @property
    def dtype(self) -> np.dtype:
        dtype: np.dtype[Any] = self._dtype
        return dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The overall shape: the shards' first dimensions added up."""
        return self._shape

    @property
    def is_sharded_variable(self) -> bool:
        return True

    def __iter__(self) -> Iterator[Any]:
        return iter(self._variables)

    def __repr__(self) -> str:
        return (f"<ShardedVariable '{self._name}' shape={self._shape} dtype={self._dtype.name} "
                f"shards={[int(v.shape[0]) for v in self._variables]}>")

    # -- reading ---------------------------------------------------------------------

    def value(self) -> Any:
        """All shards concatenated (reads every shard)."""
        parts = [as_array(v.value())[0] for v in self._variables]
        return namespace(parts[0]).concatenate(parts, axis=0)

    def read_value(self) -> Any:
        return self.value()

    def numpy(self) -> np.ndarray:
        return np.array(to_numpy(self.value()), copy=True)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.numpy()
        return array.astype(dtype) if dtype is not None else array

    def __getitem__(self, index: Any) -> Any:
        """TF's ``ShardedVariable.__getitem__``: an integer row is read from its shard alone."""
        spec = index if isinstance(index, tuple) else (index,)
        first = spec[0] if spec else slice(None)
        if isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            row = int(first)
            if row < 0:
                row += self._shape[0]
            if row < 0 or row >= self._shape[0]:
                raise IndexError(f"ShardedVariable: slice index {int(first)} of dimension 0 out of bounds.")
            shard = int(np.searchsorted(self._offsets, row, side="right")) - 1
            found = _rows(self._variables[shard], np.array([row - self._offsets[shard]]))[0]
            return found[spec[1:]] if len(spec) > 1 else found
        return self.value()[index]

    def sparse_read(self, indices: Any) -> Any:
        """The rows ``indices`` (1-D), each read from its own shard (TF's ``sparse_read``)."""
        ids = np.asarray(to_numpy(as_array(indices)[0]))
        if ids.ndim != 1:
            raise ValueError(
                f"ShardedVariable: indices must be 1D Tensor for sparse operations. Received shape: {ids.shape}"
            )
        return embedding_lookup(self, ids)

    # -- writing -----------------------------------------------------------------------

    def _per_shard(self, value: Any) -> list[Any]:
        array, _ = as_array(value)
        if tuple(array.shape) != self._shape:
            raise ValueError(f"Cannot assign a value of shape {tuple(array.shape)} to ShardedVariable "
                             f"'{self._name}' of shape {self._shape}")
        return [array[self._offsets[i]:self._offsets[i + 1]] for i in range(len(self._variables))]

    def assign(self, value: Any, read_value: bool = True) -> Any:
        """Assign ``value`` (of the full shape): each shard gets its rows."""
        for variable, part in zip(self._variables, self._per_shard(value)):
            variable.assign(part)
        return self if read_value else None

    def assign_add(self, delta: Any, read_value: bool = True) -> Any:
        for variable, part in zip(self._variables, self._per_shard(delta)):
            variable.assign_add(part)
        return self if read_value else None

    def assign_sub(self, delta: Any, read_value: bool = True) -> Any:
        for variable, part in zip(self._variables, self._per_shard(delta)):
            variable.assign_sub(part)
        return self if read_value else None

    def scatter_add(self, sparse_delta: IndexedSlices) -> ShardedVariable:
        """Add ``sparse_delta.values`` to its rows, each shard getting only its own rows (TF's ``scatter_add``)."""
        return self._scatter("add", sparse_delta)

    def scatter_sub(self, sparse_delta: IndexedSlices) -> ShardedVariable:
        """Subtract ``sparse_delta.values`` from its rows, shard by shard."""
        return self._scatter("sub", sparse_delta)

    def scatter_update(self, sparse_delta: IndexedSlices) -> ShardedVariable:
        """Set its rows to ``sparse_delta.values``, shard by shard."""
        return self._scatter("update", sparse_delta)

    def _scatter(self, method: str, sparse_delta: IndexedSlices) -> ShardedVariable:
        ids = np.asarray(to_numpy(as_array(sparse_delta.indices)[0])).astype(np.int64).reshape(-1)
        values = np.asarray(to_numpy(as_array(sparse_delta.values)[0]))
        if values.shape != (len(ids), *self._shape[1:]):
            raise ValueError(f"scatter_{method}: values of shape {values.shape} for {len(ids)} rows of shape "
                             f"{self._shape[1:]}")
        if ids.size and (ids.min() < 0 or ids.max() >= self._shape[0]):
            raise IndexError(f"scatter_{method}: rows must be in [0, {self._shape[0]}), got {ids.min()}..{ids.max()}")
        shard_of = np.searchsorted(self._offsets, ids, side="right") - 1
        for shard in np.unique(shard_of):
            where = np.nonzero(shard_of == shard)[0]
            part = IndexedSlices(values[where], ids[where] - self._offsets[shard])
            _scatter(self._variables[shard], method, part)
        return self

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError("ShardedVariable does not support slice assignment (as in TensorFlow); use assign")

    # -- arithmetic reads the whole value, like a tensor -----------------------------------

    def __add__(self, o: Any) -> Any: return self.value() + o
    def __radd__(self, o: Any) -> Any: return o + self.value()
    def __sub__(self, o: Any) -> Any: return self.value() - o
    def __rsub__(self, o: Any) -> Any: return o - self.value()
    def __mul__(self, o: Any) -> Any: return self.value() * o
    def __rmul__(self, o: Any) -> Any: return o * self.value()
    def __matmul__(self, o: Any) -> Any: return self.value() @ o
    def __rmatmul__(self, o: Any) -> Any: return o @ self.value()
    def __neg__(self) -> Any: return -self.value()
    def __len__(self) -> int: return int(self._shape[0])


def _scatter(variable: Any, method: str, part: IndexedSlices) -> None:
    """A sparse update of one shard: a stored shard sends only the rows; another is read, changed, assigned."""
    scatter = getattr(variable, f"scatter_{method}", None)
    if scatter is not None:
        scatter(part)
        return
    value = np.array(to_numpy(as_array(variable.value())[0]), copy=True)
    if method == "add":
        np.add.at(value, part.indices, part.values)
    elif method == "sub":
        np.subtract.at(value, part.indices, part.values)
    else:
        value[part.indices] = part.values
    variable.assign(value)


def _rows(variable: Any, local_ids: np.ndarray) -> Any:
    """Rows ``local_ids`` of one shard: a stored shard sends only those rows."""
    gather = getattr(variable, "_gather_rows", None)
    if gather is not None:
        return gather(local_ids)
    return as_array(variable.value())[0][local_ids]


def _rows_of_shards(variables: list[Any], local_ids: list[np.ndarray]) -> list[Any]:
    """Rows of several shards: stored shards are asked together (one request per store, all at once)."""
    gather_many = getattr(type(variables[0]), "_gather_rows_of_shards", None) if variables else None
    if gather_many is not None and all(type(v) is type(variables[0]) for v in variables):
        return list(gather_many(list(zip(variables, local_ids))))
    return [_rows(variable, ids) for variable, ids in zip(variables, local_ids)]


def embedding_lookup(params: Any, ids: Any, max_norm: float | None = None, name: str | None = None) -> Any:
    """Rows ``ids`` of ``params`` (TF's ``tf.nn.embedding_lookup``); shape ``ids.shape + row shape``.

    ``params`` is a ``ShardedVariable``, a list of shard variables (split
    along axis 0 in order), a variable or an array. With shards, each shard is
    asked only for the rows that fall in it; for TensorFlow's "div" split that
    is TF's own assignment of ids to shards. ``max_norm``: rows whose L2 norm
    is larger are scaled down to it.
    """
    del name
    if isinstance(params, (list, tuple)):
        params = params[0] if len(params) == 1 and isinstance(params[0], ShardedVariable) else ShardedVariable(params)
    ids_array = np.asarray(to_numpy(as_array(ids)[0]))
    if ids_array.dtype.kind not in "iu":
        raise TypeError(f"embedding_lookup ids must be integers, got {ids_array.dtype}")
    flat = ids_array.reshape(-1).astype(np.int64)
    if isinstance(params, ShardedVariable):
        rows = params.shape[0]
        if flat.size and (flat.min() < 0 or flat.max() >= rows):
            raise IndexError(f"embedding_lookup: ids must be in [0, {rows}), got {flat.min()}..{flat.max()}")
        shard_of = np.searchsorted(params._offsets, flat, side="right") - 1
        out = None
        shards = [int(shard) for shard in np.unique(shard_of)]
        wheres = [np.nonzero(shard_of == shard)[0] for shard in shards]
        uniques, inverses = [], []
        for shard, where in zip(shards, wheres):
            unique, inverse = np.unique(flat[where] - params._offsets[shard], return_inverse=True)  # each row once
            uniques.append(unique)
            inverses.append(inverse)
        pulled = _rows_of_shards([params._variables[shard] for shard in shards], uniques)
        for where, rows, inverse in zip(wheres, pulled, inverses):
            found = as_array(rows)[0][inverse]
            if out is None:
                out = namespace(found).empty((flat.size, *params.shape[1:]), dtype=found.dtype)
            out[where] = found
        if out is None:
            out = np.empty((0, *params.shape[1:]), dtype=params.dtype)
        result = out
    elif hasattr(params, "_gather_rows"):  # a stored variable: only the rows travel (TF gathers on the ps)
        rows = int(params.shape[0])
        if flat.size and (flat.min() < 0 or flat.max() >= rows):
            raise IndexError(f"embedding_lookup: ids must be in [0, {rows}), got {flat.min()}..{flat.max()}")
        unique, inverse = np.unique(flat, return_inverse=True)
        result = as_array(_rows(params, unique))[0][inverse]
    else:
        table = as_array(params.value() if isinstance(params, Variable) else params)[0]
        result = table[flat]
    if max_norm is not None:
        xp = namespace(result)
        axes = tuple(range(1, result.ndim))
        norms = xp.sqrt(xp.sum(result * result, axis=axes, keepdims=True)) if axes else xp.abs(result)
        scale = xp.where(norms > max_norm, max_norm / xp.maximum(norms, 1e-30), 1.0)
        result = (result * scale).astype(result.dtype, copy=False)
    return result.reshape((*ids_array.shape, *result.shape[1:]))
