"""Losses with per-example values and their gradients, Keras names and semantics.

This module holds the cross-entropies, :func:`compute_average_loss` and the
registry of names (:func:`get`): every name TensorFlow's Keras accepts for a
built-in loss (``"mse"``, ``"mae"``, ``"kld"``, ``"logcosh"``, ...); the other
losses live in ``elementwise_losses`` and ``distribution_losses``.

A :class:`Loss` gives the loss of each example (``per_example``, shape
``(batch,)``), the gradient of each example's loss with respect to its own
prediction (``gradient``, the shape of ``y_pred``), and the batch mean
(``__call__``). For data-parallel training, :func:`compute_average_loss`
divides a replica's summed loss by the *global* batch size, as
``tf.nn.compute_average_loss`` does, so the gradient to back-propagate on a
replica is ``loss.gradient(y_true, y_pred) / global_batch_size``.

Cross-entropies are numerically stable: from logits they use a
log-softmax; from probabilities they renormalise and clip to
``[eps, 1 - eps]`` like Keras (the gradient is zero where clipped).
"""

from __future__ import annotations

import math
from typing import Any

from daskdist.keras.backend import epsilon, move_like, xp_of
from daskdist.keras.distribution_losses import CategoricalHinge, CosineSimilarity, KLDivergence
from daskdist.keras.elementwise_losses import (
    BinaryCrossentropy,
    Hinge,
    Huber,
    LogCosh,
    MeanAbsoluteError,
    MeanAbsolutePercentageError,
    MeanSquaredError,
    MeanSquaredLogarithmicError,
    Poisson,
    SquaredHinge,
)
from daskdist.keras.loss_base import Loss
from daskdist.keras.loss_base import per_example_mean as _per_example_mean

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "CategoricalHinge",
    "CosineSimilarity",
    "Hinge",
    "Huber",
    "KLDivergence",
    "LogCosh",
    "Loss",
    "MeanAbsoluteError",
    "MeanAbsolutePercentageError",
    "MeanSquaredError",
    "MeanSquaredLogarithmicError",
    "Poisson",
    "SparseCategoricalCrossentropy",
    "SquaredHinge",
    "compute_average_loss",
    "get",
    "known_names",
    "serialize",
]

Array = Any


def _log_softmax(z: Array) -> Array:
    xp = xp_of(z)
    shifted = z - z.max(axis=-1, keepdims=True)
    shifted -= xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
    return shifted


def _one_hot(labels: Array, y_pred: Array) -> Array:
    xp = xp_of(y_pred)
    labels = move_like(labels, y_pred)
    if labels.ndim == y_pred.ndim and labels.shape[-1] == 1:
        labels = labels[..., 0]
    if labels.shape != y_pred.shape[:-1]:
        raise ValueError(
            f"Sparse labels of shape {tuple(labels.shape)} do not match predictions of shape {tuple(y_pred.shape)}"
        )
    labels = labels.astype("int64", copy=False)
    return (labels[..., None] == xp.arange(y_pred.shape[-1])).astype(y_pred.dtype)


def _crossentropy(t: Array, y_pred: Array, from_logits: bool) -> Array:
    xp = xp_of(y_pred)
    if from_logits:
        return -(t * _log_softmax(y_pred)).sum(axis=-1)
    eps = epsilon()
    q = y_pred / y_pred.sum(axis=-1, keepdims=True)
    xp.clip(q, eps, 1.0 - eps, out=q)
    xp.log(q, out=q)
    return -(t * q).sum(axis=-1)


def _crossentropy_gradient(t: Array, y_pred: Array, from_logits: bool) -> Array:
    xp = xp_of(y_pred)
    if from_logits:
        grad = xp.exp(_log_softmax(y_pred))
        grad *= t.sum(axis=-1, keepdims=True)
        grad -= t
    else:
        # L = -sum t log clip(q), q = p / S:  dL/dp = (g - <g, q>) / S with g = dL/dq = -t / q where unclipped.
        eps = epsilon()
        s = y_pred.sum(axis=-1, keepdims=True)
        q = y_pred / s
        inside = (q > eps) & (q < 1.0 - eps)
        g = -t / xp.clip(q, eps, 1.0 - eps)
        g *= inside
        grad = g - (g * q).sum(axis=-1, keepdims=True)
        grad /= s
    if y_pred.ndim > 2:
        grad /= math.prod(y_pred.shape[1:-1])
    return grad


class SparseCategoricalCrossentropy(Loss):
    """Cross-entropy with integer class labels ``(batch,)`` (or ``(batch, 1)``) against ``(batch, classes)``.

    Parameters
    ----------
    from_logits
        ``y_pred`` are unnormalised logits (recommended: stable and cheap)
        rather than probabilities.
    """

    default_name = "sparse_categorical_crossentropy"

    def __init__(self, from_logits: bool = False, name: str | None = None, reduction: str = "sum_over_batch_size"):
        super().__init__(name, reduction)
        self.from_logits = bool(from_logits)

    def per_example(self, y_true: Array, y_pred: Array) -> Array:
        return _per_example_mean(_crossentropy(_one_hot(y_true, y_pred), y_pred, self.from_logits))

    def gradient(self, y_true: Array, y_pred: Array) -> Array:
        return _crossentropy_gradient(_one_hot(y_true, y_pred), y_pred, self.from_logits)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "from_logits": self.from_logits}


class CategoricalCrossentropy(Loss):
    """Cross-entropy with one-hot (or soft) targets ``(batch, classes)``.

    Parameters
    ----------
    from_logits
        ``y_pred`` are unnormalised logits rather than probabilities.
    """

    default_name = "categorical_crossentropy"

    def __init__(self, from_logits: bool = False, name: str | None = None, reduction: str = "sum_over_batch_size"):
        super().__init__(name, reduction)
        self.from_logits = bool(from_logits)

    def _targets(self, y_true: Array, y_pred: Array) -> Array:
        t = move_like(y_true, y_pred).astype(y_pred.dtype, copy=False)
        if t.shape != y_pred.shape:
            raise ValueError(f"Targets of shape {tuple(t.shape)} do not match predictions {tuple(y_pred.shape)}")
        return t

    def per_example(self, y_true: Array, y_pred: Array) -> Array:
        return _per_example_mean(_crossentropy(self._targets(y_true, y_pred), y_pred, self.from_logits))

    def gradient(self, y_true: Array, y_pred: Array) -> Array:
        return _crossentropy_gradient(self._targets(y_true, y_pred), y_pred, self.from_logits)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "from_logits": self.from_logits}


def compute_average_loss(
    per_example_loss: Array, global_batch_size: int | None = None, sample_weight: Array | None = None
) -> Array:
    """``sum(per_example_loss * sample_weight) / global_batch_size`` (``tf.nn.compute_average_loss``).

    Parameters
    ----------
    per_example_loss
        This replica's per-example losses, shape ``(local_batch,)``.
    global_batch_size
        The batch size over all replicas; by default ``local_batch *
        num_replicas_in_sync`` of the current replica context.

    Returns
    -------
    array
        A 0-d array; summing it over replicas gives the global mean loss.
    """
    if sample_weight is not None:
        per_example_loss = per_example_loss * move_like(sample_weight, per_example_loss)
    if global_batch_size is None:
        from daskdist.context import get_replica_context

        ctx = get_replica_context()
        replicas = ctx.num_replicas_in_sync if ctx is not None else 1
        global_batch_size = per_example_loss.shape[0] * replicas
    if global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    return per_example_loss.sum() / global_batch_size


# every name tf.keras.losses.get accepts for these losses (its functions and their aliases), lower case
_ALIASES: dict[str, type[Loss]] = {
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "binary_crossentropy": BinaryCrossentropy,
    "bce": BinaryCrossentropy,
    "mean_squared_error": MeanSquaredError,
    "mse": MeanSquaredError,
    "mean_absolute_error": MeanAbsoluteError,
    "mae": MeanAbsoluteError,
    "mean_absolute_percentage_error": MeanAbsolutePercentageError,
    "mape": MeanAbsolutePercentageError,
    "mean_squared_logarithmic_error": MeanSquaredLogarithmicError,
    "msle": MeanSquaredLogarithmicError,
    "kl_divergence": KLDivergence,
    "kullback_leibler_divergence": KLDivergence,
    "kld": KLDivergence,
    "log_cosh": LogCosh,
    "logcosh": LogCosh,
    "huber": Huber,
    "huber_loss": Huber,
    "hinge": Hinge,
    "squared_hinge": SquaredHinge,
    "categorical_hinge": CategoricalHinge,
    "poisson": Poisson,
    "cosine_similarity": CosineSimilarity,
}
_CLASSES: tuple[type[Loss], ...] = (
    SparseCategoricalCrossentropy, CategoricalCrossentropy, BinaryCrossentropy, MeanSquaredError, MeanAbsoluteError,
    MeanAbsolutePercentageError, MeanSquaredLogarithmicError, KLDivergence, LogCosh, Huber, Hinge, SquaredHinge,
    CategoricalHinge, Poisson, CosineSimilarity,
)
_BY_CLASS_NAME: dict[str, type[Loss]] = {cls.__name__: cls for cls in _CLASSES}


def known_names() -> list[str]:
    """Every string :func:`get` accepts: Keras' function names and aliases, then the class names."""
    return sorted(_ALIASES) + sorted(_BY_CLASS_NAME)


def get(identifier: str | dict[str, Any] | Loss | type[Loss]) -> Loss:
    """Resolve a loss: a Keras name (``"sparse_categorical_crossentropy"``, ``"mse"``, ...), a class name,
    a ``{"class_name", "config"}`` dict, a :class:`Loss` subclass, or an instance (returned as is).
    """
    if isinstance(identifier, Loss):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Loss):
        return identifier()
    if isinstance(identifier, dict):
        cls = _BY_CLASS_NAME.get(identifier["class_name"])
        if cls is None:
            raise ValueError(f"Unknown loss class {identifier['class_name']!r}")
        return cls.from_config(identifier.get("config", {}))
    if isinstance(identifier, str):
        cls = _ALIASES.get(identifier.lower()) or _BY_CLASS_NAME.get(identifier)
        if cls is None:
            raise ValueError(f"Unknown loss {identifier!r}; known: {', '.join(known_names())}")
        return cls()
    if callable(identifier):
        raise TypeError(
            f"loss {identifier!r} is a function: the built-in layers back-propagate each loss's own gradient, so "
            f"compile takes a Loss (a subclass with per_example and gradient) or a name: {', '.join(known_names())}"
        )
    raise TypeError(f"Cannot interpret {identifier!r} as a loss")


def serialize(loss: Loss) -> dict[str, Any]:
    """``{"class_name": ..., "config": ...}`` for :func:`get`."""
    return {"class_name": type(loss).__name__, "config": loss.get_config()}
