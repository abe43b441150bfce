"""Keras 3 ``fit`` and ``evaluate`` under ``ParameterServerStrategy``: closures driven by the ``PsStepDriver``.

TensorFlow's rules for Keras under its ``ParameterServerStrategy``:
``steps_per_epoch`` is required, the input is a ``DatasetCreator`` (or a
``dataset_fn(input_context)``) each worker builds its own dataset from, and
callbacks run per epoch (batch-level ones are refused). Each worker keeps its
own copy of the model (``KerasPsWorker``, installed by
``ClusterCoordinator.run_on_each_worker`` with the model's ``.keras`` payload
and the step driver); the trainable parameters and the optimizer's slots live
on the parameter servers (parameter ``i`` on store ``i % num_ps``, the update
rule ``update_rule.update_rule`` of the Keras optimizer). A closure runs
``steps_per_execution`` steps: it pulls the parameters changed on the stores,
then per step runs Keras' forward and backward, pushes the gradients (the
stores apply them once) and assigns the new parameters. The epoch's logs are
Keras' metric variables summed over the closures. After every epoch the
client's model takes the stored parameters and slots; ``evaluate`` and
``predict`` run Keras' own loops on the client's copy, which then holds them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from daskdist import context
from daskdist.group.service import MODEL
from daskdist.plugins.keras3 import hooks, registry, update_rule
from daskdist.plugins.keras3.backend import keras_backend, prepare_replica
from daskdist.plugins.keras3.payload import ModelPayload, pack_model, unpack_model
from daskdist.plugins.keras3.resident import KerasTrainable

__all__ = ["KerasPsWorker", "fit", "schedules_closures"]


def schedules_closures(extended: Any) -> bool:
    """Whether the Extended runs steps as coordinator closures (ParameterServerStrategy)."""
    return bool(getattr(extended, "schedules_closures", False))


class KerasPsWorker:
    """A parameter-server worker's copy of a Keras 3 model and the ``PsStepDriver`` that trains it (resident)."""

    def __init__(self, trainable: KerasTrainable, driver: Any):
        self.trainable = trainable
        self.driver = driver

    def snapshot(self) -> dict[str, Any]:
        return self.trainable.snapshot()

    def restore(self, state: dict[str, Any]) -> None:
        self.trainable.restore(state)

    def train(self, iterator: Any, steps: int, learning_rate: float | None) -> dict[str, Any]:
        """``steps`` steps on this worker's iterator: the metric variables over them (the client sums them) and
        one row of the last batch (``sample``: the client builds its compiled metrics with it)."""
        from daskdist.plugins.keras3.resident import batch_rows

        model = self.trainable.model
        if learning_rate is not None:
            model.optimizer.learning_rate = learning_rate
        model.reset_metrics()
        self.driver.begin(self.trainable)
        batch: Any = None
        for _ in range(steps):
            batch = next(iterator)
            self.driver.step(self.trainable, batch, batch_rows(batch))
        return {"metrics": [np.array(np.asarray(v.numpy()), copy=True) for v in model.metrics_variables],
                "sample": None if batch is None else tuple(np.asarray(part)[:1] for part in batch[:2])}


def _install_worker(service: Any, model_id: str, payload: ModelPayload, driver: Any) -> None:
    """Worker command: load the model and keep it with its driver as ``(MODEL, model_id)``."""
    prepare_replica(payload.backend)
    hooks.install()
    with context.enter(context.Frame(strategy=service.strategy_view, replica_context=service.context,
                                     variable_creator=None, owner=service)):
        model = unpack_model(payload)
    service.objects.install(MODEL, model_id, KerasPsWorker(KerasTrainable(model), driver))


def _train_closure(model_id: str, iterator: Any, steps: int, learning_rate: float | None) -> dict[str, Any]:
    service = context.current_runtime()
    if service is None:
        raise RuntimeError("Keras 3 closures run on ParameterServerStrategy workers only")
    worker: KerasPsWorker = service.objects.get(MODEL, model_id)
    return worker.train(iterator, steps, learning_rate)


def _weights(model: Any) -> list[np.ndarray]:
    import keras

    return [np.array(keras.ops.convert_to_numpy(v.value), copy=True) for v in model.trainable_variables]


def _install(model: Any, record: registry.Record, coordinator: Any) -> Any:
    """Hold the client's parameters on the stores and put the model on every worker (once per ``fit``)."""
    extended = record.strategy.extended
    driver = extended.step_driver(f"{record.object_id}:{uuid.uuid4().hex[:8]}")
    rule = update_rule.update_rule(model.optimizer)
    rule.set_state(update_rule.rule_state(model.optimizer, rule))
    driver.init_stored(record.strategy.client, _weights(model), rule)
    payload = pack_model(model, keras_backend())
    coordinator.run_on_each_worker(_install_worker, lambda _index: (record.object_id, payload, driver))
    return driver


def _build_metrics(model: Any, sample: Any) -> None:
    """Build the client's compiled metrics (as the workers' are) from one row, then zero them."""
    if sample is None:
        return
    x, y = sample
    model.compute_metrics(x, y, model(x, training=False))
    model.reset_metrics()


def fit(model: Any, record: registry.Record, x: Any, y: Any, epochs: int, verbose: Any, callbacks: list[Any] | None,
        validation_data: Any, initial_epoch: int, steps_per_epoch: int | None,
        learning_rate: Callable[[], float | None]) -> Any:
    """``model.fit`` under ParameterServerStrategy (see the module)."""
    import keras

    from daskdist.keras.dataset_creator import DatasetCreator
    from daskdist.strategy.coordinator import ClusterCoordinator

    name = type(record.strategy).__name__
    if steps_per_epoch is None:
        raise ValueError(f"`steps_per_epoch` must be specified with `{name}`.")
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
    if y is not None or not (isinstance(x, DatasetCreator) or callable(x)):
        raise ValueError(f"fit under {name} takes a `DatasetCreator` (or a `dataset_fn(input_context)`) as x, "
                         "and no y: each worker builds its own dataset")
    batch_level = [type(cb).__name__ for cb in callbacks or []
                   if any(getattr(type(cb), hook) is not getattr(keras.callbacks.Callback, hook)
                          for hook in ("on_train_batch_begin", "on_train_batch_end"))]
    if batch_level:
        raise ValueError(f"Batch-level `Callback`s are not supported with `{name}`. Found: {batch_level}")
    if validation_data is not None:
        raise NotImplementedError(f"validation_data under {name}: call model.evaluate after fit")
    update_rule.check_optimizer(model.optimizer, name)
    stateful = [w.path for w in model.non_trainable_weights
                if np.dtype(keras.backend.standardize_dtype(w.dtype)).kind == "f"]
    if stateful:
        raise NotImplementedError(f"non-trainable weights ({', '.join(stateful[:4])}: BatchNormalization's moving "
                                  f"statistics, frozen layers) are not held under {name} yet: they would stay on "
                                  "each worker")
    if not model.built:
        raise ValueError(f"model {model.name!r} is not built: give it an Input (its workers build their datasets)")
    record.strategy.extended.check_open()
    coordinator = ClusterCoordinator(record.strategy)
    driver = record.driver = _install(model, record, coordinator)
    creator = x if isinstance(x, DatasetCreator) else DatasetCreator(x)
    per_worker: Any = coordinator.create_per_worker_dataset(creator)
    iterator = iter(per_worker)  # per worker, an iterator over its own dataset
    size = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
    verbose_level = 1 if verbose == "auto" else int(verbose)
    callback_list = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose_level != 0,
                                                 verbose=verbose_level, epochs=epochs, steps=steps_per_epoch,
                                                 model=model)
    model.stop_training = False
    callback_list.on_train_begin()
    logs: dict[str, Any] = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        lr = learning_rate()
        sizes = [min(size, steps_per_epoch - start) for start in range(0, steps_per_epoch, size)]
        values = [coordinator.schedule(_train_closure, args=(record.object_id, iterator, n, lr)) for n in sizes]
        coordinator.join()
        results = coordinator.fetch(values)
        _build_metrics(model, results[0]["sample"])
        totals = [np.sum(parts, axis=0) for parts in zip(*(r["metrics"] for r in results))]
        for variable, total in zip(model.metrics_variables, totals):
            variable.assign(total)
        logs = {k: float(np.asarray(v)) for k, v in model.get_metrics_result().items() if np.asarray(v).size == 1}
        update_rule.take_stored(model, record.strategy.client, driver)
        callback_list.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callback_list.on_train_end(logs)
    return model.history
