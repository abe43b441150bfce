"""What the trainer's client loops ask of Keras 3: whether a callback has per-batch hooks, and how many steps
run per command between them.

The loops themselves are the trainer's (``daskdist.training.runners.ReplicaRunner``):
one command per epoch, or per ``model.steps_per_execution`` steps when one
of the user's callbacks overrides a per-batch hook, as TensorFlow runs it.
The client's copy of the model lags the replicas' during the epoch;
``get_weights``, ``save`` and ``save_weights`` (``ModelCheckpoint(save_freq=N)``)
take the replicas' current weights first.
"""

from __future__ import annotations

from typing import Any

from daskdist.training.runners import BATCH_HOOKS, overrides_batch_hooks, planned_steps

__all__ = ["BATCH_HOOKS", "execution_size", "needs_batch_hooks", "planned_steps"]


def needs_batch_hooks(callbacks: Any, loop: str) -> bool:
    """Whether one of the user's ``callbacks`` overrides a per-batch hook of ``loop`` (Keras' own test)."""
    from keras.src.utils.python_utils import is_default

    return overrides_batch_hooks(callbacks, loop, is_default)


def execution_size(model: Any) -> int:
    """Steps per command between per-batch callbacks: the model's ``steps_per_execution`` (TF's meaning)."""
    return max(1, int(getattr(model, "steps_per_execution", 1) or 1))
