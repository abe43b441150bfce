"""Array helpers that work for numpy, cupy and any DLPack array without importing cupy.

Collectives and variables call these instead of ``numpy`` directly, so a cupy
array stays a cupy array, and a torch or jax tensor is viewed through DLPack.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["as_array", "describe", "is_array", "move_like", "namespace", "to_numpy"]


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.startswith("cupy")


def is_array(x: Any) -> bool:
    """True for numpy/cupy arrays and numpy scalars (not Python numbers)."""
    return isinstance(x, (np.ndarray, np.generic)) or _is_cupy(x)


def namespace(x: Any) -> ModuleType:
    """The array module (``numpy`` or ``cupy``) that operates on ``x``."""
    if type(x) is np.ndarray:
        return np
    if _is_cupy(x):
        return sys.modules["cupy"]
    return np


def as_array(x: Any) -> tuple[Any, Callable[[Any], Any]]:
    """Return ``x`` as a numpy or cupy array, and a function converting a result back.

    numpy and cupy arrays pass through; Python numbers become 0-d numpy
    arrays; other objects with ``__dlpack__`` (torch, jax) are viewed without
    a copy and results are converted back to the caller's framework.
    """
    if isinstance(x, np.ndarray) or _is_cupy(x):
        return x, _identity
    if isinstance(x, (np.generic, bool, int, float, complex, list, tuple)):
        return np.asarray(x), _identity
    if hasattr(x, "__dlpack__"):
        device = getattr(x, "__dlpack_device__", lambda: (1, 0))()
        if device[0] == 1:  # kDLCPU
            array = np.from_dlpack(x)
        else:
            import cupy

            array = cupy.from_dlpack(x)
        framework = type(x)

        def back(result: Any) -> Any:
            from_dlpack = getattr(sys.modules.get(framework.__module__.split(".")[0]), "from_dlpack", None)
            return from_dlpack(result) if from_dlpack is not None else result

        return array, back
    if hasattr(x, "__array__"):
        return np.asarray(x), _identity
    raise TypeError(
        f"Expected an array (numpy, cupy or a DLPack tensor) or a number, got {type(x).__name__}"
    )


def _identity(x: Any) -> Any:
    return x


def to_numpy(x: Any) -> np.ndarray:
    """Copy ``x`` to host memory as a numpy array (cupy arrays via ``.get()``)."""
    if _is_cupy(x):
        host: np.ndarray = x.get()
        return host
    return np.asarray(x)


def describe(x: Any) -> str:
    """Short ``dtype[shape]`` description, e.g. ``float32[3,4]`` (``cupy:`` prefix for GPU arrays)."""
    shape = ",".join(str(d) for d in x.shape)
    prefix = "cupy:" if _is_cupy(x) else ""
    return f"{prefix}{x.dtype}[{shape}]"


def move_like(value: Any, like: Any) -> Any:
    """``value`` in the namespace of ``like`` (host <-> device), same dtype; no copy if already there."""
    if namespace(value) is namespace(like):
        return value
    if namespace(like) is np:
        return to_numpy(value)
    return namespace(like).asarray(value)
