"""Reshaping layers: :class:`Flatten`."""

from __future__ import annotations

import math

from daskdist.keras.layers.base import Array, Layer, Shape, register_layer

__all__ = ["Flatten"]


@register_layer
class Flatten(Layer):
    """Reshape each example to one dimension: ``(N, d1, d2, ...) -> (N, d1 * d2 * ...)``."""

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        if any(d is None for d in input_shape):
            return (None,)
        return (int(math.prod(input_shape)),)

    def forward(self, x: Array, training: bool = False) -> Array:
        self._cache = {"x_shape": tuple(x.shape)}
        return x.reshape(x.shape[0], -1)

    def backward(self, grad_y: Array) -> Array:
        self.grads = {}
        return grad_y.reshape(self._cached("x_shape"))
