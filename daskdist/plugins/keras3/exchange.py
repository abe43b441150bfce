"""The point between Keras' backward and ``optimizer.apply`` where daskdist exchanges gradients.

Every Keras backend funnels its update through ``Optimizer.apply(grads,
variables)`` (``Model.train_step`` of the torch backend calls it right after
``loss.backward()``; ``stateless_apply``, which the JAX backend's
``train_step`` calls, runs it in a stateless scope). ``apply_with_exchange``
is what the patched ``apply`` does: when a step driver's exchange is active
for this optimizer (``fit`` on the replicas, torch backend), the gradients go
through it; when the optimizer is a replica's copy of one created in
``strategy.scope()`` (a custom loop), they are summed over the replicas, as
TensorFlow's optimizers do in replica context (the loss is then scaled by the
global batch size, as in TF's custom-training tutorial). The gradients are
viewed as numpy (``backend.framework().to_numpy``) and the reduced ones come
back as the backend's tensors.

On the JAX backend a step is split in two jitted halves (``backend_jax``):
while its gradient half is traced, the patched ``stateless_apply`` of the
optimizer being ``captured`` returns the gradients in place of the new
parameters, so Keras' own ``train_step`` (or a user's) hands them out.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from daskdist import context
from daskdist.ops import ReduceOp
from daskdist.plugins.keras3.backend import framework

if TYPE_CHECKING:
    from daskdist.strategy.drivers.contract import GradientExchange

__all__ = ["active", "apply_with_exchange", "captured", "count_step", "mark_ps_optimizer", "mark_replica_optimizer",
           "stateless_apply_with_capture"]

_local = threading.local()
_replica_optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
_ps_optimizers: weakref.WeakKeyDictionary[Any, Callable[[list[Any], list[Any]], None]] = weakref.WeakKeyDictionary()


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


def mark_ps_optimizer(optimizer: Any, push: Callable[[list[Any], list[Any]], None]) -> None:
    """Mark a parameter-server worker's optimizer of a custom loop: its ``apply`` gives the gradients (numpy) and
    the variables to ``push``, which applies them on the stores and assigns the new parameters."""
    _ps_optimizers[optimizer] = push


class captured:
    """``with captured(optimizer):`` its ``stateless_apply`` returns ``(grads, optimizer_variables)`` unchanged.

    Set around the call of a JAX step's jitted gradient half: when it is
    traced, the new parameters Keras' ``train_step`` returns are the gradients.
    """

    def __init__(self, optimizer: Any):
        self._key = id(optimizer)

    def __enter__(self) -> None:
        self._before = getattr(_local, "captured", None)
        _local.captured = self._key

    def __exit__(self, *exc_info: Any) -> None:
        _local.captured = self._before


def stateless_apply_with_capture(optimizer: Any, optimizer_variables: Any, grads: Any, trainable_variables: Any,
                                 original: Callable[..., Any]) -> Any:
    """``optimizer.stateless_apply``: Keras' own, or the gradients handed out while ``captured``."""
    if getattr(_local, "captured", None) == id(optimizer):
        return list(grads), list(optimizer_variables)
    return original(optimizer, optimizer_variables, grads, trainable_variables)


def count_step(optimizer: Any) -> None:
    """A step applied off the replica (the parameter holder or servers): advance ``iterations`` as ``apply`` would."""
    optimizer.iterations.assign_add(1)


def apply_with_exchange(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any] | None,
                        original: Callable[..., Any]) -> Any:
    """``optimizer.apply(grads, variables)`` with the gradients exchanged first where a driver asks for it."""
    table = getattr(_local, "table", None)
    entry = table.get(id(optimizer)) if table else None
    push = _ps_optimizers.get(optimizer) if entry is None else None
    if entry is None and push is None and optimizer not in _replica_optimizers:
        return original(optimizer, grads, variables)
    ops = framework()
    grads = list(grads)
    targets = list(variables) if variables is not None else list(optimizer.trainable_variables)
    if push is not None:  # a custom loop's closure on a parameter-server worker: the stores apply
        push(ops.to_numpy(grads, targets), targets)
        count_step(optimizer)
        return None
    if entry is not None:
        exchange, rows = entry
        reduced = exchange(ops.to_numpy(grads, targets), rows)
        if reduced is None:  # the driver assigned the new parameters (held off the replicas): nothing to apply
            count_step(optimizer)
            return None
    else:
        ctx = context.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return original(optimizer, grads, variables)
        reduced = ctx.all_reduce(ReduceOp.SUM, ops.to_numpy(grads, targets))
    return original(optimizer, ops.from_numpy(reduced), variables)
