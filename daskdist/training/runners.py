"""The client's side of an epoch or an evaluation on the replicas, with per-batch callbacks when asked.

Without a callback that overrides a per-batch hook, an epoch (or an
evaluation) is one command (``training.commands.train_epoch``): every replica
runs all of its steps and returns the global logs, replica 0 sending live
progress events. When one of the user's callbacks overrides
``on_train_batch_begin/end`` (or ``on_batch_begin/end``), ``on_test_batch_*``
or ``on_predict_batch_*`` (the trainer's ``runner_choice.choose_runner`` says so: ``STEPWISE``), the
loop runs as TensorFlow runs it with ``steps_per_execution``: one command per
``size`` steps, ``on_*_batch_begin(first step)`` before it and
``on_*_batch_end(last step, logs)`` after it, the logs being the epoch's
global running metrics (every replica's rows so far). A stop asked in a hook
(``stopped()``) ends the loop after that execution.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from daskdist.training import commands

if TYPE_CHECKING:
    from daskdist.strategy.drivers.contract import StepDriver

__all__ = ["BATCH_HOOKS", "ReplicaRunner", "hooked_callbacks", "overrides_batch_hooks", "planned_steps"]

#: The per-batch hooks of each loop (``on_batch_*`` are Keras' aliases of the training ones).
BATCH_HOOKS = {
    "train": ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end"),
    "test": ("on_test_batch_begin", "on_test_batch_end"),
    "predict": ("on_predict_batch_begin", "on_predict_batch_end"),
}


def hooked_callbacks(callbacks: Any, loop: str, is_default: Callable[[Any], bool]) -> list[str]:
    """The class names of ``callbacks`` (a list, or a framework's callback list) that override a per-batch hook of
    ``loop`` (``is_default(method)``: the framework's test that a hook is its base class's no-op), in order."""
    listed = getattr(callbacks, "callbacks", callbacks) or []
    return [type(callback).__name__ for callback in listed
            if any(not is_default(getattr(callback, hook)) for hook in BATCH_HOOKS[loop] if hasattr(callback, hook))]


def overrides_batch_hooks(callbacks: Any, loop: str, is_default: Callable[[Any], bool]) -> bool:
    """Whether one of ``callbacks`` overrides a per-batch hook of ``loop`` (see ``hooked_callbacks``)."""
    return bool(hooked_callbacks(callbacks, loop, is_default))


def planned_steps(batches: Any) -> int | None:
    """The steps of a distributed dataset's epoch as planned (``None``: not known before reading it)."""
    planned = [s for s in batches.plan().steps_per_replica() if s is not None]
    return max(planned) if planned else None


class ReplicaRunner:
    """Runs a model's epochs and evaluations on the replicas with the trainer's commands.

    Parameters
    ----------
    extended
        The strategy's Extended (``run_on_replicas``).
    model_id
        The model's resident id on the replicas.
    with_state
        Whether replica 0 returns the model's state after each epoch (the client's copy takes it).
    """

    def __init__(self, extended: Any, model_id: str, with_state: bool):
        self.extended, self.model_id, self.with_state = extended, model_id, with_state

    def train_epoch(self, batches: Any, limit: int | None, driver: StepDriver, learning_rate: Callable[[], float | None],
                    *, tag: str | None = None, epoch: int = 0, callbacks: Any = None, per_batch: bool = False,
                    steps: int | None = None, size: int = 1, stopped: Callable[[], bool] = lambda: False,
                    moved: Callable[[], None] = lambda: None) -> dict[str, Any]:
        """One epoch on the replicas; ``{"logs": global logs, "state": replica 0's state or None}``.

        ``limit``: the user's ``steps_per_epoch`` (``None``: the whole shard);
        ``tag``: the fit's progress events carry it. ``per_batch``: ``size``
        steps per command with the batch hooks of ``callbacks`` between
        (``steps``: the epoch's steps, ``None`` while unknown); ``stopped()``:
        whether a hook asked training to stop; ``moved()``: called after each
        command (the client's copy is then behind the replicas').
        """
        if not per_batch:
            results = self.extended.run_on_replicas(
                commands.train_epoch,
                (self.model_id, batches, limit, driver, learning_rate(), tag, epoch, self.with_state))
            return dict(results[0])

        def run(count: int) -> dict[str, Any]:
            out: dict[str, Any] = self.extended.run_on_replicas(
                commands.train_steps, (self.model_id, count, driver, learning_rate()))[0]
            moved()
            return out

        return self._stepwise("train", batches, steps, size, run, callbacks.on_train_batch_begin,
                              callbacks.on_train_batch_end, stopped)

    def evaluate(self, batches: Any, steps: int | None, callbacks: Any = None, per_batch: bool = False,
                 size: int = 1, stopped: Callable[[], bool] = lambda: False) -> dict[str, float]:
        """An evaluation on the replicas (``on_test_begin``/``on_test_end`` around it); the global logs."""
        if callbacks is not None:
            callbacks.on_test_begin()
        if not per_batch:
            logs: dict[str, float] = self.extended.run_on_replicas(
                commands.evaluate, (self.model_id, batches, steps))[0]
        else:
            steps = steps if steps is not None else planned_steps(batches)
            logs = self._stepwise(
                "test", batches, steps, size,
                lambda count: self.extended.run_on_replicas(commands.test_steps, (self.model_id, count))[0],
                callbacks.on_test_batch_begin, callbacks.on_test_batch_end, stopped)["logs"]
        if callbacks is not None:
            callbacks.on_test_end(logs)
        return dict(logs)

    def _stepwise(self, kind: str, batches: Any, steps: int | None, size: int,
                  run: Callable[[int], dict[str, Any]], on_begin: Callable[..., Any], on_end: Callable[..., Any],
                  stopped: Callable[[], bool]) -> dict[str, Any]:
        """A loop of ``kind`` in commands of ``size`` steps (``run(count)``), the batch hooks between; its end's
        answer. ``on_begin(first step)`` before a command, ``on_end(last step, running global logs)`` after
        it; it stops at the end of the data, after ``steps``, or when a hook asked (``stopped()``). The
        replicas' loop is ended in every case."""
        self.extended.run_on_replicas(commands.begin_loop, (self.model_id, kind, batches))
        step = 0
        try:
            while steps is None or step < steps:
                count = size if steps is None else min(size, steps - step)
                on_begin(step)
                out = run(count)
                if out["steps"]:
                    step += out["steps"]
                    on_end(step - 1, dict(out["logs"]))
                if out["steps"] < count or stopped():
                    break
        finally:
            results = self.extended.run_on_replicas(commands.end_loop, (self.model_id, kind, self.with_state))
        return dict(results[0])
