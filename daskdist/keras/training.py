"""The training, evaluation and prediction loops, as they run inside each replica.

They are written once: inside a replica, ``get_replica_context()`` is that
replica's context and gradients are all-reduced; in the client process (a
model used without a strategy) it is the one-replica default context.

One step is the strategy's step driver running the model's
``BuiltinTrainable`` (``daskdist.keras.trainable``): forward, per-example
loss, its gradient, backward (parameter gradients summed over the local
examples), then the driver's exchange: under the SPMD strategies one
all-reduce of a single pack holding every gradient plus the example count
and the loss sum, division by the global count, optimizer update on every
replica (the same update keeps the copies identical); under CentralStorage
one round to the parameter holder, which applies the optimizer once; under
ParameterServerStrategy a push to the stores (``daskdist.keras.ps_fit``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist import context, fault_points
from daskdist.arrays import as_array, namespace
from daskdist.keras.trainable import BuiltinTrainable, rows_of, split_batch
from daskdist.strategy.drivers.contract import SpmdStepDriver
from daskdist.training.loop import ReplicaLoop
from daskdist.training.timer import replica_timer

if TYPE_CHECKING:
    from daskdist.strategy.drivers.contract import StepDriver

__all__ = ["evaluate_batches", "predict_batches", "split_batch", "train_batches", "train_step"]

ProgressFn = Callable[[int, Callable[[], dict[str, float]]], None]  # (steps done, the running logs read when sent)


def train_batches(model: Any, batches: Iterable[Any], steps: int | None, progress: ProgressFn | None, *,
                  start: tuple[float, float] | None = None,
                  on_step: Callable[[int, float, float], None] | None = None,
                  before_apply: Callable[[], None] | None = None,
                  driver: StepDriver | None = None, trainable: BuiltinTrainable | None = None) -> dict[str, float]:
    """One epoch of training over ``batches`` (at most ``steps``); returns the epoch's global logs.

    The trainer's step loop (``daskdist.training.loop``) over the model's
    ``BuiltinTrainable`` (the replica's resident; default: a new one) with
    ``driver`` (default: the SPMD driver, which in the client process is one
    replica). ``start``: the epoch's global ``(loss sum, examples)`` so far,
    when the epoch resumes part-way (elastic training; the metrics are then
    not reset). ``on_step(step, loss_sum, count)`` is called on every
    replica after each step (elastic commits); ``before_apply()`` once per
    step just before the step changes the weights (an elastic commit's copy
    ends there).
    """
    service = context.current_runtime()
    driver = driver if driver is not None else SpmdStepDriver()
    trainable = trainable if trainable is not None else BuiltinTrainable(model)
    timer = replica_timer()
    if start is None:
        trainable.begin_loop("train", timer)
    else:
        trainable.resume(start[0], start[1], timer)
    trainable.before_change = before_apply
    loop = ReplicaLoop(batches, timer, fault_points.arm(service.rank if service is not None else 0,
                                                        trainable.step_count))

    def after(done: int) -> None:
        if on_step is not None:
            on_step(done, trainable.loss_sum, trainable.count)
        if progress is not None:
            progress(done, trainable.progress_logs)

    driver.begin(trainable)
    try:
        loop.steps(steps, lambda batch: trainable.train_batch(batch, driver), after)
    finally:
        loop.close()
        trainable.end_loop("train")
    return trainable.global_logs("train")


def train_step(trainable: BuiltinTrainable, driver: StepDriver, x: Any, y: Any, sample_weight: Any,
               timer: Any = None) -> tuple[float, float]:
    """One step of ``driver`` over a local batch; ``(loss sum, rows)`` of the step (global, or this worker's under PS)."""
    x, _ = as_array(x)
    y, _ = as_array(y)
    trainable.model._ensure_built(x)
    rows = rows_of(x)
    if timer is not None:
        timer.add_samples(rows)
    totals = driver.step(trainable, (x, y, sample_weight), rows)
    return (totals.sums[0] if totals.sums else 0.0), totals.rows


def evaluate_batches(model: Any, batches: Iterable[Any], steps: int | None = None,
                     progress: ProgressFn | None = None, trainable: BuiltinTrainable | None = None) -> dict[str, float]:
    """Loss and metrics over ``batches``, aggregated over all replicas (the trainer's step loop)."""
    if context.get_replica_context() is None:
        raise RuntimeError("evaluation runs in a replica, or outside any strategy's scope (a model made outside "
                           "it is evaluated outside it), not in a strategy's cross-replica context")
    trainable = trainable if trainable is not None else BuiltinTrainable(model)
    timer = replica_timer()
    trainable.begin_loop("test", timer)
    loop = ReplicaLoop(batches, timer)
    try:
        loop.steps(steps, trainable.test_batch, (lambda done: progress(done, dict)) if progress is not None else None)
    finally:
        loop.close()
        trainable.end_loop("test")
    if timer is not None:
        timer.flush()
    return trainable.global_logs("test")


def predict_batches(model: Any, batches: Iterable[Any]) -> Any:
    """Concatenated outputs for the inputs of ``batches``, in order."""
    outputs = []
    for batch in batches:
        x, _, _ = split_batch(batch)
        x, _ = as_array(x)
        if rows_of(x):
            model._ensure_built(x)
            outputs.append(model._forward(x, training=False))
    if not outputs:
        return np.empty((0,))
    return namespace(outputs[0]).concatenate(outputs)
