"""Models and optimizers captured by a function that ``strategy.run`` sends: the replicas' resident copies.

A model (or optimizer) created in ``strategy.scope()`` lives on every
replica. When a function given to ``strategy.run`` captures it, it is
pickled as a reference to that replica's copy, so a custom loop keeps
training the same weights and optimizer slots from one ``run`` to the next
(TF's mirrored model variables). The first time it is sent, the reference
carries the object itself, which each replica installs.
"""

from __future__ import annotations

from typing import Any

from daskdist import context
from daskdist.group.service import MODEL

__all__ = ["reduce_for_replicas"]


def reduce_for_replicas(obj: Any, object_id: str) -> tuple[Any, ...] | None:
    """``__reduce_ex__``'s value when ``obj`` is being sent to its own strategy's replicas, else ``None``.

    ``obj`` has ``_strategy`` (or ``None``), ``_installed`` and
    ``resident()`` (what a replica keeps, with the object as ``.model`` or
    ``.optimizer``).
    """
    strategy = getattr(obj, "_strategy", None)
    shipment = context.current_shipment()
    if strategy is None or shipment is None or shipment.strategy is not strategy:
        return None
    payload = None
    if not obj._installed:  # sent in full until a run has installed it on every replica
        payload = obj.resident()
        shipment.sent_in_full.append(obj)
    return (_resolve, (strategy.extended.token, object_id, payload))


def _resolve(token: str, object_id: str, payload: Any) -> Any:
    """On a replica: its resident copy (``payload``, installed, when it came with the reference)."""
    runtime = context.current_runtime()
    if runtime is None or runtime.token != token:
        if payload is None:
            raise RuntimeError(f"{object_id} belongs to strategy {token}, not to the replica unpickling it")
        return payload.unwrap()
    if payload is not None:  # sent in full: (re)install it, as install_resident does
        runtime.objects.install(MODEL, object_id, payload)
        return payload.unwrap()
    resident = runtime.objects.find(MODEL, object_id)
    if resident is None:
        raise RuntimeError(f"replica {runtime.rank} of {token} holds no {object_id!r}: it was never installed")
    return resident.unwrap()
