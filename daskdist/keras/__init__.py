"""A Keras-like API whose ``fit`` runs inside the replicas of a daskdist strategy.

``keras.Sequential``, ``keras.layers``, ``keras.losses``, ``keras.optimizers``,
``keras.metrics``, ``keras.callbacks``, ``keras.models.load_model``: the names
of TensorFlow's Keras, implemented with numpy (or cupy) and explicit
backpropagation. A model created inside ``strategy.scope()`` trains on every
replica with gradients all-reduced each step.
"""

from __future__ import annotations

from daskdist.keras import callbacks, layers, losses, metrics, models, optimizers
from daskdist.keras.models import Model, Sequential, load_model

__all__ = [
    "Model",
    "Sequential",
    "callbacks",
    "layers",
    "load_model",
    "losses",
    "metrics",
    "models",
    "optimizers",
]
