"""What differs on Keras' JAX backend: a step split around the exchange with Keras' stateless calls.

Keras' JAX ``Model.train_step(state, data)`` is stateless: it takes the
model's variables as arrays, computes the gradients with
``jax.value_and_grad``, calls ``optimizer.stateless_apply(optimizer_variables,
grads, trainable_variables)``, updates the metrics and returns the new state.
A replica's step runs it in two halves:

1. **gradients**: Keras' ``train_step`` (Keras' own, or the user's override)
   while its optimizer is ``exchange.captured``: ``stateless_apply`` then hands
   the gradients out in place of the new parameters, so this half returns the
   batch's gradients, the new non-trainable state (moving statistics, random
   generators) and the updated metric variables;
2. the driver's **exchange** (all-reduce, or the parameter holder/servers);
3. **apply**: ``optimizer.stateless_apply`` with the gradients that came back
   (skipped when the driver assigned the parameters itself).

Both halves are jitted (``jax.jit``), as Keras' own ``fit`` jits its step:
eager JAX dispatches every operation on its own, several times slower than
one compiled program per half; a model compiled with ``run_eagerly=True`` or
``jit_compile=False`` runs them eagerly, as Keras would. The all-reduce stays
outside the compiled code (a host callback inside it would hold the step's
program while the replicas wait for each other). The variables keep the
state between steps (read as arrays before, assigned after), so metrics,
snapshots and ``get_weights`` read them as on the torch backend.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist.plugins.keras3 import exchange as exchange_module

if TYPE_CHECKING:
    from daskdist.strategy.drivers.contract import GradientExchange

__all__ = ["JaxSteps", "from_numpy", "limit_threads", "no_grad", "steps", "to_batch", "to_numpy", "views"]

logger = logging.getLogger(__name__)

#: XLA's CPU flags for one intra-op thread (a replica per core: no oversubscription)
_ONE_THREAD_FLAGS = ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1")


def to_batch(batch: Any) -> Any:
    """A batch as Keras' JAX step takes it: numpy arrays as they are (``jax.jit`` takes them), lists as tuples."""
    return tuple(batch) if isinstance(batch, list) else batch


def to_numpy(grads: Sequence[Any], variables: Sequence[Any]) -> list[np.ndarray]:
    """The gradients as numpy arrays (zeros for a variable without one); refused inside ``jax.jit``."""
    import jax

    arrays = []
    for grad, variable in zip(grads, variables):
        if isinstance(grad, jax.core.Tracer):
            raise RuntimeError(
                "optimizer.apply of an optimizer created in a daskdist strategy's scope was called inside jax.jit: "
                "its gradients are summed over the replicas, which needs their values. Call optimizer.apply (or "
                "stateless_apply) outside the jitted function, with the gradients it returns")
        if grad is None:
            arrays.append(np.zeros(tuple(variable.shape), dtype=_dtype(variable)))
        else:
            arrays.append(np.asarray(grad))
    return arrays


def from_numpy(arrays: Sequence[Any]) -> list[Any]:
    """Reduced gradients (numpy) as JAX arrays."""
    import jax.numpy as jnp

    return [jnp.asarray(a) for a in arrays]


def views(variables: Sequence[Any]) -> list[Any]:
    """The variables' values as numpy arrays (on CPU without a copy where JAX allows it)."""
    return [np.asarray(v.value) for v in variables]


def no_grad() -> contextlib.AbstractContextManager[Any]:
    """JAX has no tape to keep assignments out of."""
    return contextlib.nullcontext()


def limit_threads(threads: int) -> None:
    """One intra-op thread for XLA when the replica has one core; only before JAX starts in this process.

    XLA reads its flags when its CPU client starts: after ``import jax`` (the
    replicas of a threaded cluster share one client) the process keeps what it has.
    """
    if threads > 1:
        return
    if "jax" in sys.modules:
        logger.debug("JAX is imported already: XLA keeps its threads")
        return
    flags = os.environ.get("XLA_FLAGS", "")
    missing = [flag for flag in _ONE_THREAD_FLAGS if flag.split("=")[0] not in flags]
    if missing:
        os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()


def _dtype(variable: Any) -> Any:
    import keras

    return keras.backend.standardize_dtype(variable.dtype)


def _values(variables: Sequence[Any]) -> list[Any]:
    return [v.value for v in variables]


def _assign(variables: Sequence[Any], values: Sequence[Any]) -> None:
    for variable, value in zip(variables, values):
        variable.assign(value)


class JaxSteps:
    """A model's training and evaluation steps on the JAX backend (see the module): the jitted halves, kept."""

    def __init__(self, model: Any):
        self.model = model
        self._functions: dict[str, Callable[..., Any]] = {}
        self._optimizer: Any = None  # the optimizer the functions were made for (compile may replace it)
        self._built = False

    def _function(self, name: str, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        optimizer = self.model.optimizer
        if optimizer is not self._optimizer:
            self._functions.clear()
            self._optimizer = optimizer
        found = self._functions.get(name)
        if found is None:
            found = make()
            if not self.model.run_eagerly and getattr(self.model, "jit_compile", True):
                import jax

                found = jax.jit(found)
            self._functions[name] = found
        return found

    def _build(self, batch: Any) -> None:
        """Keras' own build of the model, its metrics, loss and optimizer slots from a batch (before tracing)."""
        if not self._built:
            self.model._symbolic_build(data_batch=batch)
            self._built = True

    def parameters(self) -> list[Any]:
        return views(self.model.trainable_variables)

    def train_step(self, batch: Any, exchange: GradientExchange, rows: int) -> None:
        model = self.model
        optimizer = model.optimizer
        batch = to_batch(batch)
        self._build(batch)
        state = (_values(model.trainable_variables), _values(model.non_trainable_variables),
                 _values(optimizer.variables), _values(model.metrics_variables))
        gradients = self._function("gradients", lambda: model.train_step)
        with exchange_module.captured(optimizer):
            _logs, (grads, non_trainable, _optimizer_variables, metrics) = gradients(state, batch)
        _assign(model.non_trainable_variables, non_trainable)
        _assign(model.metrics_variables, metrics)
        reduced = exchange(to_numpy(grads, model.trainable_variables), rows)
        if reduced is None:  # the driver assigned the new parameters (held off the replicas): nothing to apply
            exchange_module.count_step(optimizer)
            return
        self.apply(reduced)

    def apply(self, gradients: Sequence[Any]) -> None:
        """Apply reduced gradients with the model's optimizer (``stateless_apply``, jitted)."""
        model = self.model
        optimizer = model.optimizer
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        apply = self._function("apply", lambda: optimizer.stateless_apply)
        trainable, optimizer_variables = apply(_values(optimizer.variables), list(gradients),
                                               _values(model.trainable_variables))
        _assign(model.trainable_variables, trainable)
        _assign(optimizer.variables, optimizer_variables)

    def test_step(self, batch: Any) -> None:
        model = self.model
        batch = to_batch(batch)
        self._build(batch)
        state = (_values(model.trainable_variables), _values(model.non_trainable_variables),
                 _values(model.metrics_variables))
        _logs, (_, non_trainable, metrics) = self._function("test", lambda: model.test_step)(state, batch)
        _assign(model.non_trainable_variables, non_trainable)
        _assign(model.metrics_variables, metrics)


def steps(model: Any) -> JaxSteps:
    return JaxSteps(model)
