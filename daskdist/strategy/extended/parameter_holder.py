"""``ParameterHolderExtended``: the SPMD contract with variables in parameter stores, not on the replicas.

TensorFlow's ``ParameterServerStrategyExtended`` in its local form (the one
``CentralStorageStrategy`` is a facade over): compute replicas run every step
in sync, but each variable has a single copy, held by a parameter store in a
worker's host memory (``daskdist.ps.store``); the stores are the members,
with role ``ps``, of the strategy's store group (``daskdist.ps.members``). The placement hook
``_parameter_placement`` picks the store of a new variable (round-robin over
the stores, as TF's ``replica_device_setter``); every replica gets an
``AggregatingVariable`` view of it. Gradients of ``fit`` are reduced to the
store, the optimizer runs once there, and the replicas read the new values
(``StoreGradientApplier``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import optree

from daskdist.group.service import VARIABLE, ReplicaService
from daskdist.ps.client import AggregatingVariable, StoreGroup, StoreRef
from daskdist.strategy.drivers.contract import StepDriver
from daskdist.strategy.drivers.held import HolderStepDriver
from daskdist.strategy.extended.contract import Args, Kwargs
from daskdist.strategy.extended.spmd import SpmdExtended
from daskdist.values import Mirrored, PerReplica
from daskdist.variables.distributed import DistributedVariable, VariableAggregation, VariableSpec

__all__ = ["ParameterHolderExtended", "select_single_value"]

logger = logging.getLogger(__name__)

_ALLOWED_AGGREGATIONS = {a.name for a in VariableAggregation}  # NONE, SUM, MEAN, ONLY_FIRST_REPLICA


class ParameterHolderExtended(SpmdExtended):
    """SPMD replicas with every variable kept once, in a parameter store (TF's local PS Extended).

    Subclasses say which workers hold stores by calling ``_open_stores``
    after ``SpmdExtended.__init__``.
    """

    _stores: list[StoreRef]
    _store_devices: list[str]
    _store_group: StoreGroup | None = None
    #: Variable writes made from the client (parameter-server workers drop values pulled ahead when it changes).
    client_writes: int = 0

    def _open_stores(self, addresses: list[str], devices: list[str]) -> None:
        """Install a parameter store on each of ``addresses`` (TF device names ``devices``), and the gradient rule."""
        self._stores = []
        self._store_devices = list(devices)
        self._store_of: dict[str, int] = {}
        self._placement_counter = itertools.count()
        self._store_group = StoreGroup(self.client, self.token, addresses, devices)
        self._stores = self._store_group.start()
        logger.info("%s: parameters on %s", type(self.strategy).__name__, addresses)

    @property
    def stores(self) -> tuple[StoreRef, ...]:
        """The parameter stores, in placement order (a variable's store index is its position)."""
        return tuple(getattr(self, "_stores", ()))

    @property
    def store_group(self) -> StoreGroup | None:
        """The stores' group (members with role ``ps``), or ``None`` before the stores are opened."""
        return self._store_group

    def close_stores(self) -> None:
        """Drop the variables held for this strategy and close the store group (idempotent)."""
        if self._store_group is not None:
            self._store_group.close()

    def step_driver(self, key: str | None = None) -> StepDriver:
        """Reduce to the parameter holder, apply once there, assign on every replica (``HolderStepDriver``)."""
        self.check_open()
        return HolderStepDriver(self._stores[0], key or uuid.uuid4().hex)

    # -- placement -------------------------------------------------------------------------

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return tuple(self._store_devices)

    def _parameter_placement(self, spec: VariableSpec) -> int:
        """The store a new variable goes to: round-robin (TF: ``/job:ps/task:(count % num_ps)``)."""
        return next(self._placement_counter) % len(self._stores)

    def _variable_placement(self, spec: VariableSpec | None) -> list[int]:
        return [0]  # one copy (it lives in a store, not on a replica)

    def _variable_holders(self, var_id: str) -> list[int]:
        if var_id in self._store_of:
            return [0]
        return super()._variable_holders(var_id)  # created inside a replica function: mirrored

    # -- variables ----------------------------------------------------------------------------

    _partitioner: Any = None

    def create_variable(self, *args: Any, **kwargs: Any) -> Any:
        """``dd.Variable(...)`` in ``scope()``: one copy in a store, a view of it on every replica.

        With a ``variable_partitioner`` that splits the variable (TF's rules:
        first axis only, never a scalar, never under ``colocate_vars_with``),
        a ``ShardedVariable`` whose shards ``name/part_i`` (TF's "div" split)
        are placed round-robin over the stores.
        """
        self.check_open()
        _check_aggregation(args, kwargs)
        value, spec = VariableSpec.build(*args, **kwargs)
        if self._partitioner is not None and len(spec.shape) > 0 and self._colocation is None:
            shards = self._partition(spec)
            if shards > 1:
                from daskdist.variables.partitioners import shard_sizes
                from daskdist.variables.sharded import ShardedVariable

                variables, start = [], 0
                for i, rows in enumerate(shard_sizes(spec.shape[0], shards)):
                    part = dataclasses.replace(spec, name=f"{spec.name}/part_{i}", shape=(rows, *spec.shape[1:]))
                    variables.append(self._create_stored(value[start:start + rows], part))
                    start += rows
                return ShardedVariable(variables, name=spec.name)
        return self._create_stored(value, spec)

    def _partition(self, spec: VariableSpec) -> int:
        """How many shards the partitioner asks for (TF's check of its answer)."""
        partitions = self._partitioner(spec.shape, np.dtype(spec.dtype))
        if (not partitions or len(partitions) != len(spec.shape) or partitions[0] == 0
                or any(p != 1 for p in partitions[1:])):
            raise ValueError("variable_partitioner must return a list/tuple whose elements are 1 besides the first "
                             f"element (non-zero), got: {partitions!r}")
        return min(int(partitions[0]), spec.shape[0])

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Variables created inside the block go to ``colocate_with_variable``'s store (and are never sharded)."""
        with super().colocate_vars_with(colocate_with_variable):
            previous = self._colocated_store
            self._colocated_store = self._store_of.get(colocate_with_variable.var_id)
            try:
                yield
            finally:
                self._colocated_store = previous

    _colocated_store: int | None = None

    def _create_stored(self, value: Any, spec: VariableSpec) -> DistributedVariable:
        index = self._colocated_store if self._colocated_store is not None else self._parameter_placement(spec)
        store, device = self._stores[index], self._store_devices[index]
        var_id = f"c{next(self._variable_ids)}"
        store.call_from_client(self.client, "create", var_id=var_id, value=value, spec=spec)
        self._install_views(var_id, spec, store, device)
        handle = AggregatingVariable(spec, self.token, var_id, store, device, owner=self)
        with self._lock:
            self._store_of[var_id] = index
            self._variables[var_id] = handle
        return handle

    def _install_views(self, var_id: str, spec: VariableSpec, store: StoreRef, device: str) -> None:
        """Give every replica its view of a new stored variable."""
        self._run_on(_install_view, (var_id, spec, store, device), None)

    def _store_for(self, var_id: str) -> StoreRef:
        try:
            return self._stores[self._store_of[var_id]]
        except KeyError:
            raise KeyError(f"variable {var_id!r} is not held by {type(self.strategy).__name__}'s stores") from None

    def variable_handle(self, var_id: str, spec: VariableSpec) -> DistributedVariable:
        if var_id not in self._store_of:  # created inside a replica function: mirrored on the replicas
            return super().variable_handle(var_id, spec)
        with self._lock:
            return self._variables[var_id]

    def read_variable(self, var_id: str, all_replicas: bool = False) -> Any:
        """The stored value (``all_replicas``: as a one-element list: there is one copy)."""
        self.check_open()
        if var_id not in self._store_of:
            return super().read_variable(var_id, all_replicas)
        _, value = self._store_for(var_id).call_from_client(self.client, "read", var_id=var_id)
        return [value] if all_replicas else value

    def gather_rows(self, var_id: str, rows: Any) -> Any:
        """Rows ``rows`` of a stored variable (only those travel)."""
        self.check_open()
        _, found = self._store_for(var_id).call_from_client(self.client, "gather", var_id=var_id, indices=rows)
        return found

    def scatter_variable(self, var_id: str, method: str, indices: Any, values: Any) -> None:
        """A sparse update from the client (``scatter_add``/``scatter_sub``/``scatter_update``), applied once."""
        self.check_open()
        self.client_writes += 1
        self._store_for(var_id).call_from_client(self.client, "scatter", var_id=var_id, method=method,
                                                 indices=indices, values=values)

    def update_variable(self, var_id: str, method: str, value: Any) -> None:
        """A cross-replica ``assign``/``assign_add``/``assign_sub``: applied once, to the stored value."""
        self.check_open()
        value = select_single_value(value)
        if var_id not in self._store_of:
            super().update_variable(var_id, method, value)
            return
        self.client_writes += 1
        self._store_for(var_id).call_from_client(self.client, "update", var_id=var_id, method=method, value=value)

    def update(self, var: Any, fn: Callable[..., Any], args: Any = (), kwargs: Kwargs | None = None,
               group: bool = True) -> Any:
        """TF's ``extended.update``: ``fn`` applied once to the stored variable; distributed arguments must have one value."""
        args = select_single_value(tuple(args))
        kwargs = select_single_value(dict(kwargs or {}))
        return super().update(var, fn, args, kwargs, group)

    def _update(self, var: DistributedVariable, fn: Callable[..., Any], args: Args, kwargs: Kwargs,
                holders: list[int]) -> list[Any]:
        if var.var_id not in self._store_of:
            return super()._update(var, fn, args, kwargs, holders)
        self.client_writes += 1
        result = self._store_for(var.var_id).call_from_client(
            self.client, "apply_fn", var_id=var.var_id, fn=fn, args=args, kwargs=kwargs)
        return [result]

    # -- closing -------------------------------------------------------------------------------

    def close(self) -> None:
        if not self._closed:
            self.close_stores()
        super().close()


def _check_aggregation(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """TF's ``ParameterServerStrategyExtended._create_variable`` check, before anything is built."""
    aggregation = kwargs.get("aggregation", args[4] if len(args) > 4 else VariableAggregation.NONE)
    name = kwargs.get("name", args[2] if len(args) > 2 else None)
    key = aggregation.name if isinstance(aggregation, VariableAggregation) else str(aggregation).upper()
    if key not in _ALLOWED_AGGREGATIONS:
        raise ValueError(f"Invalid variable aggregation mode: {aggregation} for variable: {name}")


def select_single_value(structured: Any) -> Any:
    """TF's ``_select_single_value``: a ``PerReplica`` (or a ``Mirrored`` of several) cannot update a variable."""

    def select(x: Any) -> Any:
        if isinstance(x, Mirrored):
            if len(x) == 1:
                return x.values[0]
            raise ValueError(
                f"You cannot update variable with a Mirrored object with multiple components {x!r} when using "
                "ParameterServerStrategy. You must specify a single value or a Mirrored with a single value."
            )
        if isinstance(x, PerReplica):
            raise ValueError(  # noqa: TRY004 - TF's error
                f"You cannot update variable with a PerReplica object {x!r} when using ParameterServerStrategy. "
                "You must specify a single value or a Mirrored with a single value"
            )
        return x

    return optree.tree_map(select, structured, is_leaf=lambda x: isinstance(x, (Mirrored, PerReplica)),
                           none_is_leaf=True)


def _install_view(service: ReplicaService, var_id: str, spec: VariableSpec, store: StoreRef, device: str) -> None:
    """Replica command: this replica's view of a stored variable, found by ``var_id``."""
    service.objects.install(VARIABLE, var_id, AggregatingVariable(spec, service.token, var_id, store, device,
                                                                  runtime=service))
