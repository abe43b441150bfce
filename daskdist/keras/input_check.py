"""Refuse, on the client and before training starts, datasets whose elements a model cannot take.

A model takes ``x`` (one array), ``(x, y)`` or ``(x, y, sample_weight)``,
or a dict with ``"x"``/``"y"`` keys. A Dask dataframe gives dict-of-columns
elements (as in TensorFlow); a model with one input cannot take those, and
without this check the error would surface deep inside a replica's step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optree

__all__ = ["check_model_input"]

_HOW_TO_PASS_A_DATAFRAME = (
    "To train on a Dask dataframe, pass its feature columns as one array: "
    "Dataset.from_dask((frame[columns].astype('float32').to_dask_array(lengths=True), "
    "frame[target].astype('float32').to_dask_array(lengths=True))); or stack the columns after batching: "
    "dataset.map(lambda x, y: (np.stack([x[c] for c in columns], axis=-1), y))"
)


def check_model_input(element_spec: Any, input_shape: tuple[Any, ...] | None, what: str = "fit") -> None:
    """Raise ``TypeError``/``ValueError`` naming what the model expects if ``element_spec`` does not fit it.

    Parameters
    ----------
    element_spec
        The dataset's ``element_spec`` (a structure of ``TensorSpec``).
    input_shape
        The model's input shape without the batch dimension, when known.
    what
        The Keras method that was called, for the message.
    """
    from daskdist.data.dataset import TensorSpec

    expects = f"one array x of shape {(None, *input_shape)}" if input_shape else "one array x (a batch of rows)"
    if isinstance(element_spec, dict) and "x" in element_spec:
        parts = {"x": element_spec["x"], "y": element_spec.get("y"), "sample_weight": element_spec.get("sample_weight")}
    elif isinstance(element_spec, (tuple, list)) and not hasattr(element_spec, "_fields"):
        if len(element_spec) not in (2, 3):
            raise ValueError(
                f"{what}: the dataset's elements have {len(element_spec)} parts; the model takes (x, y) or "
                f"(x, y, sample_weight) with {expects}"
            )
        parts = dict(zip(("x", "y", "sample_weight"), element_spec))
    else:
        parts = {"x": element_spec}
    for name, spec in parts.items():
        if spec is None:
            continue
        if not isinstance(spec, TensorSpec):
            leaves = optree.tree_leaves(spec)
            kind = (f"a dict of {len(spec)} columns ({', '.join(map(str, list(spec)[:5]))}"
                    f"{', ...' if len(spec) > 5 else ''})" if isinstance(spec, dict)
                    else f"a {type(spec).__name__} of {len(leaves)} arrays")
            raise TypeError(
                f"{what}: the model takes {expects} and one array y; the dataset's {name} is {kind}, "
                f"as a Dask dataframe gives. {_HOW_TO_PASS_A_DATAFRAME}"
            )
        if np.dtype(spec.dtype).kind not in "biuf":
            raise TypeError(
                f"{what}: the dataset's {name} has dtype {np.dtype(spec.dtype)}; the model takes numbers "
                "(cast with .astype('float32') before building the dataset)"
            )
    x = parts["x"]
    if input_shape and len(x.shape) == len(input_shape) + 1 and tuple(x.shape[1:]) != tuple(input_shape):
        raise ValueError(
            f"{what}: the model takes {expects}; the dataset's x has shape {x.shape}"
        )
