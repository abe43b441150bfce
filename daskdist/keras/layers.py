"""Keras-like layers with hand-written forward and backward passes.

A layer owns its trainable ``params`` and non-trainable ``state`` (dicts of
arrays, created by :meth:`Layer.build`), caches in :meth:`Layer.forward`
what its :meth:`Layer.backward` needs, and on ``backward`` fills ``grads``
(same keys as ``params``) and returns the gradient with respect to its
input. Arrays may be numpy or cupy: every operation takes its array module
from the data, so a layer whose weights were moved to a GPU runs there.

Images are NHWC (channels last), as in Keras and TensorFlow.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from daskdist.keras import activations as _activations
from daskdist.keras import initializers as _initializers
from daskdist.keras.backend import (
    conv2d_input_gradient,
    conv_output_length,
    copy_as,
    floatx,
    im2col,
    normalize_tuple,
    pad_amounts,
    pad_nhwc,
    snake_case,
    sum_rows,
    to_dtype,
    unique_name,
    xp_of,
)

__all__ = [
    "Activation",
    "BatchNormalization",
    "Conv2D",
    "Dense",
    "Dropout",
    "Flatten",
    "Layer",
    "MaxPooling2D",
    "ReLU",
    "Softmax",
    "deserialize",
    "get_layer_class",
    "register_layer",
    "serialize",
]

Array = Any
Shape = tuple  # excludes the batch dimension; entries may be None for unknown sizes

_LAYER_CLASSES: dict[str, type[Layer]] = {}


def register_layer(cls: type[Layer]) -> type[Layer]:
    """Class decorator: make ``cls`` known to :func:`get_layer_class` under its class name."""
    _LAYER_CLASSES[cls.__name__] = cls
    return cls


def get_layer_class(name: str) -> type[Layer]:
    """The layer class registered as ``name`` (the class name, e.g. ``"Dense"``).

    Raises
    ------
    ValueError
        If no layer class has that name.
    """
    try:
        return _LAYER_CLASSES[name]
    except KeyError:
        raise ValueError(f"Unknown layer class {name!r}; known: {sorted(_LAYER_CLASSES)}") from None


def serialize(layer: Layer) -> dict[str, Any]:
    """``{"class_name": ..., "config": ...}`` (JSON-serialisable); :func:`deserialize` rebuilds the layer."""
    return {"class_name": type(layer).__name__, "config": layer.get_config()}


def deserialize(spec: dict[str, Any]) -> Layer:
    """A new (unbuilt) layer from :func:`serialize`'s output."""
    return get_layer_class(spec["class_name"]).from_config(spec["config"])


class Layer:
    """Base class of all layers.

    Parameters
    ----------
    name
        Unique name; by default the snake-cased class name with a counter
        (``dense``, ``dense_1``, ...), as Keras names layers.
    input_shape
        Shape of one example (no batch dimension). Only meaningful on the
        first layer of a ``Sequential`` model, which builds from it.
    trainable
        Whether the model should update this layer's ``params``.
    dtype
        Dtype of the weights and of the computation (``"float32"``); float
        inputs of another dtype are cast to it.

    Attributes
    ----------
    params : dict[str, array]
        Trainable weights, created by :meth:`build` (e.g. ``kernel``, ``bias``).
    state : dict[str, array]
        Non-trainable weights (e.g. BatchNormalization's ``moving_mean``).
    grads : dict[str, array]
        Filled by :meth:`backward`, same keys as ``params``.
    built : bool
        Whether :meth:`build` has run.
    """

    def __init__(
        self,
        *,
        name: str | None = None,
        input_shape: Shape | list | None = None,
        trainable: bool = True,
        dtype: str | None = None,
    ):
        self.name = name if name is not None else unique_name(snake_case(type(self).__name__))
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.trainable = bool(trainable)
        self.dtype = str(np.dtype(dtype if dtype is not None else floatx()))
        self.params: dict[str, Array] = {}
        self.state: dict[str, Array] = {}
        self.grads: dict[str, Array] = {}
        self.built = False
        self._cache: dict[str, Any] = {}

    # -- building ------------------------------------------------------------------------------------------

    def build(self, input_shape: Shape, rng: np.random.Generator | None = None) -> None:
        """Create the weights for inputs of ``input_shape`` (no batch dimension).

        ``rng`` draws random initial values (a fresh generator by default).
        """
        self.built = True

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        """Shape of one output example for one input example of ``input_shape`` (no batch dimension)."""
        return tuple(input_shape)

    # -- computation ---------------------------------------------------------------------------------------

    def forward(self, x: Array, training: bool = False) -> Array:
        """Compute the output for a batch ``x``, caching what :meth:`backward` needs."""
        raise NotImplementedError

    def backward(self, grad_y: Array) -> Array:
        """From ``dL/dy`` for the last :meth:`forward`, set ``self.grads`` and return ``dL/dx``."""
        raise NotImplementedError

    def __call__(self, x: Array, training: bool = False) -> Array:
        """Build from ``x.shape[1:]`` if needed, then :meth:`forward`."""
        if not self.built:
            self.build(tuple(int(d) for d in x.shape[1:]))
        return self.forward(x, training=training)

    # -- weights -------------------------------------------------------------------------------------------

    def weights_list(self) -> list[tuple[str, Array]]:
        """``(name, array)`` pairs: ``params`` then ``state``, each in creation order.

        Names are local to the layer (``"kernel"``, ``"moving_mean"``, ...);
        prefix them with :attr:`name` for model-wide keys.
        """
        return list(self.params.items()) + list(self.state.items())

    def set_weights_from(self, mapping: dict[str, Array]) -> None:
        """Replace weights by copies of ``mapping``'s arrays (keys as in :meth:`weights_list`).

        Keys not in ``mapping`` keep their values. Values are cast to the
        layer's dtype and stay in their own namespace: passing cupy arrays
        puts the layer's weights on the GPU, numpy arrays on the host.

        Raises
        ------
        KeyError
            For a key that is neither a param nor a state entry of this layer.
        ValueError
            For a value whose shape differs from the weight's.
        """
        if not self.built:
            raise RuntimeError(f"Layer {self.name!r} is not built; build it before setting its weights")
        for key, value in mapping.items():
            store = self.params if key in self.params else self.state if key in self.state else None
            if store is None:
                raise KeyError(f"Layer {self.name!r} has no weight {key!r}; it has {[k for k, _ in self.weights_list()]}")
            if tuple(value.shape) != tuple(store[key].shape):
                raise ValueError(
                    f"Weight {self.name}/{key} has shape {tuple(store[key].shape)}, got {tuple(value.shape)}"
                )
            store[key] = copy_as(value, store[key].dtype)
        self.grads = {}

    def count_params(self) -> int:
        """Number of trainable scalars."""
        return sum(int(math.prod(p.shape)) for p in self.params.values())

    # -- configuration -------------------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """JSON-serialisable constructor keyword arguments, including ``name``."""
        config: dict[str, Any] = {"name": self.name, "trainable": self.trainable, "dtype": self.dtype}
        if self.input_shape is not None:
            config["input_shape"] = list(self.input_shape)
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Layer:
        """A new, unbuilt layer from :meth:`get_config`'s output."""
        return cls(**config)

    # -- helpers -------------------------------------------------------------------------------------------

    def _rng(self, rng: np.random.Generator | None) -> np.random.Generator:
        return rng if rng is not None else np.random.default_rng()

    def _cast(self, x: Array) -> Array:
        """``x`` in the layer dtype (no copy when it already is)."""
        return x if x.dtype == self.dtype else to_dtype(x, self.dtype)

    def _cached(self, key: str) -> Any:
        try:
            return self._cache[key]
        except KeyError:
            raise RuntimeError(f"{self.name}: backward() called before forward()") from None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = {}
        return state

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} built={self.built}>"


# ---------------------------------------------------------------------------------------------------------
# core layers


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
            return dxp[:, top:top + h, left:left + w, :]
        return dxp

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "pool_size": list(self.pool_size),
            "strides": list(self.strides),
            "padding": self.padding,
        }


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


# ---------------------------------------------------------------------------------------------------------
# activation layers


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


# ---------------------------------------------------------------------------------------------------------
# normalisation


AllReduce = Callable[[str, Array], Array]


class _ChannelSum:
    """Per-channel sums of arrays shaped like ``like``: a matrix-vector product for channels-last
    contiguous data (BLAS, several times faster than ``sum(axis=...)``), ``sum`` otherwise."""

    def __init__(self, like: Array, axis: int):
        self.axis = axis
        self.axes = tuple(a for a in range(like.ndim) if a != axis)
        self.channels = like.shape[axis]
        self.ones = None
        if axis == like.ndim - 1:
            self.ones = xp_of(like).ones(like.size // self.channels, dtype=like.dtype)

    def __call__(self, a: Array) -> Array:
        if self.ones is not None and a.flags.c_contiguous:
            return self.ones @ a.reshape(-1, self.channels)
        return a.sum(axis=self.axes)


@register_layer
class BatchNormalization(Layer):
    """Batch normalisation (Keras' ``BatchNormalization``), optionally synchronised across replicas.

    In training, each channel (the ``axis`` dimension) is normalised with
    the batch mean and (biased) variance, then scaled by ``gamma`` and
    shifted by ``beta``; the moving statistics are updated as
    ``moving = moving * momentum + batch * (1 - momentum)``. Otherwise the
    moving statistics are used; as in Keras, a layer with
    ``trainable=False`` always runs in inference mode.

    With ``synchronized=True`` the batch statistics are those of the global
    batch, all replicas together (TensorFlow's ``SyncBatchNormalization``):
    the forward pass all-reduces (SUM) ``[sum(x), sum(x*x), count]`` and the
    backward pass the two sums ``[sum(g), sum(g * x_hat)]``, so outputs and
    input gradients equal those of one BatchNormalization over the
    concatenated batch. ``grads`` hold this replica's contributions (sum
    them across replicas, as for any weight). Every replica must call
    ``forward``/``backward`` of a synchronised layer in the same order.

    Parameters
    ----------
    axis
        The channel axis of the full (batched) input; ``-1`` for channels last.
    momentum, epsilon
        Moving-average momentum and the variance fuzz, as in Keras.
    center, scale
        Whether to learn ``beta`` / ``gamma``.
    synchronized
        Compute training statistics across all replicas.
    all_reduce
        ``all_reduce(reduce_op, array) -> array`` used when synchronised;
        by default ``daskdist.get_replica_context().all_reduce`` at call
        time (the identity outside a strategy). Not part of the config.
    """

    def __init__(
        self,
        axis: int = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-3,
        center: bool = True,
        scale: bool = True,
        synchronized: bool = False,
        all_reduce: AllReduce | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.axis = int(axis)
        self.momentum = float(momentum)
        self.epsilon = float(epsilon)
        self.center = bool(center)
        self.scale = bool(scale)
        self.synchronized = bool(synchronized)
        self.all_reduce = all_reduce

    def _channel_axis(self, ndim: int) -> int:
        axis = self.axis if self.axis >= 0 else ndim + self.axis
        if not 1 <= axis < ndim:
            raise ValueError(f"{self.name}: axis {self.axis} is not a feature axis of a rank-{ndim} input")
        return axis

    def build(self, input_shape: Shape, rng: np.random.Generator | None = None) -> None:
        ndim = len(input_shape) + 1
        channels = int(input_shape[self._channel_axis(ndim) - 1])
        if self.scale:
            self.params["gamma"] = np.ones((channels,), dtype=self.dtype)
        if self.center:
            self.params["beta"] = np.zeros((channels,), dtype=self.dtype)
        self.state["moving_mean"] = np.zeros((channels,), dtype=self.dtype)
        self.state["moving_variance"] = np.ones((channels,), dtype=self.dtype)
        self.built = True

    def _reduce(self, value: Array) -> Array:
        """All-reduce (SUM) across replicas, or the identity with a single replica."""
        if self.all_reduce is not None:
            return self.all_reduce("SUM", value)
        from daskdist.context import get_replica_context

        ctx = get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return value
        return ctx.all_reduce("SUM", value)

    def forward(self, x: Array, training: bool = False) -> Array:
        x = self._cast(x)
        xp = xp_of(x)
        axis = self._channel_axis(x.ndim)
        channels = x.shape[axis]
        bshape = tuple(channels if a == axis else 1 for a in range(x.ndim))
        summer = _ChannelSum(x, axis)

        if training and self.trainable:
            local_count = x.size // channels
            if self.synchronized:
                sums = xp.concatenate(
                    [summer(x), summer(x * x), xp.full((1,), local_count, dtype=x.dtype)]
                )
                sums = self._reduce(sums)
                count = float(sums[2 * channels])
                mean = sums[:channels] / count
                var = xp.maximum(sums[channels:2 * channels] / count - mean * mean, 0)
                xc = x - mean.reshape(bshape)
            else:
                count = float(local_count)
                mean = summer(x) / count
                xc = x - mean.reshape(bshape)
                var = summer(xc * xc) / count
            inv_std = 1.0 / xp.sqrt(var + self.epsilon)
            mm, mv = self.state["moving_mean"], self.state["moving_variance"]
            mm *= self.momentum
            mm += (1.0 - self.momentum) * mean.astype(mm.dtype, copy=False)
            mv *= self.momentum
            mv += (1.0 - self.momentum) * var.astype(mv.dtype, copy=False)
        else:
            count = None
            inv_std = 1.0 / xp.sqrt(self.state["moving_variance"] + self.epsilon)
            xc = x - self.state["moving_mean"].reshape(bshape)
        xhat = xc
        xhat *= inv_std.reshape(bshape)
        y = xhat * self.params["gamma"].reshape(bshape) if self.scale else xhat.copy()
        if self.center:
            y += self.params["beta"].reshape(bshape)
        self._cache = {"xhat": xhat, "inv_std": inv_std, "count": count, "axis": axis, "bshape": bshape}
        return y

    def backward(self, grad_y: Array) -> Array:
        xhat = self._cached("xhat")
        c = self._cache
        bshape, inv_std = c["bshape"], c["inv_std"]
        g = self._cast(grad_y)
        xp = xp_of(g)
        summer = _ChannelSum(g, c["axis"])
        sum_g = summer(g)
        sum_gx = summer(g * xhat)
        self.grads = {}
        if self.scale:
            self.grads["gamma"] = sum_gx
        if self.center:
            self.grads["beta"] = sum_g
        factor = inv_std * self.params["gamma"] if self.scale else inv_std
        if c["count"] is None:  # inference statistics: a per-channel affine map
            return g * factor.reshape(bshape)
        if self.synchronized:
            n = sum_g.shape[0]
            both = self._reduce(xp.concatenate([sum_g, sum_gx]))
            sum_g, sum_gx = both[:n], both[n:]
        count = c["count"]
        # dx = factor * (g - mean(g) - xhat * mean(g * xhat)), the means over the (global) batch
        dx = g * factor.reshape(bshape)
        dx -= xhat * (sum_gx * (factor / count)).reshape(bshape)
        dx -= (sum_g * (factor / count)).reshape(bshape)
        return dx

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "axis": self.axis,
            "momentum": self.momentum,
            "epsilon": self.epsilon,
            "center": self.center,
            "scale": self.scale,
            "synchronized": self.synchronized,
        }
