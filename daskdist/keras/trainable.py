"""The built-in layers as one adapter of the training contract: ``BuiltinTrainable``.

A built-in ``Model`` on a replica (or a parameter-server worker, or the
client for a model without a strategy) is a
``daskdist.strategy.drivers.contract.HeldTrainable``: ``train_step`` runs
forward, the per-example loss, its gradient and backward (gradients of the
loss *sum* over the local rows), hands them to the step driver's exchange
with the loss sum (``sums=(loss_sum,)``, ``summed=True``: one message per
step under every driver), applies what comes back with the model's
optimizer (nothing when the driver assigned the new parameters itself) and
updates the metrics. It is also the replica resident of kind ``"model"``:
its ``snapshot`` (weights, optimizer state, the layers' random generators)
is what elastic commits keep and restore.
"""

from __future__ import annotations

import copy
import pickle
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist import context, fault_points
from daskdist.arrays import as_array, namespace, to_numpy
from daskdist.ops import ReduceOp

if TYPE_CHECKING:
    from daskdist.strategy.drivers.contract import GradientExchange, StepDriver

__all__ = ["BuiltinTrainable", "RandomStates", "global_metric_results", "rows_of", "split_batch", "update_metrics"]


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


def rows_of(x: Any) -> int:
    """Rows of an input array (0 for a scalar)."""
    return int(x.shape[0]) if getattr(x, "ndim", 0) else 0


def update_metrics(model: Any, y: Any, y_pred: Any, sample_weight: Any) -> None:
    """The compiled metrics take a batch as Keras 3's do: ``metrics`` unweighted, ``weighted_metrics`` (the last
    ``weighted_metric_count`` of them) weighted by the rows' sample weights."""
    metrics = model.compiled_metrics
    plain = len(metrics) - getattr(model, "weighted_metric_count", 0)
    for index, metric in enumerate(metrics):
        metric.update_state(y, y_pred, sample_weight if index >= plain else None)


def global_metric_results(model: Any, ctx: Any) -> dict[str, float]:
    """The compiled metrics over every replica's rows so far (each replica's own totals kept, so a loop can go on)."""
    metrics = model.compiled_metrics
    if not metrics:
        return {}
    own = [np.asarray(m.totals(), np.float64) for m in metrics]
    totals = ctx.all_reduce(ReduceOp.SUM, [o.copy() for o in own])
    results = {}
    for metric, total in zip(metrics, totals):
        metric.set_totals(total)
        results[metric.name] = float(metric.result())
    for metric, mine in zip(metrics, own):
        metric.set_totals(mine)
    return results


class RandomStates:
    """The layers' random generator states in a model snapshot, by layer name.

    One leaf of the snapshot (its own copy), left out of elastic training's
    state digest (``digest_bytes``): replicas may legitimately draw different
    numbers (their batches differ in shape), while their weights must agree.
    As an array (``numpy.asarray``) it is its pickled bytes.
    """

    def __init__(self, states: dict[str, dict[str, Any]]):
        self.states = copy.deepcopy(states) if states else {}

    def digest_bytes(self) -> bytes:
        return b""

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """The states as bytes (``uint8``), so that snapshots compare as arrays do."""
        return np.frombuffer(pickle.dumps(self.states, protocol=4), np.uint8)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RandomStates) and np.array_equal(np.asarray(self), np.asarray(other))

    __hash__ = None  # type: ignore[assignment]  # typeshed types object.__hash__ as a method, not None


def held_state(model: Any) -> list[Any]:
    """The layers' non-trainable state (moving statistics) in a fixed order: what the parameter servers hold
    beside the parameters (``StatefulTrainable``)."""
    if not model.built:
        return []
    return [layer.state[name] for layer in model.layers for name in sorted(getattr(layer, "state", {}))]


def assign_held_state(model: Any, values: Sequence[Any | None]) -> None:
    """Copy ``values`` (in ``held_state`` order; ``None``: leave that one) into the layers' state."""
    for target, value in zip(held_state(model), values):
        if value is not None:
            xp = namespace(target)
            xp.copyto(target, xp.asarray(np.asarray(value), dtype=target.dtype))


class BuiltinTrainable:
    """A built-in model as the training contract trains it, and as a replica keeps it (resident ``"model"``).

    Attributes
    ----------
    timer
        The replica's step timer (``add_apply``), or ``None``; set by the loop.
    before_change
        Called once per step just before the step changes the weights (an
        elastic commit's copy ends there), or ``None``; set by the loop.
    """

    def __init__(self, model: Any):
        self.model = model
        self.timer: Any = None
        self.before_change: Callable[[], None] | None = None
        self._changing = False
        # the open loop's totals: the training loss over every replica's rows (the driver's sums), the
        # evaluation loss over this replica's rows
        self.loss_sum, self.count = 0.0, 0.0
        self._test_loss, self._test_count = 0.0, 0.0
        # elastic commits (``daskdist.training.commits``): the hook that wraps the driver's exchange, what the
        # last step's exchange summed, the epoch's totals at the newest commit, and whether a restore set them
        self.exchange_hook: Callable[[GradientExchange], GradientExchange] | None = None
        self.step_totals: Any = None
        self._metric_totals: list[np.ndarray] = []
        self._resumed = False

    def unwrap(self) -> Any:
        return self.model

    # -- the training contract ------------------------------------------------------------

    def parameters(self) -> list[Any]:
        variables: list[Any] = self.model.trainable_variables
        return variables

    def train_step(self, batch: Any, exchange: GradientExchange) -> None:
        """``batch`` is ``(x, y, sample_weight)`` of arrays (``sample_weight`` may be ``None``)."""
        model = self.model
        x, y, sample_weight = batch
        self._changing = False
        y_pred = model._forward(x, training=True)
        if fault_points.ARMED:
            fault_points.reached("forward")
        per_example = model.loss.per_example(y, y_pred)
        grad = model.loss.gradient(y, y_pred)
        if sample_weight is not None:
            weight, _ = as_array(sample_weight)
            per_example = per_example * weight
            grad = grad * namespace(grad).reshape(weight, (-1,) + (1,) * (grad.ndim - 1))
        model._backward(grad)
        loss_sum = float(namespace(per_example).sum(per_example))
        params, grads = model._trainable_arrays()
        self._exchange_and_apply(exchange, params, grads, int(x.shape[0]), loss_sum)
        update_metrics(model, y, y_pred, sample_weight)

    def join_step(self, exchange: GradientExchange) -> None:
        self._changing = False
        params = self.model.trainable_variables  # (its layers may have no gradients yet: no backward ran here)
        self._exchange_and_apply(exchange, params, [namespace(p).zeros_like(p) for p in params], 0, 0.0)

    def _exchange_and_apply(self, exchange: GradientExchange, params: list[Any], grads: list[Any], rows: int,
                            loss_sum: float) -> None:
        if self.exchange_hook is not None:
            exchange = self.exchange_hook(exchange)
        start = time.perf_counter()
        reduced = exchange(grads, rows, sums=(loss_sum,), summed=True)
        if reduced is None:  # the driver assigned the new parameters (held elsewhere): that was the apply
            if self.timer is not None:
                self.timer.add_apply(time.perf_counter() - start)
            return
        self._before_change()
        start = time.perf_counter()
        self.model.optimizer.apply(params, reduced)
        if self.timer is not None:
            self.timer.add_apply(time.perf_counter() - start)

    def _before_change(self) -> None:
        if not self._changing and self.before_change is not None:
            self.before_change()
        self._changing = True

    def assign(self, values: Sequence[Any | None]) -> None:
        self._before_change()
        for target, value in zip(self.model.trainable_variables, values):
            if value is not None:
                xp = namespace(target)
                xp.copyto(target, xp.asarray(value, dtype=target.dtype))

    def held_state(self) -> list[Any]:
        """The layers' moving statistics (``StatefulTrainable``: the parameter servers hold them by assignment)."""
        return held_state(self.model)

    def assign_held_state(self, values: Sequence[Any | None]) -> None:
        assign_held_state(self.model, values)

    def update_rule(self) -> Any:
        """The model's optimizer (numpy/cupy arrays in place; slots ``<slot>/<index>`` in its state)."""
        return self.model.optimizer

    # -- the trainer's replica model (``daskdist.training.replica.ReplicaModel``) ---------------

    def set_learning_rate(self, learning_rate: float | None) -> None:
        if learning_rate is not None and self.model.optimizer is not None:
            self.model.optimizer.learning_rate = learning_rate

    def begin_loop(self, loop: str, timer: Any = None) -> None:
        """A loop begins: metrics and loss totals from zero; ``timer`` times each step's apply."""
        self.model.reset_metrics()
        self.loss_sum = self.count = self._test_loss = self._test_count = 0.0
        if loop == "train":
            self.timer = timer

    def resume(self, loss_sum: float, count: float, timer: Any = None) -> None:
        """A training loop goes on part-way into an epoch (elastic): its global loss totals so far, metrics kept."""
        self.loss_sum, self.count = float(loss_sum), float(count)
        self.timer = timer

    def end_loop(self, loop: str) -> None:
        if loop == "train":
            self.timer = self.before_change = None

    def train_batch(self, batch: Any, driver: StepDriver) -> int:
        """One step of ``driver`` over a local batch (the global loss totals kept); its rows."""
        x, y, sample_weight = split_batch(batch)
        x, _ = as_array(x)
        y, _ = as_array(y)
        self.model._ensure_built(x)
        rows = rows_of(x)
        totals = self.step_totals = driver.step(self, (x, y, sample_weight), rows)
        self.loss_sum += totals.sums[0] if totals.sums else 0.0
        self.count += totals.rows
        return rows

    def test_batch(self, batch: Any) -> int:
        """The loss and metrics of a local batch (this replica's totals); its rows."""
        model = self.model
        x, y, sample_weight = split_batch(batch)
        x, _ = as_array(x)
        y, _ = as_array(y)
        rows = rows_of(x)
        if rows:
            model._ensure_built(x)
            y_pred = model._forward(x, training=False)
            per_example = model.loss.per_example(y, y_pred)
            if sample_weight is not None:
                per_example = per_example * as_array(sample_weight)[0]
            self._test_loss += float(namespace(per_example).sum(per_example))
            self._test_count += rows
            update_metrics(model, y, y_pred, sample_weight)
        return rows

    def global_logs(self, loop: str) -> dict[str, float]:
        """The loop's loss and metrics over every replica's rows so far."""
        ctx = context.get_replica_context()
        if ctx is None:
            raise RuntimeError("evaluation runs in a replica, or outside any strategy's scope (a model made outside "
                               "it is evaluated outside it), not in a strategy's cross-replica context")
        if loop == "train":
            logs = {"loss": self.loss_sum / max(self.count, 1.0)}
        else:
            total = ctx.all_reduce(ReduceOp.SUM, np.array([self._test_loss, self._test_count], np.float64))
            logs = {"loss": float(total[0] / max(total[1], 1.0))}
        logs.update(global_metric_results(self.model, ctx))
        return logs

    def progress_logs(self) -> dict[str, float]:
        """The epoch's global loss so far (the driver summed it with each step)."""
        return {"loss": self.loss_sum / max(self.count, 1.0)}

    def end_train(self) -> None:
        """Nothing averaged at an epoch's end: the built-in layers keep no per-replica state."""

    def step_count(self) -> int:
        return int(self.model.optimizer.iterations) if self.model.optimizer is not None else 0

    # -- the resident -----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        weights = self.weights()
        optimizer = self.model.optimizer
        state = {} if optimizer is None else {k: np.array(to_numpy(v), copy=True)
                                              for k, v in optimizer.get_state().items()}
        return {"weights": weights, "optimizer": state, "rng": self.snapshot_random(),
                "metrics": [np.array(t, copy=True) for t in self._metric_totals]}

    def weights(self) -> list[np.ndarray]:
        """The model's weights (copies), in ``Model.get_weights``' order."""
        return [np.array(to_numpy(a), copy=True) for _, a in self.model._weight_items()]

    def snapshot_random(self) -> RandomStates:
        """The layers' random generator states (a copy), under ``"rng"`` in ``snapshot``."""
        rng = {layer.name: layer.rng_state() for layer in self.model.layers}
        return RandomStates({k: v for k, v in rng.items() if v})

    def restore(self, state: dict[str, Any]) -> None:
        self.model._assign_weights(state["weights"])
        if self.model.optimizer is not None and state["optimizer"]:
            self.model.optimizer.set_state(state["optimizer"])
        if "rng" in state:
            rng = state["rng"].states
            for layer in self.model.layers:
                layer.set_rng_state(rng.get(layer.name, {}))
        self._metric_totals = [np.array(t, copy=True) for t in state.get("metrics", [])]
        self._resumed = True

    # -- elastic commits (``daskdist.training.commits``) -----------------------------------------
    #
    # The epoch's totals a commit keeps: the global loss sum and rows (``[loss_sum, count]``, counted on
    # replica 0 only, so that the sum over the replicas is the global value) and each metric's totals.

    def step_state(self) -> dict[str, Any]:
        """What a step's forward changes before its apply, copied: ``{"rng": the layers' random states,
        "moving": {position in the snapshot's "weights": array}}`` (the layers' ``state``: moving statistics)."""
        moving = {}
        position = 0
        for layer in self.model.layers:  # a layer's weights: its ``params``, then its ``state`` (``weights_list``)
            position += len(layer.params)
            for array in layer.state.values():
                moving[position] = np.array(to_numpy(array), copy=True)
                position += 1
        return {"rng": self.snapshot_random(), "moving": moving}

    def replay(self, gradients: Sequence[Sequence[Any]], learning_rate: float | None) -> None:
        """Apply the reduced ``gradients`` of steps again, in order, with the optimizer (a replayed commit)."""
        optimizer = self.model.optimizer
        if learning_rate is not None:
            optimizer.learning_rate = learning_rate
        params = self.model.trainable_variables
        for reduced in gradients:
            optimizer.apply(params, list(reduced))

    def replayed_snapshot(self, forward: dict[str, Any], metrics: list[np.ndarray]) -> dict[str, Any]:
        """The ``snapshot`` after a ``replay``, with a commit's random states and totals."""
        state = self.snapshot()
        state["weights"] = [forward["moving"].get(i, w) for i, w in enumerate(state["weights"])]
        state["rng"], state["metrics"] = forward["rng"], list(metrics)
        return state

    def local_metric_totals(self) -> list[np.ndarray]:
        """This replica's share of the epoch's totals (the loss on replica 0 only), copied."""
        ctx = context.get_replica_context()
        first = ctx is None or ctx.replica_id_in_sync_group == 0
        loss = np.array([self.loss_sum, self.count] if first else [0.0, 0.0], np.float64)
        return [loss, *(np.array(m.totals(), np.float64, copy=True) for m in self.model.compiled_metrics)]

    def keep_metric_totals(self, totals: list[np.ndarray]) -> None:
        """The epoch's totals summed over the replicas at the newest commit (``snapshot`` keeps them)."""
        self._metric_totals = [np.asarray(t) for t in totals]

    def resume_metrics(self, rank: int, totals: list[np.ndarray] | None = None) -> None:
        """Mid-epoch, from a commit: the global loss totals on every replica, the metric totals on replica 0
        (zeros elsewhere: they are summed when read)."""
        if totals is None and self._resumed:
            totals = self._metric_totals
        self._resumed = False
        metrics = self.model.compiled_metrics
        if totals is None or len(totals) != len(metrics) + 1:
            return
        loss = np.asarray(totals[0], np.float64)
        self.loss_sum, self.count = float(loss[0]), float(loss[1])
        for metric, total in zip(metrics, totals[1:]):
            total = np.asarray(total, np.float64)
            metric.set_totals(total if rank == 0 else np.zeros_like(total))

    def commit_metrics(self) -> None:
        """Sum the epoch's totals over the replicas now and keep them for the next ``snapshot`` (the epoch's end)."""
        own = self.local_metric_totals()
        ctx = context.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            own = [np.asarray(t) for t in ctx.all_reduce(ReduceOp.SUM, own)]
        self._metric_totals = own
