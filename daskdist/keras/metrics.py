"""Streaming metrics (Keras names) whose state is a ``[total, count]`` pair, and the registry of names.

Every metric is a weighted mean (``result() = total / count``, see
:mod:`daskdist.keras.metric_base`), so a data-parallel model all-reduces the
pair across replicas and every replica reports the global value. This
module holds ``Mean`` and the accuracies; every built-in loss as a metric,
top-k accuracy and ``MeanMetricWrapper`` are in ``loss_metrics``. :func:`get`
accepts every name TensorFlow's Keras accepts in ``compile(metrics=...)``
for these metrics, and refuses any other on the client, listing the known.
"""

from __future__ import annotations

import copy
from typing import Any

from daskdist.keras import losses as _losses
from daskdist.keras.backend import move_like
from daskdist.keras.loss_metrics import (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    CategoricalHinge,
    CosineSimilarity,
    Hinge,
    KLDivergence,
    LogCoshError,
    MeanAbsoluteError,
    MeanAbsolutePercentageError,
    MeanMetricWrapper,
    MeanSquaredError,
    MeanSquaredLogarithmicError,
    Poisson,
    RootMeanSquaredError,
    SparseCategoricalCrossentropy,
    SparseTopKCategoricalAccuracy,
    SquaredHinge,
    TopKCategoricalAccuracy,
)
from daskdist.keras.metric_base import Metric, check_compilable

__all__ = [
    "Accuracy",
    "AutoAccuracy",
    "BinaryAccuracy",
    "BinaryCrossentropy",
    "CategoricalAccuracy",
    "CategoricalCrossentropy",
    "CategoricalHinge",
    "CosineSimilarity",
    "Hinge",
    "KLDivergence",
    "LogCoshError",
    "Mean",
    "MeanAbsoluteError",
    "MeanAbsolutePercentageError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "MeanSquaredLogarithmicError",
    "Metric",
    "Poisson",
    "Precision",
    "Recall",
    "RootMeanSquaredError",
    "SparseCategoricalAccuracy",
    "SparseCategoricalCrossentropy",
    "SparseTopKCategoricalAccuracy",
    "SquaredHinge",
    "TopKCategoricalAccuracy",
    "compiled",
    "get",
    "is_known",
    "known_names",
    "metrics_with_names",
    "serialize",
]

Array = Any


class Mean(Metric):
    """The (weighted) mean of the values passed to :meth:`update_state`, e.g. a running loss.

    ``update_state(values, sample_weight=None)`` as in Keras: ``values`` is a
    number or an array; ``sample_weight`` broadcasts against it
    (``update_state(batch_loss, sample_weight=batch_size)`` weights a batch
    mean by its size).
    """

    default_name = "mean"

    # Keras' API: Mean takes ``values`` where the other metrics take ``(y_true, y_pred)``
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


class _ConfusionRatio(Metric):
    """``true positives / (true positives + a kind of error)``, thresholded at ``thresholds``.

    The ``[total, count]`` pair is ``[true positives, the denominator]``, so
    it sums over replicas like every other metric here.
    """

    def __init__(self, thresholds: float | None = None, name: str | None = None):
        super().__init__(name)
        self.thresholds = 0.5 if thresholds is None else float(thresholds)

    def _denominator(self, predicted: Array, actual: Array) -> Array:
        raise NotImplementedError

    def update_state(self, y_true: Array, y_pred: Array, sample_weight: Array | None = None) -> None:
        actual = move_like(y_true, y_pred)
        if actual.shape != y_pred.shape and actual.size == y_pred.size:
            actual = actual.reshape(y_pred.shape)
        actual = actual > 0.5
        predicted = y_pred > self.thresholds
        weight = 1.0
        if sample_weight is not None:
            w = move_like(sample_weight, y_pred).astype("float64", copy=False)
            weight = w.reshape(w.shape + (1,) * (y_pred.ndim - w.ndim))
        self.total += float(((predicted & actual) * weight).sum())
        self.count += float((self._denominator(predicted, actual) * weight).sum())

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "thresholds": self.thresholds}


class Precision(_ConfusionRatio):
    """Of the outputs predicted positive (``y_pred > thresholds``), the fraction that are (Keras' ``Precision``)."""

    default_name = "precision"

    def _denominator(self, predicted: Array, actual: Array) -> Array:
        return predicted


class Recall(_ConfusionRatio):
    """Of the positive targets, the fraction predicted positive (Keras' ``Recall``)."""

    default_name = "recall"

    def _denominator(self, predicted: Array, actual: Array) -> Array:
        return actual


# the names tf.keras.metrics.get accepts for these metrics (its functions and aliases), lower case;
# "accuracy"/"acc" and "crossentropy"/"ce" are chosen from the loss, as Keras' compile does
_BY_NAME: dict[str, type[Metric]] = {
    "sparse_categorical_accuracy": SparseCategoricalAccuracy,
    "categorical_accuracy": CategoricalAccuracy,
    "binary_accuracy": BinaryAccuracy,
    "top_k_categorical_accuracy": TopKCategoricalAccuracy,
    "sparse_top_k_categorical_accuracy": SparseTopKCategoricalAccuracy,
    "mean_squared_error": MeanSquaredError,
    "mse": MeanSquaredError,
    "mean_absolute_error": MeanAbsoluteError,
    "mae": MeanAbsoluteError,
    "mean_absolute_percentage_error": MeanAbsolutePercentageError,
    "mape": MeanAbsolutePercentageError,
    "mean_squared_logarithmic_error": MeanSquaredLogarithmicError,
    "msle": MeanSquaredLogarithmicError,
    "root_mean_squared_error": RootMeanSquaredError,
    "kl_divergence": KLDivergence,
    "kullback_leibler_divergence": KLDivergence,
    "kld": KLDivergence,
    "logcosh": LogCoshError,
    "log_cosh": LogCoshError,
    "hinge": Hinge,
    "squared_hinge": SquaredHinge,
    "categorical_hinge": CategoricalHinge,
    "poisson": Poisson,
    "cosine_similarity": CosineSimilarity,
    "binary_crossentropy": BinaryCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
}
_CHOSEN_BY_LOSS = ("accuracy", "acc", "crossentropy", "ce")
_CLASSES: list[type[Metric]] = [Mean, SparseCategoricalAccuracy, CategoricalAccuracy, Accuracy, BinaryAccuracy,
                                AutoAccuracy, Precision, Recall, *_BY_NAME.values()]
_BY_CLASS_NAME: dict[str, type[Metric]] = {cls.__name__: cls for cls in _CLASSES}


def known_names() -> list[str]:
    """Every string :func:`get` accepts: Keras' names, then the class names."""
    return sorted({*_BY_NAME, *_CHOSEN_BY_LOSS}) + sorted(_BY_CLASS_NAME)


def get(identifier: Any, loss: Any = None) -> Metric:
    """Resolve a metric (``compile`` then checks it with :func:`compiled`).

    ``"accuracy"`` / ``"acc"`` pick the accuracy that fits ``loss``, as
    Keras' ``compile`` does: :class:`SparseCategoricalAccuracy` for
    ``sparse_categorical_crossentropy``, :class:`CategoricalAccuracy` for
    ``categorical_crossentropy``, and otherwise (no loss, or another one)
    :class:`AutoAccuracy`, which decides from the shapes as Keras does;
    ``"crossentropy"`` / ``"ce"`` the cross-entropy of the loss's kind
    (categorical when the loss is not a cross-entropy). A metric made
    from a name keeps that name (``metrics=["mae"]`` logs ``"mae"``, as in
    Keras). Other Keras names (``"mse"``, ``"kld"``, ...; see
    :func:`known_names`), class names, ``{"class_name", "config"}`` dicts,
    classes, instances, and functions of ``(y_true, y_pred)`` (wrapped in
    :class:`MeanMetricWrapper`) are accepted too.
    """
    return _resolve(identifier, loss)


def compiled(identifier: Any, loss: Any = None) -> Metric:
    """:func:`get` for ``compile``: also raise on the client for a metric that ``fit`` could not update.

    ``Mean`` and other metrics whose ``update_state`` takes ``values`` raise
    ``TypeError`` here: ``fit`` passes ``(y_true, y_pred, sample_weight)``.
    """
    metric = _resolve(identifier, loss)
    check_compilable(metric, identifier)
    return metric


def _resolve(identifier: Any, loss: Any) -> Metric:
    if isinstance(identifier, Metric):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Metric):
        return identifier()
    if isinstance(identifier, dict):
        cls = _BY_CLASS_NAME.get(identifier["class_name"])
        if cls is None:
            raise ValueError(f"Unknown metric class {identifier['class_name']!r}; known: {sorted(_BY_CLASS_NAME)}")
        return cls.from_config(identifier.get("config", {}))
    if isinstance(identifier, str):
        key = identifier.lower()
        if key in ("accuracy", "acc"):
            return _accuracy_for(loss)(name=identifier)
        if key in ("crossentropy", "ce"):
            return _crossentropy_for(loss)(name=identifier)
        cls = _BY_NAME.get(key) or _BY_CLASS_NAME.get(identifier)
        if cls is None:
            raise ValueError(f"Unknown metric {identifier!r}; known: {', '.join(known_names())}")
        return cls(name=identifier) if identifier.lower() in _BY_NAME else cls()
    if isinstance(identifier, type) and issubclass(identifier, _losses.Loss):
        return MeanMetricWrapper(identifier())
    if callable(identifier):
        return MeanMetricWrapper(identifier)
    raise TypeError(f"Cannot interpret {identifier!r} as a metric")


def _crossentropy_for(loss: Any) -> type[Metric]:
    loss = _losses.get(loss) if loss is not None else None
    if isinstance(loss, _losses.SparseCategoricalCrossentropy):
        return SparseCategoricalCrossentropy
    if isinstance(loss, _losses.BinaryCrossentropy):
        return BinaryCrossentropy
    return CategoricalCrossentropy


def _accuracy_for(loss: Any) -> type[Metric]:
    if loss is None:
        return AutoAccuracy
    loss = _losses.get(loss)
    if isinstance(loss, _losses.SparseCategoricalCrossentropy):
        return SparseCategoricalAccuracy
    if isinstance(loss, _losses.CategoricalCrossentropy):
        return CategoricalAccuracy
    return AutoAccuracy


def is_known(metric: Metric) -> bool:
    """Whether :func:`get` can rebuild ``metric`` from :func:`serialize` (a built-in class, not a wrapper)."""
    return _BY_CLASS_NAME.get(type(metric).__name__) is type(metric)


def serialize(metric: Metric) -> dict[str, Any]:
    """``{"class_name": ..., "config": ...}`` for :func:`get`."""
    return {"class_name": type(metric).__name__, "config": metric.get_config()}


def _unique(name: str, seen: dict[str, int]) -> str:
    """``name``, or ``name_<n>`` for its ``n``-th repeat (Keras' rule for the logs' keys)."""
    if name not in seen:
        seen[name] = 1
        return name
    index = seen[name]
    seen[name] += 1
    return f"{name}_{index}"


def metrics_with_names(plain: list[Metric], weighted: list[Metric]) -> list[Metric]:
    """``compile``'s ``metrics`` then ``weighted_metrics``, named as Keras 3 logs them.

    A repeated name gets ``_1``, ``_2``...; a weighted metric whose name is
    taken is ``weighted_<name>`` (then ``_1``...). A metric renamed, or given
    twice (the same object in both lists), is a copy: each keeps its own
    totals, and the caller's object keeps its name.
    """
    seen: dict[str, int] = {}
    named: list[Metric] = []

    def add(metric: Metric, name: str) -> None:
        if name != metric.name or any(metric is other for other in named):
            metric = copy.deepcopy(metric)
            metric.name = name
        named.append(metric)

    for metric in plain:
        add(metric, _unique(metric.name, seen))
    for metric in weighted:
        add(metric, _unique(metric.name, seen) if metric.name not in seen else _unique(f"weighted_{metric.name}", seen))
    return named
