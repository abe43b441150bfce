"""A Keras 3 optimizer as a parameter holder or server runs it: a built-in ``daskdist.keras`` optimizer.

Under ``CentralStorageStrategy`` and ``ParameterServerStrategy`` the
parameters and the optimizer state live off the replicas, in parameter stores
that know no framework (``training_contract.UpdateRule``). ``update_rule``
builds the built-in optimizer of the same form from the Keras optimizer's
config (Keras' update formulas, epsilon placement included: ``m / (sqrt(v) +
epsilon)`` for Adam, ``g / sqrt(v + epsilon)`` for RMSprop), and
``rule_state`` / ``assign_rule_state`` translate its slots (``<slot>/<index>``
in ``trainable_variables`` order) to and from the Keras optimizer's variables,
so a checkpoint of the client's model holds the stored optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from daskdist.keras.optimizers import Adam

__all__ = ["SUPPORTED", "KerasAdam", "UnsupportedOptimizerError", "assign_rule_state", "check_optimizer", "rule_state",
           "take_stored", "update_rule"]


class UnsupportedOptimizerError(NotImplementedError):
    """A Keras optimizer (or option) that the parameter stores cannot run."""


def _sgd(config: dict[str, Any]) -> Any:
    from daskdist.keras.optimizers import SGD

    return SGD(config["learning_rate"], momentum=config["momentum"], nesterov=config["nesterov"])


def _adam(config: dict[str, Any]) -> Any:
    import keras

    # KerasAdam repeats the torch backend's operations; the JAX backend's Adam (XLA's own fused arithmetic) is
    # not repeated bit for bit by either, and the built-in Adam needs no torch
    cls = KerasAdam if keras.backend.backend() == "torch" else Adam
    return cls(config["learning_rate"], beta_1=config["beta_1"], beta_2=config["beta_2"], epsilon=config["epsilon"])


class KerasAdam(Adam):
    """Adam as Keras' torch backend computes it, operation for operation (bit-equal updates).

    The built-in ``Adam`` has Keras' formula (``m / (sqrt(v) + epsilon)``)
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
    from daskdist.keras.optimizers import RMSprop

    return RMSprop(config["learning_rate"], rho=config["rho"], momentum=config["momentum"],
                   epsilon=config["epsilon"])


# Keras class name -> (the built-in rule's factory, {rule slot: the Keras optimizer's slot list attribute},
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
    if isinstance(config.get("learning_rate"), dict):
        raise UnsupportedOptimizerError(
            f"{strategy}: a learning-rate schedule ({config['learning_rate'].get('class_name')}) is not run on the "
            "parameter stores yet: give a float learning rate (keras.callbacks.LearningRateScheduler works)")
    wrong = {key: config.get(key) for key, value in {**_DEFAULTS, **_RULES[name][2]}.items()
             if config.get(key, value) != value}
    if wrong:
        raise UnsupportedOptimizerError(
            f"{strategy}: the parameter stores run {', '.join(SUPPORTED)} without {sorted(wrong)} (got {wrong}); "
            "compile without them, or use MirroredStrategy")


def update_rule(optimizer: Any) -> Any:
    """The built-in optimizer that applies ``optimizer``'s updates on numpy arrays in place (a fresh one)."""
    check_optimizer(optimizer, "this strategy")
    return _RULES[type(optimizer).__name__][0](optimizer.get_config())


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


def take_stored(model: Any, client: Any, driver: Any) -> None:
    """Give the client's ``model`` the parameters and optimizer slots its driver's stores hold (``None``: none yet).

    After each epoch under a parameter holder or parameter servers, so that
    ``get_weights``, ``save`` and checkpoints see the stored state.
    """
    variables = list(model.trainable_variables)
    stored = driver.stored_state(client, len(variables))
    if stored is None:
        return
    for variable, value in zip(variables, stored["params"]):
        variable.assign(np.asarray(value))
    assign_rule_state(model.optimizer, variables, update_rule(model.optimizer), stored["rule_state"])
