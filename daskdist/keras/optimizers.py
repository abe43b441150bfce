"""Optimizers that update parameter arrays in place: the trainer's update rules with TensorFlow's custom-loop API.

The arithmetic is ``daskdist.training.update_rules`` (Keras' SGD, Adam and
RMSprop, framework-free: the parameter stores run the same rules for every
adapter); this module adds what a built-in model's user calls:
``apply_gradients`` in a custom loop, ``lr``, a resident copy on the
replicas. ``apply(params, grads)`` takes two equally long lists; slot
variables (momentum, Adam's moments) are kept per *position* in those lists,
so pass the parameters in the same order every step.

Examples
--------
>>> opt = get("adam")
>>> opt.apply([w, b], [dw, db])      # w and b change in place
>>> opt.lr = opt.lr * 0.5            # what learning-rate callbacks do
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from daskdist import context
from daskdist.keras.backend import to_numpy
from daskdist.strategy.base import Strategy
from daskdist.training import update_rules

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


class Optimizer(update_rules.UpdateRule):
    """Base class: an update rule (``daskdist.training.update_rules``) with TensorFlow's custom-loop API.

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

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
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


class SGD(Optimizer, update_rules.SGD):
    """Stochastic gradient descent, with optional (Nesterov) momentum, as Keras (``update_rules.SGD``)."""

    def __init__(self, learning_rate: float = 0.01, momentum: float = 0.0, nesterov: bool = False,
                 name: str | None = None):
        super().__init__(learning_rate, momentum, nesterov, name)


class Adam(Optimizer, update_rules.Adam):
    """Adam, Keras' form (``update_rules.Adam``)."""

    def __init__(self, learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, name: str | None = None):
        super().__init__(learning_rate, beta_1, beta_2, epsilon, name)


class RMSprop(Optimizer, update_rules.RMSprop):
    """RMSprop, Keras' form, not centred (``update_rules.RMSprop``)."""

    def __init__(self, learning_rate: float = 0.001, rho: float = 0.9, momentum: float = 0.0,
                 epsilon: float = 1e-7, name: str | None = None):
        super().__init__(learning_rate, rho, momentum, epsilon, name)


_ALIASES: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam, "rmsprop": RMSprop}


def get(identifier: str | dict[str, Any] | Optimizer | type[Optimizer]) -> Optimizer:
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
