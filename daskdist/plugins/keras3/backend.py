"""Which Keras 3 backends daskdist trains with, and the environment replicas import Keras in."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["SUPPORTED_BACKENDS", "UnsupportedBackendError", "check_backend", "check_model", "keras_backend", "prepare_replica"]

#: The Keras 3 backends whose models daskdist trains (their gradients can be exchanged between backward and
#: apply); the JAX backend is planned (not installed in the project's environment).
SUPPORTED_BACKENDS = ("torch",)


class UnsupportedBackendError(ValueError):
    """Keras runs on a backend daskdist cannot train with (TensorFlow's is bound to TF's own strategies)."""


def keras_backend() -> str:
    """The backend of the imported ``keras`` (``keras.backend.backend()``)."""
    import keras

    return str(keras.backend.backend())


def check_backend(name: str) -> None:
    """Raise ``UnsupportedBackendError`` unless daskdist trains Keras 3 models with backend ``name``."""
    if name in SUPPORTED_BACKENDS:
        return
    why = ("the TensorFlow backend is bound to TensorFlow's own tf.distribute strategies" if name == "tensorflow"
           else f"the {name!r} backend cannot compute gradients to exchange between replicas")
    raise UnsupportedBackendError(
        f"daskdist cannot train a Keras 3 model on the {name!r} backend: {why}. Set KERAS_BACKEND=torch before "
        "importing keras (the JAX backend is planned, not supported yet)")


def prepare_replica(backend: str) -> Any:
    """Import Keras in a replica's process on ``backend`` (the client's); the ``keras`` module.

    Sets ``KERAS_BACKEND`` for the process when Keras is not imported yet, and
    refuses a process whose Keras already runs another backend.
    """
    check_backend(backend)
    if "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = backend
    import keras

    running = str(keras.backend.backend())
    if running != backend:
        raise UnsupportedBackendError(
            f"this worker's Keras runs the {running!r} backend but the client's runs {backend!r}: start the "
            f"workers with KERAS_BACKEND={backend}")
    return keras


def check_model(obj: Any) -> None:
    """Raise ``TypeError`` unless ``obj`` is a Keras 3 model or a built-in ``daskdist.keras`` model."""
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(obj, keras.Model):
        return
    from daskdist.keras.models import Model as BuiltinModel

    if isinstance(obj, BuiltinModel):
        return
    raise TypeError(
        f"{type(obj).__module__}.{type(obj).__qualname__} is neither a Keras 3 model (keras.Model, with "
        "KERAS_BACKEND=torch) nor a daskdist.keras model: daskdist trains those two; wrap a PyTorch module with "
        "dd.plugins.torch in a custom loop (strategy.run)")
