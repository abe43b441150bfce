"""``validation_split``, ``class_weight`` and ``sample_weight`` of ``fit``, as Keras 3's ``Model.fit`` reads them.

Before any loop runs, on the client, every adapter's ``fit`` turns these
three arguments into what its loops already train on: a training set whose
elements are ``(x, y, sample_weight)`` and validation data.

* ``validation_split`` takes the *last* fraction of array inputs (numpy, or
  Dask arrays, sliced lazily) before any shuffling, as Keras'
  ``train_validation_split``; a dataset is refused with Keras' message.
  ``validation_data`` wins when both are given.
* ``class_weight`` maps a class index to a weight; each row's weight is its
  class's (sparse labels, a trailing axis of one, or one-hot rows by
  ``argmax``; classes not listed weigh 1), as Keras'
  ``class_weight_to_sample_weights``. Arrays get a weight array; a batched
  ``daskdist.data.Dataset`` of ``(x, y)`` elements gets a ``map`` adding the
  weights to each batch (as Keras maps a ``tf.data.Dataset``), and a
  ``DatasetCreator`` (each parameter-server worker's own dataset) the same
  ``map`` on the dataset each worker builds. As in Keras, it cannot be
  combined with sample weights, nor with several outputs.
* ``sample_weight`` is one weight per row for array inputs; a dataset (or a
  ``DatasetCreator``'s) carries its weights as the third part of its
  ``(x, y, sample_weight)`` elements.

The weights then enter each replica's loss and metrics as they do in one
process; how the loss over a global batch is scaled is each adapter's step
(the gradients of the rows' weighted losses summed over every replica and
divided by the global batch's rows, Keras' ``sum_over_batch_size``).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree

__all__ = ["FitInputs", "check_class_weight", "class_weights", "element_spec_of", "fit_inputs", "first_pipeline",
           "split_for_validation", "weighted_creator", "weighted_dataset"]

BOTH_WEIGHTS = "You cannot `class_weight` and `sample_weight` at the same time."
ONE_OUTPUT = "`class_weight` is only supported for Models with a single output."


@dataclass
class FitInputs:
    """The training data (``x``, ``y``, one weight per row or ``None``) and the validation data (or ``None``)."""

    x: Any
    y: Any
    sample_weight: Any
    validation_data: Any


def _is_dataset(data: Any) -> bool:
    from daskdist.data.dataset import Dataset

    return isinstance(data, Dataset)


def _is_creator(data: Any) -> bool:
    """A ``DatasetCreator``, or a ``dataset_fn(input_context)`` that parameter-server ``fit`` takes as one."""
    from daskdist.data.dataset_creator import DatasetCreator

    return isinstance(data, DatasetCreator) or (callable(data) and not _is_dataset(data) and not _is_dask(data)
                                                and not hasattr(data, "__array__"))


def first_pipeline(data: Any) -> Any:
    """The dataset of input pipeline 0 of 1 that a ``DatasetCreator`` (or ``dataset_fn``) builds: every row."""
    from daskdist.data.dataset_creator import DatasetCreator
    from daskdist.data.options import InputContext

    creator = data if isinstance(data, DatasetCreator) else DatasetCreator(data)
    return creator(InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1))


def element_spec_of(data: Any, client: Any = None) -> Any:
    """The element spec of a ``Dataset``, or of the dataset a ``DatasetCreator`` builds (``first_pipeline``), read
    on the client (``client`` computes any Dask sample); ``None`` for arrays."""
    if _is_dataset(data):
        return data.element_spec_with(client)
    if _is_creator(data):
        return first_pipeline(data).element_spec_with(client)
    return None


def _is_dask(leaf: Any) -> bool:
    return hasattr(leaf, "__dask_graph__")


def _sliceable(leaf: Any) -> bool:
    return leaf is None or _is_dask(leaf) or isinstance(leaf, np.ndarray) or hasattr(leaf, "__array__")


def _nested(data: Any) -> bool:
    return isinstance(data, (dict, list, tuple))


def split_for_validation(arrays: Any, validation_split: float) -> tuple[Any, Any]:
    """``(training, validation)``: the rows before and from ``floor(rows * (1 - validation_split))`` of every
    array in the structure ``arrays`` (``None`` leaves kept), as Keras' ``train_validation_split``.

    Raises
    ------
    ValueError
        ``arrays`` holds something other than arrays (a dataset, a generator), with Keras' message; or too
        few rows to leave rows on both sides.
    """
    leaves = optree.tree_leaves(arrays, none_is_leaf=True)
    unsplitable = [type(leaf) for leaf in leaves if not _sliceable(leaf)]
    if unsplitable:
        raise ValueError("Argument `validation_split` is only supported for tensors or NumPy arrays."
                         f"Found incompatible type in the input: {unsplitable}")
    present = [leaf for leaf in leaves if leaf is not None]
    if not present:
        return arrays, arrays
    rows = int(present[0].shape[0])
    split_at = int(math.floor(rows * (1.0 - validation_split)))
    if split_at == 0 or split_at == rows:
        raise ValueError(f"Training data contains {rows} samples, which is not sufficient to split it into a "
                         f"validation and training set as specified by `validation_split={validation_split}`. "
                         "Either provide more data, or a different value for the `validation_split` argument.")

    def part(start: int, stop: int) -> Any:
        return optree.tree_map(lambda leaf: None if leaf is None else
                               (leaf if _is_dask(leaf) or isinstance(leaf, np.ndarray) else np.asarray(leaf))[start:stop],
                               arrays, none_is_leaf=True)

    return part(0, split_at), part(split_at, rows)


def check_class_weight(class_weight: Any) -> dict[int, float]:
    """``class_weight`` as ``{class index: weight}``.

    Raises
    ------
    ValueError
        It is not a mapping, a key is not a class index (an integer), or a value is not a number.
    """
    if not isinstance(class_weight, dict):
        raise ValueError(f"`class_weight` must be a dict mapping class indices (integers) to weights, got "
                         f"{type(class_weight).__name__}")
    bad_keys = [k for k in class_weight if isinstance(k, bool) or not isinstance(k, numbers.Integral)]
    if bad_keys:
        raise ValueError(f"`class_weight` keys must be class indices (integers), got {bad_keys!r}")
    bad_values = {k: v for k, v in class_weight.items() if isinstance(v, bool) or not isinstance(v, numbers.Real)}
    if bad_values:
        raise ValueError(f"`class_weight` values must be numbers, got {bad_values!r}")
    return {int(k): float(v) for k, v in class_weight.items()}


def class_weights(y: Any, class_weight: dict[int, float]) -> np.ndarray:
    """One weight per row of the labels ``y`` (numpy): its class's in ``class_weight``, 1 for a class not listed.

    A label is the row itself (sparse), its one column, or the ``argmax`` of its
    columns (one-hot), rounded to the nearest integer, as Keras reads it.
    """
    labels = np.asarray(y)
    if labels.ndim > 1:
        labels = np.argmax(labels, axis=-1) if labels.shape[-1] != 1 else np.squeeze(labels, axis=-1)
    if labels.ndim != 1:
        raise ValueError(f"`class_weight` needs one label per row (sparse, (rows, 1) or one-hot), got labels of "
                         f"shape {np.shape(y)}")
    labels = np.round(labels).astype(np.int64)
    return np.fromiter((class_weight.get(int(label), 1.0) for label in labels), dtype=np.float32, count=len(labels))


def _dask_class_weights(y: Any, class_weight: dict[int, float]) -> Any:
    """``class_weights`` of a Dask array of labels, block by block (lazy)."""
    whole_rows = y.rechunk({axis: -1 for axis in range(1, y.ndim)})
    return whole_rows.map_blocks(class_weights, class_weight, drop_axis=list(range(1, y.ndim)), dtype=np.float32)


def _with_class_weights(class_weight: dict[int, float], *element: Any) -> tuple[Any, Any, Any]:
    """A batch ``(x, y)`` of a dataset with its rows' class weights as the third part."""
    if len(element) != 2:
        raise ValueError(BOTH_WEIGHTS if len(element) == 3 else
                         f"`class_weight` needs (x, y) elements in the dataset, got {len(element)} parts")
    x, y = element
    if _nested(y):
        raise ValueError(ONE_OUTPUT)
    return x, y, class_weights(y, class_weight)


def weighted_dataset(dataset: Any, class_weight: Any, element_spec: Any) -> Any:
    """A batched dataset of ``(x, y)`` elements with its rows' class weights added (``(x, y, weight)``).

    ``element_spec`` is the dataset's (``Dataset.element_spec_with``): checked here, on the client.

    Raises
    ------
    ValueError
        The elements already carry sample weights, or ``y`` is not one array (several outputs), or the
        elements are not ``(x, y)`` pairs, or ``class_weight`` is malformed (``check_class_weight``).
    """
    return dataset.map(functools.partial(_with_class_weights, _checked_table(class_weight, element_spec)))


def _checked_table(class_weight: Any, element_spec: Any) -> dict[int, float]:
    table = check_class_weight(class_weight)
    if not isinstance(element_spec, tuple) or len(element_spec) != 2:
        raise ValueError(BOTH_WEIGHTS if isinstance(element_spec, tuple) and len(element_spec) == 3 else
                         "`class_weight` needs a dataset of (x, y) elements")
    if _nested(element_spec[1]):
        raise ValueError(ONE_OUTPUT)
    return table


def _class_weighted_pipeline(creator: Any, table: dict[int, float], input_context: Any) -> Any:
    """The dataset ``creator`` builds for ``input_context``, its ``(x, y)`` batches given their class weights."""
    return creator(input_context).map(functools.partial(_with_class_weights, table))


def weighted_creator(creator: Any, class_weight: Any, element_spec: Any) -> Any:
    """A ``DatasetCreator`` whose every worker's dataset is the one ``creator`` (a ``DatasetCreator`` or a
    ``dataset_fn``) builds, with its rows' class weights added to each ``(x, y)`` batch (``(x, y, weight)``).

    ``element_spec`` is that of the dataset ``creator`` builds (``element_spec_of``): checked here, on the client.

    Raises
    ------
    ValueError
        As ``weighted_dataset``.
    """
    from daskdist.data.dataset_creator import DatasetCreator

    table = _checked_table(class_weight, element_spec)
    source = creator if isinstance(creator, DatasetCreator) else DatasetCreator(creator)
    return DatasetCreator(functools.partial(_class_weighted_pipeline, source, table),
                          input_options=source.input_options)


def _array_class_weights(y: Any, class_weight: Any, sample_weight: Any) -> Any:
    table = check_class_weight(class_weight)
    if sample_weight is not None:
        raise ValueError(BOTH_WEIGHTS)
    if _nested(y):
        raise ValueError(ONE_OUTPUT)
    if y is None:
        raise ValueError("`class_weight` needs the targets `y`")
    return _dask_class_weights(y, table) if _is_dask(y) else class_weights(y, table)


def _check_rows(x: Any, sample_weight: Any) -> None:
    leaves = [leaf for leaf in optree.tree_leaves(x) if getattr(leaf, "shape", None)]
    if not leaves:
        return
    rows, weights = int(leaves[0].shape[0]), tuple(getattr(sample_weight, "shape", np.shape(sample_weight)))
    if not weights or int(weights[0]) != rows:
        raise ValueError(f"`sample_weight` must have one weight per row of x ({rows}), got shape {weights}")


def fit_inputs(x: Any, y: Any, sample_weight: Any = None, class_weight: Any = None, validation_split: float = 0.0,
               validation_data: Any = None, element_spec: Any = None) -> FitInputs:
    """What ``fit`` trains and validates on, from its arguments (Keras 3's order: split first, then weights).

    ``element_spec``: of ``x`` when it is a dataset or a ``DatasetCreator`` (``element_spec_of``).

    Raises
    ------
    ValueError
        As Keras' ``fit``: ``validation_split`` of a dataset (or ``DatasetCreator``), or too few rows to split;
        ``sample_weight`` with a dataset (its elements carry the weights); ``class_weight`` with sample weights, several
        outputs, or malformed; ``sample_weight`` not one per row.
    """
    if _is_dataset(x) or _is_creator(x):
        if validation_split and validation_data is None:
            split_for_validation(x, validation_split)  # raises Keras' message
        if sample_weight is not None:
            raise ValueError("`sample_weight` is not supported when the data is a Dataset or a DatasetCreator: put "
                             "the sample weights in the dataset's (x, y, sample_weight) elements")
        if class_weight is not None:
            x = (weighted_dataset if _is_dataset(x) else weighted_creator)(x, class_weight, element_spec)
        return FitInputs(x, y, None, validation_data)
    if sample_weight is not None:
        if _nested(sample_weight):
            raise ValueError("`sample_weight` must be one array of one weight per row (models with one output)")
        sample_weight = sample_weight if _is_dask(sample_weight) else np.asarray(sample_weight)
        _check_rows(x, sample_weight)
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = split_for_validation((x, y, sample_weight), validation_split)
        if validation_data[2] is None:
            validation_data = validation_data[:2]
    if class_weight is not None:
        sample_weight = _array_class_weights(y, class_weight, sample_weight)
    return FitInputs(x, y, sample_weight, validation_data)
