"""Array-namespace helpers shared by the Keras-like building blocks.

Everything here works on numpy and cupy arrays alike: the array module is
taken from the data (:func:`xp_of`), never hard-coded, so a model whose
weights live on a GPU runs its forward and backward passes there.

The convolution helpers use the NHWC (channels-last) layout of Keras and
TensorFlow, and TensorFlow's ``"valid"`` / ``"same"`` padding rules.
"""

from __future__ import annotations

import itertools
import re
import threading
from types import ModuleType
from typing import Any, overload

import numpy as np

from daskdist.arrays import move_like, namespace, to_numpy

__all__ = [
    "clear_session",
    "col2im",
    "conv2d_input_gradient",
    "conv_output_length",
    "copy_as",
    "epsilon",
    "floatx",
    "im2col",
    "move_like",
    "normalize_tuple",
    "pad_amounts",
    "pad_nhwc",
    "snake_case",
    "sum_rows",
    "to_dtype",
    "to_numpy",
    "unique_name",
    "windows",
    "xp_of",
]

_FLOATX = "float32"
_EPSILON = 1e-7


def floatx() -> str:
    """The default float dtype of weights and activations (``"float32"``)."""
    return _FLOATX


def epsilon() -> float:
    """The fuzz factor used to keep logarithms and divisions finite (``1e-7``, as Keras)."""
    return _EPSILON


def xp_of(x: Any) -> ModuleType:
    """The array module (``numpy`` or ``cupy``) that operates on ``x``."""
    return namespace(x)


def to_dtype(x: Any, dtype: Any) -> Any:
    """``x`` as an array of ``dtype``, without a copy when it already has it.

    Arrays keep their namespace (a cupy array stays on its GPU); Python
    numbers and lists become numpy arrays.
    """
    if hasattr(x, "astype") and hasattr(x, "dtype"):
        return x.astype(dtype, copy=False)
    return np.asarray(x, dtype=dtype)


def copy_as(value: Any, dtype: Any) -> Any:
    """A fresh copy of ``value`` with ``dtype``, in ``value``'s own namespace (host or device)."""
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        xp = xp_of(value)
        return xp.array(value, dtype=dtype, copy=True)
    return np.array(value, dtype=dtype, copy=True)



def sum_rows(a: Any) -> Any:
    """Column sums of a 2-D array, ``a.sum(axis=0)``, as a matrix-vector product.

    For tall float arrays BLAS is several times faster than numpy's
    ``sum(axis=0)``; accumulation stays in ``a``'s dtype.
    """
    if a.dtype.kind != "f":
        return a.sum(axis=0)
    return xp_of(a).ones(a.shape[0], dtype=a.dtype) @ a


# ---------------------------------------------------------------------------------------------------------
# names


_uid_lock = threading.Lock()
_uids: dict[str, itertools.count[int]] = {}


def unique_name(prefix: str) -> str:
    """``prefix``, then ``prefix_1``, ``prefix_2``, ... (process-wide, like Keras' automatic layer names)."""
    with _uid_lock:
        counter = _uids.setdefault(prefix, itertools.count())
        n = next(counter)
    return prefix if n == 0 else f"{prefix}_{n}"


def clear_session() -> None:
    """Reset the automatic name counters (Keras' ``clear_session``), so names start again at ``dense``."""
    with _uid_lock:
        _uids.clear()


def snake_case(name: str) -> str:
    """``MaxPooling2D`` -> ``max_pooling2d`` (the prefix of automatic layer names)."""
    s = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", s).lower()


# ---------------------------------------------------------------------------------------------------------
# convolution geometry


def normalize_tuple(value: int | tuple[int, ...] | list[int], n: int, what: str) -> tuple[int, ...]:
    """``3`` -> ``(3, 3)``; a sequence of ``n`` positive ints passes through as a tuple."""
    if isinstance(value, (int, np.integer)):
        result = (int(value),) * n
    else:
        result = tuple(int(v) for v in value)
    if len(result) != n or any(v <= 0 for v in result):
        raise ValueError(f"{what} must be a positive int or {n} positive ints, got {value!r}")
    return result


@overload
def conv_output_length(size: int, kernel: int, stride: int, padding: str) -> int: ...


@overload
def conv_output_length(size: None, kernel: int, stride: int, padding: str) -> None: ...


def conv_output_length(size: int | None, kernel: int, stride: int, padding: str) -> int | None:
    """Output length along one spatial axis, TensorFlow rules (``None`` stays ``None``)."""
    if size is None:
        return None
    if padding == "same":
        return -(-size // stride)
    if padding == "valid":
        return max((size - kernel) // stride + 1, 0)
    raise ValueError(f"padding must be 'valid' or 'same', got {padding!r}")


def pad_amounts(size: int, kernel: int, stride: int, padding: str) -> tuple[int, int, int]:
    """``(output_length, pad_before, pad_after)`` along one axis, as TensorFlow pads.

    ``"same"`` pads ``max((out - 1) * stride + kernel - size, 0)`` in total,
    the odd element at the end; ``"valid"`` does not pad.
    """
    out = conv_output_length(size, kernel, stride, padding)
    if padding == "valid":
        return out, 0, 0
    total = max((out - 1) * stride + kernel - size, 0)
    return out, total // 2, total - total // 2


def pad_nhwc(x: Any, pads: tuple[int, int, int, int], value: float = 0.0) -> Any:
    """Pad the two spatial axes of an NHWC array by ``(top, bottom, left, right)``; no copy if all zero."""
    top, bottom, left, right = pads
    if not (top or bottom or left or right):
        return x
    xp = xp_of(x)
    n, h, w, c = x.shape
    out = xp.full((n, h + top + bottom, w + left + right, c), value, dtype=x.dtype)
    out[:, top:top + h, left:left + w, :] = x
    return out


def windows(x: Any, kernel: tuple[int, ...], strides: tuple[int, ...], out_hw: tuple[int, int]) -> Any:
    """A read-only strided view ``(N, OH, OW, KH, KW, C)`` of the windows of an (already padded) NHWC array.

    No data is copied; window ``(i, j)`` starts at pixel ``(i * SH, j * SW)``.
    """
    xp = xp_of(x)
    n, _, _, c = x.shape
    kh, kw = kernel
    sh, sw = strides
    oh, ow = out_hw
    s_n, s_h, s_w, s_c = x.strides
    return xp.lib.stride_tricks.as_strided(
        x, shape=(n, oh, ow, kh, kw, c), strides=(s_n, s_h * sh, s_w * sw, s_h, s_w, s_c)
    )


def im2col(
    x: Any, kernel: tuple[int, ...], strides: tuple[int, ...], padding: str
) -> tuple[Any, tuple[int, int], tuple[int, int, int, int]]:
    """Unfold an NHWC array into a patch matrix for convolution as one matmul.

    Parameters
    ----------
    x
        ``(N, H, W, C)`` array.
    kernel, strides
        ``(KH, KW)`` and ``(SH, SW)``.
    padding
        ``"valid"`` or ``"same"`` (TensorFlow's rules, zero padding).

    Returns
    -------
    cols
        ``(N * OH * OW, KH * KW * C)`` contiguous array; row ``(n, i, j)`` is
        the window at output pixel ``(i, j)`` of image ``n``, flattened in
        ``(kh, kw, c)`` order (matching a ``(KH, KW, C, F)`` kernel reshaped
        to ``(KH * KW * C, F)``).
    out_hw
        ``(OH, OW)``.
    pads
        ``(top, bottom, left, right)`` zero padding that was applied.
    """
    n, h, w, c = x.shape
    kh, kw = kernel
    sh, sw = strides
    oh, top, bottom = pad_amounts(h, kh, sh, padding)
    ow, left, right = pad_amounts(w, kw, sw, padding)
    pads = (top, bottom, left, right)
    if kh == 1 and kw == 1 and sh == 1 and sw == 1:
        xp = xp_of(x)
        return xp.ascontiguousarray(x).reshape(n * h * w, c), (h, w), pads
    view = windows(pad_nhwc(x, pads), kernel, strides, (oh, ow))
    return view.reshape(n * oh * ow, kh * kw * c), (oh, ow), pads


def col2im(
    dcols: Any,
    input_shape: tuple[int, int, int, int],
    kernel: tuple[int, ...],
    strides: tuple[int, ...],
    out_hw: tuple[int, int],
    pads: tuple[int, int, int, int],
) -> Any:
    """The adjoint of :func:`im2col`: scatter-add patch gradients back onto the input.

    ``dcols`` is ``(N * OH * OW, KH * KW * C)`` (or already
    ``(N, OH, OW, KH, KW, C)``); the result has ``input_shape``. The loop
    runs over the ``KH * KW`` kernel offsets only, each a vectorised strided add.
    """
    n, h, w, c = input_shape
    kh, kw = kernel
    sh, sw = strides
    oh, ow = out_hw
    top, bottom, left, right = pads
    if kh == 1 and kw == 1 and sh == 1 and sw == 1:
        return dcols.reshape(n, h, w, c)
    xp = xp_of(dcols)
    d6 = dcols.reshape(n, oh, ow, kh, kw, c)
    dxp = xp.zeros((n, h + top + bottom, w + left + right, c), dtype=dcols.dtype)
    h_span = sh * (oh - 1) + 1
    w_span = sw * (ow - 1) + 1
    for i in range(kh):
        for j in range(kw):
            dxp[:, i:i + h_span:sh, j:j + w_span:sw, :] += d6[:, :, :, i, j, :]
    if top or bottom or left or right:
        return dxp[:, top:top + h, left:left + w, :]
    return dxp


def conv2d_input_gradient(
    grad_out: Any,
    kernel: Any,
    input_shape: tuple[int, int, int, int],
    strides: tuple[int, ...],
    out_hw: tuple[int, int],
    pads: tuple[int, int, int, int],
) -> Any:
    """``dL/dx`` of a convolution from ``dL/dy``, one small matmul per kernel offset.

    Equal to ``col2im(grad_out @ kernel.reshape(-1, F).T, ...)`` but never
    materialises the ``(N*OH*OW, KH*KW*C)`` patch gradient: each offset's
    ``(N*OH*OW, C)`` product is added straight into the input gradient.

    Parameters
    ----------
    grad_out
        ``(N * OH * OW, F)`` gradient of the convolution output.
    kernel
        ``(KH, KW, C, F)``.
    input_shape, strides, out_hw, pads
        As for :func:`col2im`.
    """
    n, h, w, c = input_shape
    kh, kw = kernel.shape[:2]
    sh, sw = strides
    oh, ow = out_hw
    top, bottom, left, right = pads
    if kh == 1 and kw == 1 and sh == 1 and sw == 1:
        return (grad_out @ kernel[0, 0].T).reshape(n, h, w, c)
    if c == 1:  # one input channel: the patch gradient is small, one matmul then col2im is cheaper
        dcols = grad_out @ kernel.reshape(-1, kernel.shape[-1]).T
        return col2im(dcols, input_shape, (kh, kw), strides, out_hw, pads)
    xp = xp_of(grad_out)
    dxp = xp.zeros((n, h + top + bottom, w + left + right, c), dtype=grad_out.dtype)
    h_span = sh * (oh - 1) + 1
    w_span = sw * (ow - 1) + 1
    for i in range(kh):
        for j in range(kw):
            dxp[:, i:i + h_span:sh, j:j + w_span:sw, :] += (grad_out @ kernel[i, j].T).reshape(n, oh, ow, c)
    if top or bottom or left or right:
        return dxp[:, top:top + h, left:left + w, :]
    return dxp
