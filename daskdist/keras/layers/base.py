"""The base :class:`Layer` and the registry of layer classes by name (for saved models).

A layer owns its trainable ``params`` and non-trainable ``state`` (dicts of
arrays, created by :meth:`Layer.build`), caches in :meth:`Layer.forward`
what its :meth:`Layer.backward` needs, and on ``backward`` fills ``grads``
(same keys as ``params``) and returns the gradient with respect to its
input.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from daskdist.keras.backend import copy_as, floatx, snake_case, to_dtype, unique_name

__all__ = ["Array", "Layer", "Shape", "deserialize", "get_layer_class", "register_layer", "serialize"]


Array = Any
Shape = tuple[Any, ...]  # excludes the batch dimension; entries may be None for unknown sizes

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
        input_shape: Shape | list[Any] | None = None,
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

    # -- random state (elastic commits) --------------------------------------------------------------------

    def rng_state(self) -> dict[str, Any]:
        """The state of the random generators the layer draws from in training (none by default).

        Elastic training keeps it in every commit and puts it back with
        :meth:`set_rng_state`, so that steps replayed after a loss draw what
        they drew the first time.
        """
        return {}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Put back a state from :meth:`rng_state`."""

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
                raise KeyError(
                    f"Layer {self.name!r} has no weight {key!r}; it has {[k for k, _ in self.weights_list()]}"
                )
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
