"""Element-wise reduction of arrays for each ``ReduceOp``, in place, for numpy and cupy."""

from __future__ import annotations

from typing import Any

from daskdist.arrays import namespace
from daskdist.ops import ReduceOp

__all__ = ["check_dtype", "combine_into", "finalize"]

#: Floating types numpy learns from ``ml_dtypes`` (they have kind "V" but reduce like floats).
_EXTENDED_FLOATS = {"bfloat16", "float8_e4m3fn", "float8_e5m2"}

_UFUNC = {
    ReduceOp.SUM: "add",
    ReduceOp.MEAN: "add",
    ReduceOp.MAX: "maximum",
    ReduceOp.MIN: "minimum",
    ReduceOp.PRODUCT: "multiply",
}


def check_dtype(op: ReduceOp, dtype: Any) -> None:
    """Raise ``TypeError`` for combinations that have no meaning (MEAN of booleans)."""
    if dtype.kind == "b" and op is ReduceOp.MEAN:
        raise TypeError("ReduceOp.MEAN is not defined for bool arrays; use SUM (logical or) or MIN/MAX")
    if dtype.kind in "OUSM" or (dtype.kind == "V" and dtype.name not in _EXTENDED_FLOATS):
        raise TypeError(f"Cannot reduce arrays of dtype {dtype}; use numeric or bool arrays")


def combine_into(op: ReduceOp, acc: Any, other: Any, base: Any = None) -> None:
    """``acc = acc <op> other`` element-wise, writing into ``acc`` (``acc = base <op> other`` when ``base`` is given)."""
    xp = namespace(acc)
    if acc.dtype.kind == "b" and op in (ReduceOp.SUM, ReduceOp.PRODUCT):
        ufunc = xp.logical_or if op is ReduceOp.SUM else xp.logical_and
    else:
        ufunc = getattr(xp, _UFUNC[op])
    ufunc(acc if base is None else base, other, out=acc)


def finalize(op: ReduceOp, acc: Any, num_replicas: int) -> None:
    """Finish a reduction in place: MEAN divides the sum by the number of replicas.

    Integer means truncate toward zero and keep the dtype, like TensorFlow's
    collective ``Div`` final op.
    """
    if op is not ReduceOp.MEAN or num_replicas == 1:
        return
    xp = namespace(acc)
    if acc.dtype.kind in "iu":
        xp.copyto(acc, xp.trunc(acc / num_replicas).astype(acc.dtype))
    elif acc.dtype.kind == "V":  # bfloat16 and friends: divide in float32, round back
        xp.copyto(acc, (acc.astype("float32") / num_replicas).astype(acc.dtype))
    else:
        xp.divide(acc, acc.dtype.type(num_replicas), out=acc)
