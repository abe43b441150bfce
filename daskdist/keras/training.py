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

import contextlib
from collections.abc import Callable, Generator, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist import context, fault_points
from daskdist.arrays import as_array, namespace
from daskdist.keras.trainable import BuiltinTrainable
from daskdist.ops import ReduceOp
from daskdist.strategy.training_contract import SpmdStepDriver

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService
    from daskdist.keras.models import Model
    from daskdist.strategy.training_contract import StepDriver

__all__ = ["evaluate_batches", "predict_batches", "split_batch", "train_batches", "train_step"]

ProgressFn = Callable[[int, dict], None]


def split_batch(batch: Any) -> tuple[Any, Any, Any]:
    """``(x, y)``, ``(x, y, sample_weight)``, a dict with ``"x"``/``"y"``, or ``x`` alone."""
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2:
            return batch[0], batch[1], None
        if len(batch) == 3:
            return batch[0], batch[1], batch[2]
        raise ValueError(f"a batch must be (x, y) or (x, y, sample_weight), got {len(batch)} parts")
    if isinstance(batch, dict) and "x" in batch:
        return batch["x"], batch.get("y"), batch.get("sample_weight")
    return batch, None, None


def _rows(x: Any) -> int:
    return int(x.shape[0]) if getattr(x, "ndim", 0) else 0


class _RuntimeTimer:
    """A replica's step timer whose finished steps also go to the scheduler (dashboard, /metrics)."""

    def __init__(self, service: ReplicaService):
        self._service = service
        self._timer = service.timer

    def begin(self, step: int) -> None:
        self._timer.begin(step)

    def add_apply(self, seconds: float) -> None:
        self._timer.add_apply(seconds)

    def add_samples(self, samples: int) -> None:
        self._timer.add_samples(samples)

    def end(self) -> None:
        self._service.record_step(self._timer.end())

    def flush(self) -> None:
        """Send the steps recorded so far to the scheduler now."""
        self._service.flush_step_events()


def _timer() -> _RuntimeTimer | None:
    service = context.current_runtime()
    return _RuntimeTimer(service) if service is not None else None


def _timed_batches(batches: Iterable[Any], steps: int | None, timer: Any,
                   before_batch: Callable[[], None] | None = None) -> Generator[Any, None, None]:
    """The batches of one pass (at most ``steps``), each taken once its step's timer is open.

    Taking the batch inside the step makes its input wait count; the caller
    ends the step. Closing the generator closes the batch iterator.
    ``before_batch``: called before each batch is taken (a test's fault point, ``fault_points.arm``).
    """
    iterator = iter(batches)
    try:
        step = 0
        while steps is None or step < steps:
            if timer is not None:
                timer.begin(step)
            if before_batch is not None:
                before_batch()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            yield batch
            step += 1
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def train_batches(model: Model, batches: Iterable[Any], steps: int | None, progress: ProgressFn | None, *,
                  start: tuple[float, float] | None = None,
                  on_step: Callable[[int, float, float], None] | None = None,
                  before_apply: Callable[[], None] | None = None,
                  driver: StepDriver | None = None, trainable: BuiltinTrainable | None = None) -> dict:
    """One epoch of training over ``batches`` (at most ``steps``); returns the epoch's global logs.

    ``driver``: the strategy's step driver (``extended.step_driver()``;
    default: the SPMD driver, which in the client process is one replica);
    ``trainable``: the model's ``BuiltinTrainable`` (the replica's resident;
    default: a new one). ``start``: the epoch's global ``(loss sum,
    examples)`` so far, when the epoch resumes part-way (elastic training;
    the metrics are then not reset). ``on_step(step, loss_sum, count)`` is
    called on every replica after each step (elastic commits);
    ``before_apply()`` once per step just before the step changes the
    weights (an elastic commit's copy ends there).
    """
    ctx = context.get_replica_context()
    if start is None:
        model.reset_metrics()
    loss_sum, count = (0.0, 0.0) if start is None else (float(start[0]), float(start[1]))
    timer = _timer()
    service = context.current_runtime()
    driver = driver if driver is not None else SpmdStepDriver()
    trainable = trainable if trainable is not None else BuiltinTrainable(model)
    trainable.timer, trainable.before_change = timer, before_apply
    before_batch = fault_points.arm(service.rank if service is not None else 0, lambda: model.optimizer.iterations)
    driver.begin(trainable)
    step = 0
    try:
        with contextlib.closing(_timed_batches(batches, steps, timer, before_batch)) as timed:
            for batch in timed:
                x, y, sample_weight = split_batch(batch)
                step_loss, step_count = train_step(trainable, driver, x, y, sample_weight, timer)
                if timer is not None:
                    timer.end()
                loss_sum += step_loss
                count += step_count
                step += 1
                if on_step is not None:
                    on_step(step, loss_sum, count)
                if progress is not None:
                    progress(step, {"loss": loss_sum / max(count, 1.0)})
    finally:
        trainable.timer = trainable.before_change = None
    logs = {"loss": loss_sum / max(count, 1.0)}
    logs.update(_global_metric_results(model, ctx))
    return logs


def train_step(trainable: BuiltinTrainable, driver: StepDriver, x: Any, y: Any, sample_weight: Any,
               timer: Any = None) -> tuple[float, float]:
    """One step of ``driver`` over a local batch; ``(loss sum, rows)`` of the step (global, or this worker's under PS)."""
    x, _ = as_array(x)
    y, _ = as_array(y)
    trainable.model._ensure_built(x)
    rows = _rows(x)
    if timer is not None:
        timer.add_samples(rows)
    totals = driver.step(trainable, (x, y, sample_weight), rows)
    return (totals.sums[0] if totals.sums else 0.0), totals.rows


def _global_metric_results(model: Model, ctx: Any) -> dict:
    metrics = model.compiled_metrics
    if not metrics:
        return {}
    totals = ctx.all_reduce(ReduceOp.SUM, [np.asarray(m.totals(), np.float64) for m in metrics])
    results = {}
    for metric, total in zip(metrics, totals):
        metric.set_totals(total)
        results[metric.name] = float(metric.result())
    return results


def evaluate_batches(model: Model, batches: Iterable[Any], steps: int | None = None,
                     progress: ProgressFn | None = None) -> dict:
    """Loss and metrics over ``batches``, aggregated over all replicas."""
    ctx = context.get_replica_context()
    if ctx is None:
        raise RuntimeError("evaluation runs in a replica, or outside any strategy's scope (a model made outside "
                           "it is evaluated outside it), not in a strategy's cross-replica context")
    model.reset_metrics()
    loss_sum = 0.0
    count = 0.0
    timer = _timer()
    step = 0
    with contextlib.closing(_timed_batches(batches, steps, timer)) as timed:
        for batch in timed:
            x, y, sample_weight = split_batch(batch)
            x, _ = as_array(x)
            y, _ = as_array(y)
            rows = _rows(x)
            if rows:
                model._ensure_built(x)
                y_pred = model._forward(x, training=False)
                per_example = model.loss.per_example(y, y_pred)
                if sample_weight is not None:
                    per_example = per_example * as_array(sample_weight)[0]
                loss_sum += float(namespace(per_example).sum(per_example))
                count += rows
                for metric in model.compiled_metrics:
                    metric.update_state(y, y_pred, sample_weight)
            if timer is not None:
                timer.add_samples(rows)
                timer.end()
            step += 1
            if progress is not None:
                progress(step, {})
    if timer is not None:
        timer.flush()
    total = ctx.all_reduce(ReduceOp.SUM, np.array([loss_sum, count], np.float64))
    logs = {"loss": float(total[0] / max(total[1], 1.0))}
    logs.update(_global_metric_results(model, ctx))
    return logs


def predict_batches(model: Model, batches: Iterable[Any]) -> Any:
    """Concatenated outputs for the inputs of ``batches``, in order."""
    outputs = []
    for batch in batches:
        x, _, _ = split_batch(batch)
        x, _ = as_array(x)
        if _rows(x):
            model._ensure_built(x)
            outputs.append(model._forward(x, training=False))
    if not outputs:
        return np.empty((0,))
    return namespace(outputs[0]).concatenate(outputs)
