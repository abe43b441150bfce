"""Where ``fit``'s optimizer step runs when the strategy keeps the parameters off the replicas.

A strategy whose parameters are not updated on the replicas (CentralStorage:
one parameter store) installs, as the resident ``(STRATEGY,
"gradient-applier")`` of every replica, an object that replaces ``fit``'s
all-reduce and local optimizer step:

``apply_gradients(service, model_key, optimizer, params, grads, stats) -> summed stats``
    one synchronous step: the replicas' summed gradients and step
    statistics reduced where the parameters live, the optimizer run there
    once, the new parameters copied into ``params``;
``model_state(service, model_key)`` / ``set_model(service, model_key, params=None, optimizer_state=None)``
    the stored copy, for checkpoints and ``set_weights``.

Without one (Mirrored and the other SPMD strategies) ``fit`` all-reduces and
applies the optimizer on every replica.
"""

from __future__ import annotations

from typing import Any

from daskdist.group.service import STRATEGY

__all__ = ["GRADIENT_APPLIER", "gradient_applier"]

#: The resident key of a strategy's gradient applier on each replica.
GRADIENT_APPLIER = (STRATEGY, "gradient-applier")


def gradient_applier(service: Any) -> Any:
    """The strategy's gradient applier on this replica, or ``None`` (all-reduce and apply on every replica)."""
    return service.objects.find(*GRADIENT_APPLIER)
