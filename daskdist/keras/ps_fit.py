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
  callbacks with batch-level hooks are refused, as in TF (by the trainer's
  ``choose_runner``, for every adapter); ``History`` holds
  each epoch's loss and metrics, computed from every closure's sums;
* ``evaluate`` with a ``DatasetCreator`` needs ``steps`` (at-least-once, as
  TF's default); with arrays or a finite ``Dataset`` it is exact: the data is
  cut into ``pss_evaluation_shards`` shards (a ``compile`` argument; 0 or
  ``"auto"``: 4 per worker; over Dask collections, shards of whole
  partitions), one closure evaluates one shard, and the client
  counts each shard once (TF's exact visitation guarantee);
* ``predict`` runs on the workers: the input cut into runs of batches,
  each a closure with the parameters stored now, the outputs put back in
  order here;
* layers' non-trainable state (``BatchNormalization``'s moving statistics)
  is held on the stores beside the parameters: a closure pulls it and
  assigns its own as it ends, the client's copy takes it after every epoch.

The closures, their scheduling, the evaluation shards and the loss of a
parameter server are the trainer's (``daskdist.training.ps``); this module
is the built-in layers' side: the worker's ``BuiltinPsWorker`` (its hooks)
and the client's install, data and logs.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from daskdist import context
from daskdist.arrays import as_array, namespace, to_numpy
from daskdist.data.dataset_creator import DatasetCreator
from daskdist.keras.trainable import BuiltinTrainable, assign_held_state, held_state, rows_of, split_batch
from daskdist.training import ps

__all__ = ["BuiltinPsWorker", "PsModelRunner", "evaluate", "local_weights", "predict"]

# -- the client ------------------------------------------------------------------------------------


def _coordinator(model: Any) -> Any:
    from daskdist.coordinator.cluster_coordinator import ClusterCoordinator

    return ClusterCoordinator(_strategy(model))


def _strategy(model: Any) -> Any:
    strategy = model._strategy
    if strategy is None:
        raise RuntimeError("the model was not created in a ParameterServerStrategy's scope")
    return strategy


def _params(model: Any) -> list[Any]:
    """The trainable arrays in the model's order (``Model._trainable_arrays``'s, also before any gradient)."""
    return [layer.params[name] for layer in model.layers for name in sorted(layer.params)]


def _install(model: Any) -> Any:
    """Put a worker for ``model`` on every worker (and on workers admitted later); the coordinator."""
    coordinator = _coordinator(model)
    if model._installed:
        return coordinator
    extended = _strategy(model).extended
    extended.check_open()
    declared = model._declared_input_shape()
    if not model.built and declared is not None:
        model.build(declared)
    if model._ps_key is not None and model.built:  # compiled again: go on from the weights trained so far
        stored = model._stored_state()
        if stored is not None:
            for target, value in zip(_params(model), stored["params"]):
                namespace(target).copyto(target, namespace(target).asarray(value, dtype=target.dtype))
        _take_held_state(model)
    # the parameters under a new key: a new compile brings a new optimizer, whose slots start afresh
    model._ps_key = f"{model._model_id}:{uuid.uuid4().hex[:8]}"
    driver = extended.step_driver(model._ps_key)
    if model.built:  # the client's initial weights are the ones kept (the workers' offers come later)
        state = [np.array(to_numpy(a), copy=True) for a in held_state(model)]
        driver.init_stored(_strategy(model).client, [np.array(to_numpy(p), copy=True) for p in _params(model)],
                           model.optimizer, state=state)
    payload = copy.copy(model)
    payload._strategy = None
    payload._installed = False
    payload.history = None
    worker = BuiltinPsWorker(BuiltinTrainable(copy.deepcopy(payload)), driver)
    coordinator.run_on_each_worker(ps.install_worker, lambda _index: (model._model_id, worker))
    model._installed = True
    return coordinator


def _take_held_state(model: Any) -> None:
    """The client's copy takes the state the workers assigned on the stores (if the model has any)."""
    count = len(held_state(model))
    driver = model._holding_driver()
    if count and driver is not None:
        values = driver.stored_held_state(_strategy(model).client, count)
        if values is not None:
            assign_held_state(model, values)


def _per_worker_input(model: Any, x: Any, y: Any, batch_size: int | None, shuffle: bool, repeat: bool) -> Any:
    """What each worker builds its dataset from: a ``DatasetCreator``, a function, a ``Dataset`` or arrays."""
    from daskdist.data.dataset import Dataset

    if isinstance(x, DatasetCreator) or (callable(x) and not isinstance(x, Dataset)):
        if y is not None:
            raise ValueError("y must not be given with a DatasetCreator (its dataset yields (x, y) pairs)")
        return x if isinstance(x, DatasetCreator) else DatasetCreator(x)
    dataset = model._as_dataset(x, y, batch_size, shuffle)
    return dataset.repeat() if repeat and not isinstance(x, Dataset) else dataset


def _closures(model: Any, coordinator: Any) -> ps.ClosureRunner:
    """The trainer's closure runner of ``model``."""
    return ps.ClosureRunner(coordinator, model._model_id, _strategy(model).extended)


def _execution_size(model: Any) -> int:
    return max(1, int(getattr(model, "_steps_per_execution", 1) or 1))


class PsModelRunner:
    """How ``Model.fit``/``evaluate``/``predict`` reach the trainer's closures (``training.ps.ClosureRunner``) when
    the Extended schedules them.

    The runner interface of ``keras.runner``: ``begin_fit``, ``steps``,
    ``begin``, ``run_epoch``, ``validate``, ``evaluate``, ``predict``,
    ``close``, and the computing copies' weights (here: the client's copy;
    the trainable parameters are read from the stores by ``Model.get_weights``).
    """

    def __init__(self, model: Any):
        self.model = model
        self._coordinator: Any = None
        self._iterator: Any = None
        self._validation: Any = None

    def begin_fit(self, x: Any, y: Any, batch_size: int | None, shuffle: bool, validation_data: Any,
                  callbacks: list[Any] | None, steps_per_epoch: int | None) -> None:
        """TF's check (``steps_per_epoch`` required), then the workers' models (batch-level callbacks were refused
        by the trainer's ``choose_runner``)."""
        ps.check_steps_per_epoch(steps_per_epoch, "ParameterServerStrategy")
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

    def run_epoch(self, epoch: int, steps: int | None, cb: Any) -> dict[str, float]:
        """The trainer's closures of one epoch (``training.ps.ClosureRunner.train_epoch``)."""
        assert steps is not None
        model = self.model
        return _closures(model, self._coordinator).train_epoch(
            self._iterator, steps, _execution_size(model), float(model.optimizer.learning_rate),
            lambda results: _epoch_logs(model, results), lambda: _take_held_state(model))

    def validate(self, batch_size: int | None, steps: int | None) -> dict[str, float] | None:
        if self._validation is None:
            return None
        val = self._validation if isinstance(self._validation, (tuple, list)) else (self._validation, None)
        return self.evaluate(val[0], val[1] if len(val) > 1 else None, batch_size, steps)

    def evaluate(self, x: Any, y: Any, batch_size: int | None, steps: int | None) -> dict[str, float]:
        """Exact shards of finite data, else ``steps`` batches of a ``DatasetCreator``'s per-worker datasets."""
        return evaluate(self.model, x, y, batch_size, steps)

    def predict(self, x: Any, batch_size: int | None) -> np.ndarray:
        """The outputs computed on the workers (``predict``)."""
        return predict(self.model, x, batch_size)

    def computed_weights(self) -> list[np.ndarray]:
        """The client's copy (the workers' are asynchronous; the stores hold the trainable parameters)."""
        return local_weights(self.model)

    def set_computed_weights(self, weights: list[np.ndarray]) -> None:
        """The layers' state (moving statistics) the weights carry held on the stores again; the workers pull it,
        and the stored parameters (``Model.set_weights`` set those), at their next closure."""
        driver = self.model._holding_driver()
        state = [np.array(to_numpy(a), copy=True) for a in held_state(self.model)]
        if driver is not None and state:
            driver.set_stored_held_state(_strategy(self.model).client, state)

    def computed_optimizer_state(self) -> dict[str, Any]:
        return dict(self.model.optimizer.get_state())

    def set_computed_optimizer_state(self, state: dict[str, Any]) -> None:
        """Nothing: the update rules run on the stores."""

    def close(self) -> None:
        """Nothing to release (the coordinator is the strategy's)."""


def _epoch_logs(model: Any, results: list[dict[str, Any]]) -> dict[str, float]:
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


def evaluate(model: Any, x: Any, y: Any, batch_size: int | None, steps: int | None) -> dict[str, float]:
    """``Model.evaluate`` under ParameterServerStrategy: exact shards of finite data, else ``steps`` batches."""
    coordinator = _install(model)
    data = _per_worker_input(model, x, y, batch_size, False, False)
    if isinstance(data, DatasetCreator):
        if steps is None:
            raise ValueError("When using a `DatasetCreator` with `ParameterServerStrategy`, `steps` must be "
                             "specified in `Model.evaluate`.")
    elif steps is not None:  # the first ``steps`` batches, each once
        data, steps = data.take(steps), None
    plan = ps.plan_evaluation(coordinator, model._model_id, data, steps, _execution_size(model),
                              model._pss_evaluation_shards)
    return _closures(model, coordinator).evaluate(plan, lambda results: _epoch_logs(model, results))


def predict(model: Any, x: Any, batch_size: int | None) -> np.ndarray:
    """``Model.predict`` under ParameterServerStrategy: runs of batches in closures on the workers, with the
    parameters stored now; the outputs in order."""
    coordinator = _install(model)
    data = model._as_dataset(x, None, batch_size or 32, False, what="predict")
    batches = [split_batch(batch)[0] for batch in data]
    pieces = ps.predict_pieces(batches, ps.evaluation_shards(model._pss_evaluation_shards,
                                                             len(coordinator.live_workers)))
    outputs = _closures(model, coordinator).predict(pieces)
    outputs = [o for o in outputs if o is not None]
    if not outputs:
        return np.empty((0,))
    return np.concatenate([np.asarray(o) for o in outputs])


def local_weights(model: Any) -> list[np.ndarray]:
    """The client's copy of the weights (the trainable ones are then read from the stores: ``Model.get_weights``)."""
    model._require_built()
    return [np.array(to_numpy(a), copy=True) for _, a in model._weight_items()]


# -- the workers -----------------------------------------------------------------------------------


class BuiltinPsWorker(ps.PsWorker):
    """A built-in model on a parameter-server worker: the trainer's ``PsWorker`` with the built-in layers' hooks.

    Its steps run in the worker's replica context (TF's Keras calls
    ``strategy.run`` inside the function it schedules); a closure returns the
    loss sum, the rows and the metrics' totals, which the client adds up.
    """

    def in_replica(self, work: Callable[..., Any], *args: Any) -> Any:
        service = context.current_runtime()
        return service.strategy_view.run(work, args=args)

    def prepare(self, batch: Any) -> None:
        """The model built for the batch's inputs (before the parameters are pulled into it)."""
        x, _ = as_array(split_batch(batch)[0])
        self.trainable.model._ensure_built(x)

    def results(self, loop: str, batch: Any) -> dict[str, Any]:
        trainable = self.trainable
        model = trainable.model
        loss_sum, count = ((trainable.loss_sum, trainable.count) if loop == "train"
                           else (trainable._test_loss, trainable._test_count))
        return {"loss_sum": loss_sum, "count": count,
                "metrics": [np.asarray(m.totals(), np.float64) for m in model.compiled_metrics],
                "input_shape": list(getattr(model, "_input_shape", None) or model._declared_input_shape() or [])}

    def predict_batch(self, batch: Any) -> Any:
        x, _ = as_array(split_batch(batch)[0])
        if not rows_of(x):
            return None
        return to_numpy(self.trainable.model._forward(x, training=False))
