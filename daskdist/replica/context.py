"""``ReplicaContext``: what a function running on a replica sees (TF's ``tf.distribute.ReplicaContext``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import optree

from daskdist import context
from daskdist.ops import CommunicationOptions, ReduceOp
from daskdist.values import regroup, select_replica

if TYPE_CHECKING:
    from daskdist.collective.process_group import ProcessGroup
    from daskdist.group.service import ReplicaService

__all__ = ["ReplicaContext"]


class ReplicaContext:
    """The context of one replica while it runs a function from ``strategy.run``.

    Every collective (``all_reduce``, ``all_gather``, ``merge_call``) must be
    called by all replicas, in the same order, with matching structures,
    shapes and dtypes; a replica that disagrees makes all of them raise
    ``CollectiveMismatchError``, and one that never joins makes them raise
    ``CollectiveTimeoutError`` naming it.
    """

    def __init__(self, runtime: ReplicaService):
        self._runtime = runtime
        self._group: ProcessGroup | None = None
        self._all_reduce: Callable[..., Any] | None = None

    def bind(self, group: ProcessGroup) -> None:
        """Bind the generation's process ``group`` (the runtime calls this at each rewiring).

        ``all_reduce`` is then the group's inline all-reduce itself, with no
        lookup through the runtime and no extra call on the way (a small
        all-reduce takes about 12 µs; each of those is a noticeable part of it).
        """
        self._group = group
        self._all_reduce = inline = group.inline_all_reduce
        # the instance attribute shadows the method: ``ctx.all_reduce(...)`` is then one call, as before the
        # process group existed (same parameters, same docstring)
        inline.__doc__ = ReplicaContext.all_reduce.__doc__
        self.all_reduce = inline  # type: ignore[method-assign]

    @property
    def process_group(self) -> Any:
        """This replica's process group (``daskdist.collective.process_group.ProcessGroup``) in this generation.

        Every member of the strategy's replica group, rank =
        ``replica_id_in_sync_group``: collectives with ``async_op=True``
        (work handles), subgroups, send/recv, from any thread of the
        replica. ``ReplicaContext``'s own collectives are calls of it. It is
        re-made when the membership changes (a new generation): look it up
        again in each ``strategy.run``.
        """
        return self._group if self._group is not None else self._runtime.process_group

    @property
    def strategy(self) -> Any:
        """The strategy, as seen from inside this replica."""
        return self._runtime.strategy_view

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index, ``0 .. num_replicas_in_sync - 1``."""
        return self._runtime.rank

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each collective."""
        return self._runtime.size

    @property
    def devices(self) -> tuple[str, ...]:
        """The device this replica runs on (a 1-tuple of a TF device string)."""
        return (self._runtime.devices[self._runtime.rank],)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None) -> Any:
        """Reduce ``value`` across all replicas; returns the same structure on every replica.

        Parameters
        ----------
        reduce_op
            ``ReduceOp.SUM`` / ``MEAN`` (or ``MAX``, ``MIN``, ``PRODUCT``), or the name.
        value
            An array, a number, or a nested structure (dict, list, tuple,
            namedtuple) of them. A list of arrays is reduced as one batch: the
            arrays are packed into a few buffers.
        options
            ``CommunicationOptions`` for this call (pack size, timeout, implementation).
        """
        all_reduce = self._all_reduce
        if all_reduce is None:
            all_reduce = self.process_group.all_reduce
        return all_reduce(reduce_op, value, options)

    def all_gather(self, value: Any, axis: int, options: CommunicationOptions | None = None) -> Any:
        """Concatenate ``value`` from all replicas along ``axis``, in replica order."""
        return self.process_group.all_gather(value, axis, options)

    def broadcast(self, value: Any, root: int = 0, options: CommunicationOptions | None = None) -> Any:
        """Return replica ``root``'s ``value`` on every replica (structures, shapes and dtypes must match)."""
        return self.process_group.broadcast(value, root, options)

    _broadcast = broadcast

    def reduce_scatter(self, reduce_op: ReduceOp | str, value: Any, axis: int = 0,
                       options: CommunicationOptions | None = None) -> Any:
        """Reduce ``value`` across replicas; each replica gets its part along ``axis`` (``array_split`` order)."""
        return self.process_group.reduce_scatter(reduce_op, value, axis, options)

    def barrier(self, options: CommunicationOptions | None = None) -> None:
        """Return once every replica has reached this barrier."""
        self.process_group.barrier(options)

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """Call ``merge_fn(strategy, *args, **kwargs)`` once with every replica's arguments.

        The arguments of all replicas are gathered, so in ``merge_fn`` each
        argument is a ``PerReplica`` (one component per replica) and
        ``strategy.reduce`` / ``strategy.extended.reduce_to`` / ``update`` work
        on them. ``merge_fn`` runs in cross-replica context on every replica
        with the same inputs, so it must be deterministic. Each replica gets
        its own component of every ``PerReplica`` (or ``Mirrored``) in the
        result, other values as they are (TF's ``select_replica``).
        """
        kwargs = kwargs or {}
        gathered = self.process_group.all_gather_objects((args, kwargs))
        merged_args, merged_kwargs = _transpose(gathered)
        frame = context.Frame(
            strategy=self.strategy, replica_context=None, variable_creator=None, owner=self._runtime
        )
        with context.enter(frame):
            merged = merge_fn(self.strategy, *merged_args, **merged_kwargs)
        return select_replica(self.replica_id_in_sync_group, merged)

    def __repr__(self) -> str:
        return f"ReplicaContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, num_replicas_in_sync={self.num_replicas_in_sync})"


def _transpose(per_replica: list[Any]) -> Any:
    """A list (one per replica) of equal structures -> one structure of ``PerReplica`` leaves (TF's regroup)."""
    flat = [optree.tree_flatten(item, none_is_leaf=True) for item in per_replica]
    treedef = flat[0][1]
    for i, (_, t) in enumerate(flat):
        if t != treedef:
            raise ValueError(f"merge_call arguments differ in structure between replica 0 and replica {i}")
    return regroup(per_replica)
