"""Which Keras 3 backends daskdist trains with, the environment replicas import Keras in, and each backend's module.

What the backends share (the loop, metrics, weights, snapshots, the
exchange's place between backward and apply) is written once against
Keras' own API; what differs (a step's gradients, tensors <-> numpy,
threads) is a small module per backend: ``backend_torch`` and
``backend_jax``, reached through ``framework()``.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from typing import Any

from daskdist.exceptions import UnsupportedBackendError

__all__ = ["SUPPORTED_BACKENDS", "UnsupportedBackendError", "check_backend", "check_model", "framework",
           "keras_backend", "prepare_replica"]

#: The Keras 3 backends whose models daskdist trains: their gradients can be exchanged between backward and
#: apply (torch: ``optimizer.apply`` after ``loss.backward()``; JAX: Keras' stateless calls, the gradients of
#: ``model.train_step`` taken before ``optimizer.stateless_apply``).
SUPPORTED_BACKENDS = ("torch", "jax")


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
        f"daskdist cannot train a Keras 3 model on the {name!r} backend: {why}. Set KERAS_BACKEND=torch or "
        "KERAS_BACKEND=jax before importing keras (daskdist trains Keras 3 models on those two backends)")


def framework(name: str | None = None) -> types.ModuleType:
    """The module of what differs on backend ``name`` (default: the imported Keras' backend).

    ``backend_torch`` or ``backend_jax``: ``steps(model)`` (a step's
    gradients exchanged, the optimizer's apply, an evaluation step),
    ``to_numpy``/``from_numpy`` (gradients as numpy and back),
    ``views``, ``no_grad()`` and ``limit_threads``.
    """
    name = name or keras_backend()
    check_backend(name)
    return importlib.import_module(f"daskdist.plugins.keras3.backend_{name}")


def prepare_replica(backend: str, threads: int | None = None) -> Any:
    """Import Keras in a replica's process on ``backend`` (the client's); the ``keras`` module.

    Sets ``KERAS_BACKEND`` for the process when Keras is not imported yet, and
    refuses a process whose Keras already runs another backend. ``threads``:
    the intra-op threads the framework may use (``framework().limit_threads``,
    which for JAX works only before its runtime starts: so here, before the
    import).
    """
    check_backend(backend)
    if "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = backend
    if threads is not None:
        framework(backend).limit_threads(threads)
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
    builtin = sys.modules.get("daskdist.keras.models")  # a built-in model exists only once that module is imported
    if builtin is not None and isinstance(obj, builtin.Model):
        return
    raise TypeError(
        f"{type(obj).__module__}.{type(obj).__qualname__} is neither a Keras 3 model (keras.Model, with "
        "KERAS_BACKEND=torch or jax) nor a daskdist.keras model: daskdist trains those two; wrap a PyTorch module with "
        "dd.plugins.torch in a custom loop (strategy.run)")
