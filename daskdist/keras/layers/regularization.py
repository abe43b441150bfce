"""Regularisation layers: :class:`Dropout`."""

from __future__ import annotations

from typing import Any

import numpy as np

from daskdist.keras.backend import xp_of
from daskdist.keras.layers.base import Array, Layer, register_layer

__all__ = ["Dropout"]


@register_layer
class Dropout(Layer):
    """Inverted dropout: in training, zero each element with probability ``rate`` and scale the rest by
    ``1 / (1 - rate)``; the identity when not training.

    Parameters
    ----------
    rate
        Fraction of the inputs to drop, in ``[0, 1)``.
    seed
        Seed of this layer's random generator (``None``: nondeterministic).
    """

    def __init__(self, rate: float, seed: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.rate = float(rate)
        if not 0.0 <= self.rate < 1.0:
            raise ValueError(f"Dropout rate must be in [0, 1), got {rate}")
        self.seed = seed
        self._generators: dict[str, Any] = {}

    def _generator(self, xp: Any) -> Any:
        key = xp.__name__
        if key not in self._generators:
            self._generators[key] = xp.random.default_rng(self.seed)
        return self._generators[key]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_generators"] = {k: v for k, v in self._generators.items() if k == "numpy"}  # device RNGs restart
        return state

    def rng_state(self) -> dict[str, Any]:
        """The numpy generator's state (``{}`` before its first draw: it then starts again from ``seed``).

        Device (cupy) generators are not included: after a restore they start again from ``seed``.
        """
        generator = self._generators.get("numpy")
        return {} if generator is None else {"numpy": generator.bit_generator.state}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        self._generators = {}
        saved = state.get("numpy")
        if saved is not None:
            generator = np.random.Generator(getattr(np.random, saved["bit_generator"])())
            generator.bit_generator.state = saved
            self._generators["numpy"] = generator

    def forward(self, x: Array, training: bool = False) -> Array:
        if not training or self.rate == 0.0:
            self._cache = {"mask": None}
            return x
        xp = xp_of(x)
        dtype = x.dtype if x.dtype.kind == "f" else np.dtype(self.dtype)
        keep = self._generator(xp).random(x.shape, dtype=np.float32) >= self.rate
        mask = keep.astype(dtype)
        mask *= 1.0 / (1.0 - self.rate)
        self._cache = {"mask": mask}
        return x * mask

    def backward(self, grad_y: Array) -> Array:
        self.grads = {}
        mask = self._cached("mask")
        return grad_y if mask is None else grad_y * mask

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "rate": self.rate, "seed": self.seed}
