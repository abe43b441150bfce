"""Keras' losses over the last axis as a whole: KL divergence, categorical hinge, cosine similarity.

Each reduces the last axis of one target and one prediction to a number
and averages any middle axes per example (as the cross-entropies do).
"""

from __future__ import annotations

import math
from typing import Any

from daskdist.keras.backend import epsilon, xp_of
from daskdist.keras.loss_base import Loss, per_example_mean, targets_like

__all__ = ["CategoricalHinge", "CosineSimilarity", "KLDivergence"]

Array = Any


def _middle(y_pred: Array) -> int:
    """How many positions each example's last-axis values are averaged over."""
    return max(math.prod(y_pred.shape[1:-1]), 1) if y_pred.ndim > 2 else 1


class KLDivergence(Loss):
    """``sum(y_true * log(y_true / y_pred))`` over the last axis, both clipped to ``[eps, 1]`` (``"kld"``)."""

    default_name = "kl_divergence"

    def per_example(self, y_true: Array, y_pred: Array) -> Array:
        xp = xp_of(y_pred)
        t = xp.clip(targets_like(y_true, y_pred), epsilon(), 1.0)
        p = xp.clip(y_pred, epsilon(), 1.0)
        return per_example_mean((t * xp.log(t / p)).sum(axis=-1))

    def gradient(self, y_true: Array, y_pred: Array) -> Array:
        xp = xp_of(y_pred)
        t = xp.clip(targets_like(y_true, y_pred), epsilon(), 1.0)
        inside = (y_pred > epsilon()) & (y_pred < 1.0)
        return -t / xp.clip(y_pred, epsilon(), 1.0) * inside / _middle(y_pred)


class CategoricalHinge(Loss):
    """``max(0, max((1 - y_true) * y_pred) - sum(y_true * y_pred) + 1)`` over the last axis (one-hot targets)."""

    default_name = "categorical_hinge"

    def _parts(self, y_true: Array, y_pred: Array) -> tuple[Array, Array, Array]:
        t = targets_like(y_true, y_pred)
        pos = (t * y_pred).sum(axis=-1)
        negatives = (1.0 - t) * y_pred
        return t, negatives, xp_of(y_pred).maximum(negatives.max(axis=-1) - pos + 1.0, 0.0)

    def per_example(self, y_true: Array, y_pred: Array) -> Array:
        return per_example_mean(self._parts(y_true, y_pred)[2])

    def gradient(self, y_true: Array, y_pred: Array) -> Array:
        xp = xp_of(y_pred)
        t, negatives, margin = self._parts(y_true, y_pred)
        top = negatives.argmax(axis=-1)[..., None] == xp.arange(y_pred.shape[-1])
        grad = top * (1.0 - t) - t
        grad = grad * (margin > 0)[..., None]
        return (grad / _middle(y_pred)).astype(y_pred.dtype, copy=False)


class CosineSimilarity(Loss):
    """``-sum(l2_normalize(y_true) * l2_normalize(y_pred))`` over the last axis (so minimising aligns them)."""

    default_name = "cosine_similarity"

    @staticmethod
    def _norm(x: Array) -> Array:
        xp = xp_of(x)
        return xp.sqrt(xp.maximum((x * x).sum(axis=-1, keepdims=True), 1e-12))

    def per_example(self, y_true: Array, y_pred: Array) -> Array:
        t = targets_like(y_true, y_pred)
        return per_example_mean(-((t / self._norm(t)) * (y_pred / self._norm(y_pred))).sum(axis=-1))

    def gradient(self, y_true: Array, y_pred: Array) -> Array:
        t = targets_like(y_true, y_pred)
        t_hat = t / self._norm(t)
        norm = self._norm(y_pred)
        p_hat = y_pred / norm
        cos = (t_hat * p_hat).sum(axis=-1, keepdims=True)
        return -(t_hat - cos * p_hat) / norm / _middle(y_pred)


DISTRIBUTION: tuple[type[Loss], ...] = (KLDivergence, CategoricalHinge, CosineSimilarity)
