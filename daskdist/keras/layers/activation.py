"""Activation layers: :class:`Activation`, :class:`ReLU`, :class:`Softmax`."""

from __future__ import annotations

from typing import Any

from daskdist.keras import activations as _activations
from daskdist.keras.backend import xp_of
from daskdist.keras.layers.base import Array, Layer, register_layer

__all__ = ["Activation", "ReLU", "Softmax"]


@register_layer
class Activation(Layer):
    """Apply an activation function (a name like ``"relu"`` or an ``ActivationFunction``)."""

    def __init__(self, activation: str | _activations.ActivationFunction, **kwargs: Any):
        super().__init__(**kwargs)
        self.activation = _activations.get(activation)

    def forward(self, x: Array, training: bool = False) -> Array:
        y = self.activation(x)
        self._cache = {"x": x, "y": y}
        return y

    def backward(self, grad_y: Array) -> Array:
        self.grads = {}
        return self.activation.backward(grad_y, self._cached("x"), self._cache["y"])

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "activation": _activations.serialize(self.activation)}


@register_layer
class ReLU(Layer):
    """``max(x, 0)``."""

    def forward(self, x: Array, training: bool = False) -> Array:
        y = xp_of(x).maximum(x, 0)
        self._cache = {"y": y}
        return y

    def backward(self, grad_y: Array) -> Array:
        self.grads = {}
        return grad_y * (self._cached("y") > 0)


@register_layer
class Softmax(Layer):
    """Softmax along ``axis`` (default the last)."""

    def __init__(self, axis: int = -1, **kwargs: Any):
        super().__init__(**kwargs)
        self.axis = int(axis)
        self._fn = _activations.Softmax(self.axis)

    def forward(self, x: Array, training: bool = False) -> Array:
        y = self._fn(x)
        self._cache = {"y": y}
        return y

    def backward(self, grad_y: Array) -> Array:
        self.grads = {}
        return self._fn.backward(grad_y, None, self._cached("y"))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "axis": self.axis}
