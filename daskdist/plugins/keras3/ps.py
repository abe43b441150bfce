"""Keras 3 ``fit`` and ``evaluate`` under ``ParameterServerStrategy``: closures driven by the ``PsStepDriver``.

TensorFlow's rules for Keras under its ``ParameterServerStrategy``:
``steps_per_epoch`` is required, the input is a ``DatasetCreator`` (or a
``dataset_fn(input_context)``) each worker builds its own dataset from, and
callbacks run per epoch (batch-level ones are refused by the trainer's
``choose_runner`` before ``fit`` reaches this module). Each worker keeps its
own copy of the model (``KerasPsWorker``, installed by
``ClusterCoordinator.run_on_each_worker`` with the model's ``.keras`` payload
and the step driver); the trainable parameters and the optimizer's slots live
on the parameter servers (parameter ``i`` on store ``i % num_ps``, the update
rule ``update_rule.update_rule`` of the Keras optimizer). A closure runs
``steps_per_execution`` steps: it pulls the parameters changed on the stores,
then per step runs Keras' forward and backward, pushes the gradients (the
stores apply them once) and assigns the new parameters. Non-trainable float
weights (BatchNormalization's moving statistics) are held on the stores beside
the parameters, as TF keeps them as ps variables the workers assign: a closure
pulls them with the parameters and assigns its own at its end (the last
writer's are kept; ``PsStepDriver.end``). The epoch's logs are
Keras' metric variables summed over the closures. After every epoch the
client's model takes the stored parameters and slots. ``predict`` of a
compiled model runs on the workers: the input's batches cut into runs, one
closure each with the parameters stored now, the outputs put back in order
(an uncompiled model, which the stores cannot hold, predicts on the client).
The closures and their scheduling are the trainer's (``training.ps``).

``evaluate`` (and ``fit``'s ``validation_data``, every ``validation_freq``
epochs) runs on the workers in closures, as TensorFlow's inline distributed
evaluation does: each closure pulls the stored parameters and runs Keras'
``test_step`` over its batches; the client sums the closures' metric
variables. Arrays (numpy, or Dask arrays read on the client) are cut into
batches that the closures carry, each row evaluated exactly once; a
``DatasetCreator`` (or a ``daskdist.data.Dataset``, every worker reading all
of it) with ``steps`` (``validation_steps``) is read by each worker from its
own iterator, with TF's at-least-once visitation, and without ``steps``
exactly once, cut by batch into shards (``training.ps.plan_evaluation``). A model
never trained here, or whose client copy changed since (``set_weights``,
``load_weights``), is held on the stores again first. Each hold replaces the
previous one: its parameter sets are released from the stores.

Custom loops (TF's parameter-server custom training): before
``ClusterCoordinator.schedule`` ships a function, ``place_models`` holds the
built models of the scope on the stores with their loop's optimizer and puts
them on the workers; pickled in the function, the model becomes the worker's
copy (``resolve_model``: the stored parameters pulled as the closure starts)
and the optimizer the copy's optimizer, whose ``apply`` pushes the gradients
(``KerasPsWorker.push``: the stores apply them once). The moving statistics
a closure changed are assigned on the stores when it returns
(the trainer's ``PsWorker.custom_closure_ended``, through ``daskdist.ps.closures.at_closure_end``),
as ``fit``'s closures assign them. The client takes the stored state before
it reads the weights (``take_loop_state``). A metric created in the scope
travels as the worker's copy whose change the client adds up when the
closure commits (``ps_metrics``).
"""

from __future__ import annotations

import hashlib
import itertools
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import optree

from daskdist import context
from daskdist.group.service import MODEL
from daskdist.plugins.keras3 import registry, update_rule, wrapped
from daskdist.plugins.keras3.backend import keras_backend, prepare_replica
from daskdist.plugins.keras3.fit_semantics import (
    finalize_optimizer,
    resumed_epoch,
    should_evaluate,
    weighted_inputs,
)
from daskdist.plugins.keras3.payload import ModelPayload, pack_model, unpack_model
from daskdist.plugins.keras3.resident import KerasTrainable, state_variables
from daskdist.training.fit import run_epochs
from daskdist.training.ps import (
    ClosureRunner,
    PsWorker,
    check_steps_per_epoch,
    evaluation_shards,
    plan_evaluation,
    predict_pieces,
    worker_model,
)

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService
    from daskdist.strategy.extended.contract import StrategyExtended

__all__ = ["KerasPsWorker", "evaluate", "fit", "place_models", "predict", "reference", "resolve_model", "resolve_optimizer",
           "schedules_closures", "take_loop_state"]


def schedules_closures(extended: StrategyExtended) -> bool:
    """Whether the Extended runs steps as coordinator closures (ParameterServerStrategy)."""
    return extended.schedules_closures


class KerasPsWorker(PsWorker):
    """A parameter-server worker's copy of a Keras 3 model and the ``PsStepDriver`` that trains it (resident).

    The trainer's ``PsWorker`` runs ``fit``'s, ``evaluate``'s and ``predict``'s closures and a custom loop's
    closures' worker side; what is Keras' own: a closure's results are Keras' metric variables (the client sums
    them) and one row of its last batch, and ``push`` (a custom loop's ``optimizer.apply`` checked against the
    model's ``trainable_variables``).
    """

    def results(self, loop: str, batch: Any) -> dict[str, Any]:
        """The metric variables over the closure's batches (the client sums them) and one row of the last batch
        (``sample``: the client builds its compiled metrics with it)."""
        return _results(self.trainable.model, batch)

    def predict_batch(self, batch: Any) -> Any:
        """Keras' ``predict_on_batch`` of the batch's inputs, as numpy."""
        x = batch[0] if isinstance(batch, tuple) else batch
        return optree.tree_map(np.asarray, self.trainable.model.predict_on_batch(x))

    def push(self, gradients: list[Any], variables: list[Any]) -> None:
        """A custom loop's ``optimizer.apply(gradients, variables)``: applied once on the stores, then assigned."""
        model = self.trainable.model
        trainable = list(model.trainable_variables)
        if len(variables) != len(trainable) or any(a is not b for a, b in zip(variables, trainable)):
            raise ValueError(
                f"under ParameterServerStrategy a custom loop's optimizer.apply takes the gradients of all of "
                f"model {model.name!r}'s trainable_variables, in their order (the parameter servers hold them as "
                f"one set); got {len(variables)} variables for its {len(trainable)}")
        self.apply_gradients(gradients)


def _results(model: Any, batch: Any) -> dict[str, Any]:
    """A closure's metric variables and one row of its last batch (the client builds its metrics with it)."""
    return {"metrics": [np.array(np.asarray(v.numpy()), copy=True) for v in model.metrics_variables],
            "sample": None if batch is None else tuple(np.asarray(part)[:1] for part in batch[:2])}


def _install_worker(service: ReplicaService, model_id: str, payload: ModelPayload, driver: Any,
                    optimizer: dict[str, Any] | None = None) -> None:
    """Worker command: load the model and keep it with its driver as ``(MODEL, model_id)``.

    ``optimizer``: a custom loop's optimizer for a model not compiled with it, as Keras serializes it (plain
    data: unpickling a Keras class would import Keras before ``prepare_replica`` chose its backend); the
    worker's copy takes it as its ``optimizer``.
    """
    keras = prepare_replica(payload.backend)
    wrapped.ensure()
    with context.enter(context.Frame(strategy=service.strategy_view, replica_context=service.context,
                                     variable_creator=None, owner=service)):
        model = unpack_model(payload)
        if optimizer is not None:
            model.optimizer = keras.optimizers.deserialize(optimizer)
    service.objects.install(MODEL, model_id, KerasPsWorker(KerasTrainable(model), driver))


def _worker(model_id: str) -> KerasPsWorker:
    worker: KerasPsWorker = worker_model(model_id)
    return worker


def _weights(model: Any) -> list[np.ndarray]:
    return _arrays(model.trainable_variables)


def _arrays(variables: list[Any]) -> list[np.ndarray]:
    import keras

    return [np.array(keras.ops.convert_to_numpy(v.value), copy=True) for v in variables]


def _take_stored(model: Any, record: registry.Record, driver: Any) -> None:
    """The client's model takes the stored parameters, optimizer slots and state (moving statistics)."""
    update_rule.take_stored(model, record.strategy.client, driver, _optimizer_of(model, record))
    variables = state_variables(model)
    values = driver.stored_held_state(record.strategy.client, len(variables)) if variables else None
    for variable, value in zip(variables, values or []):
        variable.assign(np.asarray(value))
    record.fingerprint = held_digest(model)


def held_digest(model: Any) -> str:
    """A digest of the model's weights (what the stores and workers hold after a ``fit`` or an install)."""
    import keras

    digest = hashlib.blake2b(digest_size=16)
    for variable in model.weights:
        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(variable.value)).tobytes())
    return digest.hexdigest()


def _install(model: Any, record: registry.Record, coordinator: Any) -> Any:
    """Hold the client's parameters on the stores and put the model on every worker (once per ``fit``).

    The previous hold's parameter sets (an earlier ``fit``) are released from the stores first.
    """
    extended = record.strategy.extended
    if record.driver is not None:
        record.driver.release(record.strategy.client)
        record.driver = None
    driver = extended.step_driver(f"{record.object_id}:{uuid.uuid4().hex[:8]}")
    optimizer = _optimizer_of(model, record)
    paired = registry.lookup(optimizer)
    if paired is not None:  # a scheduled function may apply it (``reference``)
        paired.model_id = record.object_id
    rule = update_rule.update_rule(optimizer)
    rule.set_state(update_rule.rule_state(optimizer, rule))
    driver.init_stored(record.strategy.client, _weights(model), rule, state=_arrays(state_variables(model)))
    payload = pack_model(model, keras_backend())
    import keras

    spec = None if getattr(model, "optimizer", None) is optimizer else keras.optimizers.serialize(optimizer)
    coordinator.run_on_each_worker(_install_worker, lambda _index: (record.object_id, payload, driver, spec))
    record.driver = driver
    record.fingerprint = held_digest(model)
    return driver


def _build_metrics(model: Any, sample: Any) -> None:
    """Build the client's compiled metrics (as the workers' are) from one row, then zero them."""
    if sample is None:
        return
    x, y = sample
    model.compute_metrics(x, y, model(x, training=False))
    model.reset_metrics()


def _sum_logs(model: Any, results: list[dict[str, Any]]) -> dict[str, float]:
    """The closures' metric variables summed into the client's model: the logs over all their batches."""
    _build_metrics(model, next((r["sample"] for r in results if r["sample"] is not None), None))
    totals = [np.sum(parts, axis=0) for parts in zip(*(r["metrics"] for r in results))]
    for variable, total in zip(model.metrics_variables, totals):
        variable.assign(total)
    return {k: float(np.asarray(v)) for k, v in model.get_metrics_result().items() if np.asarray(v).size == 1}


def _host(data: Any) -> Any:
    """Arrays (a structure of them) as numpy on the client; Dask collections read."""
    return optree.tree_map(lambda a: np.asarray(a.compute()) if hasattr(a, "__dask_graph__") else np.asarray(a), data)


def _evaluation(coordinator: Any, model_id: str, x: Any, y: Any, batch_size: int | None, steps: int | None,
                size: int, steps_name: str, sample_weight: Any = None) -> Callable[[], list[Any]]:
    """What one evaluation schedules (``training.ps.plan_evaluation``): arrays (with ``sample_weight``, one per
    row) cut into batches here, each row once; a ``DatasetCreator``, ``dataset_fn`` or ``Dataset`` read by the
    workers (see the module; its elements carry any sample weights)."""
    from daskdist import config
    from daskdist.data.dataset import Dataset
    from daskdist.data.dataset_creator import DatasetCreator

    if x is None:
        raise ValueError("no data given (x is None)")
    shards = config.get("parameter-store.evaluation-shards", "auto")
    if isinstance(x, (DatasetCreator, Dataset)) or (callable(x) and not hasattr(x, "__dask_graph__")):
        if y is not None:
            raise ValueError("y must not be given with a DatasetCreator or a Dataset (it yields (x, y) pairs)")
        if sample_weight is not None:
            raise ValueError("`sample_weight` is not supported when the data is a Dataset or a DatasetCreator: put "
                             "the sample weights in the dataset's (x, y, sample_weight) elements")
        return plan_evaluation(coordinator, model_id, x, steps, size, shards, steps_name)
    return plan_evaluation(coordinator, model_id, _host_batches(x, y, batch_size, steps, sample_weight), None, size,
                           shards, steps_name)


def _host_batches(x: Any, y: Any, batch_size: int | None, steps: int | None,
                  sample_weight: Any = None) -> list[tuple[Any, ...]]:
    """Arrays (numpy, or Dask arrays read here) cut into batches of ``batch_size`` rows (32), at most ``steps``;
    ``(x, y, sample_weight)`` batches with weights."""
    xs = _host(x)
    ys = None if y is None else _host(y)
    leaves = optree.tree_leaves(xs)
    rows = len(leaves[0]) if leaves else 0
    if ys is not None and len(optree.tree_leaves(ys)[0]) != rows:
        raise ValueError(f"x and y have different lengths ({rows} and {len(optree.tree_leaves(ys)[0])})")
    step = batch_size or 32
    parts: tuple[Any, ...] = (xs,) if ys is None else (xs, ys)
    if sample_weight is not None:
        weights = _host(sample_weight)
        if ys is None or np.shape(weights)[:1] != (rows,):
            raise ValueError(f"`sample_weight` must have one weight per row of x ({rows}) and come with y, got "
                             f"shape {np.shape(weights)}")
        parts = (xs, ys, weights)

    def batch_at(start: int) -> tuple[Any, ...]:
        return tuple(optree.tree_map(lambda a: a[start:start + step], part) for part in parts)

    return [batch_at(start) for start in list(range(0, rows, step))[:steps]]


def _held(model: Any, record: registry.Record, coordinator: Any) -> None:
    """Hold the client's copy on the stores and workers unless they hold it already (evaluate)."""
    if record.driver is None or record.fingerprint != held_digest(model):
        _check(model, type(record.strategy).__name__)
        _install(model, record, coordinator)


def _check(model: Any, name: str) -> None:
    """What the stores and workers cannot hold: refused before anything runs."""
    update_rule.check_optimizer(model.optimizer, name)
    if not model.built:
        raise ValueError(f"model {model.name!r} is not built: give it an Input (its workers build their datasets)")


def evaluate(model: Any, record: registry.Record, x: Any, y: Any, batch_size: int | None, steps: int | None,
             callbacks: Any, sample_weight: Any = None) -> dict[str, float]:
    """``model.evaluate`` under ParameterServerStrategy: closures on the workers (see the module); the logs.
    ``sample_weight``: one weight per row of array inputs."""
    from daskdist.coordinator.cluster_coordinator import ClusterCoordinator

    if not model.compiled:
        raise ValueError("You must call `compile()` before using the model (`model.compile(optimizer, loss)`).")
    record.strategy.extended.check_open()
    coordinator = ClusterCoordinator(record.strategy)
    size = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
    evaluation = _evaluation(coordinator, record.object_id, x, y, batch_size, steps, size, "steps", sample_weight)
    if not model.built and (hasattr(x, "shape") or isinstance(x, (tuple, list, dict))):  # arrays: one row builds it
        model(optree.tree_map(lambda a: a[:1], _host(x)), training=False)
    _held(model, record, coordinator)
    callbacks.on_test_begin()
    logs = _runner(coordinator, record).evaluate(evaluation, lambda results: _sum_logs(model, results))
    callbacks.on_test_end(logs)
    return logs


def predict(model: Any, record: registry.Record, x: Any, batch_size: int | None, steps: int | None) -> Any:
    """``model.predict`` under ParameterServerStrategy: the input's batches cut into runs, each a closure on a worker
    with the parameters stored now (``training.ps.ClosureRunner.predict``); the outputs in order."""
    from daskdist import config
    from daskdist.coordinator.cluster_coordinator import ClusterCoordinator
    from daskdist.data.dataset import Dataset
    from daskdist.plugins.keras3.resident import batch_rows

    record.strategy.extended.check_open()
    coordinator = ClusterCoordinator(record.strategy)
    if isinstance(x, Dataset):
        inputs = (b[0] if isinstance(b, (tuple, list)) else b for b in iter(x) if batch_rows(b))
        batches: list[Any] = [(b,) for b in itertools.islice(inputs, steps)]
    else:
        batches = _host_batches(x, None, batch_size, steps)
    _held(model, record, coordinator)
    shards = evaluation_shards(config.get("parameter-store.evaluation-shards", "auto"), len(coordinator.live_workers))
    outputs = _runner(coordinator, record).predict(predict_pieces(batches, shards))
    if not outputs:
        return np.empty((0,))
    return optree.tree_map(lambda *parts: np.concatenate(parts), *outputs)


def _runner(coordinator: Any, record: registry.Record) -> ClosureRunner:
    """The trainer's closure runner of the model recorded as ``record``."""
    return ClosureRunner(coordinator, record.object_id, record.strategy.extended)


def fit(model: Any, record: registry.Record, x: Any, y: Any, epochs: int, verbose: Any, callbacks: list[Any] | None,
        validation_data: Any, initial_epoch: int, steps_per_epoch: int | None,
        learning_rate: Callable[[], float | None], validation_steps: int | None = None,
        validation_batch_size: int | None = None, validation_freq: Any = 1, class_weight: Any = None) -> Any:
    """``model.fit`` under ParameterServerStrategy (see the module); ``class_weight`` maps each worker's
    ``(x, y)`` batches to ``(x, y, weight)`` (``fit_semantics.weighted_inputs``), checked here first."""
    import keras

    from daskdist.coordinator.cluster_coordinator import ClusterCoordinator
    from daskdist.data.dataset_creator import DatasetCreator

    name = type(record.strategy).__name__
    steps = check_steps_per_epoch(steps_per_epoch, name)
    if y is not None or not (isinstance(x, DatasetCreator) or callable(x)):
        raise ValueError(f"fit under {name} takes a `DatasetCreator` (or a `dataset_fn(input_context)`) as x, "
                         "and no y: each worker builds its own dataset")
    _check(model, name)
    record.strategy.extended.check_open()
    if class_weight is not None:
        x = weighted_inputs(record.strategy.client, x, None, class_weight=class_weight).x
    coordinator = ClusterCoordinator(record.strategy)
    size = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
    evaluation = None
    if validation_data is not None:
        vx, vy, vw = (*validation_data, None)[:3] if isinstance(validation_data, tuple) else (
            validation_data, None, None)
        evaluation = _evaluation(coordinator, record.object_id, vx, vy, validation_batch_size, validation_steps, size,
                                 "validation_steps", vw)
    driver = _install(model, record, coordinator)
    creator = x if isinstance(x, DatasetCreator) else DatasetCreator(x)
    per_worker: Any = coordinator.create_per_worker_dataset(creator)
    iterator = iter(per_worker)  # per worker, an iterator over its own dataset
    verbose_level = 1 if verbose == "auto" else int(verbose)
    callback_list = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose_level != 0,
                                                 verbose=verbose_level, epochs=epochs, steps=steps_per_epoch,
                                                 model=model)
    model.stop_training = False
    model._initial_epoch = None
    callback_list.on_train_begin()
    initial_epoch = resumed_epoch(model, initial_epoch)
    if record.fingerprint != held_digest(model):  # a callback loaded weights (BackupAndRestore): hold them
        driver = _install(model, record, coordinator)

    runner = _runner(coordinator, record)

    def one_epoch(epoch: int) -> dict[str, Any]:
        model.reset_metrics()
        return runner.train_epoch(iterator, steps, size, learning_rate(), lambda results: _sum_logs(model, results),
                                  lambda: _take_stored(model, record, driver))

    def validate(epoch: int) -> dict[str, Any] | None:
        if evaluation is None or not should_evaluate(epoch, validation_freq):
            return None
        callback_list.on_test_begin()
        val_logs = runner.evaluate(evaluation, lambda results: _sum_logs(model, results))
        callback_list.on_test_end(val_logs)
        return val_logs

    logs = run_epochs(callback_list, initial_epoch, epochs, one_epoch, validate, lambda: bool(model.stop_training))
    finalize_optimizer(model, epochs)
    callback_list.on_train_end(logs)
    return model.history


# -- custom loops: ClusterCoordinator.schedule of a function using the model and optimizer -------------------


def _optimizer_of(model: Any, record: registry.Record) -> Any:
    """The optimizer whose rule the stores run for ``model``: its compiled one, else its custom loop's."""
    compiled = getattr(model, "optimizer", None)
    return compiled if compiled is not None else record.optimizer


def _loop_optimizer(model: Any, record: registry.Record) -> tuple[Any, str | None]:
    """The optimizer an uncompiled ``model``'s custom loop applies, or why there is none: ``(optimizer, why)``.

    The optimizer is the one created in the same scope and not compiled into another model, as in TensorFlow's
    custom-training pattern (one model, one optimizer). With several, compile the model with the loop's. A
    compiled model, or one paired already, gives ``(None, None)``: nothing to pair. Changes nothing.
    """
    import keras

    if getattr(model, "optimizer", None) is not None or record.optimizer is not None:
        return None, None
    compiled = {id(getattr(obj, "optimizer", None)) for obj, _ in registry.items() if isinstance(obj, keras.Model)}
    free = [obj for obj, other in registry.items()
            if isinstance(obj, keras.optimizers.Optimizer) and other.strategy is record.strategy
            and id(obj) not in compiled and other.model_id in (None, record.object_id)]
    if len(free) == 1:
        return free[0], None
    return None, (f"{len(free)} optimizers created in the scope are free to pair with it" if free else
                  "no optimizer was created in the scope") + (
        f": compile model {model.name!r} with the optimizer its loop applies (model.compile(optimizer=...))"
        if free else ": create the loop's optimizer inside strategy.scope()")


def _pair(record: registry.Record, optimizer: Any) -> None:
    """Pair a model's record with its custom loop's ``optimizer`` (the optimizer's record names the model)."""
    record.optimizer = optimizer
    found = registry.lookup(optimizer)
    assert found is not None
    found.model_id = record.object_id


def place_models(strategy: Any) -> None:
    """Before ``ClusterCoordinator.schedule`` ships a function: the built models created in this strategy's scope
    that the stores do not hold yet are held there with their loop's optimizer, and put on every worker.

    A model ``fit`` trained is held already (its driver goes on serving closures); a model that cannot be held
    (``_unplaceable``) is left out, and a function using it is refused when it is pickled (``reference``).
    """
    import keras

    from daskdist.coordinator.cluster_coordinator import ClusterCoordinator

    for obj, record in registry.items():
        if (record.strategy is strategy and record.driver is None and isinstance(obj, keras.Model)
                and _unplaceable(obj, record) is None):
            optimizer, _ = _loop_optimizer(obj, record)
            if optimizer is not None:
                _pair(record, optimizer)
            _install(obj, record, ClusterCoordinator(strategy))


def _unplaceable(model: Any, record: registry.Record) -> str | None:
    """Why ``model`` cannot be held for custom loops (not built, no optimizer, one the stores cannot run), or
    ``None``. A question only: the pairing with the loop's optimizer is ``place_models``'."""
    if not model.built:
        return "it is not built: give it an Input (or call it on one batch) before scheduling"
    optimizer, why = _loop_optimizer(model, record)
    if why is not None:
        return why
    try:
        update_rule.check_optimizer(optimizer if optimizer is not None else _optimizer_of(model, record),
                                    type(record.strategy).__name__)
    except NotImplementedError as error:
        return str(error)
    return None


def reference(obj: Any, record: registry.Record) -> tuple[Any, tuple[Any, ...]]:
    """The pickled form of a recorded model, optimizer or metric in a scheduled function: the worker's copy.

    Raises
    ------
    ValueError
        The model is not built, or has no optimizer to pair with; the optimizer's model is not held; the metric
        keeps a variable that is not a sum.
    """
    import keras

    name = type(record.strategy).__name__
    if isinstance(obj, keras.metrics.Metric):
        from daskdist.plugins.keras3 import ps_metrics

        return ps_metrics.reference(obj, record)
    if isinstance(obj, keras.Model):
        if record.driver is None:
            raise ValueError(f"model {obj.name!r} cannot be used in a function scheduled under {name}: "
                             f"{_unplaceable(obj, record)}")
        record.dirty = True  # the client takes the stored state before it reads the weights
        return resolve_model, (record.object_id,)
    if record.model_id is None:
        raise ValueError(f"the {type(obj).__name__} created in {name}.scope() applies to no model on the workers: "
                         "create (and build) the model in the same scope; a scheduled function applies it to that "
                         "model's trainable_variables")
    return resolve_optimizer, (record.model_id,)


def resolve_model(model_id: str) -> Any:
    """On a worker running a closure: its copy of the model, the parameters pulled from the stores."""
    worker = _worker(model_id)
    worker.custom_closure_began(context.current_runtime())
    return worker.trainable.model


def resolve_optimizer(model_id: str) -> Any:
    """On a worker running a closure: its copy of the model's optimizer, whose ``apply`` pushes to the stores."""
    from daskdist.plugins.keras3 import exchange

    worker = _worker(model_id)
    optimizer = worker.trainable.model.optimizer
    exchange.mark_ps_optimizer(optimizer, worker.push)
    return optimizer


def take_loop_state(model: Any, record: registry.Record) -> None:
    """After a custom loop's closures: the client's model (and optimizer) take the stored state."""
    if record.driver is None or not record.dirty:
        return
    _take_stored(model, record, record.driver)
    record.dirty = False
