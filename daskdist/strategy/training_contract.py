"""The framework-neutral training contract: a ``Trainable`` and the step driver of a strategy's Extended.

A framework adapter (``daskdist.plugins.keras3`` for Keras 3 models) wraps a
model as a ``Trainable``: its parameters, one training step over a local batch
that hands its gradients to a ``GradientExchange`` between backward and
apply, and a state that snapshots and restores as a replica resident. The
strategy's Extended supplies the step driver (``StrategyExtended.step_driver``)
that says what happens between backward and apply:

* ``SpmdStepDriver`` (Mirrored, OneDevice, MultiWorkerMirrored): the local
  gradients, weighted by the local batch's rows, are all-reduced in one call
  with the row counts, divided by the global row count, and every replica
  applies the same global gradient, so every copy holds the same weights
  after every step. With equal local batches this is TensorFlow's mean of the
  replicas' gradients; with uneven ones (a global batch that does not divide)
  it is still the gradient of the global batch's mean loss, and a replica with
  no rows in a step joins with zeros.

The parameter-holder driver (reduce to the store, apply once) and the
parameter-server driver (a closure: pull, compute, push) implement the same
``StepDriver`` protocol; they are left for later work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from daskdist import context
from daskdist.ops import ReduceOp

__all__ = ["GradientExchange", "SpmdStepDriver", "StepDriver", "Trainable"]


class GradientExchange(Protocol):
    """What a trainable calls between backward and apply: local gradients in, the gradients to apply out."""

    def __call__(self, gradients: Sequence[Any], rows: int) -> list[Any]:
        """Reduce this replica's ``gradients`` (of its mean loss over ``rows`` rows) across the replicas."""


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


class StepDriver(Protocol):
    """How a strategy turns a trainable's local gradients into the update every replica applies."""

    def exchange(self, gradients: Sequence[Any], rows: int) -> list[Any]:
        """The gradients to apply, given this replica's gradients of its mean loss over ``rows`` rows."""

    def step(self, trainable: Trainable, batch: Any, rows: int) -> None:
        """One training step of ``trainable`` over its local ``batch`` of ``rows`` rows (0: join only)."""


class SpmdStepDriver:
    """All-reduce the row-weighted gradients, then apply on every replica (the SPMD strategies' driver).

    It runs inside a replica (it uses the current ``ReplicaContext``) and
    pickles to nothing but its class, so the client sends it with a command.
    """

    def exchange(self, gradients: Sequence[Any], rows: int) -> list[Any]:
        """Sum ``rows * gradient`` and ``rows`` over the replicas in one all-reduce; return the weighted mean.

        ``gradients`` are numpy arrays (or DLPack-capable tensors viewed as
        numpy without a copy); the result is numpy arrays, one per gradient,
        in the same order. With one replica the gradients come back unchanged.
        """
        ctx = context.get_replica_context()
        arrays = [_as_numpy(g) for g in gradients]
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return arrays
        scaled = [g * g.dtype.type(rows) for g in arrays]
        dtype = arrays[0].dtype if arrays and arrays[0].dtype.kind == "f" and arrays[0].dtype.itemsize >= 4 \
            else np.dtype(np.float64)
        total = ctx.all_reduce(ReduceOp.SUM, {"grads": scaled, "rows": np.array([float(rows)], dtype)})
        global_rows = float(total["rows"][0])
        if global_rows <= 0:
            return [np.zeros_like(g) for g in arrays]
        inverse = 1.0 / global_rows
        return [np.asarray(g) * g.dtype.type(inverse) for g in total["grads"]]

    def step(self, trainable: Trainable, batch: Any, rows: int) -> None:
        if rows:
            trainable.train_step(batch, self.exchange)
        else:
            trainable.join_step(self.exchange)

    def __repr__(self) -> str:
        return "SpmdStepDriver()"


def _as_numpy(array: Any) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    if hasattr(array, "__dlpack__"):
        return np.from_dlpack(array)
    return np.asarray(array)
