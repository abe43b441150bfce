"""The parameter stores' update rules: Keras' SGD, Adam and RMSprop on arrays updated in place, no framework.

A rule's ``apply(params, grads)`` takes two equally long lists; slot
variables (momentum, Adam's moments) are kept per *position* in those lists,
so pass the parameters in the same order every step. The slots live in the
same namespace as the parameters (a cupy parameter gets cupy slots). These
are the ``training_contract.UpdateRule`` a parameter holder or server runs
for every adapter: the built-in layers' optimizers
(``daskdist.keras.optimizers``) are these rules with the custom-loop API
added, and the Keras 3 adapter maps a Keras optimizer onto one
(``plugins/keras3/update_rule.py``).

Examples
--------
>>> rule = Adam(0.001)
>>> rule.apply([w, b], [dw, db])      # w and b change in place
>>> rule.learning_rate = 0.0005       # what learning-rate callbacks do
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import numpy as np

from daskdist import fault_points
from daskdist.arrays import move_like, namespace, to_numpy

__all__ = ["RULES", "SGD", "Adam", "RMSprop", "UpdateRule", "move_like"]

Array = Any



_Rule = TypeVar("_Rule", bound="UpdateRule")


class UpdateRule:
    """Base class: an optimizer's update applied to parameter arrays in place.

    Parameters
    ----------
    learning_rate
        Step size; settable later through :attr:`learning_rate`.
    name
        Display name.

    Attributes
    ----------
    iterations : int
        Number of :meth:`apply` calls so far.
    """

    slot_names: tuple[str, ...] = ()

    def __init__(self, learning_rate: float = 0.01, name: str | None = None):
        self._learning_rate = float(learning_rate)
        self.name = name or type(self).__name__
        self.iterations = 0
        self._slots: dict[str, list[Array]] = {}

    @property
    def learning_rate(self) -> float:
        """The current learning rate (a ``float``)."""
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self._learning_rate = float(value)

    def apply(self, params: list[Array], grads: list[Array]) -> None:
        """Update every ``params[i]`` in place from ``grads[i]``, then increment :attr:`iterations`.

        Raises
        ------
        ValueError
            If the lists differ in length, a shape differs, or the parameter
            list changed length since the slots were created.
        """
        params, grads = list(params), list(grads)
        if len(params) != len(grads):
            raise ValueError(f"{len(params)} params but {len(grads)} grads")
        for i, (p, g) in enumerate(zip(params, grads)):
            if p.shape != g.shape:
                raise ValueError(f"param {i} has shape {tuple(p.shape)} but its gradient {tuple(g.shape)}")
        self._ensure_slots(params)
        step = self.iterations + 1
        for i, (p, g) in enumerate(zip(params, grads)):
            g = move_like(g, p)
            if g.dtype != p.dtype:
                g = g.astype(p.dtype)
            slots = {name: self._slots[name][i] for name in self.slot_names}
            self._update(p, g, slots, step)
            if i == 0 and fault_points.ARMED:  # a test's fault point: the first parameter updated, not the rest
                fault_points.reached("apply")
        self.iterations = step

    def _update(self, param: Array, grad: Array, slots: dict[str, Array], step: int) -> None:
        """Update one parameter in place (``step`` counts from 1)."""
        raise NotImplementedError

    def _ensure_slots(self, params: list[Array]) -> None:
        for name in self.slot_names:
            slots = self._slots.get(name)
            if slots is None:
                self._slots[name] = [namespace(p).zeros_like(p) for p in params]
                continue
            if len(slots) != len(params):
                raise ValueError(
                    f"{self.name}: slots were created for {len(slots)} params, now given {len(params)}"
                )
            for i, p in enumerate(params):
                s = slots[i]
                if s.shape != p.shape:
                    raise ValueError(f"{self.name}: slot {name}/{i} has shape {tuple(s.shape)}, param {tuple(p.shape)}")
                if namespace(s) is not namespace(p) or s.dtype != p.dtype:  # e.g. restored on the host, params on a GPU
                    slots[i] = move_like(s, p).astype(p.dtype, copy=False)

    # -- checkpoints ---------------------------------------------------------------------------------------

    def get_state(self) -> dict[str, Array]:
        """``{"iterations": 0-d int64, "<slot>/<i>": array, ...}`` (the arrays themselves, not copies)."""
        state: dict[str, Array] = {"iterations": np.asarray(self.iterations, dtype=np.int64)}
        for name in self.slot_names:
            for i, s in enumerate(self._slots.get(name, ())):
                state[f"{name}/{i}"] = s
        return state

    def set_state(self, state: dict[str, Array]) -> None:
        """Restore :meth:`get_state`'s output (arrays are copied; slots move to the params' device on use)."""
        iterations = state.get("iterations", 0)
        self.iterations = int(to_numpy(iterations).reshape(-1)[0]) if hasattr(iterations, "shape") else int(iterations)
        slots: dict[str, list[Array]] = {}
        for key, value in state.items():
            if key == "iterations":
                continue
            name, _, index = key.partition("/")
            if name not in self.slot_names or not index.isdigit():
                raise KeyError(f"{self.name}: unknown optimizer state entry {key!r}")
            slots.setdefault(name, []).append((int(index), value))
        self._slots = {}
        for name, entries in slots.items():
            entries.sort(key=lambda e: e[0])
            if [i for i, _ in entries] != list(range(len(entries))):
                raise ValueError(f"{self.name}: slot {name!r} entries are not numbered 0..n-1")
            self._slots[name] = [namespace(v).array(v, copy=True) for _, v in entries]

    # -- configuration -------------------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """Constructor keyword arguments (JSON-serialisable), with the current learning rate."""
        return {"name": self.name, "learning_rate": self._learning_rate}

    @classmethod
    def from_config(cls: type[_Rule], config: dict[str, Any]) -> _Rule:
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class SGD(UpdateRule):
    """Stochastic gradient descent, with optional (Nesterov) momentum, as Keras.

    Without momentum ``p -= lr * g``; with it ``v = momentum * v - lr * g``
    then ``p += v`` or, Nesterov, ``p += momentum * v - lr * g``.
    """

    def __init__(self, learning_rate: float = 0.01, momentum: float = 0.0, nesterov: bool = False,
                 name: str | None = None):
        super().__init__(learning_rate, name)
        self.momentum = float(momentum)
        if not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum}")
        self.nesterov = bool(nesterov)
        self.slot_names = ("momentum",) if self.momentum > 0 else ()

    def _update(self, param: Array, grad: Array, slots: dict[str, Array], step: int) -> None:
        lr = self._learning_rate
        if not self.slot_names:
            param -= lr * grad
            return
        v = slots["momentum"]
        v *= self.momentum
        v -= lr * grad
        if self.nesterov:
            param += self.momentum * v - lr * grad
        else:
            param += v

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "momentum": self.momentum, "nesterov": self.nesterov}


class Adam(UpdateRule):
    """Adam (Keras' form).

    With ``t = iterations + 1``: ``m += (g - m) * (1 - beta_1)``,
    ``v += (g**2 - v) * (1 - beta_2)``, then
    ``p -= lr * sqrt(1 - beta_2**t) / (1 - beta_1**t) * m / (sqrt(v) + epsilon)``.
    """

    slot_names = ("m", "v")

    def __init__(self, learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, name: str | None = None):
        super().__init__(learning_rate, name)
        self.beta_1 = float(beta_1)
        self.beta_2 = float(beta_2)
        self.epsilon = float(epsilon)

    def _update(self, param: Array, grad: Array, slots: dict[str, Array], step: int) -> None:
        xp = namespace(param)
        m, v = slots["m"], slots["v"]
        m += (grad - m) * (1.0 - self.beta_1)
        v += (grad * grad - v) * (1.0 - self.beta_2)
        alpha = self._learning_rate * math.sqrt(1.0 - self.beta_2 ** step) / (1.0 - self.beta_1 ** step)
        denom = xp.sqrt(v)
        denom += self.epsilon
        param -= alpha * m / denom

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
        }


class RMSprop(UpdateRule):
    """RMSprop (Keras' form, not centred).

    ``v = rho * v + (1 - rho) * g**2``; ``step = lr * g / sqrt(v + epsilon)``;
    then ``p -= step``, or with momentum ``mom = momentum * mom + step`` and
    ``p -= mom``.
    """

    def __init__(self, learning_rate: float = 0.001, rho: float = 0.9, momentum: float = 0.0,
                 epsilon: float = 1e-7, name: str | None = None):
        super().__init__(learning_rate, name)
        self.rho = float(rho)
        self.momentum = float(momentum)
        self.epsilon = float(epsilon)
        self.slot_names = ("velocity", "momentum") if self.momentum > 0 else ("velocity",)

    def _update(self, param: Array, grad: Array, slots: dict[str, Array], step: int) -> None:
        xp = namespace(param)
        v = slots["velocity"]
        v *= self.rho
        v += (1.0 - self.rho) * grad * grad
        denom = v + self.epsilon
        xp.sqrt(denom, out=denom)
        increment = self._learning_rate * grad / denom
        if self.momentum > 0:
            mom = slots["momentum"]
            mom *= self.momentum
            mom += increment
            param -= mom
        else:
            param -= increment

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "rho": self.rho, "momentum": self.momentum, "epsilon": self.epsilon}


#: The rules by their lower-case names.
RULES: dict[str, type[UpdateRule]] = {"sgd": SGD, "adam": Adam, "rmsprop": RMSprop}
