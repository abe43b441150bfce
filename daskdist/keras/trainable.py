"""The built-in layers as one adapter of the training contract: ``BuiltinTrainable``.

A built-in ``Model`` on a replica (or a parameter-server worker, or the
client for a model without a strategy) is a
``daskdist.strategy.training_contract.HeldTrainable``: ``train_step`` runs
forward, the per-example loss, its gradient and backward (gradients of the
loss *sum* over the local rows), hands them to the step driver's exchange
with the loss sum (``sums=(loss_sum,)``, ``summed=True``: one message per
step under every driver), applies what comes back with the model's
optimizer (nothing when the driver assigned the new parameters itself) and
updates the metrics. It is also the replica resident of kind ``"model"``:
its ``snapshot`` (weights, optimizer state, the layers' random generators)
is what elastic commits keep and restore.
"""

from __future__ import annotations

import copy
import pickle
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist import fault_points
from daskdist.arrays import as_array, namespace, to_numpy

if TYPE_CHECKING:
    from daskdist.keras.models import Model
    from daskdist.strategy.training_contract import GradientExchange

__all__ = ["BuiltinTrainable", "RandomStates"]


class RandomStates:
    """The layers' random generator states in a model snapshot, by layer name.

    One leaf of the snapshot (its own copy), left out of elastic training's
    state digest (``digest_bytes``): replicas may legitimately draw different
    numbers (their batches differ in shape), while their weights must agree.
    As an array (``numpy.asarray``) it is its pickled bytes.
    """

    def __init__(self, states: dict[str, dict]):
        self.states = copy.deepcopy(states)

    def digest_bytes(self) -> bytes:
        return b""

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """The states as bytes (``uint8``), so that snapshots compare as arrays do."""
        return np.frombuffer(pickle.dumps(self.states, protocol=4), np.uint8)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RandomStates) and np.array_equal(np.asarray(self), np.asarray(other))

    __hash__ = None  # type: ignore[assignment]


class BuiltinTrainable:
    """A built-in model as the training contract trains it, and as a replica keeps it (resident ``"model"``).

    Attributes
    ----------
    timer
        The replica's step timer (``add_apply``), or ``None``; set by the loop.
    before_change
        Called once per step just before the step changes the weights (an
        elastic commit's copy ends there), or ``None``; set by the loop.
    """

    def __init__(self, model: Model):
        self.model = model
        self.timer: Any = None
        self.before_change: Callable[[], None] | None = None
        self._changing = False

    def unwrap(self) -> Model:
        return self.model

    # -- the training contract ------------------------------------------------------------

    def parameters(self) -> list[Any]:
        return self.model.trainable_variables

    def train_step(self, batch: Any, exchange: GradientExchange) -> None:
        """``batch`` is ``(x, y, sample_weight)`` of arrays (``sample_weight`` may be ``None``)."""
        model = self.model
        x, y, sample_weight = batch
        self._changing = False
        y_pred = model._forward(x, training=True)
        if fault_points.ARMED:
            fault_points.reached("forward")
        per_example = model.loss.per_example(y, y_pred)
        grad = model.loss.gradient(y, y_pred)
        if sample_weight is not None:
            weight, _ = as_array(sample_weight)
            per_example = per_example * weight
            grad = grad * namespace(grad).reshape(weight, (-1,) + (1,) * (grad.ndim - 1))
        model._backward(grad)
        loss_sum = float(namespace(per_example).sum(per_example))
        params, grads = model._trainable_arrays()
        self._exchange_and_apply(exchange, params, grads, int(x.shape[0]), loss_sum)
        for metric in model.compiled_metrics:
            metric.update_state(y, y_pred, sample_weight)

    def join_step(self, exchange: GradientExchange) -> None:
        self._changing = False
        params = self.model.trainable_variables  # (its layers may have no gradients yet: no backward ran here)
        self._exchange_and_apply(exchange, params, [namespace(p).zeros_like(p) for p in params], 0, 0.0)

    def _exchange_and_apply(self, exchange: GradientExchange, params: list[Any], grads: list[Any], rows: int,
                            loss_sum: float) -> None:
        start = time.perf_counter()
        reduced = exchange(grads, rows, sums=(loss_sum,), summed=True)
        if reduced is None:  # the driver assigned the new parameters (held elsewhere): that was the apply
            if self.timer is not None:
                self.timer.add_apply(time.perf_counter() - start)
            return
        self._before_change()
        start = time.perf_counter()
        self.model.optimizer.apply(params, reduced)
        if self.timer is not None:
            self.timer.add_apply(time.perf_counter() - start)

    def _before_change(self) -> None:
        if not self._changing and self.before_change is not None:
            self.before_change()
        self._changing = True

    def assign(self, values: Sequence[Any | None]) -> None:
        self._before_change()
        for target, value in zip(self.model.trainable_variables, values):
            if value is not None:
                xp = namespace(target)
                xp.copyto(target, xp.asarray(value, dtype=target.dtype))

    def update_rule(self) -> Any:
        """The model's optimizer (numpy/cupy arrays in place; slots ``<slot>/<index>`` in its state)."""
        return self.model.optimizer

    # -- the resident -----------------------------------------------------------------------

    def snapshot(self) -> dict:
        weights = [np.array(to_numpy(a), copy=True) for _, a in self.model._weight_items()]
        optimizer = self.model.optimizer
        state = {} if optimizer is None else {k: np.array(to_numpy(v), copy=True)
                                              for k, v in optimizer.get_state().items()}
        return {"weights": weights, "optimizer": state, "rng": self.snapshot_random()}

    def snapshot_random(self) -> RandomStates:
        """The layers' random generator states (a copy), under ``"rng"`` in ``snapshot``."""
        rng = {layer.name: layer.rng_state() for layer in self.model.layers}
        return RandomStates({k: v for k, v in rng.items() if v})

    def restore(self, state: dict) -> None:
        self.model._assign_weights(state["weights"])
        if self.model.optimizer is not None and state["optimizer"]:
            self.model.optimizer.set_state(state["optimizer"])
        if "rng" in state:
            rng = state["rng"].states
            for layer in self.model.layers:
                layer.set_rng_state(rng.get(layer.name, {}))
