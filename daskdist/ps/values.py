"""``AggregatingVariable``: one copy of a variable, in a parameter store (TF's ``ps_values.AggregatingVariable``).

On the client it is a handle whose reads and writes go to the store once.
On each replica it is a view: reads use a compute copy pulled from the store
(at most once per command, and only when the store's version is newer; in a
parameter-server closure, pulled together with the worker's other variables
and updated in one push per store at the end: ``daskdist.ps.session``), and
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

import numpy as np

from daskdist import context
from daskdist.arrays import as_array, namespace, to_numpy
from daskdist.group.service import VARIABLE
from daskdist.ps.refs import RoundCounter
from daskdist.ps.session import CLOSURE_KEY, ClosureSession, current_session
from daskdist.variables.distributed import DistributedVariable, VariableAggregation, VariableSpec

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService
    from daskdist.ps.refs import StoreRef

__all__ = ["CLOSURE_KEY", "AggregatingVariable", "aggregation_error_message", "dedupe_key"]


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
                 owner: Any = None, runtime: ReplicaService | None = None):
        super().__init__(spec, token, var_id, owner=owner, runtime=runtime)
        self._store = store
        self._device = device
        self.cached_version = -1
        self.cached_run: int | None = None
        self._rounds = RoundCounter()

    def replica_runtime(self) -> ReplicaService | None:
        """The replica runtime of a worker's view, or ``None`` for the client's handle."""
        return self._runtime if self._on_replica() else None

    @property
    def store(self) -> StoreRef:
        """The parameter store holding the variable."""
        return self._store

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
        runtime = self._service
        session = current_session(runtime)
        if session is not None:
            session.working_set.mark_read(self)
            if self._value is None or self.cached_run != runtime.run_id or session.has_pending(self):
                session.pull(self)
            return self._value
        if self._value is None or self.cached_run != runtime.run_id:
            version, value = self._store.call_from_replica(runtime, "read", var_id=self._var_id,
                                                           newer_than=self.cached_version)
            self.receive(version, value, runtime.run_id)
        return self._value

    def receive(self, version: int, value: Any, run_id: Any) -> None:
        """The store's answer to a read: its value at ``version`` (``None``: the copy held is that version).

        A host value is kept read-only (it may be the store's own array, in
        the same process): like TF's tensors, what ``value()`` returns is not
        changed in place.
        """
        if value is not None:
            value = _on_replica_device(value, self._service)
            if isinstance(value, np.ndarray) and value.flags.writeable:
                value.flags.writeable = False
            self._value, self.cached_version = value, version
        self.cached_run = run_id

    def restore(self, state: Any) -> None:
        """Put a snapshot back as this replica's compute copy (pulled again before it is used)."""
        if not self._on_replica():
            raise RuntimeError(f"Variable '{self.name}': restore() is for a replica's copy, not the client's handle")
        self._value, self.cached_run = namespace(state).array(state, copy=True), None

    def _fresh(self, session: ClosureSession | None) -> bool:
        """Whether the compute copy is the store's value for this command (nothing queued since)."""
        return (self._value is not None and self.cached_run == self._service.run_id
                and (session is None or not session.has_pending(self)))

    def _gather_rows(self, rows: Any) -> Any:
        """Rows ``rows`` of the stored value: from the compute copy if it is fresh, else only those rows."""
        if not self._on_replica():
            return self._client_owner().gather_rows(self._var_id, rows)
        runtime = self._service
        session = current_session(runtime)
        if self._fresh(session):
            return self._value[rows]
        if session is not None:
            return _on_replica_device(session.gather(self, rows), runtime)
        _, found = self._store.call_from_replica(runtime, "gather", var_id=self._var_id, indices=rows)
        return _on_replica_device(found, runtime)

    @staticmethod
    def _gather_rows_of_shards(requests: list[tuple[AggregatingVariable, Any]]) -> list[Any]:
        """Rows of several stored shards: in a closure, one request per store and all stores at once."""
        views = [v for v, _ in requests]
        runtime = views[0].replica_runtime() if views else None
        session = current_session(runtime) if runtime is not None else None
        if runtime is None or session is None or any(v.replica_runtime() is not runtime for v in views):
            return [view._gather_rows(rows) for view, rows in requests]
        found: list[Any] = [None] * len(requests)
        remote = []
        for i, (view, rows) in enumerate(requests):
            if view._fresh(session):
                found[i] = view._value[rows]
            else:
                remote.append(i)
        if remote:
            pulled = session.gather_many([requests[i] for i in remote])
            for i, rows in zip(remote, pulled):
                found[i] = _on_replica_device(rows, runtime)
        return found

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
        runtime = self._service
        frame = context.current_frame()
        if frame is not None and frame.replica_context is not None and runtime.size > 1:
            raise NotImplementedError(
                f"scatter_{method} of variable '{self.name}' in replica context with {runtime.size} replicas in "
                "sync: reduce the sparse update first (merge_call) or run it from a parameter-server worker"
            )
        read = self.cached_version if self.cached_run == runtime.run_id else None
        session = current_session(runtime)
        if session is not None:
            rows, delta = self._check_scatter(method, indices, values)
            session.queue(self, ("scatter", self._var_id, method, rows, delta, session.next_dedupe_key(), read))
            return self
        self._store.call_from_replica(runtime, "scatter", var_id=self._var_id, method=method, indices=indices,
                                      values=values, dedupe=None, read_version=read)
        self.cached_run = None  # the compute copy is stale: the next read pulls
        return self

    def _check_scatter(self, method: str, indices: Any, values: Any) -> tuple[np.ndarray, np.ndarray]:
        """The rows and values of a sparse update as the store takes them; its errors raised here, at once."""
        rows = np.asarray(to_numpy(as_array(indices)[0]), dtype=np.int64).reshape(-1)
        delta = np.array(to_numpy(as_array(values)[0]), dtype=self.dtype, copy=True)
        shape = tuple(self.shape)
        if delta.shape != (len(rows), *shape[1:]):
            raise ValueError(f"scatter_{method} of variable '{self.name}': values of shape {delta.shape} "
                             f"for {len(rows)} rows of shape {shape[1:]}")
        if rows.size and (rows.min() < 0 or rows.max() >= shape[0]):
            raise IndexError(f"scatter_{method}: rows {rows.min()}..{rows.max()} of variable "
                             f"'{self.name}' with {shape[0]} rows")
        return rows, delta

    # -- writing -----------------------------------------------------------------------

    def _update(self, method: str, value: Any) -> None:
        if not self._on_replica():
            self._client_owner().update_variable(self._var_id, method, value)
            return
        frame = context.current_frame()
        ctx = frame.replica_context if frame is not None else None
        runtime = self._service
        array = self._convert(value)
        if ctx is not None and runtime.size > 1 and self.aggregation is VariableAggregation.NONE:
            raise ValueError(aggregation_error_message("AggregatingVariable"))
        read = self.cached_version if self.cached_run == runtime.run_id else None
        session = current_session(runtime)
        if runtime.size == 1 and session is not None:  # a parameter-server closure: pushed with the others
            host = np.array(to_numpy(array), copy=True)  # the caller may reuse its array before the push
            session.queue(self, ("update", self._var_id, method, host, session.next_dedupe_key(), read))
            return
        if runtime.size == 1:  # nothing to aggregate: applied at once
            version, new_value = self._store.call_from_replica(
                runtime, "update", var_id=self._var_id, method=method, value=array, dedupe=None, read_version=read)
            self._value = _on_replica_device(new_value, runtime)
            self.cached_version, self.cached_run = version, runtime.run_id
            return
        # replica context: aggregate as the variable says; merge_call (cross-replica on every replica): once
        aggregation = self.aggregation.name if ctx is not None else "ONLY_FIRST_REPLICA"
        version, new_value = self._store.round_from_replica(
            runtime, "variable", f"var:{self._var_id}", self._rounds.next(runtime.run_id),
            {"method": method, "value": array, "aggregation": aggregation},
        )
        self._value = _on_replica_device(namespace(new_value).array(new_value, copy=True), runtime)
        self.cached_version, self.cached_run = version, runtime.run_id


def _on_replica_device(value: Any, service: ReplicaService) -> Any:
    """A value from the store (host memory) on the replica's device: cupy for a GPU replica."""
    devices = getattr(service, "devices", None)
    if devices and "GPU" in str(devices[service.rank]):
        import importlib

        return importlib.import_module("cupy").asarray(value)  # a GPU replica has cupy
    return value


def dedupe_key(service: ReplicaService) -> tuple[str, int] | None:
    """``(closure id, n)`` for the closure's next update (the parameter-server step driver's pushes too), or ``None`` outside closures."""
    session = current_session(service)
    return None if session is None else session.next_dedupe_key()


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
