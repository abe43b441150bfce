"""Pooling layers: :class:`MaxPooling2D` (NHWC)."""

from __future__ import annotations

from typing import Any

import numpy as np

from daskdist.keras.backend import conv_output_length, normalize_tuple, pad_amounts, pad_nhwc, xp_of
from daskdist.keras.layers.base import Array, Layer, Shape, register_layer

__all__ = ["MaxPooling2D"]


@register_layer
class MaxPooling2D(Layer):
    """Max pooling on NHWC input; the backward pass routes each gradient to its window's maximum.

    Parameters
    ----------
    pool_size
        An int or a pair ``(height, width)``.
    strides
        An int or a pair; ``None`` means ``pool_size``.
    padding
        ``"valid"`` or ``"same"`` (TensorFlow's rules; padding never wins the max).

    Notes
    -----
    With ties inside a window, the gradient goes to the first maximum in
    row-major window order.
    """

    def __init__(
        self,
        pool_size: int | tuple[int, int] = 2,
        strides: int | tuple[int, int] | None = None,
        padding: str = "valid",
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.pool_size = normalize_tuple(pool_size, 2, "pool_size")
        self.strides = normalize_tuple(strides, 2, "strides") if strides is not None else self.pool_size
        self.padding = str(padding).lower()
        if self.padding not in ("valid", "same"):
            raise ValueError(f"padding must be 'valid' or 'same', got {padding!r}")

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        h, w, c = input_shape
        oh = conv_output_length(h, self.pool_size[0], self.strides[0], self.padding)
        ow = conv_output_length(w, self.pool_size[1], self.strides[1], self.padding)
        return (oh, ow, c)

    def _window_slices(self, out_hw: tuple[int, int]) -> list[tuple[slice, slice]]:
        """For each offset ``(i, j)`` in the pooling window, the strided (rows, cols) slice of the padded input
        holding that window element for every output pixel."""
        ph, pw = self.pool_size
        sh, sw = self.strides
        h_span, w_span = sh * (out_hw[0] - 1) + 1, sw * (out_hw[1] - 1) + 1
        return [(slice(i, i + h_span, sh), slice(j, j + w_span, sw)) for i in range(ph) for j in range(pw)]

    def forward(self, x: Array, training: bool = False) -> Array:
        n, h, w, c = x.shape
        ph, pw = self.pool_size
        sh, sw = self.strides
        oh, top, bottom = pad_amounts(h, ph, sh, self.padding)
        ow, left, right = pad_amounts(w, pw, sw, self.padding)
        pads = (top, bottom, left, right)
        fill = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
        xpad = pad_nhwc(x, pads, fill)
        xp = xp_of(x)
        slices = self._window_slices((oh, ow))
        rows, cols = slices[0]
        y = xpad[:, rows, cols, :].copy()
        for rows, cols in slices[1:]:  # a running maximum over the window offsets, no window copies
            xp.maximum(y, xpad[:, rows, cols, :], out=y)
        self._cache = {"xpad": xpad, "y": y, "x_shape": tuple(x.shape), "pads": pads}
        return y

    def backward(self, grad_y: Array) -> Array:
        xpad = self._cached("xpad")
        y = self._cache["y"]
        n, h, w, c = self._cache["x_shape"]
        top, bottom, left, right = self._cache["pads"]
        xp = xp_of(grad_y)
        if xpad.dtype.kind == "f":
            grad_y = grad_y.astype(xpad.dtype, copy=False)
        dxp = xp.zeros(xpad.shape, dtype=grad_y.dtype)
        # Windows that do not overlap write disjoint pixels: assign instead of accumulate (much cheaper).
        overlapping = any(s < p for s, p in zip(self.strides, self.pool_size))
        contribution = xp.empty_like(grad_y)
        taken = None  # outputs whose gradient was already routed (to the first maximum of the window)
        for rows, cols in self._window_slices(y.shape[1:3]):
            hit = xpad[:, rows, cols, :] == y
            if taken is None:
                taken = hit
            else:
                xp.greater(hit, taken, out=hit)  # hit and not yet taken
                taken |= hit
            xp.multiply(grad_y, hit, out=contribution)
            if overlapping:
                dxp[:, rows, cols, :] += contribution
            else:
                dxp[:, rows, cols, :] = contribution
        self.grads = {}
        if top or bottom or left or right:
            return dxp[:, top : top + h, left : left + w, :]
        return dxp

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "pool_size": list(self.pool_size),
            "strides": list(self.strides),
            "padding": self.padding,
        }
