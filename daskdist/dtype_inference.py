"""TensorFlow's dtype inference for values given as Python numbers and lists.

``tf.Variable(1.)`` is float32, ``tf.Variable(1)`` int32 (int64 when a value
does not fit), ``tf.Variable(True)`` bool; numpy arrays and numpy scalars keep
their dtype. numpy's own inference (float64, int64) differs, so wherever a
Python scalar or list becomes an array (variables, ``from_tensor_slices``)
daskdist converts it here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["is_python_value", "python_value_array"]

_INT32 = np.iinfo(np.int32)


def is_python_value(value: Any) -> bool:
    """True for a Python bool/int/float/complex, or a (nested) list or tuple holding only those."""
    if isinstance(value, np.generic):
        return False  # np.float64 is a subclass of float: numpy scalars keep their dtype
    if isinstance(value, (bool, int, float, complex)):
        return True
    if isinstance(value, (list, tuple)):
        return len(value) > 0 and all(is_python_value(v) for v in value)
    return False


def python_value_array(value: Any) -> np.ndarray:
    """``value`` as a numpy array with TensorFlow's dtype: float32, int32 (int64 if out of range), bool.

    Only Python values (see :func:`is_python_value`) are inferred; anything
    else goes through ``np.asarray`` unchanged.
    """
    array = np.asarray(value)
    if not is_python_value(value):
        return array
    if array.dtype == np.float64:
        return array.astype(np.float32)
    if array.dtype.kind == "i" and (array.size == 0 or (array.min() >= _INT32.min and array.max() <= _INT32.max)):
        return array.astype(np.int32)
    return array
