"""A Keras 3 model on a replica: the ``Trainable`` of the training contract, and a snapshot-able resident.

``train_step`` runs Keras' own ``Model.train_step`` (forward, loss,
backward, ``optimizer.apply``, metrics; a user's overridden ``train_step``
too) with the step driver's exchange between backward and apply: on the
torch backend inside the wrapped ``optimizer.apply`` (``exchange.py``), on
the JAX backend between the two jitted halves of Keras' stateless step
(``backend_jax``); what differs per backend is in ``backend_<name>.py``. Metrics are kept per replica and summed over the replicas
when read (TensorFlow's sync-on-read SUM metric variables); non-trainable
float weights (BatchNormalization's moving statistics) are kept per replica
during an epoch and averaged at its end (TensorFlow's sync-on-read MEAN), so
every replica holds the same weights after every epoch. Each replica draws its
own random numbers (dropout): its seed generators start from the model's seed
offset by the replica's rank, so a run is reproducible and replica 0 draws
what one process would.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optree

from daskdist import context
from daskdist.ops import ReduceOp
from daskdist.plugins.keras3 import exchange as exchange_module
from daskdist.plugins.keras3 import update_rule as update_rule_module
from daskdist.plugins.keras3.backend import framework
from daskdist.strategy.drivers.contract import GradientExchange, StepDriver, StepTotals, array_view

__all__ = ["KerasTrainable", "SeedStates", "assign_state", "batch_rows", "split_variables", "state_variables"]

_SEED_STRIDE = 1_000_003  # replica r's seed generators start at seed + r * stride


def batch_rows(batch: Any) -> int:
    """Rows of a batch: the first dimension of its first array (0 for an empty share of a global batch)."""
    leaves = [leaf for leaf in optree.tree_leaves(batch) if getattr(leaf, "ndim", 0)]
    return int(leaves[0].shape[0]) if leaves else 0


def keras_numpy(variable: Any) -> np.ndarray:
    """A variable's value as numpy (Keras' own conversion: it may be a view of the variable)."""
    import keras

    return np.asarray(keras.ops.convert_to_numpy(variable.value))


def _variable_arrays(variables: list[Any]) -> list[np.ndarray]:
    return [np.array(keras_numpy(v), copy=True) for v in variables]


def _copies(values: Sequence[Any]) -> list[np.ndarray]:
    """Copies of ``values`` (the backend's views of variables: one copy each, no conversion in between)."""
    out = []
    for value in values:
        try:
            source = array_view(value)
        except (TypeError, BufferError, ValueError):  # a dtype numpy cannot view (bfloat16): Keras converts
            source = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
        out.append(np.array(source, copy=True))
    return out


class KerasTrainable:
    """A replica's copy of a Keras 3 model and its optimizer (resident kind ``MODEL``).

    Parameters
    ----------
    model
        The model, loaded on this replica.
    rank
        The replica's rank (offsets its random seeds).
    """

    def __init__(self, model: Any, rank: int = 0):
        self.model = model
        self.rank = rank
        self._ops = framework()
        self._steps = self._ops.steps(model)  # the backend's training and evaluation steps
        self._origin = uuid.uuid4().hex  # names this copy's random states in its snapshots
        self._metric_totals: list[np.ndarray] = []  # the epoch's metrics at the newest elastic commit
        self._resumed = False  # restored: resume_metrics puts the totals back at the next elastic epoch
        self._rule: tuple[Any, Any] | None = None  # (the optimizer, its update rule) for held parameters
        # an elastic epoch's commits wrap the driver's exchange (``daskdist.training.commits.Commits.exchange``)
        self.exchange_hook: Callable[[GradientExchange], GradientExchange] | None = None
        self.step_totals = StepTotals()  # what the last step's exchange summed (``driver.step``)
        self._offset_seeds(rank)

    # -- the training contract ---------------------------------------------------------

    def parameters(self) -> list[Any]:
        result: list[Any] = self._steps.parameters()  # torch: views, no autograd, no copy
        return result

    def train_step(self, batch: Any, exchange: GradientExchange) -> None:
        self._steps.train_step(batch, self._hooked(exchange), batch_rows(batch))

    def _hooked(self, exchange: GradientExchange) -> GradientExchange:
        return self.exchange_hook(exchange) if self.exchange_hook is not None else exchange

    def join_step(self, exchange: GradientExchange) -> None:
        exchange = self._hooked(exchange)
        variables = list(self.model.trainable_variables)
        zeros = [np.zeros(tuple(v.shape), dtype=_numpy_dtype(v)) for v in variables]
        reduced = exchange(zeros, 0)
        if reduced is None:  # the driver assigned the new parameters
            exchange_module.count_step(_optimizer(self.model))
            return
        self._steps.apply(reduced)

    def assign(self, values: Sequence[Any | None]) -> None:
        """Copy ``values`` (numpy, in ``parameters()`` order; ``None``: keep that one) into the trainable weights."""
        with self._ops.no_grad():
            for variable, value in zip(self.model.trainable_variables, values):
                if value is not None:
                    variable.assign(np.asarray(value))

    def held_state(self) -> list[Any]:
        """The non-trainable float weights (moving statistics): held by assignment on parameter servers."""
        result: list[Any] = self._ops.views(state_variables(self.model))
        return result

    def assign_held_state(self, values: Sequence[Any | None]) -> None:
        """Copy ``values`` (numpy, in ``held_state()`` order; ``None``: keep that one) into the moving statistics."""
        with self._ops.no_grad():
            for variable, value in zip(state_variables(self.model), values):
                if value is not None:
                    variable.assign(np.asarray(value))

    def update_rule(self) -> Any:
        """The optimizer as a parameter store runs it (``update_rule.update_rule``), at the current learning rate."""
        optimizer = _optimizer(self.model)
        if self._rule is None or self._rule[0] is not optimizer:
            rule = update_rule_module.update_rule(optimizer)
            rule.set_state(update_rule_module.rule_state(optimizer, rule))  # a loaded model's optimizer state
            self._rule = (optimizer, rule)
        rule = self._rule[1]
        rule.learning_rate = update_rule_module.learning_rate(optimizer)  # None: a schedule the store evaluates
        return rule

    def snapshot(self) -> dict[str, Any]:
        """The model's weights, its optimizer's variables, its random generators' states (``SeedStates``) and
        the epoch's metric totals at the newest elastic commit (``commit_metrics``), all copied."""
        return self.begin_snapshot()()

    def weights(self) -> list[np.ndarray]:
        """The model's weights (copies), in Keras' ``get_weights`` order."""
        return _variable_arrays(list(self.model.weights))

    def begin_snapshot(self) -> Callable[[], dict[str, Any]]:
        """A ``snapshot`` in two parts: what a step's forward changes before its apply, copied now (the random
        generators' states and the non-trainable weights: moving statistics, ``step_state``), and the function
        that copies the rest (the trainable weights and the optimizer's variables, which only
        ``optimizer.apply`` changes), which an elastic commit calls in a thread while the next step's forward
        and backward run.
        """
        optimizer = _optimizer(self.model)
        weights = split_variables(self.model)[0]
        now = self.step_state()
        rng, moving = now["rng"], now["moving"]
        metrics = [np.array(t, copy=True) for t in self._metric_totals]
        optimizer_variables = list(optimizer.variables) if optimizer is not None else []
        views = self._ops.views

        def rest() -> dict[str, Any]:
            copied = iter(_copies(views([v for v in weights if v.trainable])))
            return {"variables": [moving[i] if i in moving else next(copied) for i in range(len(weights))],
                    "optimizer": _copies(views(optimizer_variables)), "rng": rng, "metrics": metrics}

        return rest

    def step_state(self) -> dict[str, Any]:
        """What a step's forward changes before its apply, copied: ``{"rng": SeedStates, "moving": {position in
        the snapshot's "variables": array}}`` (the random generators' states, the non-trainable weights)."""
        weights, seeds = split_variables(self.model)
        return {"rng": SeedStates(self._origin, _variable_arrays(seeds)),
                "moving": {i: np.array(keras_numpy(v), copy=True) for i, v in enumerate(weights) if not v.trainable}}

    def replay(self, gradients: Sequence[Sequence[np.ndarray]], learning_rate: float | None) -> None:
        """Apply the reduced ``gradients`` of steps, in order, with the optimizer (at ``learning_rate``): the
        updates those steps made (an elastic commit rebuilt from the full one before it)."""
        optimizer = _optimizer(self.model)
        if learning_rate is not None:
            optimizer.learning_rate = learning_rate
        for reduced in gradients:
            self._steps.apply(list(reduced))

    def replayed_snapshot(self, forward: dict[str, Any], metrics: list[np.ndarray]) -> dict[str, Any]:
        """The ``snapshot`` after a ``replay``, with a commit's forward state (``step_state``) and metric totals."""
        model = self.snapshot()
        model["variables"] = [forward["moving"].get(i, v) for i, v in enumerate(model["variables"])]
        model["rng"], model["metrics"] = forward["rng"], metrics
        return model

    def restore(self, state: dict[str, Any]) -> None:
        """Put back a ``snapshot`` (this replica's, or a twin's: then its own random streams are kept)."""
        assign_state(self.model, state, seeds=getattr(state.get("rng"), "origin", None) == self._origin)
        self._metric_totals = [np.array(t, copy=True) for t in state.get("metrics", [])]
        self._resumed = True

    # -- elastic commits -----------------------------------------------------------------

    def commit_metrics(self) -> None:
        """Sum the metric variables over the replicas and keep the totals for the next ``snapshot`` (one all-reduce).

        An elastic commit keeps the epoch's metrics so far: restored on
        whatever replicas are left (``resume_metrics``), they still count the
        rows of a replica lost since.
        """
        variables = list(self.model.metrics_variables)
        ctx = context.get_replica_context()
        own = _variable_arrays(variables)
        if variables and ctx is not None and ctx.num_replicas_in_sync > 1:
            own = [np.asarray(t) for t in ctx.all_reduce(ReduceOp.SUM, own)]
        self._metric_totals = own

    def local_metric_totals(self) -> list[np.ndarray]:
        """This replica's metric variables as they are (copied): an elastic commit sums them over the replicas."""
        return _variable_arrays(list(self.model.metrics_variables))

    def keep_metric_totals(self, totals: list[np.ndarray]) -> None:
        """The epoch's metric totals summed over the replicas at the newest commit (``snapshot`` keeps them)."""
        self._metric_totals = totals

    def resume_metrics(self, rank: int, totals: list[np.ndarray] | None = None) -> None:
        """Mid-epoch, from a commit: replica 0 holds the committed metric totals (``totals``, or those restored
        last), the others zeros."""
        variables = list(self.model.metrics_variables)
        if totals is None and self._resumed:
            totals = self._metric_totals
        self._resumed = False
        if totals is None or len(totals) != len(variables):
            return
        for variable, total in zip(variables, totals):
            variable.assign(total if rank == 0 else np.zeros_like(total))

    # -- the trainer's replica model (``daskdist.training.replica.ReplicaModel``) ---------------
    #
    # The trainer's commands open a loop over this replica's shard, run its steps through ``train_batch`` /
    # ``test_batch`` and read the global logs (``daskdist.training.commands``).

    def set_learning_rate(self, learning_rate: float | None) -> None:
        """The client's learning rate (``LearningRateScheduler``); ``None``: a schedule, kept as it is."""
        optimizer = self.model.optimizer
        if learning_rate is not None and optimizer is not None:
            optimizer.learning_rate = learning_rate

    def begin_loop(self, loop: str, timer: Any = None) -> None:
        """A loop begins: Keras' metrics reset (the step timer is the loop's: Keras' apply is not timed apart)."""
        self.model.reset_metrics()

    def end_loop(self, loop: str) -> None:
        """Nothing kept per loop."""

    def train_batch(self, batch: Any, driver: StepDriver) -> int:
        """One step of ``driver`` over a local batch; its rows (0: this replica joins the step without data)."""
        rows = batch_rows(batch)
        self.step_totals = driver.step(self, batch, rows)
        return rows

    def test_batch(self, batch: Any) -> int:
        """Keras' ``test_step`` over a local batch (nothing for an empty share); its rows."""
        rows = batch_rows(batch)
        if rows:
            self.test_step(batch)
        return rows

    def test_step(self, batch: Any) -> None:
        """Keras' ``test_step`` on a local batch of numpy arrays (the metrics updated; no autograd)."""
        self._steps.test_step(batch)

    def global_logs(self, loop: str) -> dict[str, float]:
        """The loop's global logs: Keras' metrics (its loss among them) over every replica's rows so far."""
        return self.global_metrics()

    def progress_logs(self) -> dict[str, float] | None:
        """None: the metrics are summed over the replicas only when read (a collective)."""
        return None

    def end_train(self) -> None:
        """An epoch's steps are done: the moving statistics averaged over the replicas."""
        self.average_non_trainable()

    def step_count(self) -> int:
        optimizer = self.model.optimizer
        return int(keras_numpy(optimizer.iterations)) if optimizer is not None else 0

    def global_metrics(self) -> dict[str, float]:
        """The metrics over every replica's rows so far (TF's SUM sync-on-read), this replica's own kept.

        Every metric variable is summed over the replicas, the metrics are
        read from the totals, then each replica's own partial sums are put
        back, so the loop can go on (per-batch callbacks read the running logs).
        """
        variables = list(self.model.metrics_variables)
        ctx = context.get_replica_context()
        own = None
        if variables and ctx is not None and ctx.num_replicas_in_sync > 1:
            own = _variable_arrays(variables)
            for variable, total in zip(variables, ctx.all_reduce(ReduceOp.SUM, own)):
                variable.assign(total)
        results = self.model.get_metrics_result()
        logs = {name: float(np.asarray(value)) for name, value in results.items() if np.asarray(value).size == 1}
        if own is not None:
            for variable, value in zip(variables, own):
                variable.assign(value)
        return logs

    def average_non_trainable(self) -> None:
        """Average the non-trainable float weights (moving statistics) over the replicas (TF's MEAN on read)."""
        variables = [v for v in self.model.non_trainable_variables if np.dtype(_numpy_dtype(v)).kind == "f"]
        ctx = context.get_replica_context()
        if not variables or ctx is None or ctx.num_replicas_in_sync == 1:
            return
        for variable, mean in zip(variables, ctx.all_reduce(ReduceOp.MEAN, _variable_arrays(variables))):
            variable.assign(mean)

    # -- weights -----------------------------------------------------------------------

    def state_digest(self) -> str:
        """A digest of the weights every replica must share (random generator states left out)."""
        digest = hashlib.blake2b(digest_size=16)
        for variable in split_variables(self.model)[0]:
            digest.update(variable.path.encode())
            digest.update(np.ascontiguousarray(np.asarray(variable.numpy())).tobytes())
        return digest.hexdigest()

    def _offset_seeds(self, rank: int) -> None:
        if not rank:
            return
        for state in split_variables(self.model)[1]:
            value = np.array(state.numpy(), copy=True)
            value[0] = (int(value[0]) + rank * _SEED_STRIDE) % np.iinfo(value.dtype).max
            state.assign(value)


def fingerprint(model: Any) -> str:
    """What the replicas must hold: the compile settings and every weight and optimizer variable."""
    import keras

    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((id(_optimizer(model)), model.compiled, model.get_compile_config()
                        if model.compiled else None)).encode())
    variables = list(model.variables) + (list(_optimizer(model).variables) if _optimizer(model) is not None else [])
    for variable in variables:
        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(variable.value)).tobytes())
    return digest.hexdigest()


class SeedStates:
    """The random generators' states of a snapshot: one leaf, left out of elastic training's state digest.

    Replicas draw different random numbers on purpose (their seeds are offset
    by their rank), while their weights must agree: ``digest_bytes`` is empty.
    ``origin`` names the replica's copy that took it: a twin's states are not
    restored (the replica keeps its own stream).
    """

    def __init__(self, origin: str, states: list[np.ndarray]):
        self.origin = origin
        self.states = states

    def digest_bytes(self) -> bytes:
        return b""


def state_variables(model: Any) -> list[Any]:
    """The model's non-trainable float weights (moving statistics, frozen layers' weights), in a fixed order.

    Keras' ``non_trainable_weights``: metric variables and random seed states are not among them.
    """
    return [v for v in model.non_trainable_weights if np.dtype(_numpy_dtype(v)).kind == "f"]


def split_variables(model: Any) -> tuple[list[Any], list[Any]]:
    """The model's variables (Keras' ``model.variables`` order) without and with its seed generators' states."""
    seeds = [generator.state for layer in model._flatten_layers(include_self=True, recursive=True)
             for generator in getattr(layer, "_seed_generators", [])]
    ids = {id(state) for state in seeds}
    weights = [v for v in model.variables if id(v) not in ids]
    return weights, [v for v in model.variables if id(v) in ids]


def assign_state(model: Any, state: dict[str, Any], seeds: bool = True) -> None:
    """Give ``model`` the weights, optimizer variables and (``seeds``) random states of a ``snapshot``."""
    weights, generators = split_variables(model)
    for variable, value in zip(weights, state["variables"]):
        variable.assign(value)
    rng = state.get("rng")
    if seeds and rng is not None:
        for variable, value in zip(generators, rng.states):
            variable.assign(value)
    optimizer = _optimizer(model)
    if optimizer is not None and state["optimizer"]:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        _check_same_layout(optimizer.variables, state["optimizer"], type(optimizer).__name__)
        for variable, value in zip(optimizer.variables, state["optimizer"]):
            variable.assign(value)


def _check_same_layout(variables: Sequence[Any], values: Sequence[Any], owner: str) -> None:
    """Refuse values that are not the variables' own, position by position (another optimizer's layout).

    Fewer values than variables is a copy whose optimizer holds no slots (parameters held off the replicas):
    the leading ones (step count, learning rate) are taken.
    """
    shapes = [tuple(v.shape) for v in variables]
    given = [tuple(np.shape(value)) for value in values]
    if any(a != b for a, b in zip(shapes, given)):
        raise ValueError(f"the {owner}'s {len(shapes)} variables (shapes {shapes}) do not match the {len(given)} "
                         f"values given (shapes {given}): the copy that took them holds another optimizer")


def _numpy_dtype(variable: Any) -> Any:
    import keras

    return keras.backend.standardize_dtype(variable.dtype)


def _optimizer(model: Any) -> Any:
    """The model's optimizer, or ``None`` before ``compile`` (Keras sets the attribute in ``compile``)."""
    return getattr(model, "optimizer", None)
