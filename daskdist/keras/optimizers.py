"""Optimizers that update parameter arrays in place (Keras' SGD and Adam update rules).

``apply(params, grads)`` takes two equally long lists; slot variables
(momentum, Adam's moments) are kept per *position* in those lists, so pass
the parameters in the same order every step. The slots live in the same
namespace as the parameters (a cupy parameter gets cupy slots).

Examples
--------
>>> opt = get("adam")
>>> opt.apply([w, b], [dw, db])      # w and b change in place
>>> opt.lr = opt.lr * 0.5            # what learning-rate callbacks do
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import numpy as np

from daskdist import context, fault_points
from daskdist.keras.backend import move_like, to_numpy, xp_of
from daskdist.strategy.base import Strategy

__all__ = ["SGD", "Adam", "LearningRate", "Optimizer", "RMSprop", "get", "serialize"]

Array = Any


class LearningRate(float):
    """A float that also answers ``.numpy()``, so TensorFlow-style ``optimizer.lr.numpy()`` works."""

    def numpy(self) -> float:
        return float(self)


def _current_strategy() -> Any:
    frame = context.current_frame()
    if frame is not None and frame.replica_context is None and isinstance(frame.strategy, Strategy):
        return frame.strategy
    return None


class _InstalledOptimizer:
    """An optimizer resident on a replica (made in ``strategy.scope()``, captured by a ``run`` function)."""

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer

    def unwrap(self) -> Optimizer:
        return self.optimizer

    def snapshot(self) -> dict[str, Any]:
        return {k: np.array(to_numpy(v), copy=True) for k, v in self.optimizer.get_state().items()}

    def restore(self, state: dict[str, Any]) -> None:
        if state:
            self.optimizer.set_state(state)


class Optimizer:
    """Base class.

    Parameters
    ----------
    learning_rate
        Step size; settable later through :attr:`learning_rate` or :attr:`lr`.
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
        self._strategy = _current_strategy()  # made in strategy.scope(): resident on the replicas (custom loops)
        self._installed = False
        self._optimizer_id = f"optimizer-{uuid.uuid4().hex[:12]}"

    # -- custom loops ----------------------------------------------------------------------------------------

    def apply_gradients(self, grads_and_vars: Any, name: str | None = None, skip_gradients_aggregation: bool = False,
                        experimental_aggregate_gradients: bool = True) -> int:
        """Apply ``(gradient, variable)`` pairs (TF's ``apply_gradients``); returns :attr:`iterations`.

        The variables are parameter arrays (``model.trainable_variables``),
        updated in place. Inside a replica of a strategy with several
        replicas the gradients are first summed over the replicas
        (one all-reduce), as TF's optimizers do in ``strategy.run``: scale
        the loss by the *global* batch size (``dd.nn.compute_average_loss``)
        so the sum is the global mean's gradient. ``skip_gradients_aggregation=True``
        (or ``experimental_aggregate_gradients=False``) applies them as given.
        Pairs whose gradient is ``None`` are left out, as TF does (with a
        warning there); none left raises ``ValueError``. Pass the same
        variables in the same order every step: the slots (momentum, Adam's
        moments) are kept by position.
        """
        pairs = [(g, v) for g, v in grads_and_vars]
        kept = [(g, v) for g, v in pairs if g is not None]
        if not kept:
            raise ValueError(f"No gradients provided for any variable ({len(pairs)} variables)")
        grads = [g for g, _ in kept]
        ctx = context.get_replica_context()
        if (ctx is not None and ctx.num_replicas_in_sync > 1 and context.current_runtime() is not None
                and not skip_gradients_aggregation and experimental_aggregate_gradients):
            from daskdist.ops import ReduceOp

            grads = ctx.all_reduce(ReduceOp.SUM, grads)
        self.apply([v for _, v in kept], grads)
        return self.iterations

    def __reduce_ex__(self, protocol: Any) -> Any:
        from daskdist.keras.resident_ref import reduce_for_replicas

        reference = reduce_for_replicas(self, self._optimizer_id)
        return reference if reference is not None else super().__reduce_ex__(protocol)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_strategy"] = None
        return state

    def resident(self) -> _InstalledOptimizer:
        payload = object.__new__(type(self))
        payload.__dict__.update(self.__getstate__())
        return _InstalledOptimizer(payload)

    @property
    def learning_rate(self) -> LearningRate:
        """The current learning rate (a ``float``; ``.numpy()`` also gives it, as for a TF variable)."""
        return LearningRate(self._learning_rate)

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self._learning_rate = float(value)

    lr = learning_rate

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
                self._slots[name] = [xp_of(p).zeros_like(p) for p in params]
                continue
            if len(slots) != len(params):
                raise ValueError(
                    f"{self.name}: slots were created for {len(slots)} params, now given {len(params)}"
                )
            for i, p in enumerate(params):
                s = slots[i]
                if s.shape != p.shape:
                    raise ValueError(f"{self.name}: slot {name}/{i} has shape {tuple(s.shape)}, param {tuple(p.shape)}")
                if xp_of(s) is not xp_of(p) or s.dtype != p.dtype:  # e.g. restored on the host, params on a GPU
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
            self._slots[name] = [xp_of(v).array(v, copy=True) for _, v in entries]

    # -- configuration -------------------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """Constructor keyword arguments (JSON-serialisable), with the current learning rate."""
        return {"name": self.name, "learning_rate": self._learning_rate}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Optimizer:
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class SGD(Optimizer):
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


class Adam(Optimizer):
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
        xp = xp_of(param)
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


class RMSprop(Optimizer):
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
        xp = xp_of(param)
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


_ALIASES: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam, "rmsprop": RMSprop}


def get(identifier: str | dict | Optimizer | type[Optimizer]) -> Optimizer:
    """Resolve an optimizer: ``"sgd"``, ``"adam"``, ``"rmsprop"`` (default settings), a class name, a
    ``{"class_name", "config"}`` dict, a class, or an instance (returned as is)."""
    if isinstance(identifier, Optimizer):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Optimizer):
        return identifier()
    if isinstance(identifier, dict):
        cls = _ALIASES.get(str(identifier["class_name"]).lower())
        if cls is None:
            raise ValueError(f"Unknown optimizer class {identifier['class_name']!r}")
        return cls.from_config(identifier.get("config", {}))
    if isinstance(identifier, str):
        cls = _ALIASES.get(identifier.lower())
        if cls is None:
            raise ValueError(f"Unknown optimizer {identifier!r}; known: {sorted(_ALIASES)}")
        return cls()
    raise TypeError(f"Cannot interpret {identifier!r} as an optimizer")


def serialize(optimizer: Optimizer) -> dict[str, Any]:
    """``{"class_name": ..., "config": ...}`` for :func:`get`."""
    return {"class_name": type(optimizer).__name__, "config": optimizer.get_config()}
