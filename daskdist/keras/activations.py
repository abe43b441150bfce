"""Activation functions with their derivatives, for manual backpropagation.

Each activation is an :class:`ActivationFunction` object: call it (or its
``forward``) on an array, get the element-wise ``derivative`` (for
``softmax``, the Jacobian), or propagate a gradient with ``backward``. The
module-level names ``relu``, ``sigmoid``, ``tanh``, ``softmax`` and
``linear`` are those objects, so ``activations.relu(x)`` works as in Keras.

Examples
--------
>>> act = get("relu")
>>> y = act(x)
>>> grad_x = act.backward(grad_y, x, y)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daskdist.keras.backend import xp_of

__all__ = [
    "ActivationFunction",
    "Linear",
    "ReLU",
    "Sigmoid",
    "Softmax",
    "Tanh",
    "get",
    "linear",
    "relu",
    "serialize",
    "sigmoid",
    "softmax",
    "tanh",
]


class ActivationFunction:
    """An activation: ``forward``, its ``derivative``, and the vector-Jacobian product ``backward``.

    Subclasses of element-wise activations implement ``forward`` and
    ``derivative``; ``backward`` multiplies. Arrays keep their dtype and
    namespace (numpy or cupy).
    """

    name: str = "activation"

    def __call__(self, x: Any) -> Any:
        return self.forward(x)

    def forward(self, x: Any) -> Any:
        """``y = f(x)``."""
        raise NotImplementedError

    def derivative(self, x: Any, y: Any) -> Any:
        """Element-wise ``dy/dx`` given the input ``x`` and the output ``y = f(x)``."""
        raise NotImplementedError

    def backward(self, grad_y: Any, x: Any, y: Any) -> Any:
        """``dL/dx`` from ``dL/dy``, the input ``x`` and the output ``y`` of ``forward``."""
        return grad_y * self.derivative(x, y)

    def __repr__(self) -> str:
        return f"<activation {self.name}>"


class Linear(ActivationFunction):
    """The identity, ``f(x) = x``."""

    name = "linear"

    def forward(self, x: Any) -> Any:
        return x

    def derivative(self, x: Any, y: Any) -> Any:
        return xp_of(x).ones_like(x)

    def backward(self, grad_y: Any, x: Any, y: Any) -> Any:
        return grad_y


class ReLU(ActivationFunction):
    """``f(x) = max(x, 0)``; the derivative at 0 is taken as 0."""

    name = "relu"

    def forward(self, x: Any) -> Any:
        return xp_of(x).maximum(x, 0)

    def derivative(self, x: Any, y: Any) -> Any:
        return (y > 0).astype(y.dtype)

    def backward(self, grad_y: Any, x: Any, y: Any) -> Any:
        return grad_y * (y > 0)


class Sigmoid(ActivationFunction):
    """``f(x) = 1 / (1 + exp(-x))``, computed as ``(1 + tanh(x / 2)) / 2`` (no overflow)."""

    name = "sigmoid"

    def forward(self, x: Any) -> Any:
        xp = xp_of(x)
        y = x * 0.5
        xp.tanh(y, out=y)
        y += 1
        y *= 0.5
        return y

    def derivative(self, x: Any, y: Any) -> Any:
        return y * (1 - y)


class Tanh(ActivationFunction):
    """``f(x) = tanh(x)``."""

    name = "tanh"

    def forward(self, x: Any) -> Any:
        return xp_of(x).tanh(x)

    def derivative(self, x: Any, y: Any) -> Any:
        return 1 - y * y


class Softmax(ActivationFunction):
    """``f(x)_i = exp(x_i) / sum_j exp(x_j)`` along ``axis`` (max-shifted, so it never overflows)."""

    name = "softmax"

    def __init__(self, axis: int = -1):
        self.axis = axis

    def forward(self, x: Any) -> Any:
        xp = xp_of(x)
        e = x - x.max(axis=self.axis, keepdims=True)
        xp.exp(e, out=e)
        e /= e.sum(axis=self.axis, keepdims=True)
        return e

    def derivative(self, x: Any, y: Any) -> Any:
        """The Jacobian ``diag(y) - y y^T`` along the last axis, shape ``y.shape + (n,)``.

        Only for ``axis=-1``; :meth:`backward` never builds it.
        """
        if self.axis not in (-1, y.ndim - 1):
            raise NotImplementedError("softmax Jacobian is only built for axis=-1")
        xp = xp_of(y)
        jac = -y[..., :, None] * y[..., None, :]
        n = y.shape[-1]
        idx = xp.arange(n)
        jac[..., idx, idx] += y
        return jac

    def backward(self, grad_y: Any, x: Any, y: Any) -> Any:
        # J^T g = y * (g - <g, y>)
        dot = (grad_y * y).sum(axis=self.axis, keepdims=True)
        return y * (grad_y - dot)


linear = Linear()
relu = ReLU()
sigmoid = Sigmoid()
tanh = Tanh()
softmax = Softmax()

_BY_NAME: dict[str, ActivationFunction] = {a.name: a for a in (linear, relu, sigmoid, tanh, softmax)}


def get(identifier: str | ActivationFunction | Callable[..., Any] | None) -> ActivationFunction:
    """Resolve an activation: a name (``"relu"``, ...), ``None`` (linear), or an :class:`ActivationFunction`.

    A plain function is accepted when its ``__name__`` is a known activation;
    any other callable has no derivative and is rejected: subclass
    :class:`ActivationFunction` to add one.

    Raises
    ------
    ValueError
        For an unknown name.
    TypeError
        For a callable without a known derivative.
    """
    if identifier is None:
        return linear
    if isinstance(identifier, ActivationFunction):
        return identifier
    if isinstance(identifier, str):
        key = identifier.lower()
        if key not in _BY_NAME:
            raise ValueError(f"Unknown activation {identifier!r}; known: {sorted(_BY_NAME)}")
        return _BY_NAME[key]
    if callable(identifier) and getattr(identifier, "__name__", None) in _BY_NAME:
        return _BY_NAME[identifier.__name__]
    raise TypeError(
        f"Activation {identifier!r} has no derivative: pass a name or an ActivationFunction subclass instance"
    )


def serialize(activation: ActivationFunction) -> str:
    """The name that :func:`get` maps back to ``activation``."""
    if activation.name not in _BY_NAME:
        raise ValueError(f"Activation {activation!r} is not registered and cannot be serialised by name")
    return activation.name
