"""Weight initializers (Keras names and formulas), drawing on the host with a numpy ``Generator``.

An initializer is called as ``init(shape, dtype="float32", rng=None)`` and
returns a fresh numpy array; with the same ``rng`` state it returns the same
values. Weights are created on the host; the model moves them to a device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "Constant",
    "GlorotNormal",
    "GlorotUniform",
    "HeNormal",
    "HeUniform",
    "Initializer",
    "Ones",
    "Zeros",
    "compute_fans",
    "get",
    "serialize",
]


def compute_fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(fan_in, fan_out)`` as Keras computes them.

    A ``(in, out)`` kernel gives ``(in, out)``; a convolution kernel
    ``(KH, KW, C_in, C_out)`` gives ``(KH*KW*C_in, KH*KW*C_out)``.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


class Initializer:
    """Base class: ``__call__(shape, dtype, rng)`` -> numpy array; ``get_config``/``from_config``."""

    def __call__(self, shape: tuple[int, ...], dtype: Any = "float32", rng: np.random.Generator | None = None
                 ) -> np.ndarray:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        """Constructor keyword arguments (JSON-serialisable)."""
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Initializer:
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class Zeros(Initializer):
    """All zeros."""

    def __call__(self, shape: tuple[int, ...], dtype: Any = "float32", rng: np.random.Generator | None = None
                 ) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)


class Ones(Initializer):
    """All ones."""

    def __call__(self, shape: tuple[int, ...], dtype: Any = "float32", rng: np.random.Generator | None = None
                 ) -> np.ndarray:
        return np.ones(shape, dtype=dtype)


class Constant(Initializer):
    """Every element ``value``."""

    def __init__(self, value: float = 0.0):
        self.value = float(value)

    def __call__(self, shape: tuple[int, ...], dtype: Any = "float32", rng: np.random.Generator | None = None
                 ) -> np.ndarray:
        return np.full(shape, self.value, dtype=dtype)

    def get_config(self) -> dict[str, Any]:
        return {"value": self.value}


class _VarianceScaling(Initializer):
    """Keras ``VarianceScaling``: variance ``scale / fan`` with a uniform or truncated-normal draw."""

    scale: float = 1.0
    mode: str = "fan_in"
    distribution: str = "truncated_normal"

    def __call__(self, shape: tuple[int, ...], dtype: Any = "float32", rng: np.random.Generator | None = None
                 ) -> np.ndarray:
        rng = rng if rng is not None else np.random.default_rng()
        fan_in, fan_out = compute_fans(shape)
        fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[self.mode]
        variance = self.scale / max(1.0, fan)
        if self.distribution == "uniform":
            limit = math.sqrt(3.0 * variance)
            return rng.uniform(-limit, limit, size=shape).astype(dtype)
        # Truncated at two standard deviations; the constant is the std of the truncated unit normal.
        stddev = math.sqrt(variance) / 0.87962566103423978
        return (_truncated_normal(rng, shape) * stddev).astype(dtype)


def _truncated_normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal samples, redrawn until all lie within two standard deviations."""
    out = rng.standard_normal(size=shape)
    bad = np.abs(out) > 2.0
    while bad.any():
        out[bad] = rng.standard_normal(size=int(bad.sum()))
        bad = np.abs(out) > 2.0
    return out


class GlorotUniform(_VarianceScaling):
    """Uniform in ``[-limit, limit]``, ``limit = sqrt(6 / (fan_in + fan_out))`` (Keras' default kernel init)."""

    scale, mode, distribution = 1.0, "fan_avg", "uniform"


class GlorotNormal(_VarianceScaling):
    """Truncated normal with ``stddev = sqrt(2 / (fan_in + fan_out))``."""

    scale, mode, distribution = 1.0, "fan_avg", "truncated_normal"


class HeNormal(_VarianceScaling):
    """Truncated normal with ``stddev = sqrt(2 / fan_in)`` (for ReLU networks)."""

    scale, mode, distribution = 2.0, "fan_in", "truncated_normal"


class HeUniform(_VarianceScaling):
    """Uniform in ``[-limit, limit]``, ``limit = sqrt(6 / fan_in)``."""

    scale, mode, distribution = 2.0, "fan_in", "uniform"


_BY_NAME: dict[str, type[Initializer]] = {
    "zeros": Zeros,
    "ones": Ones,
    "constant": Constant,
    "glorot_uniform": GlorotUniform,
    "glorot_normal": GlorotNormal,
    "he_normal": HeNormal,
    "he_uniform": HeUniform,
}
_BY_CLASS_NAME: dict[str, type[Initializer]] = {cls.__name__: cls for cls in _BY_NAME.values()}


def get(identifier: str | dict[str, Any] | Initializer | Callable[..., Any] | None) -> Initializer | Callable[..., Any]:
    """Resolve an initializer from a name (``"glorot_uniform"``, ``"he_normal"``, ``"zeros"``, ``"ones"``, ...).

    Also accepts a class name (``"HeNormal"``), a ``{"class_name", "config"}``
    dict, an :class:`Initializer`, or any callable ``(shape, dtype, rng)``.
    """
    if identifier is None:
        return Zeros()
    if isinstance(identifier, Initializer):
        return identifier
    if isinstance(identifier, dict):
        cls = _BY_CLASS_NAME.get(identifier["class_name"]) or _BY_NAME.get(identifier["class_name"])
        if cls is None:
            raise ValueError(f"Unknown initializer {identifier['class_name']!r}")
        return cls.from_config(identifier.get("config", {}))
    if isinstance(identifier, str):
        cls = _BY_NAME.get(identifier.lower()) or _BY_CLASS_NAME.get(identifier)
        if cls is None:
            raise ValueError(f"Unknown initializer {identifier!r}; known: {sorted(_BY_NAME)}")
        return cls()
    if isinstance(identifier, type) and issubclass(identifier, Initializer):
        return identifier()
    if callable(identifier):
        return identifier
    raise TypeError(f"Cannot interpret {identifier!r} as an initializer")


def serialize(initializer: Initializer | Callable[..., Any]) -> str | dict[str, Any]:
    """A JSON-serialisable form that :func:`get` maps back: the Keras name when there is no config."""
    if not isinstance(initializer, Initializer):
        raise ValueError(f"Cannot serialise initializer {initializer!r}; use a name or an Initializer")
    config = initializer.get_config()
    if not config:
        for name, cls in _BY_NAME.items():
            if type(initializer) is cls:
                return name
    return {"class_name": type(initializer).__name__, "config": config}
