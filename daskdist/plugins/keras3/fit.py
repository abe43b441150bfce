"""``compile``, ``fit``, ``evaluate``, ``predict`` and saving of a Keras 3 model created in a strategy's scope.

The client keeps the user's model; the replicas each hold a copy
(``KerasTrainable``), installed from Keras' own ``.keras`` file on first use
and again whenever the client's copy changed (compile, ``set_weights``,
``load_weights``). ``fit`` runs on the runner the trainer chooses
(``daskdist.training.runner_choice.choose_runner``, the built-in layers'
choice too): one command per epoch (per ``steps_per_execution`` steps when a
callback has per-batch hooks: ``loops.py``; epochs in committed steps on an
elastic strategy: ``elastic.py``; coordinator closures under
ParameterServerStrategy: ``ps.py``): each replica trains over its share of every global batch
with the strategy's step driver (``extended.step_driver()``), and returns the
epoch's global logs; replica 0
also returns its weights and optimizer state, which the client's model takes,
so Keras callbacks (``ModelCheckpoint``, ``TensorBoard``, ``EarlyStopping``,
``LearningRateScheduler``, a user's own) run on the client with the global
logs and the current weights, and ``model.save`` writes a plain ``.keras``
file. ``predict`` runs Keras' own ``predict`` on the client's (current) copy.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import optree

from daskdist.exceptions import OutsideScopeError
from daskdist.plugins.keras3 import commands, loops, registry, update_rule
from daskdist.plugins.keras3.backend import check_backend, check_model, keras_backend
from daskdist.plugins.keras3.fit_semantics import (
    finalize_optimizer,
    one_step_per_execution,
    refuse_ps_weights,
    refuse_weighted_mean_reduction,
    resumed_epoch,
    should_evaluate,
    weighted_inputs,
)
from daskdist.plugins.keras3.payload import pack_model
from daskdist.plugins.keras3.resident import fingerprint
from daskdist.strategy.drivers.contract import ParameterHoldingDriver
from daskdist.training.commands import model_state
from daskdist.training.fit import EpochRunner, run_epochs
from daskdist.training.runner_choice import RunnerKind, choose_runner
from daskdist.training.runners import ReplicaRunner, planned_steps

__all__ = [
    "OutsideScopeError",
    "compile",
    "created",
    "created_optimizer",
    "evaluate",
    "fingerprint",
    "fit",
    "predict",
    "reference",
    "save",
    "save_weights",
]

logger = logging.getLogger(__name__)


# -- creation -------------------------------------------------------------------------


def created(model: Any) -> None:
    """Called at the end of every Keras model's ``__init__``: record models created in a client scope."""
    strategy = registry.current_client_strategy()
    if strategy is None or registry.lookup(model) is not None:
        return
    check_backend(keras_backend())
    registry.register(model, strategy)
    # this model's get_weights takes the replicas' weights first (bound on it alone: Keras' Layer.get_weights,
    # which every layer shares, stays Keras' own)
    vars(model)["get_weights"] = types.MethodType(_recorded_get_weights, model)
    from daskdist.plugins.keras3 import ps, references

    if ps.schedules_closures(strategy.extended):
        # each worker gets its copy when fit installs it (ClusterCoordinator.run_on_each_worker), or before a
        # function that may use it is scheduled (a custom loop)
        strategy.extended.provide_residents("keras3", functools.partial(ps.place_models, strategy))
        return
    # before strategy.run ships a function, the built models created in this scope go to the replicas
    strategy.extended.provide_residents(
        "keras3", functools.partial(references.place_models, strategy.extended, ensure_installed))


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
    held = isinstance(extended.step_driver(record.object_id), ParameterHoldingDriver)  # no slots on the replicas
    extended.run_on_replicas(commands.install_model, (record.object_id, payload, held))
    extended.run_on_replicas(commands.check_same_weights, (record.object_id,))
    record.fingerprint = current
    record.dirty = False


def _take_state(model: Any, state: dict[str, Any]) -> None:
    """Give the client's model the weights, optimizer state and random states of replica 0."""
    from daskdist.plugins.keras3.resident import assign_state

    assign_state(model, state)


def _give_stored(model: Any, record: registry.Record, driver: Any) -> None:
    """The client's weights and optimizer state replace the held copy, or are held first (``init_stored``)."""
    import keras

    variables = list(model.trainable_variables)
    rule = update_rule.update_rule(_optimizer(model))
    params = [np.array(keras.ops.convert_to_numpy(v.value), copy=True) for v in variables]
    rule.set_state(update_rule.rule_state(_optimizer(model), rule))
    if not driver.set_stored(record.strategy.client, len(variables), params=params, rule_state=rule.get_state()):
        driver.init_stored(record.strategy.client, params, rule)  # the replicas' optimizers hold no slots


def _pull(model: Any, record: registry.Record) -> None:
    """After a custom loop (``strategy.run``) changed the replicas' copy: take replica 0's state."""
    if not record.dirty or record.fingerprint is None:
        return
    if choose_runner(record.strategy, training=False).kind is RunnerKind.CLOSURES:  # the stores hold the state
        from daskdist.plugins.keras3 import ps

        ps.take_loop_state(model, record)
        return
    state = record.strategy.extended.run_on_replica(0, model_state, (record.object_id,))
    _take_state(model, state)
    driver = record.strategy.extended.step_driver(record.object_id)
    if isinstance(driver, ParameterHoldingDriver):  # a held copy (an earlier fit's) follows the loop's weights
        import keras

        variables = list(model.trainable_variables)
        driver.set_stored(record.strategy.client, len(variables),
                          params=[np.array(keras.ops.convert_to_numpy(v.value), copy=True) for v in variables])
    record.fingerprint = fingerprint(model)
    record.dirty = False


# -- input -------------------------------------------------------------------------------


def _as_dataset(record: registry.Record, x: Any, y: Any, batch_size: int | None, shuffle: bool,
                sample_weight: Any = None) -> tuple[Any, Any]:
    """The data as a batched ``daskdist.data.Dataset`` and one input row (to build the model).

    ``x`` (and ``y``) may be arrays or any structure of them Keras' own ``fit`` takes: a dict of named inputs,
    a list or tuple of inputs, nested; numpy (or array-likes) or Dask arrays. ``sample_weight`` (one per row,
    or ``None``) becomes the third part of the elements.
    """
    from daskdist.data.dataset import Dataset

    if x is None:
        raise ValueError("no data given (x is None)")
    if isinstance(x, Dataset):
        if y is not None:
            raise ValueError("y must not be given when x is a Dataset (it yields (x, y) pairs)")
        return x, None
    x, y = _as_arrays(x), None if y is None else _as_arrays(y)
    structure: Any = x if y is None else (x, y) if sample_weight is None else (x, y, _as_arrays(sample_weight))
    leaves: list[Any] = optree.tree_leaves(structure)
    if any(hasattr(leaf, "__dask_graph__") for leaf in leaves):
        import dask.array as da

        structure = optree.tree_map(lambda a: a if hasattr(a, "__dask_graph__")
                                    else da.from_array(a),  # type: ignore[no-untyped-call]  # dask leaves it untyped
                                    structure)
        dataset = Dataset.from_dask(structure)
        sample = optree.tree_map(lambda a: np.asarray(a[:1].compute() if hasattr(a, "__dask_graph__") else a[:1]), x)
    else:
        lengths = {len(leaf) for leaf in leaves}
        if len(lengths) > 1:
            raise ValueError("x and y have different lengths: every array of x (and y) must have the same number "
                             f"of rows, got {optree.tree_map(len, structure)}")
        dataset = Dataset.from_tensor_slices(structure)
        sample = optree.tree_map(lambda a: a[:1], x)
        if shuffle and lengths:
            dataset = dataset.shuffle(lengths.pop())
    return dataset.batch(batch_size or 32), sample


def _as_arrays(data: Any) -> Any:
    """``data`` as Keras' ``fit`` reads it: an array, or a structure (dict, list, tuple, nested) of arrays.

    Dask arrays stay Dask arrays; anything else becomes numpy. A list (or tuple) of numbers is one array.
    """
    def array(leaf: Any) -> Any:
        return leaf if hasattr(leaf, "__dask_graph__") else np.asarray(leaf)

    if isinstance(data, (dict, list, tuple)):
        tree: Any = data
        leaves: list[Any] = optree.tree_leaves(tree)
        if leaves and all(np.ndim(leaf) == 0 and not hasattr(leaf, "__dask_graph__") for leaf in leaves):
            return np.asarray(data)  # rows of numbers written as lists
        # lists become tuples: a dataset's element takes a list for one array (Keras reads both as inputs)
        return _tuples(optree.tree_map(array, tree))
    return array(data)


def _tuples(data: Any) -> Any:
    """``data`` with every list a tuple."""
    if isinstance(data, dict):
        return {key: _tuples(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)) and not hasattr(data, "_fields"):
        return tuple(_tuples(value) for value in data)
    return data


def _dataset_sample(record: registry.Record, dataset: Any) -> Any:
    """One input row of zeros shaped as the dataset's elements (to build an unbuilt model)."""
    spec = dataset.element_spec_with(record.strategy.client)
    first = spec[0] if isinstance(spec, (tuple, list)) else spec

    def zeros(leaf: Any) -> np.ndarray:
        shape = tuple(1 if d is None else int(d) for d in getattr(leaf, "shape", ()))
        return np.zeros(shape, dtype=np.dtype(getattr(leaf, "dtype", "float32")))

    return optree.tree_map(zeros, first)


def _distribute(record: registry.Record, x: Any, y: Any, batch_size: int | None, shuffle: bool,
                model: Any, sample_weight: Any = None) -> Any:
    dataset, sample = _as_dataset(record, x, y, batch_size, shuffle, sample_weight)
    if not model.built or sample is None:
        _ensure_built(model, sample if sample is not None else _dataset_sample(record, dataset))
    return record.strategy.experimental_distribute_dataset(dataset)


def _learning_rate(model: Any) -> float | None:
    """The client's learning rate (``LearningRateScheduler`` sets it), or ``None`` for a schedule."""
    optimizer = _optimizer(model)
    return None if optimizer is None else update_rule.learning_rate(optimizer)


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
    choice = choose_runner(record.strategy, loops.hooked(callbacks))  # the trainer's, as the built-in layers'
    if choice.kind is RunnerKind.CLOSURES:
        from daskdist.plugins.keras3 import ps

        _pull(model, record)  # a custom loop's closures trained it: fit goes on from the stored state
        refuse_ps_weights(validation_split, sample_weight)
        return ps.fit(model, record, x, y, epochs, verbose, callbacks, validation_data, initial_epoch,
                      steps_per_epoch, lambda: _learning_rate(model), validation_steps, validation_batch_size,
                      validation_freq, class_weight)
    inputs = weighted_inputs(record.strategy.client, x, y, sample_weight, class_weight, validation_split,
                             validation_data)
    x, y, sample_weight, validation_data = inputs.x, inputs.y, inputs.sample_weight, inputs.validation_data
    extended = record.strategy.extended
    refuse_weighted_mean_reduction(model, extended.num_replicas, inputs, record.strategy.client)
    options = choice.elastic
    driver = extended.step_driver(record.object_id)  # a stable key: the held parameters of this model
    holding = isinstance(driver, ParameterHoldingDriver)
    if holding:
        update_rule.check_optimizer(_optimizer(model), type(record.strategy).__name__)
    elastic = None
    train = None  # an elastic fit plans each epoch's batches over the members of the moment
    if options is None:
        train = _distribute(record, x, y, batch_size, shuffle, model, sample_weight)
    else:
        from daskdist.plugins.keras3.elastic import KerasElasticFit

        dataset, sample = _as_dataset(record, x, y, batch_size, shuffle, sample_weight)
        if not model.built or sample is None:
            _ensure_built(model, sample if sample is not None else _dataset_sample(record, dataset))
        elastic = KerasElasticFit(model, record, dataset, options)
    planned_val: dict[int, Any] = {}

    def val_data() -> Any:
        """The validation data distributed over the current members (planned again after a change)."""
        generation = elastic.generation if elastic is not None else 0
        if generation not in planned_val:
            vx, vy, vw = (*validation_data, None)[:3] if isinstance(validation_data, tuple) else (
                validation_data, None, None)
            planned_val.clear()
            planned_val[generation] = _distribute(record, vx, vy, validation_batch_size or batch_size, False, model,
                                                  vw)
        return planned_val[generation]

    def prepare() -> None:
        """The model on the replicas (if it changed), the validation data distributed over them."""
        _pull(model, record)
        installed = record.fingerprint
        ensure_installed(model, record)
        if holding and record.fingerprint != installed:
            _give_stored(model, record, driver)
        if validation_data is not None:
            planned_val.clear()  # planned again over the members left (a loss while installing)
            val_data()

    if elastic is None:
        prepare()
    else:  # a loss while installing: the group re-formed on the members left, the model installed there again
        elastic.prepare(prepare)
    steps = steps_per_epoch
    if steps is None and elastic is not None:
        steps = elastic.input.steps_from(0, extended.num_replicas)
    elif steps is None:
        steps = planned_steps(train)
    verbose_level = 1 if verbose == "auto" else int(verbose)
    callback_list = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose_level != 0, verbose=verbose_level, epochs=epochs,
        steps=steps, model=model)
    size = loops.execution_size(model)
    runner = ReplicaRunner(extended, record.object_id, with_state=True)
    epochs_runner = EpochRunner(choice, runner, elastic)
    tag = f"keras3-{record.object_id}"  # the fit's progress events carry it

    def moved() -> None:
        record.dirty = True  # get_weights, save: the replicas' weights first

    model.stop_training = False
    model._initial_epoch = None
    callback_list.on_train_begin()
    initial_epoch = resumed_epoch(model, initial_epoch)
    if record.fingerprint != fingerprint(model):  # a callback loaded weights (BackupAndRestore): install them
        prepare() if elastic is None else elastic.prepare(prepare)
    if elastic is not None:
        for callback in callback_list.callbacks:  # the History fit returns: its ledger, rows and events, as
            if isinstance(callback, keras.callbacks.History):  # the built-in layers' fit keeps them
                elastic.history = callback
                callback.elastic = elastic
                callback.elastic_events = [e.to_msg() for e in elastic.events]
        elastic.set_callbacks(callback_list)  # told of a loss while installing, then of each change
        elastic.begin(initial_epoch)

    def one_epoch(epoch: int) -> dict[str, Any]:
        model.reset_metrics()
        results = epochs_runner.train_epoch(epoch, train, steps_per_epoch, driver, lambda: _learning_rate(model), tag,
                                            callbacks=callback_list, steps=steps, size=size,
                                            stopped=lambda: bool(model.stop_training), moved=moved)
        _take_state(model, results["state"])
        if holding:
            update_rule.take_stored(model, record.strategy.client, driver)
        record.fingerprint = fingerprint(model)
        record.dirty = False
        return dict(results["logs"])

    def validate(epoch: int) -> dict[str, Any] | None:
        if validation_data is None or not should_evaluate(epoch, validation_freq):
            return None
        model.stop_evaluating = False
        return epochs_runner.evaluate(val_data, validation_steps, callback_list, size,
                                      lambda: bool(getattr(model, "stop_evaluating", False)))

    logs = run_epochs(callback_list, initial_epoch, epochs, one_epoch, validate, lambda: bool(model.stop_training))
    finalize_optimizer(model, epochs)
    callback_list.on_train_end(logs)
    return model.history


def evaluate(original: Callable[..., Any], model: Any, x: Any = None, y: Any = None, batch_size: int | None = None,
             verbose: Any = "auto", sample_weight: Any = None, steps: int | None = None, callbacks: Any = None,
             return_dict: bool = False, **kwargs: Any) -> Any:
    """Keras' ``evaluate``; on the replicas (each over its share, metrics summed) for a distributed model."""
    record = _distributed(model, "evaluate")
    if record is None:
        return original(model, x, y, batch_size, verbose, sample_weight, steps, callbacks, return_dict, **kwargs)
    import keras

    from daskdist.plugins.keras3 import ps

    verbose_level = 1 if verbose == "auto" else int(verbose)
    callback_list = callbacks if isinstance(callbacks, keras.callbacks.CallbackList) else keras.callbacks.CallbackList(
        callbacks, add_progbar=verbose_level != 0, verbose=verbose_level, epochs=1, steps=steps, model=model)
    choice = choose_runner(record.strategy, loops.hooked(callbacks), training=False)
    if choice.kind is RunnerKind.CLOSURES:  # closures on the workers, as TF's inline evaluation
        if sample_weight is not None:  # Keras' checks (one per row; a dataset's elements carry them)
            sample_weight = weighted_inputs(record.strategy.client, x, y, sample_weight).sample_weight
        _pull(model, record)
        logs = ps.evaluate(model, record, x, y, batch_size, steps, callback_list, sample_weight)
    else:
        data = _distribute(record, x, y, batch_size, False, model,
                           weighted_inputs(record.strategy.client, x, y, sample_weight).sample_weight)
        _pull(model, record)
        ensure_installed(model, record)
        model.stop_evaluating = False
        logs = ReplicaRunner(record.strategy.extended, record.object_id, with_state=False).evaluate(
            data, steps, callback_list, choice.per_batch_test, loops.execution_size(model),
            lambda: bool(getattr(model, "stop_evaluating", False)))
    if return_dict:
        return logs
    values = [logs[name] for name in logs]
    return values[0] if len(values) == 1 else values


def predict(original: Callable[..., Any], model: Any, x: Any, batch_size: int | None = None, verbose: Any = "auto",
            steps: int | None = None, callbacks: Any = None) -> Any:
    """Keras' ``predict`` on the client's copy (the replicas' current weights), under ParameterServerStrategy on
    the workers (``ps.predict``); Dask collections are read in order."""
    record = _distributed(model, "predict")
    if record is not None:
        _pull(model, record)
        if (choose_runner(record.strategy, training=False).kind is RunnerKind.CLOSURES
                and getattr(model, "optimizer", None) is not None):
            from daskdist.plugins.keras3 import ps

            return ps.predict(model, record, x, batch_size, steps)  # closures on the workers
        from daskdist.data.dataset import Dataset

        with one_step_per_execution(model):
            if isinstance(x, Dataset):
                return _predict_dataset(model, x, steps, callbacks)
            if hasattr(x, "__dask_graph__"):
                x = np.asarray(x.compute())
            return original(model, x, batch_size, verbose, steps, callbacks)
    return original(model, x, batch_size, verbose, steps, callbacks)


def _predict_dataset(model: Any, dataset: Any, steps: int | None, callbacks: Any) -> np.ndarray:
    """Keras' ``predict`` loop over a ``daskdist.data.Dataset`` on the client, with Keras' predict callbacks."""
    import keras

    from daskdist.plugins.keras3.resident import batch_rows

    callback_list = callbacks if isinstance(callbacks, keras.callbacks.CallbackList) else keras.callbacks.CallbackList(
        callbacks, model=model)
    callback_list.on_predict_begin()
    outputs = []
    for step, batch in enumerate(b for b in iter(dataset) if batch_rows(b)):
        if steps is not None and step >= steps:
            break
        callback_list.on_predict_batch_begin(step)
        outputs.append(np.asarray(model.predict_on_batch(batch[0] if isinstance(batch, (tuple, list)) else batch)))
        callback_list.on_predict_batch_end(step, {"outputs": outputs[-1]})
    callback_list.on_predict_end()
    return np.concatenate(outputs) if outputs else np.empty((0,))


def _recorded_get_weights(model: Any) -> Any:
    """``get_weights`` of a recorded model: its replicas' current weights (after a custom loop changed them)."""
    record = registry.lookup(model)
    if record is not None and registry.is_open(record):
        _pull(model, record)
    return type(model).get_weights(model)


def save(original: Callable[..., Any], model: Any, *args: Any, **kwargs: Any) -> Any:
    record = registry.lookup(model)
    if record is not None and registry.is_open(record):
        _pull(model, record)
    return original(model, *args, **kwargs)


save_weights = save


# -- references inside strategy.run -------------------------------------------------------


def reference(obj: Any) -> Any:
    """``__reduce_ex__`` of a recorded model, optimizer or metric: a reference to the replica's copy, or ``None``."""
    record = registry.lookup(obj)
    if record is None or not registry.is_open(record):
        return None
    from daskdist.plugins.keras3 import references

    return references.reduce(obj, record)


def _optimizer(model: Any) -> Any:
    """The model's optimizer, or ``None`` before ``compile`` (Keras sets the attribute in ``compile``)."""
    return getattr(model, "optimizer", None)
