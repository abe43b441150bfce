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
from daskdist.group.service import MODEL
from daskdist.keras import callbacks as callbacks_module
from daskdist.keras import training
from daskdist.keras.dataset_creator import DatasetCreator

if TYPE_CHECKING:
    from daskdist.keras.models import Model

__all__ = ["PsTrainer", "evaluate", "fit", "get_optimizer_state", "get_weights", "set_optimizer_state",
           "set_weights", "uses_coordinator"]

#: Evaluation shards per worker for ``pss_evaluation_shards="auto"`` (or 0).
AUTO_SHARDS_PER_WORKER = 4


def uses_coordinator(strategy: Any) -> bool:
    """Whether ``strategy`` runs Keras steps as coordinator closures (ParameterServerStrategy)."""
    extended = getattr(strategy, "extended", None)
    return bool(getattr(extended, "schedules_closures", False))


# -- the client ------------------------------------------------------------------------------------


def _coordinator(model: Model) -> Any:
    from daskdist.strategy.coordinator import ClusterCoordinator

    return ClusterCoordinator(_strategy(model))


def _strategy(model: Model) -> Any:
    strategy = model._strategy
    if strategy is None:
        raise RuntimeError("the model was not created in a ParameterServerStrategy's scope")
    return strategy


def _stores(model: Model) -> list[Any]:
    return list(_strategy(model).extended.stores)


def _params(model: Model) -> list[Any]:
    """The trainable arrays in the model's order (``Model._trainable_arrays``'s, also before any gradient)."""
    return [layer.params[name] for layer in model.layers for name in sorted(layer.params)]


def _key(model: Model) -> str:
    """The key of the model's parameters on the stores (a new one each time the model is compiled and used)."""
    key = model._ps_key
    if key is None:
        raise RuntimeError("the model's parameters are not on the ps yet: fit or evaluate it first")
    return key


def _layout(count: int, stores: int) -> list[list[int]]:
    """Per store, the indices of the parameters it holds (parameter ``i`` on store ``i % stores``)."""
    return [list(range(s, count, stores)) for s in range(stores)]


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
    _strategy(model).extended.check_open()
    declared = model._declared_input_shape()
    if not model.built and declared is not None:
        model.build(declared)
    _check_model(model)
    stores = _stores(model)
    previous = getattr(model, "_ps_key", None)
    if previous is not None and model.built:  # compiled again: go on from the weights trained so far
        stored = _stored_params(model)
        if stored is not None:
            for target, value in zip(_params(model), stored):
                namespace(target).copyto(target, namespace(target).asarray(value, dtype=target.dtype))
    # the parameters under a new key: a new compile brings a new optimizer, whose slots start afresh
    model._ps_key = f"{model._model_id}:{uuid.uuid4().hex[:8]}"
    if model.built:  # the client's initial weights are the ones kept (the workers' offers come later)
        _init_stores(model, stores)
    payload = copy.copy(model)
    payload._strategy = None
    payload._installed = False
    payload.history = None
    trainer = PsTrainer(copy.deepcopy(payload), stores, _key(model))
    coordinator.run_on_each_worker(_install_trainer, lambda _index: (model._model_id, trainer))
    model._installed = True
    return coordinator


def _init_stores(model: Model, stores: list[Any], params: list[Any] | None = None) -> None:
    client = _strategy(model).client
    if params is None:
        params = [np.array(to_numpy(p), copy=True) for p in _params(model)]
    for store, indices in zip(stores, _layout(len(params), len(stores))):
        if indices:
            store.call_from_client(client, "model_init", model_key=_key(model),
                                   params=[params[i] for i in indices], optimizer=copy.deepcopy(model.optimizer))


def _per_worker_input(model: Model, x: Any, y: Any, batch_size: int | None, shuffle: bool, repeat: bool) -> Any:
    """What each worker builds its dataset from: a ``DatasetCreator``, a function, a ``Dataset`` or arrays."""
    from daskdist.data.dataset import Dataset

    if isinstance(x, DatasetCreator) or (callable(x) and not isinstance(x, Dataset)):
        if y is not None:
            raise ValueError("y must not be given with a DatasetCreator (its dataset yields (x, y) pairs)")
        return x if isinstance(x, DatasetCreator) else DatasetCreator(x)
    dataset = model._as_dataset(x, y, batch_size, shuffle)
    return dataset.repeat() if repeat and not isinstance(x, Dataset) else dataset


def fit(model: Model, x: Any, y: Any, batch_size: int | None, epochs: int, verbose: Any, callbacks: list[Any] | None,
        validation_data: Any, shuffle: bool, initial_epoch: int, steps_per_epoch: int | None,
        validation_steps: int | None) -> Any:
    """``Model.fit`` under ParameterServerStrategy (see the module's notes)."""
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
    coordinator = _install(model)
    per_worker = coordinator.create_per_worker_dataset(_per_worker_input(model, x, y, batch_size, shuffle, True))
    iterator = iter(per_worker)
    spe = max(1, int(getattr(model, "_steps_per_execution", 1) or 1))
    history = callbacks_module.History()
    cb = callbacks_module.CallbackList(list(callbacks or []) + [history], model=model,
                                       verbose=1 if verbose == "auto" else int(verbose),
                                       params={"epochs": epochs, "steps": steps_per_epoch})
    model.stop_training = False
    model.history = history
    cb.on_train_begin()
    for epoch in range(max(initial_epoch, cb.resume_epoch()), epochs):
        cb.on_epoch_begin(epoch)
        lr = float(model.optimizer.learning_rate)
        sizes = [min(spe, steps_per_epoch - start) for start in range(0, steps_per_epoch, spe)]
        values = [coordinator.schedule(_train_closure, args=(model._model_id, iterator, n, lr)) for n in sizes]
        coordinator.join()
        logs = _epoch_logs(model, coordinator.fetch(values))
        if validation_data is not None:
            val = validation_data if isinstance(validation_data, (tuple, list)) else (validation_data, None)
            val_logs = evaluate(model, val[0], val[1] if len(val) > 1 else None, batch_size, validation_steps)
            logs.update({f"val_{k}": v for k, v in val_logs.items()})
        cb.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    cb.on_train_end()
    return history


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


def get_weights(model: Model) -> list[np.ndarray]:
    """The weights, the trainable ones as the ps hold them now (``Model.get_weights``)."""
    model._require_built()
    weights = [np.array(to_numpy(a), copy=True) for _, a in model._weight_items()]
    stored = _stored_params(model)
    if stored is None:
        return weights
    positions = _trainable_positions(model)
    for position, value in zip(positions, stored):
        weights[position] = value
    return weights


def _stored_params(model: Model) -> list[np.ndarray] | None:
    stores, client = _stores(model), _strategy(model).client
    count = len(_params(model))
    params: list[Any] = [None] * count
    for store, indices in zip(stores, _layout(count, len(stores))):
        if not indices:
            continue
        state = store.call_from_client(client, "model_state", model_key=_key(model))
        if state is None:
            return None
        for i, value in zip(indices, state["params"]):
            params[i] = value
    return params


def _trainable_positions(model: Model) -> list[int]:
    """Where each of ``_trainable_arrays()`` sits in ``_weight_items()``."""
    names = [name for name, _ in model._weight_items()]
    positions = []
    for index, layer in enumerate(model.layers):
        for name in sorted(layer.params):
            positions.append(names.index(f"{index}/{name}"))
    return positions


def set_weights(model: Model, weights: list[Any]) -> None:
    """Set the weights on the client and the trainable ones on the ps (workers pull them next)."""
    model._require_built()
    model._assign_weights(list(weights))
    params = [np.array(to_numpy(p), copy=True) for p in _params(model)]
    stores, client = _stores(model), _strategy(model).client
    for store, indices in zip(stores, _layout(len(params), len(stores))):
        if indices and not store.call_from_client(client, "set_model", model_key=_key(model),
                                                  params=[params[i] for i in indices]):
            _init_stores(model, stores, params)
            return


def get_optimizer_state(model: Model) -> dict[str, Any]:
    """The optimizer state gathered from the stores, slots renumbered in the model's parameter order."""
    stores, client = _stores(model), _strategy(model).client
    count = len(_params(model)) if model.built else 0
    state: dict[str, Any] = {}
    for store, indices in zip(stores, _layout(count, len(stores))):
        stored = store.call_from_client(client, "model_state", model_key=_key(model)) if indices else None
        if stored is None:
            continue
        for key, value in stored["optimizer_state"].items():
            slot, _, position = key.rpartition("/")
            if slot:
                state[f"{slot}/{indices[int(position)]}"] = value
            else:
                state.setdefault(key, value)
    return state or model.optimizer.get_state()


def set_optimizer_state(model: Model, state: dict[str, Any]) -> None:
    """Give each store its part of ``state`` (slots renumbered to the store's own order)."""
    model.optimizer.set_state(state)
    stores, client = _stores(model), _strategy(model).client
    count = len(_params(model))
    for store, indices in zip(stores, _layout(count, len(stores))):
        if not indices:
            continue
        local = {j: i for j, i in enumerate(indices)}
        part = {key: value for key, value in state.items() if "/" not in key}
        for j, i in local.items():
            part.update({f"{key.rpartition('/')[0]}/{j}": value for key, value in state.items()
                         if "/" in key and key.rpartition("/")[2] == str(i)})
        store.call_from_client(client, "set_model", model_key=_key(model), optimizer_state=part)


# -- the workers -----------------------------------------------------------------------------------


class PsTrainer:
    """A model on a parameter-server worker: its compute copy, and the stores that hold its parameters.

    Installed as the worker's resident ``(MODEL, model id)``; closures find it
    there. It is the gradient applier ``training._train_step`` calls: each
    step's gradients go to the stores, the optimizer runs there, and the new
    parameters come back into the compute copy.
    """

    def __init__(self, model: Model, stores: list[Any], model_key: str):
        self.model = model
        self.stores = stores
        self.model_key = model_key
        self._versions: list[int] | None = None  # per store, the version of the parameters held here

    def snapshot(self) -> dict[str, Any]:
        return {"weights": [np.array(to_numpy(a), copy=True) for _, a in self.model._weight_items()]}

    def restore(self, state: dict[str, Any]) -> None:
        self.model._assign_weights(state["weights"])

    def _indices(self) -> list[list[int]]:
        return _layout(len(_params(self.model)), len(self.stores))

    def _ready(self, service: Any, x: Any) -> None:
        """Build on the first batch, offer this copy to the stores (the first offer is kept), pull."""
        self.model._ensure_built(x)
        if self._versions is None:
            params = _params(self.model)
            for store, indices in zip(self.stores, self._indices()):
                if indices:
                    store.call_from_replica(service, "model_init", model_key=self.model_key,
                                            params=[to_numpy(params[i]) for i in indices],
                                            optimizer=copy.deepcopy(self.model.optimizer))
            self._versions = [-1] * len(self.stores)
        self.pull(service)

    def pull(self, service: Any) -> None:
        """Copy in the parameters changed on the stores since this worker last saw them."""
        assert self._versions is not None
        params = _params(self.model)
        for s, (store, indices) in enumerate(zip(self.stores, self._indices())):
            if not indices:
                continue
            version, values = store.call_from_replica(service, "model_pull", model_key=self.model_key,
                                                      newer_than=self._versions[s])
            if values is not None:
                _copy_into([params[i] for i in indices], values)
                self._versions[s] = version

    def apply_gradients(self, service: Any, model_key: str, optimizer: Any, params: list[Any], grads: list[Any],
                        stats: Any) -> Any:
        """Push this step's mean gradients to the stores; their optimizers apply them; copy back the result."""
        from daskdist.ps.client import dedupe_key

        assert self._versions is not None
        count = float(to_numpy(stats)[0])
        if count <= 0:
            return stats
        scale = 1.0 / count
        for s, (store, indices) in enumerate(zip(self.stores, self._indices())):
            if not indices:
                continue
            version, values = store.call_from_replica(
                service, "model_push", model_key=self.model_key,
                grads=[to_numpy(grads[i] * grads[i].dtype.type(scale)) for i in indices],
                lr=float(optimizer.learning_rate), dedupe=dedupe_key(service), read_version=self._versions[s])
            _copy_into([params[i] for i in indices], values)
            self._versions[s] = version
        return stats

    def train(self, service: Any, iterator: Any, steps: int, lr: float) -> dict[str, Any]:
        """``steps`` training steps on this worker's iterator; the sums the client makes the epoch's logs of."""
        model = self.model
        model.optimizer.learning_rate = lr
        model.reset_metrics()
        loss_sum = count = 0.0
        for step in range(steps):
            x, y, sample_weight = training.split_batch(next(iterator))
            if self._versions is None:
                self._ready(service, as_array(x)[0])
            elif step == 0:
                self.pull(service)  # once per closure: what the other workers pushed meanwhile
            step_loss, step_count = training._train_step(model, None, x, y, sample_weight, None, self)
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
                if self._versions is None:
                    self._ready(service, x)
                else:
                    self.pull(service)
                pulled = True
            if not training._rows(x):
                continue
            y_pred = model._forward(x, training=False)
            per_example = model.loss.per_example(y, y_pred)
            if sample_weight is not None:
                per_example = per_example * as_array(sample_weight)[0]
            loss_sum += float(namespace(per_example).sum(per_example))
            count += training._rows(x)
            for metric in model.compiled_metrics:
                metric.update_state(y, y_pred, sample_weight)
        return self._sums(loss_sum, count)

    def _sums(self, loss_sum: float, count: float) -> dict[str, Any]:
        model = self.model
        return {"loss_sum": loss_sum, "count": count,
                "metrics": [np.asarray(m.totals(), np.float64) for m in model.compiled_metrics],
                "input_shape": list(getattr(model, "_input_shape", None) or model._declared_input_shape() or [])}


def _copy_into(targets: list[Any], values: list[Any]) -> None:
    for target, value in zip(targets, values):
        namespace(target).copyto(target, namespace(target).asarray(value, dtype=target.dtype))


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
    return trainer.train(service, iterator, steps, lr)


def _evaluate_closure(model_id: str, data: Any, steps: int | None) -> dict[str, Any]:
    """The function each ``evaluate`` closure runs: a per-worker iterator's ``steps`` batches, or one shard."""
    service, trainer = _trainer(model_id)
    return trainer.evaluate(service, data, steps)
