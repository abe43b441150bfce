"""The framework-neutral training contract: a ``Trainable`` and the step driver of a strategy's Extended.

A framework adapter (``daskdist.plugins.keras3`` for Keras 3 models,
``daskdist.keras.trainable`` for the built-in layers) wraps a model as a
``Trainable``: its parameters, one training step over a local batch that
hands its gradients to a ``GradientExchange`` between backward and apply,
and a state that snapshots and restores as a replica resident. The
strategy's Extended supplies the step driver (``StrategyExtended.step_driver``)
that says what happens between backward and apply.

How an adapter uses a driver
----------------------------
Before each run of steps (an epoch on a replica, a closure on a
parameter-server worker) the adapter calls ``driver.begin(trainable)``, and
``driver.end(trainable)`` after it when the driver has an ``end`` (the
parameter-server driver: a ``StatefulTrainable`` assigns its state); for
each local batch it calls ``totals = driver.step(trainable, batch, rows)``
(``rows == 0``: this replica's share of the global batch is empty, it joins
the step without data). The driver calls ``trainable.train_step(batch,
exchange)`` (or ``join_step(exchange)``); the trainable runs forward and
backward and calls ``exchange(gradients, rows, sums=..., summed=...)``:

* ``gradients``: one array per parameter (numpy, cupy, or a DLPack-capable
  tensor viewed as numpy without a copy), of the mean loss over ``rows``
  rows, or of the loss *sum* when ``summed=True``;
* ``sums``: a few floats of this step summed over the replicas in the same
  message (a loss sum, for the logs); ``totals.rows`` and ``totals.sums``
  hold the global values once ``step`` returns;
* the return value is either the global gradients (a list: the trainable
  applies them with its own optimizer) or ``None``: the driver has already
  put the updated parameters in place through ``trainable.assign`` and the
  trainable must not apply anything.

The drivers:

* ``SpmdStepDriver`` (Mirrored, OneDevice, MultiWorkerMirrored): the local
  gradients, weighted by the local batch's rows, are all-reduced in one call
  with the row counts, divided by the global row count, and every replica
  applies the same global gradient (a list comes back), so every copy holds
  the same weights after every step. With equal local batches this is
  TensorFlow's mean of the replicas' gradients; with uneven ones it is still
  the gradient of the global batch's mean loss, and a replica with no rows
  in a step joins with zeros.
* ``HolderStepDriver`` (CentralStorage; in ``held_drivers``): every
  replica sends its weighted gradients to the parameter holder as one
  synchronous round; the holder
  sums them, runs the update rule once on the one stored copy of the
  parameters and hands the new parameters to every replica, which
  ``assign`` them (``None`` comes back). The first round carries replica 0's
  parameters and a copy of its ``update_rule()``; the replicas' own
  optimizers never run.
* ``PsStepDriver`` (ParameterServer; in ``held_drivers``): a closure on
  one worker. ``begin`` marks the parameters stale; the first step of the closure pulls those
  changed on the stores since this worker last saw them (parameter ``i`` on
  store ``i % len(stores)``); each step pushes the worker's mean gradients,
  each store runs its update rule once per push (keyed by closure id and
  step: a closure run again after its worker was lost is applied once), and
  the new parameters come back into the trainable (``None``). Workers are
  asynchronous: ``totals`` are this worker's own.

Holder and PS drivers need more of the trainable (``HeldTrainable``):
``assign`` and ``update_rule`` (the optimizer as a store runs it: numpy
arrays in place, its slots in ``get_state``). They keep nothing of any
framework on the stores: parameters are arrays, the update rule an opaque
object the adapter supplies. From the client a ``ParameterHoldingDriver``
reads and writes the stored copy (``stored_state``, ``set_stored``,
``init_stored``: checkpoints, ``set_weights``; ``release`` drops it); the same ``key`` (or driver)
goes on training the same stored parameters.

The protocol is stable: ``Trainable``, ``HeldTrainable``, ``GradientExchange``,
``StepDriver``, ``ParameterHoldingDriver``, ``StepTotals`` and ``UpdateRule``
as written here; adapters may rely on nothing else of a driver.

Drivers run inside a replica (they use the current ``ReplicaContext`` and
replica runtime) and pickle small (their store references and key), so the
client sends them with a command.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from daskdist import context
from daskdist.ops import ReduceOp

if TYPE_CHECKING:
    from distributed import Client

    from daskdist.group.service import ReplicaService

__all__ = [
    "GradientExchange",
    "HeldTrainable",
    "ParameterHoldingDriver",
    "SpmdStepDriver",
    "StatefulTrainable",
    "StepDriver",
    "StepDriverBase",
    "StepTotals",
    "Trainable",
    "UpdateRule",
    "array_view",
    "current_runtime",
    "held",
    "host",
]


class GradientExchange(Protocol):
    """What a trainable calls between backward and apply: local gradients in, the gradients to apply out."""

    def __call__(self, gradients: Sequence[Any], rows: int, sums: Sequence[float] = (),
                 summed: bool = False) -> list[Any] | None:
        """Reduce this replica's ``gradients`` (of its mean loss over ``rows`` rows; ``summed``: of its loss sum).

        Returns the gradients to apply, or ``None`` when the driver already
        assigned the updated parameters (the trainable applies nothing).
        """


@runtime_checkable
class Trainable(Protocol):
    """A model as daskdist trains it, whatever its framework.

    The adapter keeps the model and its optimizer; daskdist keeps the loop,
    the data and the exchange of gradients.
    """

    def parameters(self) -> list[Any]:
        """The trainable parameters as arrays (numpy or DLPack-capable), in a fixed order."""

    def train_step(self, batch: Any, exchange: GradientExchange) -> None:
        """Forward and backward over a local ``batch``, ``exchange`` the gradients, apply what comes back."""

    def join_step(self, exchange: GradientExchange) -> None:
        """Take part in a step without data (this replica's share of the global batch is empty)."""

    def snapshot(self) -> Any:
        """A copy of the parameters, optimizer state and random state (later updates do not change it)."""

    def restore(self, state: Any) -> None:
        """Put back a state from ``snapshot`` (this replica's or a twin's)."""


class UpdateRule(Protocol):
    """An optimizer as a parameter holder or server runs it: numpy arrays updated in place, slots in its state."""

    learning_rate: Any
    """A float sent with every step, or ``None``: the rule keeps its own (a schedule of its step count)."""

    def apply(self, params: list[Any], grads: list[Any]) -> None:
        """Update ``params`` in place with the mean gradients ``grads`` (same order)."""

    def get_state(self) -> dict[str, Any]:
        """The slots and step counter, as arrays keyed by name (``<slot>/<parameter index>``)."""

    def set_state(self, state: dict[str, Any]) -> None:
        """Put back a state from ``get_state``."""


@runtime_checkable
class HeldTrainable(Trainable, Protocol):
    """A trainable whose parameters may be held elsewhere (the holder and parameter-server drivers)."""

    def assign(self, values: Sequence[Any | None]) -> None:
        """Copy ``values`` (numpy, in ``parameters()`` order; ``None``: leave that one) into the parameters."""

    def update_rule(self) -> UpdateRule:
        """The optimizer as a store runs it (the driver sends a copy once; ``learning_rate`` read every step)."""


@runtime_checkable
class StatefulTrainable(HeldTrainable, Protocol):
    """A held trainable with state beside its parameters that no gradient updates (moving statistics).

    Under the parameter-server driver the stores keep it by assignment, as
    TensorFlow keeps such variables on the ps: a worker pulls it with the
    parameters when a closure starts and assigns its own values when the
    closure ends (``driver.end``); the last writer's values are kept.
    """

    def held_state(self) -> list[Any]:
        """The state as arrays, in a fixed order (empty: nothing to hold)."""

    def assign_held_state(self, values: Sequence[Any | None]) -> None:
        """Copy ``values`` (numpy, in ``held_state()`` order; ``None``: leave that one) into the state."""


@dataclasses.dataclass
class StepTotals:
    """What a step's exchange summed: the rows and the trainable's ``sums`` (global, or this worker's under PS)."""

    rows: float = 0.0
    sums: tuple[float, ...] = ()


@runtime_checkable
class StepDriver(Protocol):
    """How a strategy turns a trainable's local gradients into the update every replica applies."""

    def begin(self, trainable: Trainable) -> None:
        """A run of steps starts (an epoch on a replica, a closure on a parameter-server worker)."""

    def step(self, trainable: Trainable, batch: Any, rows: int) -> StepTotals:
        """One training step of ``trainable`` over its local ``batch`` of ``rows`` rows (0: join only)."""


@runtime_checkable
class ParameterHoldingDriver(StepDriver, Protocol):
    """A driver whose parameters live off the replicas (holder, parameter servers): the stored copy, from the client."""

    key: str

    def stored_state(self, client: Client, count: int) -> dict[str, Any] | None:
        """``{"params": [count arrays], "rule_state": {...}}`` held now, or ``None`` before any is held."""

    def set_stored(self, client: Client, count: int, params: list[Any] | None = None,
                   rule_state: dict[str, Any] | None = None) -> bool:
        """Overwrite the stored parameters and/or update-rule state; ``False`` if none are held yet."""

    def init_stored(self, client: Client, params: list[Any], rule: UpdateRule) -> None:
        """Hold ``params`` and a copy of ``rule`` unless held already (the holder: its first round does)."""

    def release(self, client: Client) -> None:
        """Drop the stored parameters and update rule of this ``key`` (nothing is held of it afterwards)."""


class StepDriverBase:
    """What every driver does around the exchange: run the trainable's step, keep the step's totals."""

    def __init__(self) -> None:
        self._totals = StepTotals()

    def begin(self, trainable: Trainable) -> None:
        """Nothing to do before a run of steps (the parameter-server driver pulls)."""

    def end(self, trainable: Trainable) -> None:
        """Nothing to do after a run of steps (the parameter-server driver assigns a ``StatefulTrainable``'s state)."""

    def step(self, trainable: Trainable, batch: Any, rows: int) -> StepTotals:
        self._totals = StepTotals()
        if rows:
            trainable.train_step(batch, self._exchange_for(trainable))
        else:
            trainable.join_step(self._exchange_for(trainable))
        return self._totals

    def _exchange_for(self, trainable: Trainable) -> GradientExchange:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_totals"] = StepTotals()
        return state


class SpmdStepDriver(StepDriverBase):
    """All-reduce the row-weighted gradients, then apply on every replica (the SPMD strategies' driver).

    It runs inside a replica (it uses the current ``ReplicaContext``) and
    pickles to nothing but its class, so the client sends it with a command.
    """

    def exchange(self, gradients: Sequence[Any], rows: int, sums: Sequence[float] = (),
                 summed: bool = False) -> list[Any]:
        """Sum ``rows * gradient`` (or the summed gradients), ``rows`` and ``sums`` over the replicas in one
        all-reduce; return the weighted mean.

        ``gradients`` are numpy or cupy arrays (or DLPack-capable tensors
        viewed as numpy without a copy); the result has one array per
        gradient, in the same order and namespace. With one replica nothing
        travels. With no rows anywhere the gradients come back as zeros.
        """
        ctx = context.get_replica_context()
        arrays = [array_view(g) for g in gradients]
        stats_dtype = _stats_dtype(arrays)
        if ctx is None or ctx.num_replicas_in_sync == 1:
            self._totals = StepTotals(float(rows), tuple(float(s) for s in sums))
            if not summed:
                return arrays
            total_rows: float = float(rows)
            reduced = arrays
        else:
            weighted = arrays if summed else [g * g.dtype.type(rows) for g in arrays]
            xp = _namespace(arrays[0]) if arrays and stats_dtype == arrays[0].dtype else np  # one pack
            stats = xp.asarray([float(rows), *(float(s) for s in sums)], dtype=stats_dtype)
            total = ctx.all_reduce(ReduceOp.SUM, {"grads": weighted, "stats": stats})
            values = [float(v) for v in host(total["stats"])]
            total_rows = values[0]
            self._totals = StepTotals(total_rows, tuple(values[1:]))
            reduced = list(total["grads"])
        if total_rows <= 0:
            return [_namespace(g).zeros_like(g) for g in arrays]
        inverse = 1.0 / total_rows
        return [g * g.dtype.type(inverse) for g in reduced]

    def _exchange_for(self, trainable: Trainable) -> GradientExchange:
        return self.exchange

    def __repr__(self) -> str:
        return "SpmdStepDriver()"


def held(trainable: Trainable, driver: object) -> HeldTrainable:
    if not isinstance(trainable, HeldTrainable):
        raise TypeError(f"{type(driver).__name__} needs a trainable with assign() and update_rule() "
                        f"(training_contract.HeldTrainable); {type(trainable).__name__} has not both")
    return trainable


def current_runtime(driver: object) -> ReplicaService:
    """The replica (or parameter-server worker) whose function this thread runs; refused elsewhere."""
    runtime: ReplicaService | None = context.current_runtime()
    if runtime is None:
        raise RuntimeError(f"{type(driver).__name__} runs on a replica or a parameter-server worker only")
    return runtime


def _namespace(array: Any) -> Any:
    from daskdist.arrays import namespace

    return namespace(array)


def host(array: Any) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    from daskdist.arrays import to_numpy

    return np.asarray(to_numpy(array))


def _stats_dtype(arrays: Sequence[Any]) -> Any:
    """The gradients' dtype when float32/64 (one pack with the gradients), else float64."""
    if arrays and arrays[0].dtype.kind == "f" and arrays[0].dtype.itemsize >= 4:
        return arrays[0].dtype
    return np.dtype(np.float64)


def array_view(array: Any) -> Any:
    """numpy and cupy arrays as they are; other DLPack tensors viewed as numpy without a copy."""
    if isinstance(array, np.ndarray) or hasattr(array, "__cuda_array_interface__"):
        return array
    if hasattr(array, "__dlpack__"):
        return np.from_dlpack(array)
    return np.asarray(array)
