"""Normalisation layers: :class:`BatchNormalization`, optionally synchronised across replicas."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from daskdist.keras.backend import xp_of
from daskdist.keras.layers.base import Array, Layer, Shape, register_layer

__all__ = ["AllReduce", "BatchNormalization"]


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
                sums = xp.concatenate([summer(x), summer(x * x), xp.full((1,), local_count, dtype=x.dtype)])
                sums = self._reduce(sums)
                count = float(sums[2 * channels])
                mean = sums[:channels] / count
                var = xp.maximum(sums[channels : 2 * channels] / count - mean * mean, 0)
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
