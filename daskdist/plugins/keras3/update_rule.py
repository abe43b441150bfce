"""A Keras 3 optimizer as a parameter holder or server runs it: one of the trainer's update rules.

Under ``CentralStorageStrategy`` and ``ParameterServerStrategy`` the
parameters and the optimizer state live off the replicas, in parameter stores
that know no framework (``training_contract.UpdateRule``). ``update_rule``
builds the framework-free rule of the same form (``daskdist.training.update_rules``) from the Keras optimizer's
config (Keras' update formulas, epsilon placement included: ``m / (sqrt(v) +
epsilon)`` for Adam, ``g / sqrt(v + epsilon)`` for RMSprop), and
``rule_state`` / ``assign_rule_state`` translate its slots (``<slot>/<index>``
in ``trainable_variables`` order) to and from the Keras optimizer's variables,
so a checkpoint of the client's model holds the stored optimizer state.

A ``keras.optimizers.schedules.LearningRateSchedule`` (any schedule Keras
serialises: ``ExponentialDecay``, ``PiecewiseConstantDecay``, ``CosineDecay``,
``InverseTimeDecay``, a registered one of the user's) becomes a
``ScheduledRule``: the store evaluates Keras' own schedule at the rule's step
count before each update, as Keras' optimizer does at its ``iterations``. The
step count is the stored one: the holder's under CentralStorage, every
worker's pushes counted under ParameterServerStrategy (TF's ``iterations``
variable on the ps). A float learning rate (``LearningRateScheduler`` sets
it) travels with each step instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from daskdist.exceptions import UnsupportedOptimizerError
from daskdist.training.update_rules import SGD, Adam, RMSprop

__all__ = ["SUPPORTED", "KerasAdam", "ScheduledRule", "UnsupportedOptimizerError", "assign_rule_state",
           "check_optimizer", "learning_rate", "rule_state", "take_stored", "update_rule"]


def _sgd(config: dict[str, Any]) -> Any:
    return SGD(config["learning_rate"], momentum=config["momentum"], nesterov=config["nesterov"])


def _adam(config: dict[str, Any]) -> Any:
    import keras

    # KerasAdam repeats the torch backend's operations; the JAX backend's Adam (XLA's own fused arithmetic) is
    # not repeated bit for bit by either, and the framework-free Adam needs no torch
    cls = KerasAdam if keras.backend.backend() == "torch" else Adam
    return cls(config["learning_rate"], beta_1=config["beta_1"], beta_2=config["beta_2"], epsilon=config["epsilon"])


class KerasAdam(Adam):
    """Adam as Keras' torch backend computes it, operation for operation (bit-equal updates).

    The framework-free ``Adam`` (``update_rules.Adam``) has Keras' formula (``m / (sqrt(v) + epsilon)``)
    but computes ``alpha`` in float64 and ``m`` as ``m += (g - m) * (1 -
    beta_1)``; Keras' torch optimizer (``torch_adam``) computes ``alpha`` in
    the parameters' dtype and ``m = m * beta_1 + (1 - beta_1) * g``. Adam
    divides by ``sqrt(v)``, so an ulp of difference on a near-zero gradient
    grows over the steps: this rule runs Keras' torch operations on torch
    views of the stored numpy arrays (in place, no copy).
    """

    def _update(self, param: Any, grad: Any, slots: dict[str, Any], step: int) -> None:
        import torch

        p, g, m, v = (torch.from_numpy(np.asarray(a)) for a in (param, grad, slots["m"], slots["v"]))
        dtype = p.dtype
        lr = torch.tensor(float(self.learning_rate), dtype=dtype)
        local_step = torch.tensor(float(step), dtype=dtype)
        beta_1_power = torch.pow(torch.tensor(self.beta_1, dtype=dtype), local_step)
        beta_2_power = torch.pow(torch.tensor(self.beta_2, dtype=dtype), local_step)
        alpha = lr * torch.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        m.mul_(self.beta_1).add_(g, alpha=1 - self.beta_1)
        v.mul_(self.beta_2).add_(g * g, alpha=1 - self.beta_2)
        p.add_((m * alpha) / (torch.sqrt(v) + self.epsilon), alpha=-1)


def _rmsprop(config: dict[str, Any]) -> Any:
    return RMSprop(config["learning_rate"], rho=config["rho"], momentum=config["momentum"],
                   epsilon=config["epsilon"])


# Keras class name -> (the framework-free rule's factory, {rule slot: the Keras optimizer's slot list attribute},
# options that must keep these values)
_RULES: dict[str, tuple[Callable[[dict[str, Any]], Any], dict[str, str], dict[str, Any]]] = {
    "SGD": (_sgd, {"momentum": "momentums"}, {}),
    "Adam": (_adam, {"m": "_momentums", "v": "_velocities"}, {"amsgrad": False}),
    "RMSprop": (_rmsprop, {"velocity": "_velocities", "momentum": "_momentums"}, {"centered": False}),
}
SUPPORTED = tuple(f"keras.optimizers.{name}" for name in _RULES)
_DEFAULTS = {"weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None, "use_ema": False,
             "loss_scale_factor": None, "gradient_accumulation_steps": None}


def check_optimizer(optimizer: Any, strategy: str) -> None:
    """Raise ``UnsupportedOptimizerError`` unless the stores can run ``optimizer`` (naming those they can)."""
    name = type(optimizer).__name__
    if name not in _RULES or type(optimizer).__module__.split(".")[0] != "keras":
        raise UnsupportedOptimizerError(
            f"{strategy} holds the parameters and applies the updates on its parameter stores, which run "
            f"{', '.join(SUPPORTED)} (no weight decay, clipping, EMA, loss scaling or gradient accumulation); "
            f"got {type(optimizer).__module__}.{name}: compile with one of those, or use MirroredStrategy")
    config = optimizer.get_config()
    schedule = config.get("learning_rate")
    if isinstance(schedule, dict):
        import keras

        try:
            _schedule(keras, schedule)
        except Exception as e:  # noqa: BLE001 - any failure to rebuild it is the user's schedule's
            raise UnsupportedOptimizerError(
                f"{strategy} evaluates the learning-rate schedule on its parameter stores from its config, and "
                f"Keras cannot rebuild {schedule.get('class_name')!r} from it ({e}): register the class with "
                "keras.saving.register_keras_serializable and give it get_config/from_config") from e
    wrong = {key: config.get(key) for key, value in {**_DEFAULTS, **_RULES[name][2]}.items()
             if config.get(key, value) != value}
    if wrong:
        raise UnsupportedOptimizerError(
            f"{strategy}: the parameter stores run {', '.join(SUPPORTED)} without {sorted(wrong)} (got {wrong}); "
            "compile without them, or use MirroredStrategy")


class ScheduledRule:
    """An update rule whose learning rate is a Keras ``LearningRateSchedule`` of its step count.

    Before each ``apply`` the schedule (kept as Keras' serialised config,
    rebuilt once where the rule runs) is evaluated at the rule's
    ``iterations``, the step count before this update, as Keras' optimizer
    evaluates it at its ``iterations``; ``learning_rate`` is ``None``: nothing
    is sent with each step.

    Parameters
    ----------
    rule
        The update rule (``daskdist.training.update_rules``) that applies the updates.
    schedule
        ``optimizer.get_config()["learning_rate"]``: the schedule as Keras serialises it.
    backend
        The Keras backend the schedule is evaluated on (the client's).
    """

    def __init__(self, rule: Any, schedule: dict[str, Any], backend: str):
        self.rule = rule
        self.schedule = schedule
        self.backend = backend
        self._evaluate: Any = None

    @property
    def learning_rate(self) -> None:
        return None

    @learning_rate.setter
    def learning_rate(self, value: float | None) -> None:
        if value is not None:
            raise TypeError("the learning rate of an optimizer made with a LearningRateSchedule is not settable "
                            "(Keras refuses it too)")

    @property
    def slot_names(self) -> Any:
        return self.rule.slot_names

    @property
    def iterations(self) -> int:
        return int(self.rule.iterations)

    def current(self) -> float:
        """The schedule's learning rate at the rule's step count (Keras' own computation, as a float)."""
        if self._evaluate is None:
            from daskdist.plugins.keras3.backend import prepare_replica

            keras = prepare_replica(self.backend)
            schedule = _schedule(keras, self.schedule)

            def evaluate(step: int) -> float:
                value = schedule(keras.ops.convert_to_tensor(np.int64(step), dtype="int64"))
                return float(keras.ops.convert_to_numpy(value))

            self._evaluate = evaluate
        return float(self._evaluate(self.iterations))

    def apply(self, params: list[Any], grads: list[Any]) -> None:
        self.rule.learning_rate = self.current()
        self.rule.apply(params, grads)

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.rule.get_state()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        self.rule.set_state(state)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_evaluate": None}

    def __repr__(self) -> str:
        return f"ScheduledRule({self.rule!r}, {self.schedule.get('class_name')})"


def _schedule(keras: Any, config: dict[str, Any]) -> Any:
    """The ``LearningRateSchedule`` of a serialised one, as Keras' optimizer rebuilds it (``TypeError`` if it cannot)."""
    schedule = keras.saving.deserialize_keras_object(config)
    if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        raise TypeError(f"{config.get('class_name')!r} rebuilds as {type(schedule).__name__}, not a LearningRateSchedule")
    return schedule


def learning_rate(optimizer: Any) -> float | None:
    """The Keras optimizer's float learning rate now, or ``None`` when a schedule gives it (the stores evaluate it)."""
    if isinstance(optimizer.get_config().get("learning_rate"), dict):
        return None
    return float(np.asarray(optimizer.learning_rate))


def update_rule(optimizer: Any) -> Any:
    """The update rule that applies ``optimizer``'s updates on numpy arrays in place (a fresh one);
    a ``ScheduledRule`` around it when the learning rate is a schedule."""
    check_optimizer(optimizer, "this strategy")
    config = optimizer.get_config()
    schedule = config.get("learning_rate")
    if not isinstance(schedule, dict):
        return _RULES[type(optimizer).__name__][0](config)
    from daskdist.plugins.keras3.backend import keras_backend

    return ScheduledRule(_RULES[type(optimizer).__name__][0]({**config, "learning_rate": 0.0}), schedule,
                         keras_backend())


def _slot_lists(optimizer: Any, rule: Any) -> dict[str, list[Any]]:
    slots = _RULES[type(optimizer).__name__][1]
    return {slot: list(getattr(optimizer, slots[slot], None) or []) for slot in rule.slot_names}


def rule_state(optimizer: Any, rule: Any) -> dict[str, Any]:
    """The Keras optimizer's slots and step counter as ``rule.get_state()`` keys them (for ``set_stored``)."""
    import keras

    state: dict[str, Any] = {"iterations": np.asarray(int(keras.ops.convert_to_numpy(optimizer.iterations)),
                                                      dtype=np.int64)}
    if not optimizer.built:
        return state
    for slot, variables in _slot_lists(optimizer, rule).items():
        for i, variable in enumerate(variables):
            state[f"{slot}/{i}"] = np.array(keras.ops.convert_to_numpy(variable.value), copy=True)
    return state


def assign_rule_state(optimizer: Any, variables: list[Any], rule: Any, state: dict[str, Any]) -> None:
    """Put a stored ``rule_state`` into the Keras optimizer (built for ``variables`` first if need be)."""
    if not optimizer.built:
        optimizer.build(variables)
    if "iterations" in state:
        optimizer.iterations.assign(int(np.asarray(state["iterations"]).reshape(-1)[0]))
    for slot, targets in _slot_lists(optimizer, rule).items():
        for i, target in enumerate(targets):
            value = state.get(f"{slot}/{i}")
            if value is not None:
                target.assign(np.asarray(value))


def take_stored(model: Any, client: Any, driver: Any, optimizer: Any = None) -> None:
    """Give the client's ``model`` the parameters and optimizer slots its driver's stores hold (``None``: none yet).

    After each epoch under a parameter holder or parameter servers, so that
    ``get_weights``, ``save`` and checkpoints see the stored state. The slots
    go to ``optimizer`` (default: the model's, from ``compile``).
    """
    variables = list(model.trainable_variables)
    stored = driver.stored_state(client, len(variables))
    if stored is None:
        return
    for variable, value in zip(variables, stored["params"]):
        variable.assign(np.asarray(value))
    optimizer = optimizer if optimizer is not None else model.optimizer
    assign_rule_state(optimizer, variables, update_rule(optimizer), stored["rule_state"])
