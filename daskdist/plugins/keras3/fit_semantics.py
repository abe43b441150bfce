"""What Keras' own ``fit`` and ``predict`` do around their loops, which daskdist's fit loops do the same way.

Small functions each fit loop calls at the same point Keras' does (the
SPMD loop in ``fit.py``, the parameter-server loop in ``ps.py``):
``resumed_epoch`` after ``on_train_begin`` (``BackupAndRestore``),
``finalize_optimizer`` after the last epoch (``use_ema=True``),
``one_step_per_execution`` around ``predict`` on the client's copy,
``should_evaluate`` (``validation_freq``) after each epoch, and
``weighted_inputs`` (``validation_split``, ``class_weight``, ``sample_weight``) before anything runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from daskdist.training.fit_inputs import FitInputs, element_spec_of, fit_inputs

__all__ = ["finalize_optimizer", "one_step_per_execution", "resumed_epoch", "should_evaluate", "weighted_inputs"]


def resumed_epoch(model: Any, initial_epoch: int) -> int:
    """The epoch ``fit`` starts at once ``on_train_begin`` ran: the one a callback set (``BackupAndRestore`` sets
    ``model._initial_epoch`` from its backup, as Keras' own ``fit`` reads it), else ``initial_epoch``."""
    return int(getattr(model, "_initial_epoch", None) or initial_epoch)


def finalize_optimizer(model: Any, epochs: int) -> None:
    """What Keras' ``fit`` does after its last epoch: ``optimizer.finalize_variable_values`` on the client's model
    (``use_ema=True``: the weights become their moving averages). The replicas' copy then differs from the
    client's, which the next command installs again (its fingerprint changed)."""
    import keras

    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer) and epochs > 0:
        optimizer.finalize_variable_values(model.trainable_weights)


@contextlib.contextmanager
def one_step_per_execution(model: Any) -> Iterator[None]:
    """``model.steps_per_execution`` 1 meanwhile: ``predict`` on the client's copy runs Keras' own loop, which on
    the torch backend takes no other (the predictions do not depend on it; ``fit`` and ``evaluate`` run it on the
    replicas, which take any)."""
    size = getattr(model, "steps_per_execution", 1)
    if size == 1:
        yield
        return
    model.steps_per_execution = 1
    model.predict_function = None
    try:
        yield
    finally:
        model.steps_per_execution = size
        model.predict_function = None


def should_evaluate(epoch: int, freq: Any) -> bool:
    """Keras' ``validation_freq`` rule: every ``freq`` epochs (an int), or at the epochs (1-based) listed."""
    if isinstance(freq, int):
        return (epoch + 1) % freq == 0
    return epoch + 1 in freq


def weighted_inputs(client: Any, x: Any, y: Any, sample_weight: Any = None, class_weight: Any = None,
                    validation_split: float = 0.0, validation_data: Any = None) -> FitInputs:
    """``fit``'s (or ``evaluate``'s) data with ``validation_split``, ``class_weight`` and ``sample_weight`` read as
    Keras' ``fit`` reads them (``daskdist.training.fit_inputs``), before anything runs.

    ``client`` reads the element spec of a dataset or of a ``DatasetCreator``'s dataset (to check
    ``class_weight`` against its elements).

    Raises
    ------
    ValueError
        Keras' errors for these arguments (``fit_inputs``).
    """
    spec = element_spec_of(x, client) if class_weight is not None else None
    return fit_inputs(x, y, sample_weight, class_weight, validation_split, validation_data, spec)


def refuse_ps_weights(validation_split: float, sample_weight: Any) -> None:
    """Refuse what ``fit`` under ParameterServerStrategy does not take: its input is a ``DatasetCreator`` (TF's
    rule), whose elements carry any sample weights (``class_weight`` is taken: ``weighted_inputs`` maps it over
    each worker's dataset).

    Raises
    ------
    ValueError
        ``validation_split`` (Keras' message: it splits arrays only) or ``sample_weight`` (Keras' rule for
        datasets).
    """
    if validation_split:
        raise ValueError("Argument `validation_split` is only supported for tensors or NumPy arrays, and fit under "
                         "ParameterServerStrategy takes a DatasetCreator: pass validation_data")
    if sample_weight is not None:
        raise ValueError("`sample_weight` is not supported when the data is a DatasetCreator: its dataset's "
                         "elements carry the sample weights as (x, y, sample_weight)")


def refuse_weighted_mean_reduction(model: Any, replicas: int, inputs: FitInputs, client: Any) -> None:
    """Refuse a loss reduced by the sum of the sample weights (``reduction="mean_with_sample_weight"``) over weighted
    rows on several replicas: the replicas' gradients are weighted by their rows (Keras' ``sum_over_batch_size``),
    so each replica's division by its own weights' sum would not be one process's division by the global sum.

    Raises
    ------
    NotImplementedError
        Such a loss, weighted data and more than one replica.
    """
    import keras

    losses = [loss for loss in keras.tree.flatten(getattr(model, "loss", None))
              if getattr(loss, "reduction", None) == "mean_with_sample_weight"]
    if replicas < 2 or not losses:
        return
    from daskdist.data.dataset import Dataset

    weighted = inputs.sample_weight is not None
    if isinstance(inputs.x, Dataset):
        spec = inputs.x.element_spec_with(client)
        weighted = isinstance(spec, tuple) and len(spec) == 3
    if weighted:
        raise NotImplementedError(
            f"a loss with reduction='mean_with_sample_weight' ({type(losses[0]).__name__}) over sample weights on "
            f"{replicas} replicas: each replica would divide by its own weights' sum. Use the default "
            "reduction ('sum_over_batch_size', the weighted losses over the global batch's rows)")
