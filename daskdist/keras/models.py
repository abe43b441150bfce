"""``Model`` and ``Sequential``: compile, fit, evaluate, predict, save, over replicas or locally.

A model created inside ``strategy.scope()`` is *distributed*: on first use
it is installed on every replica (one identical copy each, resident there),
``fit`` sends one command per epoch and each replica runs the whole epoch
over its own shard of the data, all-reducing gradients every step. The
client keeps the architecture and the compile settings; weights are read
from replica 0 when needed (``get_weights``, checkpoints, ``save``). A
model created outside any scope trains in the client process.
"""

from __future__ import annotations

import copy
import logging
import uuid
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist import context
from daskdist.arrays import as_array, to_numpy
from daskdist.group.service import MODEL
from daskdist.keras import callbacks as callbacks_module
from daskdist.keras import ps_fit, resident_ref, runner, saving
from daskdist.keras.trainable import BuiltinTrainable, RandomStates
from daskdist.strategy.base import Strategy
from daskdist.training.fit import run_epochs
from daskdist.training.runner_choice import RunnerKind, choose_runner

if TYPE_CHECKING:
    from daskdist.strategy.drivers.contract import ParameterHoldingDriver

__all__ = ["Model", "RandomStates", "Sequential", "load_model"]

logger = logging.getLogger(__name__)

#: every model installed on its strategy's replicas (an elastic newcomer is given each one of its strategy)
_INSTALLED: weakref.WeakSet[Model] = weakref.WeakSet()



def _current_strategy() -> Any:
    frame = context.current_frame()
    if frame is not None and frame.replica_context is None and isinstance(frame.strategy, Strategy):
        return frame.strategy
    return None


class Model:
    """A stack of layers trained by backpropagation (Keras' ``Model`` API, ``Sequential`` topology)."""

    def __init__(self, layers: Iterable[Any] | None = None, name: str | None = None):
        self.layers: list[Any] = list(layers or [])
        self.name = name or type(self).__name__.lower()
        self.optimizer: Any = None
        self.loss: Any = None
        self.compiled_metrics: list[Any] = []
        self.weighted_metric_count = 0  # the last metrics of compiled_metrics are weighted_metrics
        self._compile_config: dict[str, Any] | None = None
        self.stop_training = False
        self.history: callbacks_module.History | None = None
        self.built = False
        self._strategy: Strategy | None = _current_strategy()
        self._model_id = uuid.uuid4().hex[:12]
        self._installed = False
        self._steps_per_execution = 1
        self._pss_evaluation_shards: int | str = 0
        self._ps_key: str | None = None  # where ParameterServerStrategy's stores hold the parameters (keras/ps_fit)

    # -- building ------------------------------------------------------------------

    def add(self, layer: Any) -> None:
        self.layers.append(layer)
        self.built = False

    def build(self, input_shape: tuple[Any, ...]) -> None:
        """Build every layer for inputs of ``input_shape`` (without the batch dimension)."""
        shape = tuple(input_shape)
        for layer in self.layers:
            if not layer.built:
                layer.build(shape)
            shape = tuple(layer.compute_output_shape(shape))
        self.built = True

    def _declared_input_shape(self) -> tuple[Any, ...] | None:
        shape = getattr(self.layers[0], "input_shape", None) if self.layers else None
        return tuple(shape) if shape else None

    def _ensure_built(self, x: Any) -> None:
        if self.built:
            return
        self.build(tuple(x.shape[1:]))
        ctx = context.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1 and hasattr(ctx, "broadcast"):
            names_arrays = self._weight_items()
            synced = ctx.broadcast([a for _, a in names_arrays], root=0)  # replica 0's initial weights
            self._assign_weights([np.array(a, copy=True) for a in synced])

    def build_as_first_batch(self, input_shape: tuple[int, ...] | None, dtype: str | None = None) -> None:
        """Build the model as its first batch would, if it is not built (an elastic commit before the first step).

        ``input_shape``: of ``x`` without the batch (``dtype`` its dtype);
        inside a replica every replica then takes replica 0's initial
        weights. ``None``: the model's declared input shape.

        Raises
        ------
        ValueError
            ``input_shape`` is ``None`` and the model declares none.
        """
        if self.built:
            return
        if input_shape is None:
            self._require_built()
        else:
            self._ensure_built(np.empty((0, *input_shape), dtype=dtype or "float32"))

    # -- forward / backward ------------------------------------------------------------

    def _forward(self, x: Any, training: bool) -> Any:
        for layer in self.layers:
            x = layer.forward(x, training=training)
        return x

    def _backward(self, grad: Any) -> Any:
        """Back-propagate ``grad`` (of the last forward's output); fills the layers' ``grads``; returns ``dL/dx``."""
        for layer in reversed(self.layers):
            grad = layer.backward(grad)
        return grad

    def _trainable_arrays(self) -> tuple[list[Any], list[Any]]:
        params, grads = [], []
        for layer in self.layers:
            for name in sorted(layer.params):
                params.append(layer.params[name])
                grads.append(layer.grads[name])
        return params, grads

    def __call__(self, x: Any, training: bool = False) -> Any:
        """The model's output for a batch ``x``; recorded when a ``GradientTape`` is open (custom loops)."""
        from daskdist.keras.gradient_tape import record_model_call

        inputs = x
        x, _ = as_array(np.asarray(x) if isinstance(x, np.ndarray) else x)
        self._ensure_built(x)
        return record_model_call(self, inputs, self._forward(x, training=training))

    @property
    def trainable_variables(self) -> list[Any]:
        """The trainable parameter arrays, in a fixed order (``tape.gradient``'s sources, the optimizer's).

        Empty until the model is built. Inside a replica they are that
        replica's arrays; ``optimizer.apply_gradients`` updates them in place.
        """
        if not self.built:
            return []
        return [layer.params[name] for layer in self.layers for name in sorted(layer.params)]

    trainable_weights = trainable_variables

    # -- weights -------------------------------------------------------------------

    def _weight_items(self) -> list[tuple[str, Any]]:
        """``("<layer index>/<weight name>", array)`` for every weight: names that do not depend on
        automatic layer names, so a checkpoint loads into any model of the same architecture."""
        items = []
        for index, layer in enumerate(self.layers):
            for name, array in layer.weights_list():
                items.append((f"{index}/{name}", array))
        return items

    def _assign_weights(self, arrays: list[Any]) -> None:
        items = self._weight_items()
        if len(arrays) != len(items):
            raise ValueError(f"the model has {len(items)} weight arrays, got {len(arrays)}")
        per_layer: dict[int, dict[str, Any]] = {}
        for (key, current), new in zip(items, arrays):
            new = np.asarray(to_numpy(new))
            if tuple(new.shape) != tuple(current.shape):
                raise ValueError(f"weight {key}: shape {tuple(new.shape)} does not match {tuple(current.shape)}")
            index, name = key.split("/", 1)
            per_layer.setdefault(int(index), {})[name] = new.astype(current.dtype, copy=False)
        for layer_index, mapping in per_layer.items():
            self.layers[layer_index].set_weights_from(mapping)

    def get_weights(self) -> list[np.ndarray]:
        """The weights as numpy arrays: the trainable ones from where the strategy holds them (the parameter
        holder, the ps), the others from replica 0 (PS: this copy); a model without a strategy: its own."""
        if not self._installed:
            self._require_built()
            return [np.array(to_numpy(a), copy=True) for _, a in self._weight_items()]
        weights = self._runner().computed_weights()
        stored = self._stored_state()
        if stored is not None:
            for position, value in zip(self._trainable_positions(), stored["params"]):
                weights[position] = np.array(to_numpy(value), copy=True)
        return weights

    def set_weights(self, weights: list[Any]) -> None:
        """Set every weight (here, on every replica of a distributed model, and where its parameters are held)."""
        self._require_built()
        self._assign_weights(list(weights))
        if not self._installed:
            return
        self._runner().set_computed_weights([to_numpy(w) for w in weights])
        params = [np.array(to_numpy(p), copy=True) for p in self.trainable_variables]
        self._set_stored(params=params)

    # -- parameters held off the replicas (the parameter holder's and the ps' step drivers) -----------

    def _params_key(self) -> str:
        """The name of the model's parameters where the strategy holds them."""
        return self._ps_key or self._model_id

    def _holding_driver(self) -> ParameterHoldingDriver | None:
        """The strategy's step driver when it holds the parameters off the replicas, else ``None``."""
        from daskdist.strategy.drivers.contract import ParameterHoldingDriver

        if self._strategy is None:
            return None
        driver = self._strategy.extended.step_driver(self._params_key())
        return driver if isinstance(driver, ParameterHoldingDriver) else None

    def _stored_state(self) -> dict[str, Any] | None:
        driver = self._holding_driver()
        if driver is None or self._strategy is None or not self.built:
            return None
        return driver.stored_state(self._strategy.client, len(self.trainable_variables))

    def _set_stored(self, params: list[Any] | None = None, rule_state: dict[str, Any] | None = None) -> None:
        """Overwrite the held copy (if any is held yet; else the next step's first offer carries these values)."""
        driver = self._holding_driver()
        if driver is None or self._strategy is None or not self.built:
            return
        count = len(self.trainable_variables)
        if not driver.set_stored(self._strategy.client, count, params=params, rule_state=rule_state):
            current = [np.array(to_numpy(p), copy=True) for p in self.trainable_variables]
            driver.init_stored(self._strategy.client, current, self.optimizer)

    def _trainable_positions(self) -> list[int]:
        """Where each of ``trainable_variables`` sits in ``_weight_items()``."""
        names = [name for name, _ in self._weight_items()]
        return [names.index(f"{index}/{name}") for index, layer in enumerate(self.layers)
                for name in sorted(layer.params)]

    def _require_built(self) -> None:
        if not self.built:
            shape = self._declared_input_shape()
            if shape is None:
                raise ValueError("the model is not built: call it on data, fit it, or give input_shape")
            self.build(shape)

    # -- compile -------------------------------------------------------------------

    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, metrics: list[Any] | None = None,
                steps_per_execution: int = 1, pss_evaluation_shards: int | str = 0,
                weighted_metrics: list[Any] | None = None) -> None:
        """Choose the optimizer, loss and metrics (objects or Keras names).

        As in Keras 3, ``metrics`` ignore sample weights (``sample_weight``,
        ``class_weight``, a dataset's third element) and ``weighted_metrics``
        are weighted by them; a weighted metric whose name a plain one already
        logs is logged as ``weighted_<name>`` (``metrics_with_names``).
        ``steps_per_execution`` and ``pss_evaluation_shards`` are used under ParameterServerStrategy only.
        """
        if type(steps_per_execution) is not int or steps_per_execution < 1:
            raise ValueError(f"steps_per_execution must be an int >= 1, got {steps_per_execution!r}")
        from daskdist.keras import losses, optimizers
        from daskdist.keras import metrics as metrics_module

        if loss is None:
            raise ValueError("compile needs a loss")
        for argument, given in (("metrics", metrics), ("weighted_metrics", weighted_metrics)):
            if given is not None and not isinstance(given, (list, tuple)):
                raise ValueError(f"Expected `{argument}` argument to be a list or tuple, got {given!r}")
        self.optimizer = optimizers.get(optimizer)
        self.loss = losses.get(loss)
        plain = [metrics_module.compiled(m, loss=self.loss) for m in (metrics or [])]
        weighted = [metrics_module.compiled(m, loss=self.loss) for m in (weighted_metrics or [])]
        self.compiled_metrics = metrics_module.metrics_with_names(plain, weighted)
        self.weighted_metric_count = len(weighted)  # the last ones of compiled_metrics

        def config(given: list[Any] | None, made: list[Any]) -> list[Any]:
            return [m if isinstance(m, str) else metrics_module.serialize(c) for m, c in zip(given or [], made)
                    if isinstance(m, str) or metrics_module.is_known(c)]

        self._compile_config = {
            "optimizer": {"class_name": type(self.optimizer).__name__, "config": self.optimizer.get_config()},
            "loss": {"class_name": type(self.loss).__name__, "config": self.loss.get_config()},
            "metrics": config(metrics, plain),
            "weighted_metrics": config(weighted_metrics, weighted),
        }
        self._steps_per_execution = steps_per_execution
        self._pss_evaluation_shards = pss_evaluation_shards
        self._installed = False  # the replicas get the newly compiled model on next use

    def reset_metrics(self) -> None:
        for metric in self.compiled_metrics:
            metric.reset_state()

    @property
    def metrics_names(self) -> list[str]:
        return ["loss", *(m.name for m in self.compiled_metrics)]

    def _require_compiled(self) -> None:
        if self.optimizer is None or self.loss is None:
            raise RuntimeError("compile the model before fit/evaluate: model.compile(optimizer=..., loss=...)")

    # -- placement on replicas -------------------------------------------------------

    def _ensure_installed(self) -> None:
        if self._strategy is None or self._installed:
            return
        self._strategy.extended.check_open()
        declared = self._declared_input_shape()
        if not self.built and declared is not None:
            self.build(declared)
        self._strategy.extended.install_resident(MODEL, self._model_id, self.resident())
        self._installed = True
        _INSTALLED.add(self)

    def installed_beside(self) -> list[Model]:
        """This model and every other model installed on the replicas of its strategy (what a commit restores
        on every member, and so what an elastic newcomer must be given first)."""
        others = [m for m in list(_INSTALLED)
                  if m is not self and m._installed and m._strategy is not None and m._strategy is self._strategy]
        return [self, *others]

    @property
    def model_id(self) -> str:
        """The id of the model's copies on the replicas (resident kind ``model``)."""
        return self._model_id

    @property
    def distribute_strategy(self) -> Strategy | None:
        """The strategy whose scope the model was created in (Keras' name), or ``None``."""
        return self._strategy

    def resident(self) -> BuiltinTrainable:
        """What is installed on a replica: a copy without the client's strategy and history.

        Also what an elastic newcomer is installed with (its weights then come with the commit).
        """
        payload = object.__new__(type(self))  # not copy.copy: that would call __reduce_ex__, which may refer
        payload.__dict__.update(self.__dict__)
        payload._strategy = None
        payload._installed = False
        payload.history = None
        return BuiltinTrainable(payload)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Inside a function sent by its strategy's ``run``: a reference to each replica's resident copy."""
        reference = resident_ref.reduce_for_replicas(self, self._model_id)
        return reference if reference is not None else super().__reduce_ex__(protocol)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_strategy"] = None
        state["history"] = None
        return state

    # -- fit / evaluate / predict --------------------------------------------------------

    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1, verbose: int | str = "auto",
            callbacks: list[Any] | None = None, validation_data: Any = None, shuffle: bool = True,
            initial_epoch: int = 0, steps_per_epoch: int | None = None, validation_steps: int | None = None,
            validation_split: float = 0.0, class_weight: dict[int, float] | None = None,
            sample_weight: Any = None) -> Any:
        """Train for ``epochs`` (Keras' ``fit``): ``x`` is a ``Dataset`` (batched) or arrays with ``y``.

        ``validation_split``, ``class_weight`` and ``sample_weight`` are read as
        Keras 3 reads them (``daskdist.training.fit_inputs``): the last fraction
        of array inputs held out before shuffling, a class's weight for each
        row, one weight per row (a ``Dataset`` carries its weights in its
        ``(x, y, sample_weight)`` elements); the loss of a global batch is
        ``sum(weight * loss) / rows`` over every replica's rows.

        One loop for every strategy: the model's runner (``_runner``) runs each
        epoch where the strategy trains (replica commands with its step
        driver, coordinator closures under ParameterServerStrategy: see
        ``keras/ps_fit.py`` for ``DatasetCreator`` and ``steps_per_epoch``, or
        this process); callbacks run here with the epoch's global logs.
        """
        self._require_compiled()
        x, y, validation_data = self._weighted_inputs(x, y, batch_size, shuffle, validation_split, validation_data,
                                                      class_weight, sample_weight, repeat=True)
        runner = self._runner(callbacks, training=True)
        try:
            runner.begin_fit(x, y, batch_size, shuffle, validation_data, callbacks, steps_per_epoch)
            history = callbacks_module.History()
            cb = callbacks_module.CallbackList(
                list(callbacks or []) + [history], model=self, verbose=1 if verbose == "auto" else int(verbose),
                params={"epochs": epochs, "steps": steps_per_epoch or runner.steps()},
            )
            self.stop_training = False
            self.history = history
            cb.on_train_begin()
            start_epoch = max(initial_epoch, cb.resume_epoch())
            runner.begin(start_epoch)
            run_epochs(cb, start_epoch, epochs, lambda epoch: runner.run_epoch(epoch, steps_per_epoch, cb),
                       lambda epoch: runner.validate(batch_size, validation_steps), lambda: self.stop_training)
        finally:
            runner.close()
        cb.on_train_end()
        return history

    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None, verbose: int | str = "auto",
                 steps: int | None = None, return_dict: bool = False, sample_weight: Any = None) -> Any:
        """Loss and metrics over the data (Keras' ``evaluate``), where the strategy trains (as ``fit``);
        ``sample_weight``: one weight per row of array inputs."""
        self._require_compiled()
        x, y, _ = self._weighted_inputs(x, y, batch_size, False, 0.0, None, None, sample_weight)
        runner = self._runner()
        try:
            logs = runner.evaluate(x, y, batch_size, steps)
        finally:
            runner.close()
        if return_dict:
            return logs
        values = [logs[name] for name in self.metrics_names if name in logs]
        return values[0] if len(values) == 1 else values

    def predict(self, x: Any, batch_size: int | None = None, verbose: int | str = "auto") -> np.ndarray:
        """Outputs for ``x`` (arrays or a ``Dataset``): on the parameter-server workers under
        ParameterServerStrategy, else in this process with the current weights."""
        return np.asarray(self._runner().predict(x, batch_size))

    def _runner(self, callbacks: list[Any] | None = None,
                training: bool = False) -> runner.ReplicaModelRunner | ps_fit.PsModelRunner:
        """Where this model's ``fit`` (``training``, with the user's ``callbacks``), evaluations and weights run:
        the trainer's choice (``keras.runner.for_model``)."""
        return runner.for_model(self, callbacks, training=training)

    def _local_copy(self) -> Model:
        if not self._installed:
            return self
        clone = copy.copy(self)
        clone.layers = copy.deepcopy(self.layers)
        clone._strategy = None
        clone._installed = False
        clone._assign_weights(self.get_weights())
        return clone

    def _weighted_inputs(self, x: Any, y: Any, batch_size: int | None, shuffle: bool, validation_split: float,
                         validation_data: Any, class_weight: Any, sample_weight: Any,
                         repeat: bool = False) -> tuple[Any, Any, Any]:
        """``(x, y, validation_data)`` with ``validation_split``, ``class_weight`` and ``sample_weight`` applied
        (``fit_inputs``): weighted arrays become a batched ``Dataset`` of ``(x, y, sample_weight)``, repeated
        under ParameterServerStrategy when ``repeat`` (fit's training data; an evaluation reads every row once)."""
        from daskdist.training.fit_inputs import element_spec_of, fit_inputs

        if validation_split == 0.0 and class_weight is None and sample_weight is None:
            return x, y, validation_data
        spec = None
        if class_weight is not None:  # of a Dataset, or of a DatasetCreator's dataset
            spec = element_spec_of(x, self._strategy.client if self._strategy is not None else None)
        inputs = fit_inputs(x, y, sample_weight, class_weight, validation_split, validation_data, spec)
        x, y, validation_data = inputs.x, inputs.y, inputs.validation_data
        if inputs.sample_weight is not None:
            x, y = self._as_dataset(x, y, batch_size, shuffle, sample_weight=inputs.sample_weight), None
            if repeat and choose_runner(self._strategy).kind is RunnerKind.CLOSURES:
                x = x.repeat()  # as the workers' datasets of arrays repeat (steps_per_epoch ends an epoch)
        if isinstance(validation_data, tuple) and len(validation_data) == 3 and validation_data[2] is not None:
            val_x, val_y, val_weight = validation_data
            validation_data = self._as_dataset(val_x, val_y, batch_size, False, sample_weight=val_weight)
        return x, y, validation_data

    def _as_dataset(self, x: Any, y: Any = None, batch_size: int | None = None, shuffle: bool = False,
                    what: str = "fit", sample_weight: Any = None) -> Any:
        from daskdist.data.dataset import Dataset, TensorSpec
        from daskdist.keras.input_check import check_model_input

        if x is None:
            raise ValueError("no data given")
        if isinstance(x, Dataset):
            if y is not None:
                raise ValueError("y must not be given when x is a Dataset (it yields (x, y) pairs)")
            client = self._strategy.client if self._strategy is not None else None
            check_model_input(x.element_spec_with(client), self._built_input_shape(), what)  # on the client, first
            return x
        x_array, _ = as_array(x)
        y_array = None if y is None else as_array(y)[0]
        if y_array is not None and len(y_array) != len(x_array):
            raise ValueError(f"x and y have different lengths ({len(x_array)} and {len(y_array)})")
        structure: tuple[Any, ...] = (x_array,) if y_array is None else (x_array, y_array)
        if sample_weight is not None and y_array is not None:
            structure = (x_array, y_array, as_array(sample_weight)[0])
        specs = tuple(TensorSpec((None, *a.shape[1:]), a.dtype) for a in structure)
        check_model_input(specs if y is not None else specs[0], self._built_input_shape(), what)  # as for a Dataset
        dataset = Dataset.from_tensor_slices(structure if y is not None else x_array)
        if shuffle:
            dataset = dataset.shuffle(len(x_array))
        return dataset.batch(batch_size or 32)

    # -- description and saving ----------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "layers": [{"class_name": type(layer).__name__, "config": layer.get_config()}
                                              for layer in self.layers]}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Model:
        from daskdist.keras.layers import get_layer_class

        layers = [get_layer_class(item["class_name"]).from_config(item["config"]) for item in config["layers"]]
        return cls(layers, name=config.get("name"))

    def summary(self) -> str:
        """A table of the layers, their output shapes and parameter counts (returned, and logged)."""
        self._require_built()
        lines = [f'Model: "{self.name}"', f"{'Layer':<28}{'Output shape':<22}{'Params':>10}"]
        shape = self._declared_input_shape() or ()
        total = 0
        for layer in self.layers:
            shape = tuple(layer.compute_output_shape(shape)) if shape else ()
            count = sum(int(np.prod(a.shape)) for a in layer.params.values())
            total += count
            lines.append(f"{layer.name + ' (' + type(layer).__name__ + ')':<28}{(None, *shape)!s:<22}{count:>10}")
        lines.append(f"Total params: {total}")
        text = "\n".join(lines)
        logger.info("%s", text)
        return text

    def save_weights(self, filepath: str) -> None:
        """Write the weights (and optimizer state) as a safetensors checkpoint ``filepath``."""
        self._require_built()
        names = [name for name, _ in self._weight_items()]
        tensors = dict(zip(names, self.get_weights()))
        meta = {"model": self.get_config(), "weights": names}
        if self.optimizer is not None:
            state = self._optimizer_state()
            tensors.update({f"optimizer/{k}": to_numpy(v) for k, v in state.items()})
            meta["optimizer"] = sorted(state)
        saving.write_checkpoint(filepath, tensors, meta)

    def load_weights(self, filepath: str) -> None:
        """Load a checkpoint written by ``save_weights`` (verified; never unpickled)."""
        if filepath is None:
            raise saving.CheckpointError("no checkpoint to load (latest_checkpoint found none)")
        tensors, meta = saving.read_checkpoint(filepath)
        self._require_built()
        names = [name for name, _ in self._weight_items()]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise saving.CheckpointError(f"checkpoint {filepath} lacks weights {missing[:3]}: a different model?")
        self.set_weights([tensors[n] for n in names])
        optimizer_state = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("optimizer/")}
        if optimizer_state and self.optimizer is not None:
            self._set_optimizer_state(optimizer_state)

    def _optimizer_state(self) -> dict[str, Any]:
        """The optimizer state: where the parameters are held (the update rule runs there), else replica 0's."""
        state: dict[str, Any]
        if not self._installed:
            state = self.optimizer.get_state()
            return state
        stored = self._stored_state()
        if stored is not None:
            state = stored["rule_state"] or self.optimizer.get_state()
            return state
        return self._runner().computed_optimizer_state()

    def _set_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.set_state(state)
        if not self._installed:
            return
        self._runner().set_computed_optimizer_state(state)
        self._set_stored(rule_state=state)

    def save(self, filepath: str) -> None:
        """Save architecture, compile settings, weights and optimizer state into directory ``filepath``."""
        import os

        os.makedirs(filepath, exist_ok=True)
        self.save_weights(os.path.join(filepath, "weights"))
        saving.write_json(os.path.join(filepath, "model.json"), {
            "format": "daskdist-model-1",
            "class_name": type(self).__name__,
            "config": self.get_config(),
            "input_shape": list(self._built_input_shape() or []),
            "compile": self._compile_config,
        })

    def _built_input_shape(self) -> tuple[Any, ...] | None:
        return self._declared_input_shape() or getattr(self, "_input_shape", None)


class Sequential(Model):
    """A linear stack of layers (Keras' ``Sequential``)."""

    def build(self, input_shape: tuple[Any, ...]) -> None:
        self._input_shape = tuple(input_shape)
        super().build(input_shape)


def load_model(filepath: str, compile: bool = True) -> Model:
    """Load a model saved with ``model.save``; inside ``strategy.scope()`` it is distributed over the replicas."""
    import os

    from daskdist.keras import losses, optimizers

    info = saving.read_json(os.path.join(filepath, "model.json"))
    if info.get("format") != "daskdist-model-1":
        raise saving.CheckpointError(f"{filepath} is not a daskdist saved model")
    cls = Sequential if info.get("class_name") == "Sequential" else Model
    model = cls.from_config(info["config"])
    if info.get("input_shape"):
        model.build(tuple(info["input_shape"]))
    compile_config = info.get("compile")
    if compile and compile_config:
        optimizer = optimizers.get(compile_config["optimizer"]["class_name"].lower())
        optimizer = type(optimizer).from_config(compile_config["optimizer"]["config"])
        loss = losses.get(compile_config["loss"]["class_name"]).__class__.from_config(compile_config["loss"]["config"])
        model.compile(optimizer=optimizer, loss=loss, metrics=compile_config.get("metrics") or None,
                      weighted_metrics=compile_config.get("weighted_metrics") or None)
    model.load_weights(os.path.join(filepath, "weights"))
    return model
