"""Convolution layers: :class:`Conv2D` (NHWC, one im2col matmul)."""

from __future__ import annotations

from typing import Any

import numpy as np

from daskdist.keras import activations as _activations
from daskdist.keras import initializers as _initializers
from daskdist.keras.backend import conv2d_input_gradient, conv_output_length, im2col, normalize_tuple, sum_rows
from daskdist.keras.layers.base import Array, Layer, Shape, register_layer

__all__ = ["Conv2D"]


@register_layer
class Conv2D(Layer):
    """2-D convolution on NHWC input, as one im2col matmul.

    ``kernel`` has shape ``(KH, KW, C_in, filters)`` (Keras' layout) and
    ``bias`` ``(filters,)``. Padding follows TensorFlow: ``"valid"`` (none)
    or ``"same"`` (output ``ceil(size / stride)``, extra padding at the end).

    Parameters
    ----------
    filters
        Number of output channels.
    kernel_size, strides
        An int or a pair ``(height, width)``.
    padding
        ``"valid"`` or ``"same"``.
    activation, use_bias, kernel_initializer, bias_initializer
        As for :class:`Dense`.
    """

    def __init__(
        self,
        filters: int,
        kernel_size: int | tuple[int, int],
        strides: int | tuple[int, int] = 1,
        padding: str = "valid",
        activation: str | _activations.ActivationFunction | None = None,
        use_bias: bool = True,
        kernel_initializer: str | Any = "glorot_uniform",
        bias_initializer: str | Any = "zeros",
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.filters = int(filters)
        self.kernel_size = normalize_tuple(kernel_size, 2, "kernel_size")
        self.strides = normalize_tuple(strides, 2, "strides")
        self.padding = str(padding).lower()
        if self.padding not in ("valid", "same"):
            raise ValueError(f"padding must be 'valid' or 'same', got {padding!r}")
        self.activation = _activations.get(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = _initializers.get(kernel_initializer)
        self.bias_initializer = _initializers.get(bias_initializer)

    def build(self, input_shape: Shape, rng: np.random.Generator | None = None) -> None:
        if len(input_shape) != 3:
            raise ValueError(f"{self.name}: Conv2D expects (height, width, channels) inputs, got {input_shape}")
        rng = self._rng(rng)
        kh, kw = self.kernel_size
        shape = (kh, kw, int(input_shape[-1]), self.filters)
        self.params["kernel"] = self.kernel_initializer(shape, self.dtype, rng)
        if self.use_bias:
            self.params["bias"] = self.bias_initializer((self.filters,), self.dtype, rng)
        self.built = True

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        h, w, _ = input_shape
        oh = conv_output_length(h, self.kernel_size[0], self.strides[0], self.padding)
        ow = conv_output_length(w, self.kernel_size[1], self.strides[1], self.padding)
        return (oh, ow, self.filters)

    def forward(self, x: Array, training: bool = False) -> Array:
        x = self._cast(x)
        n = x.shape[0]
        kernel = self.params["kernel"]
        cols, (oh, ow), pads = im2col(x, self.kernel_size, self.strides, self.padding)
        z = cols @ kernel.reshape(-1, self.filters)
        if self.use_bias:
            z += self.params["bias"]
        z = z.reshape(n, oh, ow, self.filters)
        y = self.activation(z)
        self._cache = {"cols": cols, "z": z, "y": y, "x_shape": tuple(x.shape), "out_hw": (oh, ow), "pads": pads}
        return y

    def backward(self, grad_y: Array) -> Array:
        cols = self._cached("cols")
        c = self._cache
        g = self.activation.backward(self._cast(grad_y), c["z"], c["y"]).reshape(-1, self.filters)
        kernel = self.params["kernel"]
        self.grads = {"kernel": (cols.T @ g).reshape(kernel.shape)}
        if self.use_bias:
            self.grads["bias"] = sum_rows(g)
        return conv2d_input_gradient(g, kernel, c["x_shape"], self.strides, c["out_hw"], c["pads"])

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "filters": self.filters,
            "kernel_size": list(self.kernel_size),
            "strides": list(self.strides),
            "padding": self.padding,
            "activation": _activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "kernel_initializer": _initializers.serialize(self.kernel_initializer),
            "bias_initializer": _initializers.serialize(self.bias_initializer),
        }
