"""``AggregatingVariable``: one copy of a variable, in a parameter store (TF's ``ps_values.AggregatingVariable``).

On the client it is a handle whose reads and writes go to the store once.
On each replica it is a view: reads use a compute copy pulled from the store
(at most once per command, and only when the store's version is newer), and
an ``assign``/``assign_add``/``assign_sub`` in replica context is TensorFlow's
``merge_call`` -> ``apply_aggregation`` -> one update of the stored value:
every replica contributes to a round at the store, which aggregates the
contributions (SUM, MEAN or the first replica's) and applies the result once;
all replicas get the new value back. With aggregation ``NONE`` that raises, as
in TensorFlow. Inside ``merge_call`` (cross-replica context on the replicas)
the update is applied once too: the replicas make it together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from daskdist import context
from daskdist.arrays import namespace
from daskdist.group.service import STRATEGY, VARIABLE
from daskdist.strategy.parameter_client import RoundCounter
from daskdist.variables import DistributedVariable, VariableAggregation, VariableSpec

if TYPE_CHECKING:
    from daskdist.strategy.parameter_client import StoreRef

__all__ = ["AggregatingVariable", "aggregation_error_message"]


def aggregation_error_message(variable_type: str) -> str:
    """TensorFlow's ``values_util.aggregation_error_msg`` for ``variable_type``."""
    return (
        f"You must specify an aggregation method to update a {variable_type} in Replica Context. You can do so "
        "by passing an explicit value for argument `aggregation` to tf.Variable(..).e.g. "
        "`tf.Variable(..., aggregation=tf.VariableAggregation.SUM)``tf.VariableAggregation` lists the possible "
        f"aggregation methods.This is required because {variable_type} should always be kept in sync. When "
        "updating them or assigning to them in a replica context, we automatically try to aggregate the values "
        "before updating the variable. For this aggregation, we need to know the aggregation method. Another "
        f"alternative is to not try to update such {variable_type} in replica context, but in cross replica "
        "context. You can enter cross replica context by calling "
        "`tf.distribute.get_replica_context().merge_call(merge_fn, ..)`.Inside `merge_fn`, you can then update "
        f"the {variable_type} using `tf.distribute.StrategyExtended.update()`."
    )


class AggregatingVariable(DistributedVariable):
    """A variable with a single copy in a parameter store; replicas compute with pulled copies.

    ``strategy.experimental_local_results(v)`` has one element, ``v.device``
    is the parameter device.
    """

    def __init__(self, spec: VariableSpec, token: str, var_id: str, store: StoreRef, device: str,
                 owner: Any = None, runtime: Any = None):
        super().__init__(spec, token, var_id, owner=owner, runtime=runtime)
        self._store = store
        self._device = device
        self._cached_version = -1
        self._cached_run = None
        self._rounds = RoundCounter()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_resolve_stored_variable, (self._token, self._var_id, self._spec, self._store, self._device))

    @property
    def device(self) -> str:
        """The parameter device the one copy lives on (TF's ``var.device``)."""
        return self._device

    # -- reading --------------------------------------------------------------------

    def value(self) -> Any:
        if not self._on_replica():
            return self._client_owner().read_variable(self._var_id)
        runtime = self._runtime
        if self._value is None or self._cached_run != runtime.run_id:
            version, value = self._store.call_from_replica(runtime, "read", var_id=self._var_id,
                                                           newer_than=self._cached_version)
            if value is not None:
                self._value, self._cached_version = _on_replica_device(value, runtime), version
            self._cached_run = runtime.run_id
        return self._value

    def _gather_rows(self, rows: Any) -> Any:
        """Rows ``rows`` of the stored value: from the compute copy if it is fresh, else only those rows."""
        if not self._on_replica():
            return self._client_owner().gather_rows(self._var_id, rows)
        runtime = self._runtime
        if self._value is not None and self._cached_run == runtime.run_id:
            return self._value[rows]
        _, found = self._store.call_from_replica(runtime, "gather", var_id=self._var_id, indices=rows)
        return _on_replica_device(found, runtime)

    # -- sparse updates (embeddings) -------------------------------------------------------

    def scatter_add(self, sparse_delta: Any) -> AggregatingVariable:
        """Add ``sparse_delta.values`` to rows ``sparse_delta.indices`` (only those rows travel)."""
        return self._scatter("add", sparse_delta)

    def scatter_sub(self, sparse_delta: Any) -> AggregatingVariable:
        """Subtract ``sparse_delta.values`` from rows ``sparse_delta.indices``."""
        return self._scatter("sub", sparse_delta)

    def scatter_update(self, sparse_delta: Any) -> AggregatingVariable:
        """Set rows ``sparse_delta.indices`` to ``sparse_delta.values``."""
        return self._scatter("update", sparse_delta)

    def _scatter(self, method: str, sparse_delta: Any) -> AggregatingVariable:
        indices, values = sparse_delta.indices, sparse_delta.values
        if not self._on_replica():
            self._client_owner().scatter_variable(self._var_id, method, indices, values)
            return self
        runtime = self._runtime
        frame = context.current_frame()
        if frame is not None and frame.replica_context is not None and runtime.size > 1:
            raise NotImplementedError(
                f"scatter_{method} of variable '{self.name}' in replica context with {runtime.size} replicas in "
                "sync: reduce the sparse update first (merge_call) or run it from a parameter-server worker"
            )
        read = self._cached_version if self._cached_run == runtime.run_id else None
        self._store.call_from_replica(runtime, "scatter", var_id=self._var_id, method=method, indices=indices,
                                      values=values, dedupe=_dedupe_key(runtime), read_version=read)
        self._cached_run = None  # the compute copy is stale: the next read pulls
        return self

    # -- writing -----------------------------------------------------------------------

    def _update(self, method: str, value: Any) -> None:
        if not self._on_replica():
            self._client_owner().update_variable(self._var_id, method, value)
            return
        frame = context.current_frame()
        ctx = frame.replica_context if frame is not None else None
        runtime = self._runtime
        array = self._convert(value)
        if ctx is not None and runtime.size > 1 and self.aggregation is VariableAggregation.NONE:
            raise ValueError(aggregation_error_message("AggregatingVariable"))
        if runtime.size == 1:  # nothing to aggregate (a parameter-server worker): applied at once, deduplicated
            version, new_value = self._store.call_from_replica(
                runtime, "update", var_id=self._var_id, method=method, value=array, dedupe=_dedupe_key(runtime),
                read_version=self._cached_version if self._cached_run == runtime.run_id else None)
            self._value = _on_replica_device(new_value, runtime)
            self._cached_version, self._cached_run = version, runtime.run_id
            return
        # replica context: aggregate as the variable says; merge_call (cross-replica on every replica): once
        aggregation = self.aggregation.name if ctx is not None else "ONLY_FIRST_REPLICA"
        version, new_value = self._store.round_from_replica(
            runtime, "variable", f"var:{self._var_id}", self._rounds.next(runtime.run_id),
            {"method": method, "value": array, "aggregation": aggregation},
        )
        self._value = _on_replica_device(namespace(new_value).array(new_value, copy=True), runtime)
        self._cached_version, self._cached_run = version, runtime.run_id


def _on_replica_device(value: Any, runtime: Any) -> Any:
    """A value from the store (host memory) on the replica's device: cupy for a GPU replica."""
    devices = getattr(runtime, "devices", None)
    if devices and "GPU" in str(devices[runtime.rank]):
        import importlib

        return importlib.import_module("cupy").asarray(value)  # a GPU replica has cupy
    return value


#: The resident under which a parameter-server worker records the closure it runs (id, updates so far).
CLOSURE_KEY = (STRATEGY, "ps-closure")


def _dedupe_key(runtime: Any) -> tuple[str, int] | None:
    """``(closure id, n)`` for the n-th update of the closure this worker runs, or ``None`` outside closures.

    A closure run again after a worker failure makes the same updates in the
    same order, so the store applies each key once.
    """
    closure = runtime.objects.find(*CLOSURE_KEY)
    if closure is None:
        return None
    closure[1] += 1
    return (closure[0], closure[1])


def _resolve_stored_variable(token: str, var_id: str, spec: VariableSpec, store: StoreRef,
                             device: str) -> Any:
    """Unpickle a stored variable: this replica's view (made on first use), else the client's handle."""
    runtime = context.current_runtime()
    if runtime is not None:
        view = runtime.objects.find(VARIABLE, var_id)
        if view is None:
            view = AggregatingVariable(spec, token, var_id, store, device, runtime=runtime)
            runtime.objects.install(VARIABLE, var_id, view)
        return view
    from daskdist import registry

    owner = registry.lookup(token)
    if owner is not None:
        return owner.variable_handle(var_id, spec)
    return AggregatingVariable(spec, token, var_id, store, device)
