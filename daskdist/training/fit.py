"""The client's epoch loop of ``fit``, for every adapter and every runner.

An adapter's ``fit`` checks its arguments, installs its model and picks a
runner (epochs on the replicas: ``training.runners.ReplicaRunner``; elastic
epochs: ``training.elastic.ElasticRunner``; coordinator closures under
ParameterServerStrategy; the client process for a model without a
strategy), then hands this loop its callbacks and two functions: one epoch's
training (its global logs) and the epoch's validation (``None``: none this
epoch). Callbacks see the epoch's global logs, the validation's as ``val_*``;
a callback that sets ``stop_training`` ends the loop after that epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["run_epochs"]


def run_epochs(callbacks: Any, first: int, epochs: int, train_epoch: Callable[[int], dict[str, Any]],
               validate: Callable[[int], dict[str, Any] | None], stop_requested: Callable[[], bool]) -> dict[str, Any]:
    """Epochs ``first`` ... ``epochs - 1`` (``on_epoch_begin``, train, validate, ``on_epoch_end``); the last logs."""
    logs: dict[str, Any] = {}
    for epoch in range(first, epochs):
        callbacks.on_epoch_begin(epoch)
        logs = dict(train_epoch(epoch))
        val_logs = validate(epoch)
        if val_logs is not None:
            logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callbacks.on_epoch_end(epoch, logs)
        if stop_requested():
            break
    return logs
