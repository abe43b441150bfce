"""Models and optimizers captured by a function given to ``strategy.run``: references to the replicas' copies.

TensorFlow's custom-training tutorial calls the model and the optimizer
created in the scope from a function run on every replica. Pickled for that
function, a recorded model becomes a reference resolved on each replica to its
own copy (built models created in the scope are installed on the replicas
before ``strategy.run`` ships its function: ``place_models``); a recorded
optimizer becomes its class and configuration, built once per replica, whose
``apply`` sums the gradients over the replicas (``exchange.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from daskdist import context
from daskdist.group.service import MODEL
from daskdist.plugins.keras3 import registry
from daskdist.plugins.keras3.backend import keras_backend, prepare_replica
from daskdist.plugins.keras3.resident import fingerprint

__all__ = ["OptimizerResident", "install_or_keep_error", "place_models", "reduce", "resolve_model", "resolve_optimizer"]

logger = logging.getLogger(__name__)

_OPTIMIZER_PREFIX = "optimizer/"


class OptimizerResident:
    """A replica's copy of an optimizer created in the scope (resident kind ``MODEL``, id ``optimizer/<id>``)."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def snapshot(self) -> list[Any]:
        import keras

        return [keras.ops.convert_to_numpy(v.value).copy() for v in self.optimizer.variables]

    def restore(self, state: list[Any]) -> None:
        for variable, value in zip(self.optimizer.variables, state):
            variable.assign(value)


def reduce(obj: Any, record: registry.Record) -> tuple[Any, tuple[Any, ...]]:
    """The pickled form of a recorded model or optimizer (see the module's docstring)."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    from daskdist.plugins.keras3.ps import schedules_closures

    if schedules_closures(record.strategy.extended):  # a function scheduled on a parameter-server worker
        from daskdist.plugins.keras3 import ps

        return ps.reference(obj, record)
    from keras.src.metrics.metric import Metric

    if isinstance(obj, Metric):
        from daskdist.plugins.keras3 import replica_metrics

        return replica_metrics.reference(obj, record)
    token = record.strategy.extended.token
    if isinstance(obj, BaseOptimizer):
        return resolve_optimizer, (token, record.object_id, keras_backend(), type(obj), obj.get_config())
    if record.fingerprint is None and record.install_error is not None:
        raise RuntimeError(f"model {obj.name!r} could not be installed on the replicas, so a function using it cannot "
                           f"run there: {record.install_error[1]}") from record.install_error[1]
    if record.fingerprint is None:
        raise RuntimeError(f"model {obj.name!r} is not on the replicas yet: build it (give it an Input, or call it on "
                           "one batch) before strategy.run uses it")
    record.dirty = True
    return resolve_model, (token, record.object_id)


def place_models(extended: Any, install: Callable[[Any, registry.Record], None]) -> None:
    """Before ``strategy.run``: install the built models created in this strategy's scope not installed yet
    (``install(model, record)``: ``fit.ensure_installed``)."""
    import keras

    for obj, record in registry.items():
        if (record.strategy.extended is extended and record.fingerprint is None and isinstance(obj, keras.Model)
                and obj.built):
            install_or_keep_error(obj, record, install)


def install_or_keep_error(model: Any, record: registry.Record, install: Any) -> None:
    """``install(model, record)``; if it fails, keep the error on the record instead of raising it.

    Every built model of the scope is placed before any ``strategy.run``:
    one that cannot be installed must fail only the calls whose function uses
    it (``reduce`` raises the kept error), not every later call. Its install
    is tried again once the model changed (compile, new weights).
    """
    current = fingerprint(model)
    if record.install_error is not None and record.install_error[0] == current:
        return
    try:
        install(model, record)
    except Exception as error:
        if not registry.is_open(record):
            raise
        logger.warning("model %r could not be installed on the replicas: %s", model.name, error)
        record.install_error = (current, error)
    else:
        record.install_error = None


def _runtime(token: str, what: str) -> Any:
    runtime = context.current_runtime()
    if runtime is None or runtime.token != token:
        raise RuntimeError(f"a Keras {what} created in a strategy's scope can only be used inside that strategy's "
                           "replicas (strategy.run) or on the client")
    return runtime


def resolve_model(token: str, model_id: str) -> Any:
    """The replica's copy of a model."""
    runtime = _runtime(token, "model")
    found = runtime.objects.find(MODEL, model_id)
    if found is None:
        raise RuntimeError(f"model {model_id} is not on this replica: re-create it in the strategy's scope")
    return found.model


def resolve_optimizer(token: str, optimizer_id: str, backend: str, cls: Any, config: dict[str, Any]) -> Any:
    """The replica's copy of an optimizer created in the scope (built from its configuration the first time)."""
    runtime = _runtime(token, "optimizer")
    key = _OPTIMIZER_PREFIX + optimizer_id
    found = runtime.objects.find(MODEL, key)
    if found is None:
        prepare_replica(backend)
        from daskdist.plugins.keras3 import exchange, wrapped

        wrapped.ensure()
        optimizer = cls.from_config(config)
        exchange.mark_replica_optimizer(optimizer)
        found = OptimizerResident(optimizer)
        runtime.objects.install(MODEL, key, found)
    return found.optimizer
