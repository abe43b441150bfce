"""Keras ``fit`` and ``evaluate`` under ParameterServerStrategy: every step a closure the coordinator schedules.

TensorFlow's rules (Keras' ``_ClusterCoordinatorDataHandler`` and
``parameter_server_training`` tutorial):

* the model's trainable parameters and their optimizer slots live on the ps:
  parameter ``i`` (in the model's order) goes to store ``i % num_ps``, with a
  copy of the optimizer that keeps that store's slots; the optimizer runs
  there, once per push;
* ``steps_per_epoch`` is required; every ``steps_per_execution`` steps (a
  ``compile`` argument) make one closure, scheduled through the strategy's
  ``ClusterCoordinator`` (made on first use) on whichever worker is free;
  workers are asynchronous;
* one closure: pull the parameters that changed since this worker last saw
  them, then per step take the next batch of this worker's iterator, compute
  the gradient, push it to the stores (each push keyed by (closure id, n):
  applied at most once even when the closure runs again after its worker
  was lost) and copy the updated parameters back;
* callbacks run per epoch (the epoch ends with ``coordinator.join()``);
  callbacks with batch-level hooks are refused, as in TF; ``History`` holds
  each epoch's loss and metrics, computed from every closure's sums;
* ``evaluate`` with a ``DatasetCreator`` needs ``steps`` (at-least-once, as
  TF's default); with arrays or a finite ``Dataset`` it is exact: the data is
  cut into ``pss_evaluation_shards`` shards (a ``compile`` argument; 0 or
  ``"auto"``: 4 per worker; over Dask collections, shards of whole
  partitions), one closure evaluates one shard, and the client
  counts each shard once (TF's exact visitation guarantee);
* ``predict`` raises ``NotImplementedError`` (TF's message).

Layers with non-trainable state (``BatchNormalization``'s moving averages)
are refused: their state would stay on each worker.
"""

from __future__ import annotations

import copy
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist import context
from daskdist.arrays import as_array, namespace, to_numpy
from daskdist.data import ops
from daskdist.data.dataset_creator import DatasetCreator
from daskdist.group.service import MODEL
from daskdist.keras import callbacks as callbacks_module
from daskdist.keras import training
from daskdist.keras.trainable import BuiltinTrainable, rows_of

if TYPE_CHECKING:
    from daskdist.keras.models import Model
    from daskdist.strategy.base import Strategy

__all__ = ["ClosureRunner", "PsTrainer", "evaluate", "local_weights", "uses_coordinator"]

#: Evaluation shards per worker for ``pss_evaluation_shards="auto"`` (or 0).
AUTO_SHARDS_PER_WORKER = 4


def uses_coordinator(strategy: Strategy) -> bool:
    """Whether ``strategy`` runs Keras steps as coordinator closures (ParameterServerStrategy)."""
    return strategy.extended.schedules_closures


# -- the client ------------------------------------------------------------------------------------


def _coordinator(model: Model) -> Any:
    from daskdist.coordinator.cluster_coordinator import ClusterCoordinator

    return ClusterCoordinator(_strategy(model))


def _strategy(model: Model) -> Any:
    strategy = model._strategy
    if strategy is None:
        raise RuntimeError("the model was not created in a ParameterServerStrategy's scope")
    return strategy


def _params(model: Model) -> list[Any]:
    """The trainable arrays in the model's order (``Model._trainable_arrays``'s, also before any gradient)."""
    return [layer.params[name] for layer in model.layers for name in sorted(layer.params)]


def _check_model(model: Model) -> None:
    stateful = [layer.name for layer in model.layers if getattr(layer, "state", None)]
    if stateful:
        raise NotImplementedError(
            f"Layers with non-trainable state ({', '.join(stateful)}) are not supported by fit under "
            "ParameterServerStrategy yet: their state would stay on each worker"
        )


def _install(model: Model) -> Any:
    """Put a trainer for ``model`` on every worker (and on workers admitted later); the coordinator."""
    coordinator = _coordinator(model)
    if model._installed:
        return coordinator
    extended = _strategy(model).extended
    extended.check_open()
    declared = model._declared_input_shape()
    if not model.built and declared is not None:
        model.build(declared)
    _check_model(model)
    if model._ps_key is not None and model.built:  # compiled again: go on from the weights trained so far
        stored = model._stored_state()
        if stored is not None:
            for target, value in zip(_params(model), stored["params"]):
                namespace(target).copyto(target, namespace(target).asarray(value, dtype=target.dtype))
    # the parameters under a new key: a new compile brings a new optimizer, whose slots start afresh
    model._ps_key = f"{model._model_id}:{uuid.uuid4().hex[:8]}"
    driver = extended.step_driver(model._ps_key)
    if model.built:  # the client's initial weights are the ones kept (the workers' offers come later)
        driver.init_stored(_strategy(model).client, [np.array(to_numpy(p), copy=True) for p in _params(model)],
                           model.optimizer)
    payload = copy.copy(model)
    payload._strategy = None
    payload._installed = False
    payload.history = None
    trainer = PsTrainer(copy.deepcopy(payload), driver)
    coordinator.run_on_each_worker(_install_trainer, lambda _index: (model._model_id, trainer))
    model._installed = True
    return coordinator


def _per_worker_input(model: Model, x: Any, y: Any, batch_size: int | None, shuffle: bool, repeat: bool) -> Any:
    """What each worker builds its dataset from: a ``DatasetCreator``, a function, a ``Dataset`` or arrays."""
    from daskdist.data.dataset import Dataset

    if isinstance(x, DatasetCreator) or (callable(x) and not isinstance(x, Dataset)):
        if y is not None:
            raise ValueError("y must not be given with a DatasetCreator (its dataset yields (x, y) pairs)")
        return x if isinstance(x, DatasetCreator) else DatasetCreator(x)
    dataset = model._as_dataset(x, y, batch_size, shuffle)
    return dataset.repeat() if repeat and not isinstance(x, Dataset) else dataset


class ClosureRunner:
    """The runner ``Model.fit``/``evaluate``/``predict`` use when the Extended schedules closures (see the module).

    The same interface as ``keras.models._Runner``: ``begin_fit``, ``steps``,
    ``begin``, ``train_epoch``, ``validate``, ``evaluate``, ``check_predict``,
    ``close``, and the computing copies' weights (here: the client's copy; the
    trainable parameters are read from the stores by ``Model.get_weights``).
    """

    def __init__(self, model: Model):
        self.model = model
        self._coordinator: Any = None
        self._iterator: Any = None
        self._validation: Any = None

    def begin_fit(self, x: Any, y: Any, batch_size: int | None, shuffle: bool, validation_data: Any,
                  callbacks: list[Any] | None, steps_per_epoch: int | None) -> None:
        """TF's checks (``steps_per_epoch`` required, no batch-level callbacks), then the workers' trainers."""
        if steps_per_epoch is None:
            raise ValueError("`steps_per_epoch` must be specified with `ParameterServerStrategy`.")
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        batch_level = [type(cb).__name__ for cb in callbacks or []
                       if any(getattr(type(cb), hook) is not getattr(callbacks_module.Callback, hook)
                              for hook in ("on_train_batch_begin", "on_train_batch_end"))]
        if batch_level:
            raise ValueError(f"Batch-level `Callback`s are not supported with `ParameterServerStrategy`. "
                             f"Found: {batch_level}")
        model = self.model
        self._coordinator = _install(model)
        per_worker = self._coordinator.create_per_worker_dataset(
            _per_worker_input(model, x, y, batch_size, shuffle, True))
        self._iterator = iter(per_worker)
        self._validation = validation_data

    def steps(self) -> int | None:
        return None  # ``steps_per_epoch`` is required

    def begin(self, epoch: int) -> None:
        """Nothing: each closure begins its own run of the step driver."""

    def train_epoch(self, epoch: int, steps: int | None, cb: Any) -> dict[str, float]:
        """``steps`` steps in closures of ``steps_per_execution`` steps on whichever worker is free; joined."""
        assert steps is not None
        model, coordinator = self.model, self._coordinator
        spe = max(1, int(getattr(model, "_steps_per_execution", 1) or 1))
        lr = float(model.optimizer.learning_rate)
        sizes = [min(spe, steps - start) for start in range(0, steps, spe)]
        values = [coordinator.schedule(_train_closure, args=(model._model_id, self._iterator, n, lr)) for n in sizes]
        coordinator.join()
        return _epoch_logs(model, coordinator.fetch(values))

    def validate(self, batch_size: int | None, steps: int | None) -> dict[str, float] | None:
        if self._validation is None:
            return None
        val = self._validation if isinstance(self._validation, (tuple, list)) else (self._validation, None)
        return self.evaluate(val[0], val[1] if len(val) > 1 else None, batch_size, steps)

    def evaluate(self, x: Any, y: Any, batch_size: int | None, steps: int | None) -> dict[str, float]:
        """Exact shards of finite data, else ``steps`` batches of a ``DatasetCreator``'s per-worker datasets."""
        return evaluate(self.model, x, y, batch_size, steps)

    def check_predict(self) -> None:
        raise NotImplementedError("`model.predict` is not yet supported with `ParameterServerStrategy`.")

    def computed_weights(self) -> list[np.ndarray]:
        """The client's copy (the workers' are asynchronous; the stores hold the trainable parameters)."""
        return local_weights(self.model)

    def set_computed_weights(self, weights: list[np.ndarray]) -> None:
        """Nothing: the workers pull the stored parameters at their next closure."""

    def computed_optimizer_state(self) -> dict[str, Any]:
        return dict(self.model.optimizer.get_state())

    def set_computed_optimizer_state(self, state: dict[str, Any]) -> None:
        """Nothing: the update rules run on the stores."""

    def close(self) -> None:
        """Nothing to release (the coordinator is the strategy's)."""


def _epoch_logs(model: Model, results: list[dict[str, Any]]) -> dict[str, float]:
    """Loss and metrics of every closure's sums (each committed closure counted once)."""
    loss = sum(r["loss_sum"] for r in results)
    count = sum(r["count"] for r in results)
    logs = {"loss": float(loss / max(count, 1.0))}
    if not model.built and results:
        model.build(tuple(results[0]["input_shape"]))
    for i, metric in enumerate(model.compiled_metrics):
        metric.set_totals(np.sum([r["metrics"][i] for r in results], axis=0))
        logs[metric.name] = float(metric.result())
    return logs


def evaluate(model: Model, x: Any, y: Any, batch_size: int | None, steps: int | None) -> dict[str, float]:
    """``Model.evaluate`` under ParameterServerStrategy: exact shards of finite data, else ``steps`` batches."""
    coordinator = _install(model)
    data = _per_worker_input(model, x, y, batch_size, False, False)
    spe = max(1, int(getattr(model, "_steps_per_execution", 1) or 1))
    if isinstance(data, DatasetCreator):
        if steps is None:
            raise ValueError("When using a `DatasetCreator` with `ParameterServerStrategy`, `steps` must be "
                             "specified in `Model.evaluate`.")
        iterator = iter(coordinator.create_per_worker_dataset(data))
        sizes = [min(spe, steps - start) for start in range(0, steps, spe)]
        values = [coordinator.schedule(_evaluate_closure, args=(model._model_id, iterator, n)) for n in sizes]
    else:
        shards = _evaluation_shards(model, len(_strategy(model).extended.worker_addresses))
        pieces = _evaluation_pieces(data.take(steps) if steps is not None else data, shards)
        values = [coordinator.schedule(_evaluate_closure, args=(model._model_id, piece, None)) for piece in pieces]
    coordinator.join()
    return _epoch_logs(model, coordinator.fetch(values))


def _evaluation_pieces(data: Any, shards: int) -> list[Any]:
    """The shards of an exact evaluation: whole partitions of Dask collections (each read once), else batches."""
    from daskdist.data.dataset import Dataset
    from daskdist.data.sources import DaskSource

    source = data.source
    if isinstance(source, DaskSource) and not any(isinstance(op, ops.Take) for op in data.transformations):
        count = min(shards, len(source.partitions))
        pieces = []
        for i in range(count):
            part = copy.copy(source)
            part.partitions = source.partitions[i::count]
            pieces.append(Dataset(part, data.transformations))
        return pieces
    return [data.shard(shards, i) for i in range(shards)]


def _evaluation_shards(model: Model, workers: int) -> int:
    shards = getattr(model, "_pss_evaluation_shards", 0)
    if shards in (0, "auto", None):
        return AUTO_SHARDS_PER_WORKER * max(workers, 1)
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 0:
        raise ValueError(f"pss_evaluation_shards must be a non-negative int or 'auto', got {shards!r}")
    return shards


def local_weights(model: Model) -> list[np.ndarray]:
    """The client's copy of the weights (the trainable ones are then read from the stores: ``Model.get_weights``)."""
    model._require_built()
    return [np.array(to_numpy(a), copy=True) for _, a in model._weight_items()]


# -- the workers -----------------------------------------------------------------------------------


class PsTrainer:
    """A model on a parameter-server worker: its ``BuiltinTrainable`` and the ``PsStepDriver`` that trains it.

    Installed as the worker's resident ``(MODEL, model id)``; closures find it
    there. Each closure begins a run of the driver (its first step pulls the
    parameters changed on the stores), each step's gradients go to the
    stores, their update rules run there, and the new parameters come back.
    """

    def __init__(self, model: Model, driver: Any):
        self.model = model
        self.trainable = BuiltinTrainable(model)
        self.driver = driver

    def snapshot(self) -> dict[str, Any]:
        return {"weights": [np.array(to_numpy(a), copy=True) for _, a in self.model._weight_items()]}

    def restore(self, state: dict[str, Any]) -> None:
        self.model._assign_weights(state["weights"])

    def train(self, service: Any, iterator: Any, steps: int, lr: float) -> dict[str, Any]:
        """``steps`` training steps on this worker's iterator; the sums the client makes the epoch's logs of."""
        model = self.model
        model.optimizer.learning_rate = lr
        model.reset_metrics()
        loss_sum = count = 0.0
        self.driver.begin(self.trainable)
        for _ in range(steps):
            x, y, sample_weight = training.split_batch(next(iterator))
            step_loss, step_count = training.train_step(self.trainable, self.driver, x, y, sample_weight)
            loss_sum += step_loss
            count += step_count
        return self._sums(loss_sum, count)

    def evaluate(self, service: Any, batches: Any, steps: int | None) -> dict[str, Any]:
        """Loss and metric sums over ``steps`` batches (``None``: all) with the parameters pulled now."""
        model = self.model
        model.reset_metrics()
        loss_sum = count = 0.0
        iterator = iter(batches)
        pulled = False
        step = 0
        while steps is None or step < steps:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            step += 1
            x, y, sample_weight = training.split_batch(batch)
            x, _ = as_array(x)
            y, _ = as_array(y)
            if not pulled:
                model._ensure_built(x)
                self.driver.begin(self.trainable)
                self.driver.pull(self.trainable)
                pulled = True
            if not rows_of(x):
                continue
            y_pred = model._forward(x, training=False)
            per_example = model.loss.per_example(y, y_pred)
            if sample_weight is not None:
                per_example = per_example * as_array(sample_weight)[0]
            loss_sum += float(namespace(per_example).sum(per_example))
            count += rows_of(x)
            for metric in model.compiled_metrics:
                metric.update_state(y, y_pred, sample_weight)
        return self._sums(loss_sum, count)

    def _sums(self, loss_sum: float, count: float) -> dict[str, Any]:
        model = self.model
        return {"loss_sum": loss_sum, "count": count,
                "metrics": [np.asarray(m.totals(), np.float64) for m in model.compiled_metrics],
                "input_shape": list(getattr(model, "_input_shape", None) or model._declared_input_shape() or [])}


def _install_trainer(service: Any, model_id: str, trainer: PsTrainer) -> None:
    """Worker command: keep a trainer for the model (a fresh copy; built and initialised on first use)."""
    service.objects.install(MODEL, model_id, copy.deepcopy(trainer))


def _trainer(model_id: str) -> tuple[Any, PsTrainer]:
    service = context.current_runtime()
    if service is None:
        raise RuntimeError("Keras closures run on ParameterServerStrategy workers only")
    trainer: PsTrainer = service.objects.get(MODEL, model_id)
    return service, trainer


def _train_closure(model_id: str, iterator: Any, steps: int, lr: float) -> dict[str, Any]:
    """The function each ``fit`` closure runs: ``steps`` steps on this worker's iterator."""
    service, trainer = _trainer(model_id)
    # a scheduled function runs in cross-replica context; the steps run in the worker's replica (TF's
    # Keras calls strategy.run inside the function it schedules)
    return service.strategy_view.run(trainer.train, args=(service, iterator, steps, lr))


def _evaluate_closure(model_id: str, data: Any, steps: int | None) -> dict[str, Any]:
    """The function each ``evaluate`` closure runs: a per-worker iterator's ``steps`` batches, or one shard."""
    service, trainer = _trainer(model_id)
    return service.strategy_view.run(trainer.evaluate, args=(service, data, steps))
