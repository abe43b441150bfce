"""The arrays a parameter store holds: one stored variable, its dense updates, and copy-on-write hand-outs.

A store hands its arrays out without a copy, read-only (``hand_out``): a
replica of the same process, or a reply serialized later, sees the value as
it was. Dense updates (``apply_method``) put a fresh array in place of the
old one; an in-place change (scatter, ``extended.update``'s function) first
copies an array that was handed out (``writable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist.arrays import as_array, to_numpy

if TYPE_CHECKING:
    from daskdist.variables.distributed import VariableSpec

__all__ = ["Entry", "StoredVariable", "apply_method", "copy_to_host", "hand_out", "writable"]


@dataclass
class Entry:
    """One stored variable: its array, what it is, and how many times it changed."""

    value: Any
    spec: VariableSpec
    version: int = 0
    shared: bool = False  # ``value`` itself was handed out (read-only): copy it before changing it in place


def copy_to_host(value: Any) -> np.ndarray:
    """A host (numpy) copy: stores hold host memory, whatever device a replica computes on."""
    return np.array(to_numpy(as_array(value)[0]), copy=True)


def hand_out(entry: Entry) -> np.ndarray:
    """The stored value without a copy, as a read-only view (copy-on-write: the store never changes it again).

    Dense updates replace ``entry.value`` by a fresh array; an in-place
    change (scatter, ``apply_fn``) copies first if the value was handed out.
    A replica in the same process and Dask's serialization of a reply (which
    may happen after other operations ran) both see the value as it was.
    """
    entry.shared = True
    view: np.ndarray = entry.value.view()
    view.flags.writeable = False
    return view


def writable(entry: Entry) -> np.ndarray:
    """``entry.value``, copied first if it was handed out (to change it in place)."""
    if entry.shared:
        entry.value, entry.shared = entry.value.copy(), False
    value: np.ndarray = entry.value
    return value


def apply_method(entry: Entry, method: str, value: Any) -> None:
    """Apply a dense update into a fresh array (what was handed out before keeps its value; no copy of the old)."""
    array = np.asarray(to_numpy(as_array(value)[0]))
    shape = tuple(entry.spec.shape)
    if array.ndim != 0 and tuple(array.shape) != shape:
        raise ValueError(f"Cannot assign a value of shape {tuple(array.shape)} to variable "
                         f"'{entry.spec.name}' of shape {shape}")
    new_value = np.empty_like(entry.value)
    if method == "assign":
        np.copyto(new_value, array, casting="unsafe")
    elif method == "assign_add":
        np.add(entry.value, array, out=new_value, casting="unsafe")
    elif method == "assign_sub":
        np.subtract(entry.value, array, out=new_value, casting="unsafe")
    else:
        raise ValueError(f"unknown update method {method!r}")
    entry.value, entry.shared = new_value, False
    entry.version += 1


class StoredVariable:
    """The stored variable as ``extended.update``'s function sees it: a plain variable over the stored array."""

    @staticmethod
    def wrap(entry: Entry) -> Any:
        from daskdist.variables.distributed import Variable

        variable = Variable.__new__(Variable)  # no copy: writes go to the stored array
        variable._value = entry.value
        variable._spec = entry.spec
        return variable
