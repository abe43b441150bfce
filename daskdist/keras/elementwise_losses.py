"""Keras' element-by-element losses: regression errors, binary cross-entropy, hinges, Poisson.

Each is the mean over the non-batch axes of a function of one target and
one prediction (Keras averages over the last axis, then the batch: the same
mean). Gradients are exact, with Keras' clipping (zero where clipped).
"""

from __future__ import annotations

import math
from typing import Any

from daskdist.keras.backend import epsilon, xp_of
from daskdist.keras.loss_base import ElementwiseLoss, Loss

__all__ = [
    "BinaryCrossentropy",
    "Hinge",
    "Huber",
    "LogCosh",
    "MeanAbsoluteError",
    "MeanAbsolutePercentageError",
    "MeanSquaredError",
    "MeanSquaredLogarithmicError",
    "Poisson",
    "SquaredHinge",
]

Array = Any


class MeanSquaredError(ElementwiseLoss):
    """Mean over the non-batch axes of ``(y_pred - y_true) ** 2``.

    ``y_true`` with the same number of elements as ``y_pred`` but another
    shape (``(batch,)`` against ``(batch, 1)``) is reshaped to it.
    """

    default_name = "mean_squared_error"

    def _values(self, t: Array, p: Array) -> Array:
        d = p - t
        d *= d
        return d

    def _derivative(self, t: Array, p: Array) -> Array:
        d = p - t
        d *= 2.0
        return d


class MeanAbsoluteError(ElementwiseLoss):
    """Mean of ``|y_pred - y_true|`` (``"mae"``); the gradient at a tie is 0."""

    default_name = "mean_absolute_error"

    def _values(self, t: Array, p: Array) -> Array:
        return xp_of(p).abs(p - t)

    def _derivative(self, t: Array, p: Array) -> Array:
        return xp_of(p).sign(p - t)


class MeanAbsolutePercentageError(ElementwiseLoss):
    """``100 * mean(|y_true - y_pred| / max(|y_true|, eps))`` (``"mape"``)."""

    default_name = "mean_absolute_percentage_error"

    def _scale(self, t: Array) -> Array:
        return 100.0 / xp_of(t).maximum(xp_of(t).abs(t), epsilon())

    def _values(self, t: Array, p: Array) -> Array:
        return xp_of(p).abs(p - t) * self._scale(t)

    def _derivative(self, t: Array, p: Array) -> Array:
        return xp_of(p).sign(p - t) * self._scale(t)


class MeanSquaredLogarithmicError(ElementwiseLoss):
    """Mean of ``(log(max(y_pred, eps) + 1) - log(max(y_true, eps) + 1)) ** 2`` (``"msle"``)."""

    default_name = "mean_squared_logarithmic_error"

    def _diff(self, t: Array, p: Array) -> Array:
        xp = xp_of(p)
        return xp.log1p(xp.maximum(p, epsilon())) - xp.log1p(xp.maximum(t, epsilon()))

    def _values(self, t: Array, p: Array) -> Array:
        d = self._diff(t, p)
        return d * d

    def _derivative(self, t: Array, p: Array) -> Array:
        xp = xp_of(p)
        return 2.0 * self._diff(t, p) / (1.0 + xp.maximum(p, epsilon())) * (p > epsilon())


class Huber(ElementwiseLoss):
    """``0.5 x**2`` for ``|x| <= delta``, else ``delta * |x| - 0.5 delta**2``, with ``x = y_pred - y_true``."""

    default_name = "huber_loss"

    def __init__(self, delta: float = 1.0, name: str | None = None, reduction: str = "sum_over_batch_size"):
        super().__init__(name, reduction)
        self.delta = float(delta)

    def _values(self, t: Array, p: Array) -> Array:
        xp = xp_of(p)
        x = xp.abs(p - t)
        return xp.where(x <= self.delta, 0.5 * x * x, self.delta * x - 0.5 * self.delta ** 2)

    def _derivative(self, t: Array, p: Array) -> Array:
        return xp_of(p).clip(p - t, -self.delta, self.delta)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "delta": self.delta}


class LogCosh(ElementwiseLoss):
    """``log(cosh(y_pred - y_true))``, computed without overflow (``"logcosh"``)."""

    default_name = "log_cosh"

    def _values(self, t: Array, p: Array) -> Array:
        xp = xp_of(p)
        x = p - t
        return x + xp.logaddexp(0.0, -2.0 * x) - math.log(2.0)

    def _derivative(self, t: Array, p: Array) -> Array:
        return xp_of(p).tanh(p - t)


class BinaryCrossentropy(ElementwiseLoss):
    """Cross-entropy of 0/1 (or soft) targets against one probability (or logit) per output.

    Parameters
    ----------
    from_logits
        ``y_pred`` are logits rather than probabilities (clipped to
        ``[eps, 1 - eps]`` as in Keras).
    """

    default_name = "binary_crossentropy"

    def __init__(self, from_logits: bool = False, name: str | None = None, reduction: str = "sum_over_batch_size"):
        super().__init__(name, reduction)
        self.from_logits = bool(from_logits)

    def _values(self, t: Array, p: Array) -> Array:
        xp = xp_of(p)
        if self.from_logits:
            return xp.maximum(p, 0.0) - p * t + xp.log1p(xp.exp(-xp.abs(p)))
        q = xp.clip(p, epsilon(), 1.0 - epsilon())
        return -(t * xp.log(q) + (1.0 - t) * xp.log(1.0 - q))

    def _derivative(self, t: Array, p: Array) -> Array:
        xp = xp_of(p)
        if self.from_logits:
            return 1.0 / (1.0 + xp.exp(-p)) - t
        inside = (p > epsilon()) & (p < 1.0 - epsilon())
        q = xp.clip(p, epsilon(), 1.0 - epsilon())
        return (q - t) / (q * (1.0 - q)) * inside

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "from_logits": self.from_logits}


def _signed_labels(t: Array) -> Array:
    """Keras' hinge labels: 0/1 targets become -1/1; -1/1 targets are kept."""
    xp = xp_of(t)
    if bool(xp.all((t == 0) | (t == 1))):
        return 2.0 * t - 1.0
    return t


class Hinge(ElementwiseLoss):
    """``max(1 - y_true * y_pred, 0)`` with -1/1 (or 0/1) targets."""

    default_name = "hinge"

    def _values(self, t: Array, p: Array) -> Array:
        return xp_of(p).maximum(1.0 - _signed_labels(t) * p, 0.0)

    def _derivative(self, t: Array, p: Array) -> Array:
        s = _signed_labels(t)
        return -s * (1.0 - s * p > 0)


class SquaredHinge(ElementwiseLoss):
    """``max(1 - y_true * y_pred, 0) ** 2`` with -1/1 (or 0/1) targets."""

    default_name = "squared_hinge"

    def _values(self, t: Array, p: Array) -> Array:
        m = xp_of(p).maximum(1.0 - _signed_labels(t) * p, 0.0)
        return m * m

    def _derivative(self, t: Array, p: Array) -> Array:
        s = _signed_labels(t)
        return -2.0 * s * xp_of(p).maximum(1.0 - s * p, 0.0)


class Poisson(ElementwiseLoss):
    """``y_pred - y_true * log(y_pred + eps)``."""

    default_name = "poisson"

    def _values(self, t: Array, p: Array) -> Array:
        return p - t * xp_of(p).log(p + epsilon())

    def _derivative(self, t: Array, p: Array) -> Array:
        return 1.0 - t / (p + epsilon())


ELEMENTWISE: tuple[type[Loss], ...] = (
    MeanSquaredError, MeanAbsoluteError, MeanAbsolutePercentageError, MeanSquaredLogarithmicError, Huber, LogCosh,
    BinaryCrossentropy, Hinge, SquaredHinge, Poisson,
)
