"""A Keras-like API whose ``fit`` runs inside the replicas of a daskdist strategy.

``keras.Sequential``, ``keras.layers``, ``keras.losses``, ``keras.optimizers``,
``keras.metrics``, ``keras.callbacks``, ``keras.models.load_model``: the names
of TensorFlow's Keras, implemented with numpy (or cupy) and explicit
backpropagation; ``GradientTape`` (also ``dd.GradientTape``) gives the
gradients of a loss in a custom training loop. A model created inside ``strategy.scope()`` trains on every
replica with gradients all-reduced each step.
"""

from __future__ import annotations

from daskdist.keras import callbacks, layers, losses, metrics, models, optimizers
from daskdist.keras.gradient_tape import GradientTape
from daskdist.keras.models import Model, Sequential, load_model

__all__ = [
    "GradientTape",
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
