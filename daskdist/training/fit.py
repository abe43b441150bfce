"""The client's epoch loop of ``fit``, for every adapter and every runner.

An adapter's ``fit`` checks its arguments, asks the trainer which runner
(``training.runner_choice.choose_runner``), installs its model, then hands
this loop its callbacks and two functions: one epoch's training (its global
logs) and the epoch's validation (``None``: none this epoch). Callbacks see
the epoch's global logs, the validation's as ``val_*``; a callback that sets
``stop_training`` ends the loop after that epoch.

On the replicas, ``EpochRunner`` runs both over the runner chosen: the
trainer's ``ReplicaRunner`` (one command per epoch, or ``steps_per_execution``
steps per command with the per-batch callbacks between) or its
``ElasticRunner`` (epochs in committed steps; a validation run again on the
members left after a loss). Under ParameterServerStrategy the epochs are the
``ClosureRunner``'s (``training.ps``); without a strategy, the adapter's loop
in this process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from daskdist.training.runner_choice import RunnerChoice, RunnerKind

if TYPE_CHECKING:
    from daskdist.strategy.drivers.contract import StepDriver
    from daskdist.training.elastic import ElasticRunner
    from daskdist.training.runners import ReplicaRunner

__all__ = ["EpochRunner", "run_epochs"]


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


class EpochRunner:
    """One ``fit``'s epochs and validations on the replicas, over the runner the trainer chose.

    Parameters
    ----------
    choice
        The trainer's choice (``REPLICAS``, ``STEPWISE`` or ``ELASTIC``).
    replicas
        The model's ``ReplicaRunner`` (an elastic fit's validations run on it too).
    elastic
        The fit's ``ElasticRunner`` (the adapter's subclass), given exactly when ``choice`` is ``ELASTIC``.

    Raises
    ------
    ValueError
        A choice that does not run on the replicas, or an elastic runner given or missing against it.
    """

    def __init__(self, choice: RunnerChoice, replicas: ReplicaRunner, elastic: ElasticRunner | None = None):
        if not choice.on_replicas:
            raise ValueError(f"an EpochRunner runs epochs on the replicas, not {choice.kind.value!r}")
        if (choice.kind is RunnerKind.ELASTIC) != (elastic is not None):
            raise ValueError(f"the {choice.kind.value!r} runner "
                             + ("needs the fit's ElasticRunner" if elastic is None else "takes no ElasticRunner"))
        self.choice, self.replicas, self.elastic = choice, replicas, elastic

    def train_epoch(self, epoch: int, batches: Any, limit: int | None, driver: StepDriver,
                    learning_rate: Callable[[], float | None], tag: str, *, callbacks: Any = None,
                    steps: int | None = None, size: int = 1, stopped: Callable[[], bool] = lambda: False,
                    moved: Callable[[], None] = lambda: None) -> dict[str, Any]:
        """One epoch; ``{"logs": the global logs, "state": replica 0's state when the runner returns it}``.

        ``batches``: the distributed training data (an elastic fit plans its own from the session's input);
        ``limit``: the user's ``steps_per_epoch``; ``tag``: the fit's progress events carry it; stepwise:
        ``callbacks``' batch hooks every ``size`` steps (``steps``: the epoch's, ``stopped()``: a hook asked
        to stop, ``moved()``: after each command).
        """
        if self.elastic is not None:
            return self.elastic.train_epoch(epoch, limit, driver, learning_rate(), tag)
        return self.replicas.train_epoch(batches, limit, driver, learning_rate, tag=tag, epoch=epoch,
                                         callbacks=callbacks, per_batch=self.choice.per_batch_train, steps=steps,
                                         size=size, stopped=stopped, moved=moved)

    def evaluate(self, batches: Callable[[], Any], steps: int | None, callbacks: Any = None, size: int = 1,
                 stopped: Callable[[], bool] = lambda: False) -> dict[str, float]:
        """A validation over ``batches()`` (the distributed data over the current members): its global logs.

        With ``callbacks``, ``on_test_begin``/``on_test_end`` around it and, when chosen, the per-batch test
        hooks every ``size`` steps. An elastic fit's validation changes no state: after a loss it runs again
        on the members left (``batches()`` then plans it over them).
        """
        per_batch = self.choice.per_batch_test and callbacks is not None
        if self.elastic is None:
            return self.replicas.evaluate(batches(), steps, callbacks, per_batch, size, stopped)
        if callbacks is not None:
            callbacks.on_test_begin()
        logs: dict[str, float] = self.elastic.with_recovery(lambda: self.replicas.evaluate(batches(), steps))
        if callbacks is not None:
            callbacks.on_test_end(logs)
        return logs
