"""Densely connected layers: :class:`Dense`."""

from __future__ import annotations

from typing import Any

import numpy as np

from daskdist.keras import activations as _activations
from daskdist.keras import initializers as _initializers
from daskdist.keras.backend import sum_rows
from daskdist.keras.layers.base import Array, Layer, Shape, register_layer

__all__ = ["Dense"]


@register_layer
class Dense(Layer):
    """``y = activation(x @ kernel + bias)`` on the last axis.

    Parameters
    ----------
    units
        Output size.
    activation
        Name (``"relu"``, ``"softmax"``, ...) or ``ActivationFunction``; ``None`` is linear.
    use_bias
        Whether to add a bias.
    kernel_initializer, bias_initializer
        Initializer names (or objects) for ``kernel`` ``(in, units)`` and ``bias`` ``(units,)``.
    """

    def __init__(
        self,
        units: int,
        activation: str | _activations.ActivationFunction | None = None,
        use_bias: bool = True,
        kernel_initializer: str | Any = "glorot_uniform",
        bias_initializer: str | Any = "zeros",
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.units = int(units)
        self.activation = _activations.get(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = _initializers.get(kernel_initializer)
        self.bias_initializer = _initializers.get(bias_initializer)

    def build(self, input_shape: Shape, rng: np.random.Generator | None = None) -> None:
        rng = self._rng(rng)
        self.params["kernel"] = self.kernel_initializer((int(input_shape[-1]), self.units), self.dtype, rng)
        if self.use_bias:
            self.params["bias"] = self.bias_initializer((self.units,), self.dtype, rng)
        self.built = True

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        return tuple(input_shape[:-1]) + (self.units,)

    def forward(self, x: Array, training: bool = False) -> Array:
        x = self._cast(x)
        z = x @ self.params["kernel"]
        if self.use_bias:
            z += self.params["bias"]
        y = self.activation(z)
        self._cache = {"x": x, "z": z, "y": y}
        return y

    def backward(self, grad_y: Array) -> Array:
        x, z, y = self._cached("x"), self._cache["z"], self._cache["y"]
        g = self.activation.backward(self._cast(grad_y), z, y)
        kernel = self.params["kernel"]
        g2 = g.reshape(-1, self.units)
        self.grads = {"kernel": x.reshape(-1, kernel.shape[0]).T @ g2}
        if self.use_bias:
            self.grads["bias"] = sum_rows(g2)
        return g @ kernel.T

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "units": self.units,
            "activation": _activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "kernel_initializer": _initializers.serialize(self.kernel_initializer),
            "bias_initializer": _initializers.serialize(self.bias_initializer),
        }
