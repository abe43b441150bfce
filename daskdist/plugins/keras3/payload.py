"""A Keras 3 model as it travels to the replicas: the ``.keras`` file Keras writes, and the custom classes.

The model is saved with Keras' own ``model.save`` (architecture, compile
settings, weights, optimizer state) and loaded on each replica with
``keras.saving.load_model``. Classes that are not Keras' own (a subclassed
model, a custom layer or loss) travel with it as ``custom_objects``: Dask
pickles them by reference when the workers can import their module, by value
when they live in ``__main__`` (a script or a notebook). The model's dtype
policy travels too: Keras' ``compile`` wraps the optimizer of a
``mixed_float16`` model in a ``LossScaleOptimizer``, so the replica loads the
model under that policy (its global one, meanwhile) to hold the same optimizer
(and the same optimizer variables, in the same order) as the client.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelPayload", "custom_objects", "pack_model", "unpack_model"]


@dataclass
class ModelPayload:
    """What a replica needs to rebuild a model: the backend, the ``.keras`` bytes, the custom classes, and the
    model's dtype policy (``None``: the replica's global one)."""

    backend: str
    keras_bytes: bytes
    custom: dict[str, Any] = field(default_factory=dict)
    dtype_policy: str | None = None


def _is_custom(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return not module.split(".")[0] == "keras"


def custom_objects(model: Any) -> dict[str, Any]:
    """The model's classes (and its loss and metric objects) that are not Keras' own, by name."""
    import keras

    found: dict[str, Any] = {}
    candidates: list[Any] = [type(model)]
    candidates += [type(layer) for layer in model._flatten_layers(include_self=False, recursive=True)]
    loss = getattr(model, "loss", None)
    if loss is not None:
        candidates += [loss if callable(loss) and not isinstance(loss, keras.losses.Loss) else type(loss)]
    for obj in candidates:
        if isinstance(obj, (str, dict, list, tuple)) or not _is_custom(obj):
            continue
        found[getattr(obj, "__name__", str(obj))] = obj
        name = keras.saving.get_registered_name(obj)
        found[name] = obj
    return found


def pack_model(model: Any, backend: str) -> ModelPayload:
    """Save ``model`` (weights, compile settings, optimizer state) into a ``ModelPayload``."""
    with tempfile.TemporaryDirectory(prefix="daskdist-keras3-") as directory:
        path = os.path.join(directory, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            data = f.read()
    policy = getattr(model, "dtype_policy", None)
    return ModelPayload(backend, data, custom_objects(model), getattr(policy, "name", None))


def unpack_model(payload: ModelPayload) -> Any:
    """Load the model of ``payload`` (in a replica whose Keras runs ``payload.backend``)."""
    import keras

    with tempfile.TemporaryDirectory(prefix="daskdist-keras3-") as directory:
        path = os.path.join(directory, "model.keras")
        with open(path, "wb") as f:
            f.write(payload.keras_bytes)
        with warnings.catch_warnings(), _global_dtype_policy(payload.dtype_policy):
            # an optimizer that has not taken a step yet is saved without its slots: Keras warns on load
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            return keras.saving.load_model(path, custom_objects=payload.custom, compile=True, safe_mode=True)


@contextlib.contextmanager
def _global_dtype_policy(name: str | None) -> Iterator[None]:
    """Keras' global dtype policy set to ``name`` meanwhile (Keras keeps it per thread: this replica's alone)."""
    import keras

    before = keras.config.dtype_policy()
    if name is None or name == before.name:
        yield
        return
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(before)
