"""Keras 3 models under daskdist's strategies (the Keras 3 adapter of the training contract).

With ``KERAS_BACKEND=torch`` (or ``jax``), the model of TensorFlow's Keras tutorial runs
with only ``tf.distribute.X`` -> ``daskdist.X`` changed::

    import keras
    import daskdist as dd

    strategy = dd.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="relu"), ...])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    model.fit(dataset, epochs=12, callbacks=[...])    # each replica: Keras' forward and backward,
                                                      # daskdist's all-reduce, Keras' optimizer.apply

A model created inside ``strategy.scope()`` is recorded as the strategy's (as
TensorFlow records it); its ``fit``, ``evaluate`` and ``predict`` then run on
the replicas. Importing ``daskdist`` wraps a few methods of Keras' ``Model``
and ``Optimizer`` classes to make that link (``hooks``); models created
outside every scope run Keras' own code untouched. See ``docs/keras3.md``.
"""

from __future__ import annotations

from daskdist.plugins.keras3.backend import SUPPORTED_BACKENDS, UnsupportedBackendError, check_backend, check_model
from daskdist.plugins.keras3.hooks import install, install_when_imported, installed

__all__ = [
    "SUPPORTED_BACKENDS",
    "OutsideScopeError",
    "UnsupportedBackendError",
    "UnsupportedOptimizerError",
    "WeightsDifferError",
    "check_backend",
    "check_model",
    "install",
    "installed",
]


def __getattr__(name: str) -> object:
    # the errors live in modules that need keras' neighbours only when used
    if name == "OutsideScopeError":
        from daskdist.plugins.keras3.fit import OutsideScopeError

        return OutsideScopeError
    if name == "UnsupportedOptimizerError":
        from daskdist.plugins.keras3.update_rule import UnsupportedOptimizerError

        return UnsupportedOptimizerError
    if name == "WeightsDifferError":
        from daskdist.plugins.keras3.commands import WeightsDifferError

        return WeightsDifferError
    raise AttributeError(name)


install_when_imported()
