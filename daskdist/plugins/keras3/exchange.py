"""The point between Keras' backward and ``optimizer.apply`` where daskdist exchanges gradients.

Every Keras backend funnels its update through ``Optimizer.apply(grads,
variables)`` (``Model.train_step`` of the torch backend calls it right after
``loss.backward()``). ``apply_with_exchange`` is what the patched ``apply``
does: when a step driver's exchange is active for this optimizer (``fit`` on
the replicas), the gradients go through it; when the optimizer is a replica's
copy of one created in ``strategy.scope()`` (a custom loop), they are summed
over the replicas, as TensorFlow's optimizers do in replica context (the loss
is then scaled by the global batch size, as in TF's custom-training
tutorial). The gradients are viewed as numpy without a copy and the reduced
ones come back as torch tensors viewing the reduced arrays.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist import context
from daskdist.ops import ReduceOp

if TYPE_CHECKING:
    from daskdist.strategy.training_contract import GradientExchange

__all__ = ["active", "apply_with_exchange", "mark_replica_optimizer"]

_local = threading.local()
_replica_optimizers: weakref.WeakSet[Any] = weakref.WeakSet()


class active:
    """``with active(optimizer, exchange, rows):`` routes that optimizer's ``apply`` through ``exchange``."""

    def __init__(self, optimizer: Any, exchange: GradientExchange, rows: int):
        self._key = id(optimizer)
        self._value = (exchange, rows)

    def __enter__(self) -> None:
        table = getattr(_local, "table", None)
        if table is None:
            table = _local.table = {}
        table[self._key] = self._value

    def __exit__(self, *exc_info: Any) -> None:
        _local.table.pop(self._key, None)


def mark_replica_optimizer(optimizer: Any) -> None:
    """Mark a replica's copy of an optimizer created in ``strategy.scope()`` (its ``apply`` sums gradients)."""
    _replica_optimizers.add(optimizer)


def _numpy_views(grads: Sequence[Any], variables: Sequence[Any]) -> list[np.ndarray]:
    import torch

    views = []
    for grad, variable in zip(grads, variables):
        if grad is None:
            grad = torch.zeros(tuple(variable.shape), dtype=variable.value.dtype)
        views.append(grad.detach().contiguous().cpu().numpy())
    return views


def apply_with_exchange(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any] | None,
                        original: Callable[..., Any]) -> Any:
    """``optimizer.apply(grads, variables)`` with the gradients exchanged first where a driver asks for it."""
    table = getattr(_local, "table", None)
    entry = table.get(id(optimizer)) if table else None
    if entry is None and optimizer not in _replica_optimizers:
        return original(optimizer, grads, variables)
    import torch

    grads = list(grads)
    targets = list(variables) if variables is not None else list(optimizer.trainable_variables)
    if entry is not None:
        exchange, rows = entry
        reduced = exchange(_numpy_views(grads, targets), rows)
        if reduced is None:  # the driver assigned the new parameters (held off the replicas): nothing to apply
            return None
    else:
        ctx = context.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return original(optimizer, grads, variables)
        reduced = ctx.all_reduce(ReduceOp.SUM, _numpy_views(grads, targets))
    tensors = [torch.from_numpy(np.ascontiguousarray(g)) for g in reduced]
    return original(optimizer, tensors, variables)
