"""The client's side of an epoch or an evaluation of a Keras 3 model, with Keras' per-batch callbacks.

Without a callback that overrides a per-batch hook, an epoch (or an
evaluation) is one command: every replica runs all of its steps and returns
the global logs. When one of the user's callbacks overrides
``on_train_batch_begin/end`` (or ``on_batch_begin/end``), ``on_test_batch_*``
or ``on_predict_batch_*``, the loop runs as TensorFlow runs it with
``steps_per_execution``: one command per ``model.steps_per_execution`` steps
(1 by default), ``on_*_batch_begin(first step)`` before it and
``on_*_batch_end(last step, logs)`` after it, the logs being the epoch's
global running metrics (every replica's rows so far). ``model.stop_training``
(``stop_evaluating``) set in a hook ends the loop after that execution. The
client's copy of the model lags the replicas' during the epoch; ``get_weights``,
``save`` and ``save_weights`` (``ModelCheckpoint(save_freq=N)``) take the
replicas' current weights first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daskdist.plugins.keras3 import commands

__all__ = ["BATCH_HOOKS", "evaluate", "execution_size", "needs_batch_hooks", "planned_steps", "train_epoch"]

#: The per-batch hooks of each loop (``on_batch_*`` are Keras' aliases of the training ones).
BATCH_HOOKS = {
    "train": ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end"),
    "test": ("on_test_batch_begin", "on_test_batch_end"),
    "predict": ("on_predict_batch_begin", "on_predict_batch_end"),
}


def needs_batch_hooks(callbacks: Any, loop: str) -> bool:
    """Whether one of the user's ``callbacks`` overrides a per-batch hook of ``loop`` (Keras' own test)."""
    from keras.src.utils.python_utils import is_default

    listed = getattr(callbacks, "callbacks", callbacks) or []
    return any(not is_default(getattr(callback, hook)) for callback in listed for hook in BATCH_HOOKS[loop]
               if hasattr(callback, hook))


def execution_size(model: Any) -> int:
    """Steps per command between per-batch callbacks: the model's ``steps_per_execution`` (TF's meaning)."""
    return max(1, int(getattr(model, "steps_per_execution", 1) or 1))


def planned_steps(batches: Any) -> int | None:
    """The steps of a distributed dataset's epoch as planned (``None``: not known before reading it)."""
    planned = [s for s in batches.plan().steps_per_replica() if s is not None]
    return max(planned) if planned else None


def train_epoch(extended: Any, model_id: str, batches: Any, limit: int | None, steps: int | None, driver: Any,
                learning_rate: Callable[[], float | None], callbacks: Any, per_batch: bool, size: int,
                stopped: Callable[[], bool], moved: Callable[[], None]) -> dict[str, Any]:
    """One epoch on the replicas; ``{"logs": global logs, "state": replica 0's state}``.

    ``limit``: the user's ``steps_per_epoch`` (``None``: the whole shard).
    ``per_batch``: run it ``size`` steps per command with the batch hooks of
    ``callbacks`` between (``steps``: the epoch's steps, ``None`` while unknown);
    ``stopped()``: whether a hook asked training to stop; ``moved()``: called
    after each command (the client's copy is then behind the replicas').
    """
    if not per_batch:
        results = extended.run_on_replicas(commands.train_epoch,
                                           (model_id, batches, limit, driver, learning_rate()))
        return dict(results[0])
    def run(count: int) -> dict[str, Any]:
        out: dict[str, Any] = extended.run_on_replicas(commands.train_steps,
                                                       (model_id, count, driver, learning_rate()))[0]
        moved()
        return out

    return _stepwise(extended, model_id, "train", batches, steps, size, run, callbacks.on_train_batch_begin,
                     callbacks.on_train_batch_end, stopped)


def evaluate(extended: Any, model_id: str, batches: Any, steps: int | None, callbacks: Any, per_batch: bool,
             size: int, stopped: Callable[[], bool]) -> dict[str, float]:
    """An evaluation on the replicas (``on_test_begin``/``on_test_end`` around it); the global logs."""
    if callbacks is not None:
        callbacks.on_test_begin()
    if not per_batch:
        logs: dict[str, float] = extended.run_on_replicas(commands.evaluate, (model_id, batches, steps))[0]
    else:
        steps = steps if steps is not None else planned_steps(batches)
        logs = _stepwise(extended, model_id, "test", batches, steps, size,
                         lambda count: extended.run_on_replicas(commands.test_steps, (model_id, count))[0],
                         callbacks.on_test_batch_begin, callbacks.on_test_batch_end, stopped)["logs"]
    if callbacks is not None:
        callbacks.on_test_end(logs)
    return dict(logs)


def _stepwise(extended: Any, model_id: str, kind: str, batches: Any, steps: int | None, size: int,
              run: Callable[[int], dict[str, Any]], on_begin: Callable[..., Any], on_end: Callable[..., Any],
              stopped: Callable[[], bool]) -> dict[str, Any]:
    """A loop of ``kind`` in commands of ``size`` steps (``run(count)``), the batch hooks between; its end's answer.

    ``on_begin(first step)`` before a command, ``on_end(last step, running global logs)`` after it (TF's
    semantics with ``steps_per_execution``); it stops at the end of the data, after ``steps``, or when a hook
    asked (``stopped()``). The replicas' loop state is ended in every case.
    """
    extended.run_on_replicas(commands.begin_loop, (model_id, kind, batches))
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
        results = extended.run_on_replicas(commands.end_loop, (model_id, kind))
    return dict(results[0])
