"""The ``Metric`` base class: a weighted mean whose state is a ``[total, count]`` pair.

``result() = total / count``. The pair is exposed by :meth:`Metric.totals`
and :meth:`Metric.set_totals`, so a data-parallel model can all-reduce (SUM)
it across replicas and every replica then reports the global value. Totals
are kept on the host in float64, so counts stay exact.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from daskdist.arrays import to_numpy
from daskdist.keras.backend import move_like, xp_of

__all__ = ["Metric", "check_compilable"]

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


def check_compilable(metric: Metric, requested: Any = None) -> None:
    """Raise ``TypeError`` unless ``fit`` can call ``metric.update_state(y_true, y_pred, sample_weight)``.

    ``Mean`` (and any metric whose ``update_state`` takes ``values``) cannot be
    compiled: Keras' ``fit`` would pass it ``(y_true, y_pred)`` too and fail
    inside training; here it fails on the client, at ``compile``.
    """
    try:
        parameters = list(inspect.signature(metric.update_state).parameters.values())
    except (TypeError, ValueError):
        return
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_varargs = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    names = [p.name for p in positional]
    if takes_varargs or (len(positional) >= 2 and names[1] != "sample_weight"):
        return
    raise TypeError(
        f"metric {requested if requested is not None else metric!r} cannot be compiled: its update_state takes "
        f"({', '.join(names)}), and fit calls update_state(y_true, y_pred, sample_weight) (TensorFlow's Keras "
        "fails the same way, inside fit). Use it in a custom loop or a callback, or compile a function of "
        "(y_true, y_pred), e.g. metrics.MeanMetricWrapper(fn, name=...)"
    )
