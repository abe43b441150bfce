"""Keras 3 metrics created in a ``ParameterServerStrategy``'s scope and updated inside scheduled functions.

TensorFlow's parameter-server custom loop creates its metrics in the scope:
their variables live on the parameter servers, a closure's
``metric.update_state`` adds to them there, and ``metric.result()`` on the
coordinator reads the totals after ``coordinator.join()``. Here the client's
metric holds the totals, and each closure counts once, from the run the
coordinator keeps:

* Pickled in a scheduled function, a recorded metric becomes a reference
  (``reference``) carrying the client's values at that moment; on the worker
  it resolves to the worker's copy of the metric (``MetricCopy``, built once
  from the metric's class and configuration), which takes those values, so a
  ``result()`` inside the closure sees the totals so far plus its own updates.
* When the closure returns, the copy's change over the closure (each variable
  now minus at the closure's start) goes back with the closure's result
  (``daskdist.ps.closures.at_closure_end``); the client adds it to its metric's
  variables when the coordinator commits the closure
  (``ParameterServerExtended.on_closure_commit``). A closure re-run after its
  worker was lost adds the change of the run that returned only; a closure
  that raised adds nothing.

Keras metrics keep sums (``aggregation="sum"``: totals, counts, confusion
counts), so adding each closure's change gives the totals over all closures'
batches, in any order. A variable with another aggregation is refused when the
function is pickled; a metric that creates its variables on its first
``update_state`` (``F1Score``, ``R2Score``) must be built on the client first.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import numpy as np

from daskdist import context, serialization
from daskdist.group.service import MODEL
from daskdist.plugins.keras3 import registry
from daskdist.plugins.keras3.backend import keras_backend, prepare_replica

__all__ = ["MetricCopy", "created", "reference", "resolve_metric"]

_PREFIX = "metric/"  # the worker's copy: resident ``(MODEL, "metric/<id>")``
_PART = "keras3/metric/"  # a closure's change of the metric: its part ``keras3/metric/<id>``
_lock = threading.Lock()  # the client's metric values: read for a closure's reference, added to at its commit


def created(metric: Any) -> None:
    """Called at the end of every Keras metric's ``__init__``: record those created in a ParameterServerStrategy's
    scope on the client (their updates in scheduled functions then count on the client's metric)."""
    strategy = registry.current_client_strategy()
    if strategy is None or not strategy.extended.schedules_closures or registry.lookup(metric) is not None:
        return
    registry.register(metric, strategy)


def metric_values(metric: Any) -> list[np.ndarray]:
    """A copy of each of ``metric``'s variables, as numpy."""
    import keras

    return [np.array(keras.ops.convert_to_numpy(v.value), copy=True) for v in metric.variables]


def non_sum_variables(metric: Any) -> list[str]:
    """The names of ``metric``'s variables that are not sums: updates of several copies cannot be added up."""
    return [v.name for v in metric.variables if getattr(v, "aggregation", "sum") != "sum"]


def reference(metric: Any, record: registry.Record) -> tuple[Any, tuple[Any, ...]]:
    """The pickled form of a recorded metric in a scheduled function: the worker's copy, with the values now.

    Raises
    ------
    ValueError
        A variable of the metric is not a sum (its closures' changes could not be added up).
    """
    odd = non_sum_variables(metric)
    if odd:
        raise ValueError(f"metric {metric.name!r} cannot be updated in a function scheduled under "
                         f"{type(record.strategy).__name__}: its variables {odd} are not sums (aggregation='sum'), "
                         "so the closures' updates cannot be added up; return the values from the function instead")
    record.strategy.extended.on_closure_commit(_PART + record.object_id,
                                               functools.partial(_commit, weakref.ref(metric)))
    with _lock:
        values = metric_values(metric)
    spec = serialization.dumps((type(metric), metric.get_config()))
    return resolve_metric, (record.object_id, keras_backend(), spec, values)


def _commit(ref: weakref.ref[Any], change: list[np.ndarray]) -> None:
    """A committed closure's change of the metric: added to the client's metric."""
    import keras

    metric = ref()
    if metric is None:
        return
    with _lock:
        for variable, delta in zip(metric.variables, change):
            now = np.asarray(keras.ops.convert_to_numpy(variable.value))
            variable.assign((now + np.asarray(delta)).astype(now.dtype, copy=False))


class MetricCopy:
    """A worker's copy of a metric created in the scope (resident kind ``MODEL``, id ``metric/<id>``)."""

    def __init__(self, metric: Any):
        self.metric = metric
        self.start: list[np.ndarray] = []
        self.client_variables = 0

    def begin(self, values: list[np.ndarray]) -> None:
        """A closure brings the client's values: take them (when the copy is built as the client's is)."""
        variables = self.metric.variables
        if len(values) == len(variables):
            for variable, value in zip(variables, values):
                variable.assign(np.asarray(value))
        self.start = metric_values(self.metric)
        self.client_variables = len(values)

    def finish(self) -> list[np.ndarray]:
        """The closure returns: each variable's change since it began (the client adds it when it commits).

        Raises
        ------
        ValueError
            The copy created variables the client's metric lacks (built on its first ``update_state``).
        """
        end = metric_values(self.metric)
        if len(end) != self.client_variables:
            raise ValueError(
                f"metric {self.metric.name!r} creates its variables on its first update_state and the client's "
                f"metric has {self.client_variables} of its {len(end)}: build it on the client before scheduling "
                "(metric.build(...), or one update_state then reset_state())")
        start = self.start + [np.zeros_like(e) for e in end[len(self.start):]]
        return [e - s for e, s in zip(end, start)]


def resolve_metric(metric_id: str, backend: str, spec: bytes, values: list[np.ndarray]) -> Any:
    """On a worker running a closure: its copy of the metric, holding the client's values (see the module)."""
    from daskdist.ps.closures import at_closure_end

    runtime = context.current_runtime()
    if runtime is None:
        raise RuntimeError("a Keras metric created in a ParameterServerStrategy's scope can only be used in functions "
                           "scheduled with its ClusterCoordinator, or on the client")
    copy = runtime.objects.find(MODEL, _PREFIX + metric_id)
    if copy is None:
        prepare_replica(backend)  # before the class is unpickled: it imports Keras
        from daskdist.plugins.keras3 import wrapped

        wrapped.ensure()
        cls, config = serialization.loads(spec)
        copy = MetricCopy(cls.from_config(config))
        runtime.objects.install(MODEL, _PREFIX + metric_id, copy)
    copy.begin(values)
    at_closure_end(runtime, _PART + metric_id, copy.finish)
    return copy.metric
