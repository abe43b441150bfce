"""The Keras 3 adapter's own replica commands (``command(service, *args)``): install a model, check the copies agree.

Training, evaluation and the model's state are the trainer's commands
(``daskdist.training.commands``), which run the installed ``KerasTrainable``
through its ``ReplicaModel`` methods.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist import context, fault_points
from daskdist.exceptions import WeightsDifferError
from daskdist.group.service import MODEL
from daskdist.plugins.keras3 import wrapped
from daskdist.plugins.keras3.backend import prepare_replica
from daskdist.plugins.keras3.payload import ModelPayload, unpack_model
from daskdist.plugins.keras3.resident import KerasTrainable

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService

__all__ = ["WeightsDifferError", "check_same_weights", "install_model", "trainable"]

logger = logging.getLogger(__name__)



def _replica_frame(service: ReplicaService) -> context.Frame:
    return context.Frame(strategy=service.strategy_view, replica_context=service.context, variable_creator=None,
                         owner=service)


def _threads(service: ReplicaService) -> int:
    """One replica per process: the framework's intra-op threads are the cores the process may use on its host."""
    members = service.membership.members
    host = members[service.rank].host
    same_host = sum(1 for member in members if member.host == host)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // same_host)


def trainable(service: ReplicaService, model_id: str) -> KerasTrainable:
    """The replica's ``KerasTrainable`` installed as ``model_id``."""
    found: KerasTrainable = service.objects.get(MODEL, model_id)
    return found


def install_model(service: ReplicaService, model_id: str, payload: ModelPayload, held: bool = False) -> str:
    """Load the model of ``payload`` on this replica and keep it as ``(MODEL, model_id)``; its weight digest.

    ``held``: a parameter holder keeps the optimizer's state, so the replica's optimizer, which never applies,
    is replaced by an unbuilt copy (its step count kept): no slots on the replicas.
    """
    prepare_replica(payload.backend, threads=_threads(service))
    wrapped.ensure()
    with context.enter(_replica_frame(service)):
        model = unpack_model(payload)
        if held:
            _unbuilt_optimizer(model)
        resident = KerasTrainable(model, service.rank)
    service.objects.install(MODEL, model_id, resident)
    fault_points.installed(service.rank)  # a test's fault point (``daskdist.testing.pause-at``): installed, unanswered
    return resident.state_digest()


def _unbuilt_optimizer(model: Any) -> None:
    """Give ``model`` an unbuilt copy of its optimizer (same config and ``iterations``, no slot variables)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return
    fresh = type(optimizer).from_config(optimizer.get_config())
    fresh.iterations.assign(optimizer.iterations)
    model.optimizer = fresh


def check_same_weights(service: ReplicaService, model_id: str) -> None:
    """Raise ``WeightsDifferError`` on every replica unless all hold the same weights (one all-gather of digests)."""
    resident = trainable(service, model_id)
    digest = np.frombuffer(bytes.fromhex(resident.state_digest()), np.uint8)
    gathered = service.context.all_gather(digest[None, :], axis=0)
    if any(not np.array_equal(row, gathered[0]) for row in np.asarray(gathered)):
        differing = [r for r, row in enumerate(np.asarray(gathered)) if not np.array_equal(row, gathered[0])]
        raise WeightsDifferError(
            f"the replicas' copies of model {resident.model.name!r} hold different weights at the start of training "
            f"(replicas {differing} differ from replica 0): a layer initialised or restored its weights differently "
            "on each replica; create its weights in build() from Keras initializers (or seeded ones)")
