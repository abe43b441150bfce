"""Metrics that average a per-example function: every built-in loss as a metric, top-k accuracy, wrappers.

``metrics=["mae"]`` in ``compile`` is :class:`MeanAbsoluteError`, as in
Keras; :class:`MeanMetricWrapper` makes any function of ``(y_true, y_pred)``
(a Keras-style metric function, or a :class:`~daskdist.keras.losses.Loss`) a
metric. Each keeps the ``[total, count]`` state of
:class:`~daskdist.keras.metric_base.Metric`, so it aggregates over replicas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from daskdist.keras import distribution_losses as _dist
from daskdist.keras import elementwise_losses as _elem
from daskdist.keras import losses as _losses
from daskdist.keras.backend import move_like, xp_of
from daskdist.keras.loss_base import Loss
from daskdist.keras.metric_base import Metric

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "CategoricalHinge",
    "CosineSimilarity",
    "Hinge",
    "KLDivergence",
    "LogCoshError",
    "MeanAbsoluteError",
    "MeanAbsolutePercentageError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "MeanSquaredLogarithmicError",
    "Poisson",
    "RootMeanSquaredError",
    "SparseCategoricalCrossentropy",
    "SparseTopKCategoricalAccuracy",
    "SquaredHinge",
    "TopKCategoricalAccuracy",
]

Array = Any


def _per_example(values: Array) -> Array:
    values = values if hasattr(values, "ndim") else xp_of(values).asarray(values)
    if values.ndim <= 1:
        return values
    return values.reshape(values.shape[0], -1).mean(axis=1)


class MeanMetricWrapper(Metric):
    """The mean of ``fn(y_true, y_pred, **kwargs)`` over the examples (Keras' ``MeanMetricWrapper``).

    ``fn`` returns one value per example, or per element (averaged per
    example); a :class:`~daskdist.keras.losses.Loss` instance gives its
    per-example losses.
    """

    default_name = "mean_metric_wrapper"

    def __init__(self, fn: Callable[..., Any], name: str | None = None, **kwargs: Any):
        super().__init__(name or getattr(fn, "name", None) or getattr(fn, "__name__", None))
        self._fn = fn
        self._fn_kwargs = kwargs

    def values(self, y_true: Array, y_pred: Array) -> Array:
        if isinstance(self._fn, Loss):
            return self._fn.per_example(y_true, y_pred)
        return _per_example(self._fn(y_true, y_pred, **self._fn_kwargs))


class _LossMetric(Metric):
    """A built-in loss, averaged as a metric (``sign`` -1 turns the cosine loss into the similarity)."""

    loss_class: type[Loss] = Loss
    sign = 1.0

    def __init__(self, name: str | None = None, **loss_kwargs: Any):
        super().__init__(name)
        self._loss_kwargs = loss_kwargs
        self._loss = self.loss_class(**loss_kwargs)

    def values(self, y_true: Array, y_pred: Array) -> Array:
        per = self._loss.per_example(y_true, y_pred)
        return per if self.sign == 1.0 else per * self.sign

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **self._loss_kwargs}


class MeanSquaredError(_LossMetric):
    """Mean of ``(y_pred - y_true) ** 2`` (``"mse"``)."""

    loss_class = _elem.MeanSquaredError
    default_name = "mean_squared_error"


class MeanAbsoluteError(_LossMetric):
    """Mean of ``|y_pred - y_true|`` (``"mae"``)."""

    loss_class = _elem.MeanAbsoluteError
    default_name = "mean_absolute_error"


class MeanAbsolutePercentageError(_LossMetric):
    """``100 * mean(|y_true - y_pred| / |y_true|)`` (``"mape"``)."""

    loss_class = _elem.MeanAbsolutePercentageError
    default_name = "mean_absolute_percentage_error"


class MeanSquaredLogarithmicError(_LossMetric):
    """Mean of ``(log(1 + y_pred) - log(1 + y_true)) ** 2`` (``"msle"``)."""

    loss_class = _elem.MeanSquaredLogarithmicError
    default_name = "mean_squared_logarithmic_error"


class Hinge(_LossMetric):
    """Mean hinge loss."""

    loss_class = _elem.Hinge
    default_name = "hinge"


class SquaredHinge(_LossMetric):
    """Mean squared hinge loss."""

    loss_class = _elem.SquaredHinge
    default_name = "squared_hinge"


class CategoricalHinge(_LossMetric):
    """Mean categorical hinge loss."""

    loss_class = _dist.CategoricalHinge
    default_name = "categorical_hinge"


class KLDivergence(_LossMetric):
    """Mean Kullback-Leibler divergence (``"kld"``)."""

    loss_class = _dist.KLDivergence
    default_name = "kullback_leibler_divergence"


class LogCoshError(_LossMetric):
    """Mean ``log(cosh(y_pred - y_true))``."""

    loss_class = _elem.LogCosh
    default_name = "logcosh"


class Poisson(_LossMetric):
    """Mean Poisson loss."""

    loss_class = _elem.Poisson
    default_name = "poisson"


class CosineSimilarity(_LossMetric):
    """Mean cosine similarity of ``y_true`` and ``y_pred`` (positive, unlike the loss)."""

    loss_class = _dist.CosineSimilarity
    default_name = "cosine_similarity"
    sign = -1.0


class BinaryCrossentropy(_LossMetric):
    """Mean binary cross-entropy (``from_logits`` as the loss)."""

    loss_class = _elem.BinaryCrossentropy
    default_name = "binary_crossentropy"


class CategoricalCrossentropy(_LossMetric):
    """Mean categorical cross-entropy (``from_logits`` as the loss)."""

    loss_class = _losses.CategoricalCrossentropy
    default_name = "categorical_crossentropy"


class SparseCategoricalCrossentropy(_LossMetric):
    """Mean sparse categorical cross-entropy (``from_logits`` as the loss)."""

    loss_class = _losses.SparseCategoricalCrossentropy
    default_name = "sparse_categorical_crossentropy"


class RootMeanSquaredError(MeanSquaredError):
    """``sqrt`` of the mean squared error over everything seen."""

    default_name = "root_mean_squared_error"

    def result(self) -> float:
        return math.sqrt(super().result())


def _in_top_k(scores: Array, target_index: Array, k: int) -> Array:
    """Whether each example's target class scores at least its ``k``-th best (ties count, as ``in_top_k``)."""
    xp = xp_of(scores)
    classes = scores.shape[-1]
    if k >= classes:
        return xp.ones(scores.shape[:-1], dtype=bool)
    kth = -xp.partition(-scores, k - 1, axis=-1)[..., k - 1]
    target = xp.take_along_axis(scores, target_index[..., None], axis=-1)[..., 0]
    return target >= kth


class TopKCategoricalAccuracy(Metric):
    """How often the one-hot target is among the ``k`` highest predictions."""

    default_name = "top_k_categorical_accuracy"

    def __init__(self, k: int = 5, name: str | None = None):
        super().__init__(name)
        self.k = int(k)

    def values(self, y_true: Array, y_pred: Array) -> Array:
        return _in_top_k(y_pred, move_like(y_true, y_pred).argmax(axis=-1), self.k)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "k": self.k}


class SparseTopKCategoricalAccuracy(TopKCategoricalAccuracy):
    """How often the integer label is among the ``k`` highest predictions."""

    default_name = "sparse_top_k_categorical_accuracy"

    def values(self, y_true: Array, y_pred: Array) -> Array:
        labels = move_like(y_true, y_pred)
        if labels.ndim == y_pred.ndim and labels.shape[-1] == 1:
            labels = labels[..., 0]
        return _in_top_k(y_pred, labels.astype("int64", copy=False), self.k)
