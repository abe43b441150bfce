"""``DatasetCreator``: a function that builds each worker's dataset (TF's ``tf.keras.utils.experimental.DatasetCreator``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["DatasetCreator"]


class DatasetCreator:
    """Input for ``Model.fit`` that builds the dataset where it is read: ``dataset_fn(input_context)``.

    Under ``ParameterServerStrategy`` each worker calls ``dataset_fn`` with a
    ``dd.distribute.InputContext`` (``num_input_pipelines`` = the number of
    workers, ``input_pipeline_id`` = this worker's index) and reads from the
    dataset it returns; shard with it and ``repeat()``: ``fit`` asks for
    ``steps_per_epoch`` batches per epoch from one iterator per worker.

    Parameters
    ----------
    dataset_fn
        ``dataset_fn(input_context) -> dd.data.Dataset`` (batched).
    input_options
        Accepted for TensorFlow's signature; not used (TF ignores it under
        ParameterServerStrategy too).

    Raises
    ------
    TypeError
        ``dataset_fn`` is not callable (TF's message); when called, it returned
        something other than a ``dd.data.Dataset``.
    """

    def __init__(self, dataset_fn: Callable[[Any], Any], input_options: Any = None):
        if not callable(dataset_fn):
            raise TypeError("`dataset_fn` for `DatasetCreator` must be a `callable`.")
        self.dataset_fn = dataset_fn
        self.input_options = input_options

    def __call__(self, input_context: Any = None) -> Any:
        from daskdist.data.dataset import Dataset

        dataset = self.dataset_fn(input_context)
        if not isinstance(dataset, Dataset):
            raise TypeError("The `callable` provided to `DatasetCreator` must return a Dataset.")
        return dataset

    def __repr__(self) -> str:
        return f"DatasetCreator({getattr(self.dataset_fn, '__name__', self.dataset_fn)!r})"
