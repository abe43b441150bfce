"""Models and optimizers captured by a function given to ``strategy.run``: references to the replicas' copies.

TensorFlow's custom-training tutorial calls the model and the optimizer
created in the scope from a function run on every replica. Pickled for that
function, a recorded model becomes a reference resolved on each replica to its
own copy (its ``.keras`` payload is scattered to the replicas' workers with
the first function that uses it, and loaded there on first use); a recorded
optimizer becomes its class and configuration, built once per replica, whose
``apply`` sums the gradients over the replicas (``exchange.py``).
"""

from __future__ import annotations

from typing import Any

from daskdist import context
from daskdist.group.service import MODEL
from daskdist.plugins.keras3 import registry
from daskdist.plugins.keras3.backend import keras_backend, prepare_replica

__all__ = ["OptimizerResident", "reduce", "resolve_model", "resolve_optimizer"]

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

    token = record.strategy.extended.token
    if isinstance(obj, BaseOptimizer):
        return resolve_optimizer, (token, record.object_id, keras_backend(), type(obj), obj.get_config())
    from daskdist.plugins.keras3 import fit
    from daskdist.plugins.keras3.payload import pack_model

    if record.fingerprint is None:  # not on the replicas yet: sent to their workers, loaded on first use
        extended = record.strategy.extended
        payload = pack_model(obj, keras_backend())
        record.payload = extended.client.scatter(payload, workers=list(extended.worker_addresses), broadcast=True,
                                                 hash=False)
        record.fingerprint = fit.fingerprint(obj)
    record.dirty = True
    key = record.payload.key if record.payload is not None else None
    return resolve_model, (token, record.object_id, key)


def _runtime(token: str, what: str) -> Any:
    runtime = context.current_runtime()
    if runtime is None or runtime.token != token:
        raise RuntimeError(f"a Keras {what} created in a strategy's scope can only be used inside that strategy's "
                           "replicas (strategy.run) or on the client")
    return runtime


def resolve_model(token: str, model_id: str, payload_key: str | None) -> Any:
    """The replica's copy of a model (loaded the first time from the payload its worker holds)."""
    runtime = _runtime(token, "model")
    found = runtime.objects.find(MODEL, model_id)
    if found is None:
        if payload_key is None:
            raise RuntimeError(f"model {model_id} is not on this replica and no copy was sent: call model.fit, or "
                               "re-create the model in the scope")
        from daskdist.plugins.keras3 import commands

        commands.install_model(runtime, model_id, _payload(runtime, payload_key))
        found = runtime.objects.get(MODEL, model_id)
    return found.model


def _payload(runtime: Any, key: str) -> Any:
    """The scattered payload: from this worker's memory, else (Dask's memory manager dropped the copy) fetched."""
    data = runtime.worker.data
    if key in data:
        return data[key]
    from distributed import Future, get_client

    return Future(key, client=get_client()).result()


def resolve_optimizer(token: str, optimizer_id: str, backend: str, cls: Any, config: dict[str, Any]) -> Any:
    """The replica's copy of an optimizer created in the scope (built from its configuration the first time)."""
    runtime = _runtime(token, "optimizer")
    key = _OPTIMIZER_PREFIX + optimizer_id
    found = runtime.objects.find(MODEL, key)
    if found is None:
        prepare_replica(backend)
        from daskdist.plugins.keras3 import exchange, hooks

        hooks.install()
        optimizer = cls.from_config(config)
        exchange.mark_replica_optimizer(optimizer)
        found = OptimizerResident(optimizer)
        runtime.objects.install(MODEL, key, found)
    return found.optimizer
