"""Distributed values: one component per replica (TF's ``PerReplica`` and ``Mirrored``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import optree

from daskdist import context
from daskdist.arrays import as_array, namespace
from daskdist.collective.core.reduction import check_dtype, finalize
from daskdist.ops import ReduceOp

__all__ = [
    "DistributedValues",
    "Mirrored",
    "PerReplica",
    "check_num_components",
    "gather_values",
    "local_results",
    "reduce_values",
    "regroup",
    "select_replica",
]


class DistributedValues:
    """A value with one component per replica, in replica order."""

    __slots__ = ("_values",)

    def __init__(self, values: Sequence[Any]):
        self._values = tuple(values)
        if not self._values:
            raise ValueError(f"{type(self).__name__} needs at least one component")

    @property
    def values(self) -> tuple[Any, ...]:
        """The components, one per replica."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        inner = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{inner}\n}}"

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{i}</td><td><pre>{v!r}</pre></td></tr>" for i, v in enumerate(self._values))
        return f"<b>{type(self).__name__}</b><table><tr><th>replica</th><th>value</th></tr>{rows}</table>"


class PerReplica(DistributedValues):
    """Values that differ between replicas, such as the result of ``strategy.run``."""

    __slots__ = ()


class Mirrored(DistributedValues):
    """Values that are identical on every replica; it acts as its value (TF's ``DistributedDelegate``).

    In cross-replica context (the client, ``merge_call``) the value is the
    first component; inside a replica, that replica's component. Arithmetic,
    comparisons, indexing, ``np.asarray`` and public attributes (``shape``,
    ``dtype``...) go to that value, so ``Mirrored([a, a]) + 1`` is ``a + 1``.
    ``PerReplica`` values do none of this: they must be reduced first, as in
    TensorFlow.
    """

    __slots__ = ()

    def _get(self) -> Any:
        """The component for the current replica, or the first one in cross-replica context (TF's ``_get``)."""
        frame = context.current_frame()
        replica = frame.replica_context if frame is not None else None
        if replica is not None and replica.num_replicas_in_sync == len(self._values):
            return self._values[replica.replica_id_in_sync_group]
        return self._values[0]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # private and special names are the container's (pickling and copying look them up)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self._get(), name)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        return np.asarray(self._get(), dtype=dtype)

    def __add__(self, o: Any) -> Any: return self._get() + o
    def __radd__(self, o: Any) -> Any: return o + self._get()
    def __sub__(self, o: Any) -> Any: return self._get() - o
    def __rsub__(self, o: Any) -> Any: return o - self._get()
    def __mul__(self, o: Any) -> Any: return self._get() * o
    def __rmul__(self, o: Any) -> Any: return o * self._get()
    def __truediv__(self, o: Any) -> Any: return self._get() / o
    def __rtruediv__(self, o: Any) -> Any: return o / self._get()
    def __floordiv__(self, o: Any) -> Any: return self._get() // o
    def __rfloordiv__(self, o: Any) -> Any: return o // self._get()
    def __mod__(self, o: Any) -> Any: return self._get() % o
    def __rmod__(self, o: Any) -> Any: return o % self._get()
    def __matmul__(self, o: Any) -> Any: return self._get() @ o
    def __rmatmul__(self, o: Any) -> Any: return o @ self._get()
    def __lt__(self, o: Any) -> Any: return self._get() < o
    def __le__(self, o: Any) -> Any: return self._get() <= o
    def __gt__(self, o: Any) -> Any: return self._get() > o
    def __ge__(self, o: Any) -> Any: return self._get() >= o
    def __and__(self, o: Any) -> Any: return self._get() & o
    def __rand__(self, o: Any) -> Any: return o & self._get()
    def __or__(self, o: Any) -> Any: return self._get() | o
    def __ror__(self, o: Any) -> Any: return o | self._get()
    def __xor__(self, o: Any) -> Any: return self._get() ^ o
    def __rxor__(self, o: Any) -> Any: return o ^ self._get()
    def __getitem__(self, o: Any) -> Any: return self._get()[o]
    def __pow__(self, o: Any, modulo: Any = None) -> Any: return pow(self._get(), o, modulo)
    def __rpow__(self, o: Any) -> Any: return pow(o, self._get())
    def __invert__(self) -> Any: return ~self._get()
    def __neg__(self) -> Any: return -self._get()
    def __abs__(self) -> Any: return abs(self._get())


def _is_distributed(x: Any) -> bool:
    return isinstance(x, DistributedValues)


def select_replica(rank: int, structure: Any) -> Any:
    """Replace every ``DistributedValues`` in ``structure`` with its component for ``rank``."""
    return optree.tree_map(
        lambda x: x.values[rank] if isinstance(x, DistributedValues) else x,
        structure,
        is_leaf=_is_distributed,
        none_is_leaf=True,
    )


def check_num_components(structure: Any, num_replicas: int) -> None:
    """Raise ``ValueError`` if a ``DistributedValues`` in ``structure`` has the wrong length."""
    leaves = optree.tree_leaves(structure, is_leaf=_is_distributed, none_is_leaf=True)
    for leaf in leaves:
        if isinstance(leaf, DistributedValues) and len(leaf) != num_replicas:
            raise ValueError(
                f"{type(leaf).__name__} has {len(leaf)} components but the strategy has "
                f"{num_replicas} replicas"
            )


_SMALL_INTS = range(-5, 257)  # CPython keeps one object per int in this range


def _same_on_every_replica(components: Sequence[Any]) -> bool:
    """Whether ``components`` are what TF's regroup sees as one object returned by every replica.

    TensorFlow's replicas are threads of one process, and regroup returns a
    value unwrapped when every replica returned *the same object* (``v is
    v0``). Here each replica is another process and results arrive pickled,
    so identity is rebuilt for the objects CPython itself shares: the same
    distributed variable handle, ``None``, ``True``/``False``, and equal ints
    in CPython's small-int cache (-5 to 256), which TensorFlow's ``is`` check
    also sees as one object. Floats, strings and arrays stay per replica,
    as values each replica computes do in TensorFlow.
    """
    first = components[0]
    if all(c is first for c in components):
        return first is None or isinstance(first, bool) or hasattr(first, "_var_id") or (
            type(first) is int and first in _SMALL_INTS
        )
    if type(first) is int and first in _SMALL_INTS:
        return all(type(c) is int and c == first for c in components)
    return False


def regroup(results: Sequence[Any], always_wrap: bool = False) -> Any:
    """Turn per-replica results into one structure whose leaves are ``PerReplica`` (TF's regroup).

    With one replica the result is returned as is. Results whose nested
    structures differ between replicas raise ``ValueError`` (TF's regroup
    refuses them too). A leaf that every replica
    returned as one object (a distributed variable, ``None``, a bool, a small
    int; see ``_same_on_every_replica``) is returned as itself, as TF's
    regroup does; every other leaf becomes a ``PerReplica``. ``always_wrap``
    makes every leaf a ``PerReplica`` (TF's argument of that name, used by
    ``experimental_distribute_values_from_function``).
    """
    if len(results) == 1:
        return results[0]
    try:
        flat = [optree.tree_flatten(r, none_is_leaf=True) for r in results]
    except Exception:
        return PerReplica(results)
    treedef = flat[0][1]
    for replica, (_, other) in enumerate(flat):
        if other != treedef:  # TF's regroup asserts the same: lists/tuples of one length, dicts of one key set
            raise ValueError(
                f"the replicas returned results of different structures: replica 0 returned {treedef}, replica "
                f"{replica} returned {other}; every replica must return the same nested structure"
            )
    leaves = []
    for components in zip(*(leaves_ for leaves_, _ in flat)):
        same = not always_wrap and _same_on_every_replica(components)
        leaves.append(components[0] if same else PerReplica(components))
    return optree.tree_unflatten(treedef, leaves)


def local_results(value: Any) -> tuple[Any, ...]:
    """One entry per replica (TF's ``experimental_local_results``).

    A ``PerReplica``/``Mirrored`` gives its components; a distributed variable
    its copies; a nested structure containing any of them gives one structure
    per replica, each holding that replica's components (so a list of
    ``PerReplica`` becomes a tuple of lists). A value with nothing distributed
    in it gives a 1-tuple.
    """
    if isinstance(value, DistributedValues):
        return value.values
    read = _local_results_method(value)
    if read is not None:
        results: tuple[Any, ...] = read()
        return results
    leaves, treedef = optree.tree_flatten(value, is_leaf=_is_distributed, none_is_leaf=True)
    per_leaf: list[tuple[Any, ...] | None] = []
    num_replicas = None
    for leaf in leaves:
        components = None
        if isinstance(leaf, DistributedValues):
            components = leaf.values
        elif (read_leaf := _local_results_method(leaf)) is not None:
            components = tuple(read_leaf())
        if components is not None:
            if num_replicas is not None and len(components) != num_replicas:
                raise ValueError(
                    f"The distributed values in this structure have {num_replicas} and {len(components)} components"
                )
            num_replicas = len(components)
        per_leaf.append(components)
    if num_replicas is None:
        return (value,)
    return tuple(
        optree.tree_unflatten(treedef, [leaf if c is None else c[r] for leaf, c in zip(leaves, per_leaf)])
        for r in range(num_replicas)
    )


def reduce_values(op: ReduceOp | str, value: Any, axis: int | tuple[int, ...] | None, num_replicas: int) -> Any:
    """Reduce across replicas (and along ``axis`` within each), as ``Strategy.reduce`` does.

    Parameters
    ----------
    value
        ``PerReplica``/``Mirrored``, a structure of them, or a plain value
        (treated as the same value on every replica).
    axis
        ``None``: reduce across replicas only. An int: also reduce along that
        axis of each component; ``MEAN`` is then the mean over all elements of
        all replicas (TF's semantics for uneven per-replica batches). A tuple
        of ints: along all those axes.
    """
    op = ReduceOp.from_any(op)

    def reduce_leaf(leaf: Any) -> Any:
        if isinstance(leaf, DistributedValues):
            parts = [as_array(v)[0] for v in leaf.values]
        else:
            parts = [as_array(leaf)[0]] * num_replicas
            if op is ReduceOp.SUM and num_replicas > 1:
                raise ValueError(
                    f"A non-DistributedValues value {leaf!r} cannot be reduced with the given reduce op "
                    "ReduceOp.SUM. (It would be counted once per replica: pass a PerReplica value or use MEAN.)"
                )
        xp = namespace(parts[0])
        if axis is None:
            stacked = xp.stack(parts)
            return _reduce_stack(xp, op, stacked, 0, count=len(parts))
        if isinstance(axis, (tuple, list)):  # several axes: moved to the front, flattened into one
            axes = tuple(axis)
            parts = [xp.moveaxis(p, axes, tuple(range(len(axes)))) for p in parts]
            parts = [p.reshape((-1, *p.shape[len(axes):])) for p in parts]
            concatenated = xp.concatenate(parts, axis=0)
            return _reduce_stack(xp, op, concatenated, 0, count=concatenated.shape[0])
        concatenated = xp.concatenate([xp.atleast_1d(p) for p in parts], axis=axis)
        return _reduce_stack(xp, op, concatenated, axis, count=concatenated.shape[axis])

    return optree.tree_map(reduce_leaf, value, is_leaf=_is_distributed)


def _reduce_stack(xp: Any, op: ReduceOp, stacked: Any, axis: int, count: int) -> Any:
    if op is ReduceOp.SUM:
        return stacked.sum(axis=axis, dtype=stacked.dtype)
    if op is ReduceOp.MEAN:
        check_dtype(op, stacked.dtype)
        total = xp.asarray(stacked.sum(axis=axis, dtype=stacked.dtype))
        finalize(op, total, count)
        return total
    if op is ReduceOp.MAX:
        return stacked.max(axis=axis)
    if op is ReduceOp.MIN:
        return stacked.min(axis=axis)
    return stacked.prod(axis=axis, dtype=stacked.dtype)


def gather_values(value: Any, axis: int) -> Any:
    """Concatenate the components of ``value`` along ``axis`` (``Strategy.gather``)."""

    def gather_leaf(leaf: Any) -> Any:
        parts = [as_array(v)[0] for v in local_results(leaf)]
        if any(p.ndim == 0 for p in parts):
            raise ValueError("gather needs arrays with at least one dimension; got a 0-d component")
        return namespace(parts[0]).concatenate(parts, axis=axis)

    return optree.tree_map(gather_leaf, value, is_leaf=_is_distributed)




def _local_results_method(value: Any) -> Any:
    """The ``local_results`` method of a distributed variable (its copies; TF's ``_local_results``), else ``None``.

    Duck-typed, as in TensorFlow: the variables sit above this module.
    """
    if isinstance(value, type):
        return None
    read = getattr(value, "local_results", None)
    return read if callable(read) and getattr(read, "__self__", None) is value else None
