"""The ``Loss`` base class and the helpers every loss module shares.

A :class:`Loss` gives the loss of each example (``per_example``, shape
``(batch,)``), the gradient of each example's loss with respect to its own
prediction (``gradient``, the shape of ``y_pred``), and the batch mean
(``__call__``).
"""

from __future__ import annotations

import math
from typing import Any

from daskdist.keras.backend import move_like
from daskdist.keras.gradient_tape import TapeTensor, record_loss

__all__ = ["ElementwiseLoss", "Loss", "per_example_mean", "targets_like"]

Array = Any

_REDUCTIONS = ("sum_over_batch_size", "sum", "none", "auto")  # "auto": the default, as in Keras


class Loss:
    """Base class: ``per_example``, ``gradient``, ``__call__``, ``get_config``/``from_config``.

    Predictions of shape ``(batch, ..., k)`` with extra middle dimensions
    (e.g. per-pixel classes) are averaged over those dimensions per example.
    """

    default_name = "loss"

    def __init__(self, name: str | None = None, reduction: str = "sum_over_batch_size"):
        if reduction not in _REDUCTIONS:
            raise ValueError(f"Invalid reduction {reduction!r}; expected one of {', '.join(_REDUCTIONS)}")
        self.name = name or self.default_name
        self.reduction = reduction

    def per_example(self, y_true: Array, y_pred: Array) -> Array:
        """The loss of each example, shape ``(batch,)``, dtype of ``y_pred``."""
        raise NotImplementedError

    def gradient(self, y_true: Array, y_pred: Array) -> Array:
        """``d per_example(y_true, y_pred)[i] / d y_pred[i]`` for every example ``i``; shape of ``y_pred``."""
        raise NotImplementedError

    def __call__(self, y_true: Array, y_pred: Array, sample_weight: Array | None = None) -> Any:
        """The loss of the batch, reduced as ``reduction`` says (Keras' ``reduction``).

        ``"sum_over_batch_size"`` (the default): the mean, ``sum(w * loss) /
        batch`` with ``sample_weight`` (a float); ``"sum"``: the sum;
        ``"none"``: the per-example losses (for
        ``dd.nn.compute_average_loss`` in a custom loop). Under a
        ``GradientTape`` with a recorded ``y_pred`` the value is recorded, so
        ``tape.gradient`` differentiates it.
        """
        if isinstance(y_pred, TapeTensor):
            return record_loss(self, y_true, y_pred, sample_weight, self.reduction)
        per = self.per_example(y_true, y_pred)
        if sample_weight is not None:
            per = per * move_like(sample_weight, per).reshape(-1)
        if self.reduction == "none":
            return per
        if self.reduction == "sum":
            return float(per.sum())
        return float(per.sum()) / max(per.shape[0], 1)

    def get_config(self) -> dict[str, Any]:
        """Constructor keyword arguments (JSON-serialisable)."""
        return {"name": self.name, "reduction": self.reduction}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Loss:
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


def per_example_mean(values: Array) -> Array:
    """Average ``(batch, ...)`` over everything but the batch axis."""
    if values.ndim == 1:
        return values
    return values.reshape(values.shape[0], -1).mean(axis=1)


def targets_like(y_true: Array, y_pred: Array) -> Array:
    """``y_true`` in ``y_pred``'s namespace, dtype and shape (``(batch,)`` against ``(batch, 1)`` is reshaped)."""
    t = move_like(y_true, y_pred)
    if t.shape != y_pred.shape:
        if t.size != y_pred.size:
            raise ValueError(f"Targets of shape {tuple(t.shape)} do not match predictions {tuple(y_pred.shape)}")
        t = t.reshape(y_pred.shape)
    return t.astype(y_pred.dtype, copy=False)


class ElementwiseLoss(Loss):
    """A loss ``mean over the non-batch axes of f(y_true, y_pred)``, computed element by element.

    Subclasses give ``_values(t, p)`` (``f``) and ``_derivative(t, p)``
    (``df/dp``), both on arrays of ``y_pred``'s shape.
    """

    def _values(self, t: Array, p: Array) -> Array:
        raise NotImplementedError

    def _derivative(self, t: Array, p: Array) -> Array:
        raise NotImplementedError

    def per_example(self, y_true: Array, y_pred: Array) -> Array:
        return per_example_mean(self._values(targets_like(y_true, y_pred), y_pred))

    def gradient(self, y_true: Array, y_pred: Array) -> Array:
        grad = self._derivative(targets_like(y_true, y_pred), y_pred)
        grad /= max(math.prod(y_pred.shape[1:]), 1)
        return grad
