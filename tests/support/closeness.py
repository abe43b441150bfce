"""How far apart two lists of arrays are, for checks reported by a subprocess and asserted by the test."""

from __future__ import annotations

import numpy as np

__all__ = ["max_rel", "same"]


def max_rel(a_list, b_list, atol=1e-6) -> float:
    """The smallest rtol at which ``np.testing.assert_allclose(a, b, rtol, atol)`` passes for every pair.

    ``inf`` when the lists differ in length, a pair in shape, or either side holds a NaN or an infinity:
    no tolerance makes those equal.
    """
    if len(a_list) != len(b_list):
        return float("inf")
    worst = 0.0
    for a, b in zip(a_list, b_list, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape or not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
            return float("inf")
        over = np.maximum(np.abs(a - b) - atol, 0.0)
        if over.size and np.any(over > 0):
            with np.errstate(divide="ignore", invalid="ignore"):
                worst = max(worst, float(np.max(np.where(over > 0, over / np.abs(b), 0.0))))
    return worst


def same(a_list, b_list) -> bool:
    """Whether paired arrays are equal bit for bit (and there are as many on each side)."""
    return len(a_list) == len(b_list) and all(np.array_equal(np.asarray(a), np.asarray(b))
                                              for a, b in zip(a_list, b_list, strict=True))
