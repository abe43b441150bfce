"""Keras 3 metrics created in an SPMD strategy's scope and updated inside ``strategy.run``: summed on read.

TensorFlow's custom-training tutorial creates its metrics in
``strategy.scope()`` and updates them in the replica function; their
variables are sync-on-read sums, so ``metric.result()`` on the client reads
every replica's updates. Here (MirroredStrategy, OneDevice,
MultiWorkerMirrored, CentralStorage):

* Pickled in a function given to ``strategy.run``, a recorded metric becomes
  a reference (``reference``) to the replica's copy (``MetricCopy``, built once
  from the metric's class and configuration, resident ``(MODEL, "metric/<id>")``);
  ``update_state`` there adds to that copy, and a ``result()`` there reads
  that replica's own updates (TF's local value in replica context).
* ``result()`` or ``reset_state()`` of the client's metric (bound on that
  metric alone, as ``get_weights`` is on a recorded model) first takes each
  replica's change since the last read and adds their sum to the client's
  variables (``take_changes``), so the client holds the totals over every
  replica's batches.

Keras metrics keep sums (``aggregation="sum"``); a variable with another
aggregation is refused when the function is pickled. Under
``ParameterServerStrategy`` the same pattern is ``ps_metrics``'.
"""

from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist import context, serialization
from daskdist.group.service import MODEL
from daskdist.plugins.keras3 import registry
from daskdist.plugins.keras3.backend import keras_backend, prepare_replica
from daskdist.plugins.keras3.ps_metrics import metric_values, non_sum_variables

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService

__all__ = ["MetricCopy", "created", "reference", "resolve_metric", "take_changes"]

_PREFIX = "metric/"


def created(metric: Any) -> None:
    """Called at the end of every Keras metric's ``__init__``: record those created in an SPMD strategy's scope on
    the client (their updates in ``strategy.run`` then count on the client's metric)."""
    from daskdist.plugins.keras3.ps import schedules_closures

    strategy = registry.current_client_strategy()
    if strategy is None or schedules_closures(strategy.extended) or registry.lookup(metric) is not None:
        return
    registry.register(metric, strategy)
    vars(metric)["result"] = types.MethodType(functools.partial(_after_sync, "result"), metric)
    vars(metric)["reset_state"] = types.MethodType(functools.partial(_after_sync, "reset_state"), metric)




def reference(metric: Any, record: registry.Record) -> tuple[Any, tuple[Any, ...]]:
    """The pickled form of a recorded metric in a function given to ``strategy.run``: the replica's copy.

    Raises
    ------
    ValueError
        A variable of the metric is not a sum (the replicas' updates could not be added up).
    """
    odd = non_sum_variables(metric)
    if odd:
        raise ValueError(f"metric {metric.name!r} cannot be updated inside {type(record.strategy).__name__}.run: its "
                         f"variables {odd} are not sums (aggregation='sum'), so the replicas' updates cannot be "
                         "added up; return the values from the function instead")
    record.dirty = True
    spec = serialization.dumps((type(metric), metric.get_config()))
    return resolve_metric, (record.strategy.extended.token, record.object_id, keras_backend(), spec)


def sync(metric: Any) -> None:
    """Add every replica's change of the metric since the last read to the client's metric."""
    import keras

    record = registry.lookup(metric)
    if record is None or not record.dirty or not registry.is_open(record):
        return
    changes = [c for c in record.strategy.extended.run_on_replicas(take_changes, (record.object_id,)) if c]
    record.dirty = False
    for position, variable in enumerate(metric.variables):
        total = sum((np.asarray(change[position]) for change in changes if position < len(change)),
                    np.zeros(tuple(variable.shape)))
        now = np.asarray(keras.ops.convert_to_numpy(variable.value))
        variable.assign((now + total).astype(now.dtype, copy=False))


def _after_sync(name: str, metric: Any, *args: Any, **kwargs: Any) -> Any:
    sync(metric)
    return getattr(type(metric), name)(metric, *args, **kwargs)


class MetricCopy:
    """A replica's copy of a metric created in the scope; ``start``: its values when the client last read it."""

    def __init__(self, metric: Any):
        self.metric = metric
        self.start = metric_values(metric)

    def take_changes(self) -> list[np.ndarray]:
        """Each variable's change since the last take (the client adds it to its metric)."""
        now = metric_values(self.metric)
        start = self.start + [np.zeros_like(v) for v in now[len(self.start):]]
        self.start = now
        return [n - s for n, s in zip(now, start)]

    def snapshot(self) -> list[np.ndarray]:
        return metric_values(self.metric)

    def restore(self, state: list[np.ndarray]) -> None:
        for variable, value in zip(self.metric.variables, state):
            variable.assign(np.asarray(value))
        self.start = metric_values(self.metric)


def take_changes(service: ReplicaService, metric_id: str) -> list[np.ndarray] | None:
    """Command: this replica's change of the metric since the last take (``None``: no copy here yet)."""
    copy = service.objects.find(MODEL, _PREFIX + metric_id)
    return None if copy is None else copy.take_changes()


def resolve_metric(token: str, metric_id: str, backend: str, spec: bytes) -> Any:
    """On a replica running ``strategy.run``: its copy of the metric (see the module)."""
    runtime = context.current_runtime()
    if runtime is None or runtime.token != token:
        raise RuntimeError("a Keras metric created in a strategy's scope can only be used inside that strategy's "
                           "replicas (strategy.run) or on the client")
    copy = runtime.objects.find(MODEL, _PREFIX + metric_id)
    if copy is None:
        prepare_replica(backend)  # before the class is unpickled: it imports Keras
        from daskdist.plugins.keras3 import wrapped

        wrapped.ensure()
        cls, config = serialization.loads(spec)
        copy = MetricCopy(cls.from_config(config))
        runtime.objects.install(MODEL, _PREFIX + metric_id, copy)
    return copy.metric
