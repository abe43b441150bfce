"""What collective results are checked against: numpy reductions and random inputs per dtype."""

from __future__ import annotations

import numpy as np

from daskdist.ops import ReduceOp

NUMPY_OPS = {
    ReduceOp.SUM: lambda xs: np.sum(xs, axis=0, dtype=xs[0].dtype),
    ReduceOp.MAX: lambda xs: np.max(xs, axis=0),
    ReduceOp.MIN: lambda xs: np.min(xs, axis=0),
    ReduceOp.PRODUCT: lambda xs: np.prod(xs, axis=0, dtype=xs[0].dtype),
}


def random_inputs(size: int, shape: tuple, dtype: str, seed: int = 0) -> list[np.ndarray]:
    """One input per replica: booleans, small integers (no overflow in a product), or normal floats."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "b":
        return [rng.random(shape) > 0.5 for _ in range(size)]
    if np.dtype(dtype).kind in "iu":
        return [rng.integers(0, 5, shape).astype(dtype) for _ in range(size)]
    return [rng.standard_normal(shape).astype(dtype) for _ in range(size)]
