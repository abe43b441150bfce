"""Keras-like layers with hand-written forward and backward passes, one module per family.

A layer owns its trainable ``params`` and non-trainable ``state`` (dicts of
arrays, created by :meth:`Layer.build`), caches in :meth:`Layer.forward`
what its :meth:`Layer.backward` needs, and on ``backward`` fills ``grads``
(same keys as ``params``) and returns the gradient with respect to its
input. Arrays may be numpy or cupy: every operation takes its array module
from the data, so a layer whose weights were moved to a GPU runs there.

Images are NHWC (channels last), as in Keras and TensorFlow.

Modules: :mod:`.base` (``Layer`` and the registry of layer classes),
:mod:`.core` (``Dense``), :mod:`.convolutional` (``Conv2D``), :mod:`.pooling`
(``MaxPooling2D``), :mod:`.reshaping` (``Flatten``), :mod:`.regularization`
(``Dropout``), :mod:`.activation` (``Activation``, ``ReLU``, ``Softmax``),
:mod:`.normalization` (``BatchNormalization``). Importing this package
registers every layer class, so saved models naming them load.
"""

from __future__ import annotations

from daskdist.keras.layers.activation import Activation, ReLU, Softmax
from daskdist.keras.layers.base import Layer, deserialize, get_layer_class, register_layer, serialize
from daskdist.keras.layers.convolutional import Conv2D
from daskdist.keras.layers.core import Dense
from daskdist.keras.layers.normalization import BatchNormalization
from daskdist.keras.layers.pooling import MaxPooling2D
from daskdist.keras.layers.regularization import Dropout
from daskdist.keras.layers.reshaping import Flatten

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
