"""Streaming metrics (Keras names) whose state is a ``[total, count]`` pair.

Every metric here is a weighted mean: ``result() = total / count``. The pair
is exposed by :meth:`Metric.totals` and :meth:`Metric.set_totals`, so a
data-parallel model can all-reduce (SUM) it across replicas and every
replica then reports the global value. Totals are kept on the host in
float64, so counts stay exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskdist.arrays import to_numpy
from daskdist.keras import losses as _losses
from daskdist.keras.backend import move_like, xp_of

__all__ = [
    "Accuracy",
    "AutoAccuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "Mean",
    "Metric",
    "SparseCategoricalAccuracy",
    "get",
    "serialize",
]

Array = Any


class Metric:
    """Base class: a weighted mean of per-example values.

    Subclasses implement :meth:`values` (per-example values from
    ``y_true``/``y_pred``).
    """

    default_name = "metric"

    def __init__(self, name: str | None = None):
        self.name = name or self.default_name
        self.total = 0.0
        self.count = 0.0

    def values(self, y_true: Array, y_pred: Array) -> Array:
        """Per-example values (e.g. 1.0 for a correct prediction)."""
        raise NotImplementedError

    def update_state(self, y_true: Array, y_pred: Array, sample_weight: Array | None = None) -> None:
        """Accumulate a batch."""
        self._accumulate(self.values(y_true, y_pred), sample_weight)

    def _accumulate(self, values: Array, sample_weight: Array | None) -> None:
        if not hasattr(values, "dtype"):
            values = np.asarray(values)
        values = values.astype("float64", copy=False)
        if sample_weight is None:
            self.total += float(values.sum())
            self.count += float(values.size)
            return
        w = sample_weight if hasattr(sample_weight, "dtype") else np.asarray(sample_weight)
        w = move_like(w, values).astype("float64", copy=False)
        if w.shape != values.shape:
            w = w.reshape(values.shape) if w.size == values.size else xp_of(values).broadcast_to(w, values.shape)
        self.total += float((values * w).sum())
        self.count += float(w.sum())

    def result(self) -> float:
        """``total / count`` (0.0 before any update)."""
        return self.total / self.count if self.count else 0.0

    def reset_state(self) -> None:
        """Forget all accumulated values."""
        self.total = 0.0
        self.count = 0.0

    def totals(self) -> np.ndarray:
        """``array([total, count])`` (float64, host) for all-reducing across replicas."""
        return np.array([self.total, self.count], dtype=np.float64)

    def set_totals(self, totals: Array) -> None:
        """Replace the state by a ``[total, count]`` pair (e.g. the all-reduced sum of :meth:`totals`)."""
        total, count = (float(v) for v in to_numpy(totals).reshape(-1)[:2])
        self.total, self.count = total, count

    def __call__(self, *args: Any, **kwargs: Any) -> float:
        """Update with a batch and return the new result."""
        self.update_state(*args, **kwargs)
        return self.result()

    def get_config(self) -> dict[str, Any]:
        """Constructor keyword arguments (JSON-serialisable)."""
        return {"name": self.name}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Metric:
        return cls(**config)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} result={self.result():.6g}>"


class Mean(Metric):
    """The (weighted) mean of the values passed to :meth:`update_state`, e.g. a running loss.

    ``update_state(values, sample_weight=None)`` as in Keras: ``values`` is a
    number or an array; ``sample_weight`` broadcasts against it
    (``update_state(batch_loss, sample_weight=batch_size)`` weights a batch
    mean by its size).
    """

    default_name = "mean"

    def update_state(self, values: Array, sample_weight: Array | None = None) -> None:  # type: ignore[override]
        self._accumulate(values, sample_weight)


def _argmax(y: Array) -> Array:
    return y.argmax(axis=-1)


class SparseCategoricalAccuracy(Metric):
    """How often ``argmax(y_pred)`` equals the integer label ``y_true`` (``(batch,)`` or ``(batch, 1)``)."""

    default_name = "sparse_categorical_accuracy"

    def values(self, y_true: Array, y_pred: Array) -> Array:
        labels = move_like(y_true, y_pred)
        if labels.ndim == y_pred.ndim and labels.shape[-1] == 1:
            labels = labels[..., 0]
        return _argmax(y_pred) == labels.astype("int64", copy=False)


class CategoricalAccuracy(Metric):
    """How often ``argmax(y_pred)`` equals ``argmax(y_true)`` (one-hot targets)."""

    default_name = "categorical_accuracy"

    def values(self, y_true: Array, y_pred: Array) -> Array:
        return _argmax(y_pred) == _argmax(move_like(y_true, y_pred))


class Accuracy(Metric):
    """How often ``y_pred`` equals ``y_true`` exactly (Keras' ``Accuracy`` class)."""

    default_name = "accuracy"

    def values(self, y_true: Array, y_pred: Array) -> Array:
        t = move_like(y_true, y_pred)
        if t.shape != y_pred.shape and t.size == y_pred.size:
            t = t.reshape(y_pred.shape)
        eq = y_pred == t
        return eq if eq.ndim <= 1 else eq.reshape(eq.shape[0], -1).mean(axis=1)


class BinaryAccuracy(Metric):
    """How often ``y_pred > threshold`` matches the 0/1 ``y_true``."""

    default_name = "binary_accuracy"

    def __init__(self, name: str | None = None, threshold: float = 0.5):
        super().__init__(name)
        self.threshold = float(threshold)

    def values(self, y_true: Array, y_pred: Array) -> Array:
        t = move_like(y_true, y_pred)
        if t.shape != y_pred.shape and t.size == y_pred.size:
            t = t.reshape(y_pred.shape)
        eq = (y_pred > self.threshold) == (t > 0.5)
        return eq if eq.ndim <= 1 else eq.reshape(eq.shape[0], -1).mean(axis=1)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "threshold": self.threshold}


class AutoAccuracy(Metric):
    """Keras' ``"accuracy"`` when the loss does not tell: chosen per batch from the shapes.

    Binary accuracy when ``y_pred`` has one output per example, sparse
    categorical when ``y_true`` holds labels (one rank less, or a last axis
    of 1), categorical otherwise.
    """

    default_name = "accuracy"

    def values(self, y_true: Array, y_pred: Array) -> Array:
        if y_pred.ndim == 1 or y_pred.shape[-1] == 1:
            return BinaryAccuracy().values(y_true, y_pred)
        if y_true.ndim < y_pred.ndim or y_true.shape[-1] == 1:
            return SparseCategoricalAccuracy().values(y_true, y_pred)
        return CategoricalAccuracy().values(y_true, y_pred)


_BY_NAME: dict[str, type[Metric]] = {
    "sparse_categorical_accuracy": SparseCategoricalAccuracy,
    "categorical_accuracy": CategoricalAccuracy,
    "binary_accuracy": BinaryAccuracy,
    "mean": Mean,
}
_BY_CLASS_NAME: dict[str, type[Metric]] = {
    cls.__name__: cls
    for cls in (Mean, SparseCategoricalAccuracy, CategoricalAccuracy, Accuracy, BinaryAccuracy, AutoAccuracy)
}


def get(identifier: str | dict | Metric | type[Metric], loss: Any = None) -> Metric:
    """Resolve a metric.

    ``"accuracy"`` / ``"acc"`` pick the accuracy that fits ``loss``, as
    Keras' ``compile`` does: :class:`SparseCategoricalAccuracy` for
    ``sparse_categorical_crossentropy``, :class:`CategoricalAccuracy` for
    ``categorical_crossentropy``, and otherwise (no loss, or another one)
    :class:`AutoAccuracy`, which decides from the shapes as Keras does. The
    metric keeps the name you asked for. Other names
    (``"sparse_categorical_accuracy"``, ...), class names, ``{"class_name",
    "config"}`` dicts, classes and instances are accepted too.
    """
    if isinstance(identifier, Metric):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Metric):
        return identifier()
    if isinstance(identifier, dict):
        cls = _BY_CLASS_NAME.get(identifier["class_name"])
        if cls is None:
            raise ValueError(f"Unknown metric class {identifier['class_name']!r}")
        return cls.from_config(identifier.get("config", {}))
    if isinstance(identifier, str):
        if identifier.lower() in ("accuracy", "acc"):
            return _accuracy_for(loss)(name=identifier)
        cls = _BY_NAME.get(identifier.lower()) or _BY_CLASS_NAME.get(identifier)
        if cls is None:
            raise ValueError(f"Unknown metric {identifier!r}; known: {sorted(_BY_NAME) + ['accuracy']}")
        return cls()
    raise TypeError(f"Cannot interpret {identifier!r} as a metric")


def _accuracy_for(loss: Any) -> type[Metric]:
    if loss is None:
        return AutoAccuracy
    loss = _losses.get(loss)
    if isinstance(loss, _losses.SparseCategoricalCrossentropy):
        return SparseCategoricalAccuracy
    if isinstance(loss, _losses.CategoricalCrossentropy):
        return CategoricalAccuracy
    return AutoAccuracy


def serialize(metric: Metric) -> dict[str, Any]:
    """``{"class_name": ..., "config": ...}`` for :func:`get`."""
    return {"class_name": type(metric).__name__, "config": metric.get_config()}
