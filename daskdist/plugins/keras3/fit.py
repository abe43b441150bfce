"""``compile``, ``fit``, ``evaluate``, ``predict`` and saving of a Keras 3 model created in a strategy's scope.

The client keeps the user's model; the replicas each hold a copy
(``KerasTrainable``), installed from Keras' own ``.keras`` file on first use
and again whenever the client's copy changed (compile, ``set_weights``,
``load_weights``). ``fit`` sends one command per epoch: each replica trains
over its share of every global batch with the strategy's step driver
(``extended.step_driver()``), and returns the epoch's global logs; replica 0
also returns its weights and optimizer state, which the client's model takes,
so Keras callbacks (``ModelCheckpoint``, ``TensorBoard``, ``EarlyStopping``,
``LearningRateScheduler``, a user's own) run on the client with the global
logs and the current weights, and ``model.save`` writes a plain ``.keras``
file. ``predict`` runs Keras' own ``predict`` on the client's (current) copy.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from daskdist.plugins.keras3 import commands, registry
from daskdist.plugins.keras3.backend import check_backend, check_model, keras_backend
from daskdist.plugins.keras3.payload import pack_model

__all__ = [
    "OutsideScopeError",
    "compile",
    "created",
    "created_optimizer",
    "evaluate",
    "fingerprint",
    "fit",
    "get_weights",
    "predict",
    "reference",
    "save",
    "save_weights",
]

logger = logging.getLogger(__name__)


class OutsideScopeError(ValueError):
    """A Keras object created outside a strategy's scope is compiled or trained inside it (TF refuses it too)."""


# -- creation -------------------------------------------------------------------------


def created(model: Any) -> None:
    """Called at the end of every Keras model's ``__init__``: record models created in a client scope."""
    strategy = registry.current_client_strategy()
    if strategy is None or registry.lookup(model) is not None:
        return
    check_backend(keras_backend())
    _check_driver(strategy)
    registry.register(model, strategy)


def _check_driver(strategy: Any) -> None:
    """Refuse strategies whose step driver this adapter cannot use yet (it has no ``assign``/``update_rule``)."""
    from daskdist.strategy.training_contract import SpmdStepDriver

    if not isinstance(strategy.extended.step_driver(), SpmdStepDriver):
        raise NotImplementedError(
            f"{type(strategy).__name__} cannot train framework models (Keras 3) yet: use MirroredStrategy, "
            "OneDeviceStrategy or MultiWorkerMirroredStrategy, or the built-in layers (daskdist.keras)")


def created_optimizer(optimizer: Any) -> None:
    strategy = registry.current_client_strategy()
    if strategy is not None and registry.lookup(optimizer) is None:
        registry.register(optimizer, strategy)


def _distributed(model: Any, api: str) -> registry.Record | None:
    """The model's record if it runs on replicas; ``None`` for a plain model; refuse scope mismatches."""
    record = registry.lookup(model)
    scope = registry.current_client_strategy()
    if record is None:
        if scope is not None:
            raise OutsideScopeError(
                f"`{api}` of model {model.name!r} inside {type(scope).__name__}.scope(), but the model was created "
                "outside it. Create the model (and compile it) inside the scope: `with strategy.scope(): model = "
                "...; model.compile(...)`")
        return None
    if scope is not None and scope is not record.strategy:
        raise OutsideScopeError(
            f"`{api}` of model {model.name!r} inside the scope of another strategy than the one it was created in")
    record.strategy.extended.check_open()
    return record


# -- the replicas' copy ------------------------------------------------------------------


def fingerprint(model: Any) -> str:
    """What the replicas must hold: the compile settings and every weight and optimizer variable."""
    import keras

    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((id(_optimizer(model)), model.compiled, model.get_compile_config()
                        if model.compiled else None)).encode())
    variables = list(model.variables) + (list(_optimizer(model).variables) if _optimizer(model) is not None else [])
    for variable in variables:
        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(variable.value)).tobytes())
    return digest.hexdigest()


def _ensure_built(model: Any, sample: Any) -> None:
    """Build the model on the client (one row of ``sample``) so every replica loads the same initial weights."""
    if model.built and all(getattr(layer, "built", True) for layer in model.layers):
        return
    if sample is None:
        raise ValueError(f"model {model.name!r} is not built and no input shows its shape: give it an Input")
    model(sample, training=False)


def ensure_installed(model: Any, record: registry.Record) -> None:
    """Install (or re-install) the model on every replica when the client's copy changed."""
    check_model(model)
    current = fingerprint(model)
    if current == record.fingerprint:
        return
    extended = record.strategy.extended
    payload = pack_model(model, keras_backend())
    extended.run_on_replicas(commands.install_model, (record.object_id, payload))
    extended.run_on_replicas(commands.check_same_weights, (record.object_id,))
    record.fingerprint = current
    record.dirty = False


def _take_state(model: Any, state: dict[str, list[np.ndarray]]) -> None:
    """Give the client's model the weights and optimizer state of replica 0."""
    for variable, value in zip(model.variables, state["variables"]):
        variable.assign(value)
    optimizer = _optimizer(model)
    if optimizer is not None and state["optimizer"]:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        for variable, value in zip(optimizer.variables, state["optimizer"]):
            variable.assign(value)


def _pull(model: Any, record: registry.Record) -> None:
    """After a custom loop (``strategy.run``) changed the replicas' copy: take replica 0's state."""
    if not record.dirty or record.fingerprint is None:
        return
    state = record.strategy.extended.run_on_replica(0, commands.model_state, (record.object_id,))
    _take_state(model, state)
    record.fingerprint = fingerprint(model)
    record.dirty = False


# -- input -------------------------------------------------------------------------------


def _as_dataset(record: registry.Record, x: Any, y: Any, batch_size: int | None, shuffle: bool) -> tuple[Any, Any]:
    """The data as a batched ``daskdist.data.Dataset`` and one input row (to build the model)."""
    from daskdist.data.dataset import Dataset

    if x is None:
        raise ValueError("no data given (x is None)")
    if isinstance(x, Dataset):
        if y is not None:
            raise ValueError("y must not be given when x is a Dataset (it yields (x, y) pairs)")
        return x, None
    if hasattr(x, "__dask_graph__"):
        structure = x if y is None else (x, y)
        dataset = Dataset.from_dask(structure)
        sample = np.asarray(x[:1].compute())
    else:
        x_array = np.asarray(x)
        if y is not None and len(np.asarray(y)) != len(x_array):
            raise ValueError(f"x and y have different lengths ({len(x_array)} and {len(np.asarray(y))})")
        dataset = Dataset.from_tensor_slices(x_array if y is None else (x_array, np.asarray(y)))
        sample = x_array[:1]
        if shuffle:
            dataset = dataset.shuffle(len(x_array))
    return dataset.batch(batch_size or 32), sample


def _dataset_sample(record: registry.Record, dataset: Any) -> Any:
    """One input row of zeros shaped as the dataset's elements (to build an unbuilt model)."""
    spec = dataset.element_spec_with(record.strategy.client)
    first = spec[0] if isinstance(spec, (tuple, list)) else spec
    shape = tuple(1 if d is None else int(d) for d in getattr(first, "shape", ()))
    return np.zeros(shape, dtype=np.dtype(getattr(first, "dtype", "float32")))


def _distribute(record: registry.Record, x: Any, y: Any, batch_size: int | None, shuffle: bool,
                model: Any) -> Any:
    dataset, sample = _as_dataset(record, x, y, batch_size, shuffle)
    if not model.built or sample is None:
        _ensure_built(model, sample if sample is not None else _dataset_sample(record, dataset))
    return record.strategy.experimental_distribute_dataset(dataset)


def _learning_rate(model: Any) -> float | None:
    """The client's learning rate (``LearningRateScheduler`` sets it), or ``None`` for a schedule."""
    optimizer = _optimizer(model)
    if optimizer is None or isinstance(optimizer.get_config().get("learning_rate"), dict):
        return None
    return float(np.asarray(optimizer.learning_rate))


# -- the wrapped methods -------------------------------------------------------------------


def compile(original: Callable[..., Any], model: Any, *args: Any, **kwargs: Any) -> Any:
    _distributed(model, "compile")
    return original(model, *args, **kwargs)


def fit(original: Callable[..., Any], model: Any, x: Any = None, y: Any = None, batch_size: int | None = None,
        epochs: int = 1, verbose: Any = "auto", callbacks: list[Any] | None = None, validation_split: float = 0.0,
        validation_data: Any = None, shuffle: bool = True, class_weight: Any = None, sample_weight: Any = None,
        initial_epoch: int = 0, steps_per_epoch: int | None = None, validation_steps: int | None = None,
        validation_batch_size: int | None = None, validation_freq: int = 1) -> Any:
    """Keras' ``fit``; on the strategy's replicas for a model created in its scope."""
    record = _distributed(model, "fit")
    if record is None:
        return original(model, x, y, batch_size, epochs, verbose, callbacks, validation_split, validation_data,
                        shuffle, class_weight, sample_weight, initial_epoch, steps_per_epoch, validation_steps,
                        validation_batch_size, validation_freq)
    import keras

    if not model.compiled:
        raise ValueError("You must call `compile()` before using the model (`model.compile(optimizer, loss)`).")
    unsupported = {"validation_split": validation_split != 0.0, "class_weight": class_weight is not None,
                   "sample_weight": sample_weight is not None, "validation_freq": validation_freq != 1}
    if any(unsupported.values()):
        raise NotImplementedError(f"fit under a daskdist strategy does not take {[k for k, v in unsupported.items() if v]}"
                                  " yet: put the weights in the dataset's (x, y, weight) elements, split it yourself")
    extended = record.strategy.extended
    if getattr(extended, "elastic", None) is not None:
        raise NotImplementedError("elastic training (dd.ElasticOptions) of Keras 3 models is not supported yet: "
                                  "use a strategy without elastic options, or the built-in layers (daskdist.keras)")
    driver = extended.step_driver()
    train = _distribute(record, x, y, batch_size, shuffle, model)
    val = None
    if validation_data is not None:
        vx, vy = (validation_data[0], validation_data[1]) if isinstance(validation_data, tuple) else (
            validation_data, None)
        val = _distribute(record, vx, vy, validation_batch_size or batch_size, False, model)
    _pull(model, record)
    ensure_installed(model, record)
    steps = steps_per_epoch
    if steps is None:
        planned = [s for s in train.plan().steps_per_replica() if s is not None]
        steps = max(planned) if planned else None
    verbose_level = 1 if verbose == "auto" else int(verbose)
    callback_list = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose_level != 0, verbose=verbose_level, epochs=epochs,
        steps=steps, model=model)
    model.stop_training = False
    callback_list.on_train_begin()
    logs: dict[str, Any] = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        results = extended.run_on_replicas(
            commands.train_epoch,
            (record.object_id, train, steps_per_epoch, driver, _learning_rate(model)))
        logs = dict(results[0]["logs"])
        _take_state(model, results[0]["state"])
        record.fingerprint = fingerprint(model)
        if val is not None:
            val_logs = extended.run_on_replicas(commands.evaluate, (record.object_id, val, validation_steps))[0]
            logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callback_list.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callback_list.on_train_end(logs)
    return model.history


def evaluate(original: Callable[..., Any], model: Any, x: Any = None, y: Any = None, batch_size: int | None = None,
             verbose: Any = "auto", sample_weight: Any = None, steps: int | None = None, callbacks: Any = None,
             return_dict: bool = False, **kwargs: Any) -> Any:
    """Keras' ``evaluate``; on the replicas (each over its share, metrics summed) for a distributed model."""
    record = _distributed(model, "evaluate")
    if record is None:
        return original(model, x, y, batch_size, verbose, sample_weight, steps, callbacks, return_dict, **kwargs)
    if sample_weight is not None:
        raise NotImplementedError("evaluate under a daskdist strategy takes sample weights in the dataset's elements")
    data = _distribute(record, x, y, batch_size, False, model)
    _pull(model, record)
    ensure_installed(model, record)
    logs: dict[str, float] = record.strategy.extended.run_on_replicas(
        commands.evaluate, (record.object_id, data, steps))[0]
    if return_dict:
        return logs
    values = [logs[name] for name in logs]
    return values[0] if len(values) == 1 else values


def predict(original: Callable[..., Any], model: Any, x: Any, batch_size: int | None = None, verbose: Any = "auto",
            steps: int | None = None, callbacks: Any = None) -> Any:
    """Keras' ``predict`` on the client's copy (the replicas' current weights); Dask collections are read in order."""
    record = _distributed(model, "predict")
    if record is not None:
        _pull(model, record)
        from daskdist.data.dataset import Dataset

        if isinstance(x, Dataset):
            from daskdist.plugins.keras3.resident import batch_rows

            outputs = [np.asarray(model.predict_on_batch(b[0] if isinstance(b, (tuple, list)) else b))
                       for b in iter(x) if batch_rows(b)]
            return np.concatenate(outputs) if outputs else np.empty((0,))
        if hasattr(x, "__dask_graph__"):
            x = np.asarray(x.compute())
    return original(model, x, batch_size, verbose, steps, callbacks)


def get_weights(original: Callable[..., Any], model: Any) -> Any:
    record = registry.lookup(model)
    if record is not None and registry.is_open(record):
        _pull(model, record)
    return original(model)


def save(original: Callable[..., Any], model: Any, *args: Any, **kwargs: Any) -> Any:
    record = registry.lookup(model)
    if record is not None and registry.is_open(record):
        _pull(model, record)
    return original(model, *args, **kwargs)


save_weights = save


# -- references inside strategy.run -------------------------------------------------------


def reference(obj: Any) -> Any:
    """``__reduce_ex__`` of a recorded model or optimizer: a reference to the replica's copy, or ``None``."""
    record = registry.lookup(obj)
    if record is None or not registry.is_open(record):
        return None
    from daskdist.plugins.keras3 import references

    return references.reduce(obj, record)


def _optimizer(model: Any) -> Any:
    """The model's optimizer, or ``None`` before ``compile`` (Keras sets the attribute in ``compile``)."""
    return getattr(model, "optimizer", None)
