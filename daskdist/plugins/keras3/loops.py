"""What the trainer's client loops ask of Keras 3: which callbacks have per-batch hooks, and how many steps
run per command between them.

The loops themselves, and the choice between them, are the trainer's
(``daskdist.training.runner_choice.choose_runner``, ``training.runners.ReplicaRunner``):
one command per epoch, or per ``model.steps_per_execution`` steps when one
of the user's callbacks overrides a per-batch hook, as TensorFlow runs it.
The client's copy of the model lags the replicas' during the epoch;
``get_weights``, ``save`` and ``save_weights`` (``ModelCheckpoint(save_freq=N)``)
take the replicas' current weights first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daskdist.training.runners import BATCH_HOOKS, hooked_callbacks, planned_steps

__all__ = ["BATCH_HOOKS", "execution_size", "hooked", "planned_steps"]


def hooked(callbacks: Any) -> Callable[[str], list[str]]:
    """``hooked(loop)`` for the trainer's ``choose_runner``: the user's ``callbacks`` that override a per-batch hook
    of ``loop``, by class name (Keras' own test: a ``LambdaCallback`` given a hook counts, Keras' defaults do not)."""
    from keras.src.utils.python_utils import is_default

    return lambda loop: hooked_callbacks(callbacks, loop, is_default)


def execution_size(model: Any) -> int:
    """Steps per command between per-batch callbacks: the model's ``steps_per_execution`` (TF's meaning)."""
    return max(1, int(getattr(model, "steps_per_execution", 1) or 1))
