"""A Keras 3 model on a replica: the ``Trainable`` of the training contract, and a snapshot-able resident.

``train_step`` runs Keras' own ``Model.train_step`` (forward, loss,
backward, ``optimizer.apply``, metrics; a user's overridden ``train_step``
too) with the step driver's exchange active between backward and apply
(``exchange.py``). Metrics are kept per replica and summed over the replicas
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
from typing import Any, Protocol

import numpy as np
import optree

from daskdist import context
from daskdist.ops import ReduceOp
from daskdist.plugins.keras3 import exchange as exchange_module
from daskdist.strategy.training_contract import GradientExchange, StepDriver

__all__ = ["KerasTrainable", "batch_rows", "to_tensors"]

_SEED_STRIDE = 1_000_003  # replica r's seed generators start at seed + r * stride


class StepTimerLike(Protocol):
    """A replica's step timer as ``train_epoch`` uses it."""

    def begin(self, step: int) -> None: ...
    def add_samples(self, samples: int) -> None: ...
    def end(self) -> None: ...


def batch_rows(batch: Any) -> int:
    """Rows of a batch: the first dimension of its first array (0 for an empty share of a global batch)."""
    leaves = [leaf for leaf in optree.tree_leaves(batch) if getattr(leaf, "ndim", 0)]
    return int(leaves[0].shape[0]) if leaves else 0


def to_tensors(batch: Any) -> Any:
    """A batch of numpy arrays as torch tensors (CPU: views, no copy), the structure kept."""
    import torch

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(leaf))
        return leaf

    if isinstance(batch, list):
        batch = tuple(batch)
    return optree.tree_map(convert, batch, none_is_leaf=True)


def _variable_arrays(variables: list[Any]) -> list[np.ndarray]:
    import keras

    return [np.array(keras.ops.convert_to_numpy(v.value), copy=True) for v in variables]


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
        self._offset_seeds(rank)

    # -- the training contract ---------------------------------------------------------

    def parameters(self) -> list[Any]:
        return [v.value for v in self.model.trainable_variables]

    def train_step(self, batch: Any, exchange: GradientExchange) -> None:
        with exchange_module.active(_optimizer(self.model), exchange, batch_rows(batch)):
            self.model.train_step(to_tensors(batch))

    def join_step(self, exchange: GradientExchange) -> None:
        import torch

        variables = list(self.model.trainable_variables)
        zeros = [np.zeros(tuple(v.shape), dtype=_numpy_dtype(v)) for v in variables]
        reduced = exchange(zeros, 0)
        if reduced is None:  # the driver assigned the new parameters
            return
        with torch.no_grad():
            _optimizer(self.model).apply([torch.from_numpy(g) for g in reduced], variables)

    def snapshot(self) -> dict[str, list[np.ndarray]]:
        optimizer = _optimizer(self.model)
        return {"variables": _variable_arrays(list(self.model.variables)),
                "optimizer": _variable_arrays(list(optimizer.variables)) if optimizer is not None else []}

    def restore(self, state: dict[str, list[np.ndarray]]) -> None:
        for variable, value in zip(self.model.variables, state["variables"]):
            variable.assign(value)
        optimizer = _optimizer(self.model)
        if optimizer is not None and state["optimizer"]:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            for variable, value in zip(optimizer.variables, state["optimizer"]):
                variable.assign(value)

    # -- epochs --------------------------------------------------------------------

    def train_epoch(self, batches: Any, steps: int | None, driver: StepDriver,
                    timer: StepTimerLike | None = None) -> dict[str, float]:
        """One epoch over this replica's shard; the epoch's global logs (every replica returns the same).

        ``timer``: the replica's step timer (``begin(step)``, ``add_samples``, ``end()``); a batch is taken
        once its step's timer is open, so the input wait counts.
        """
        self.model.reset_metrics()
        iterator = iter(batches)
        step = 0
        try:
            while steps is None or step < steps:
                if timer is not None:
                    timer.begin(step)
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                rows = batch_rows(batch)
                driver.step(self, batch, rows)
                if timer is not None:
                    timer.add_samples(rows)
                    timer.end()
                step += 1
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        self.average_non_trainable()
        return self.global_metrics()

    def evaluate(self, batches: Any, steps: int | None) -> dict[str, float]:
        """Loss and metrics over this replica's shard, summed over the replicas (every replica: the same logs)."""
        self.model.reset_metrics()
        step = 0
        for batch in batches:
            if steps is not None and step >= steps:
                break
            if batch_rows(batch):
                self.model.test_step(to_tensors(batch))
            step += 1
        return self.global_metrics()

    def global_metrics(self) -> dict[str, float]:
        """Sum every metric variable over the replicas, then read the metrics (TF's SUM sync-on-read)."""
        variables = list(self.model.metrics_variables)
        ctx = context.get_replica_context()
        if variables and ctx is not None and ctx.num_replicas_in_sync > 1:
            totals = ctx.all_reduce(ReduceOp.SUM, _variable_arrays(variables))
            for variable, total in zip(variables, totals):
                variable.assign(total)
        results = self.model.get_metrics_result()
        return {name: float(np.asarray(value)) for name, value in results.items()
                if np.asarray(value).size == 1}

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
        seeds = {id(g.state) for g in self._seed_generators()}
        for variable in self.model.variables:
            if id(variable) in seeds:
                continue
            digest.update(variable.path.encode())
            digest.update(np.ascontiguousarray(np.asarray(variable.numpy())).tobytes())
        return digest.hexdigest()

    def weight_names(self) -> list[str]:
        seeds = {id(g.state) for g in self._seed_generators()}
        return [v.path for v in self.model.variables if id(v) not in seeds]

    def _seed_generators(self) -> list[Any]:
        generators: list[Any] = []
        for layer in self.model._flatten_layers(include_self=True, recursive=True):
            generators.extend(getattr(layer, "_seed_generators", []))
        return generators

    def _offset_seeds(self, rank: int) -> None:
        if not rank:
            return
        for generator in self._seed_generators():
            state = np.array(generator.state.numpy(), copy=True)
            state[0] = (int(state[0]) + rank * _SEED_STRIDE) % np.iinfo(state.dtype).max
            generator.state.assign(state)


def _numpy_dtype(variable: Any) -> Any:
    import keras

    return keras.backend.standardize_dtype(variable.dtype)


def _optimizer(model: Any) -> Any:
    """The model's optimizer, or ``None`` before ``compile`` (Keras sets the attribute in ``compile``)."""
    return getattr(model, "optimizer", None)
