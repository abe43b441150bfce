"""The commands the client sends to the replicas for a Keras 3 model (``command(service, *args)``)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist import context
from daskdist.group.service import MODEL
from daskdist.plugins.keras3 import hooks
from daskdist.plugins.keras3.backend import prepare_replica
from daskdist.plugins.keras3.payload import ModelPayload, unpack_model
from daskdist.plugins.keras3.resident import KerasTrainable

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService
    from daskdist.strategy.training_contract import StepDriver

__all__ = [
    "WeightsDifferError",
    "evaluate",
    "install_model",
    "model_state",
    "set_learning_rate",
    "train_epoch",
]

logger = logging.getLogger(__name__)



class WeightsDifferError(ValueError):
    """The replicas' copies of a model do not hold the same weights at the start of training."""


def _replica_frame(service: ReplicaService) -> context.Frame:
    return context.Frame(strategy=service.strategy_view, replica_context=service.context, variable_creator=None,
                         owner=service)


def _limit_threads(service: ReplicaService) -> None:
    """One replica per process: torch's intra-op threads match the cores the process may use on its host."""
    import torch

    members = service.membership.members
    host = members[service.rank].host
    same_host = sum(1 for member in members if member.host == host)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // same_host))


def trainable(service: ReplicaService, model_id: str) -> KerasTrainable:
    """The replica's ``KerasTrainable`` installed as ``model_id``."""
    found: KerasTrainable = service.objects.get(MODEL, model_id)
    return found


def install_model(service: ReplicaService, model_id: str, payload: ModelPayload) -> str:
    """Load the model of ``payload`` on this replica and keep it as ``(MODEL, model_id)``; its weight digest."""
    prepare_replica(payload.backend)
    hooks.install()
    _limit_threads(service)
    with context.enter(_replica_frame(service)):
        model = unpack_model(payload)
        resident = KerasTrainable(model, service.rank)
    service.objects.install(MODEL, model_id, resident)
    return resident.state_digest()


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


def set_learning_rate(service: ReplicaService, model_id: str, learning_rate: float | None) -> None:
    optimizer = trainable(service, model_id).model.optimizer
    if learning_rate is not None and optimizer is not None:
        optimizer.learning_rate = learning_rate


class _RecordingTimer:
    """The replica's step timer whose finished steps go to the scheduler (dashboard, /metrics)."""

    def __init__(self, service: ReplicaService):
        self._service = service
        self._timer = service.timer

    def begin(self, step: int) -> None:
        self._timer.begin(step)

    def add_samples(self, samples: int) -> None:
        self._timer.add_samples(samples)

    def end(self) -> None:
        self._service.record_step(self._timer.end())


def train_epoch(service: ReplicaService, model_id: str, batches: Any, steps: int | None, driver: StepDriver,
                learning_rate: float | None) -> dict[str, Any]:
    """One epoch on this replica's shard; replica 0 adds the model's state (for the client's copy) to its logs."""
    set_learning_rate(service, model_id, learning_rate)
    resident = trainable(service, model_id)
    logs = resident.train_epoch(batches, steps, driver, _RecordingTimer(service))
    service.flush_step_events()
    return {"logs": logs, "state": resident.snapshot() if service.rank == 0 else None}


def evaluate(service: ReplicaService, model_id: str, batches: Any, steps: int | None) -> dict[str, float]:
    return trainable(service, model_id).evaluate(batches, steps)


def model_state(service: ReplicaService, model_id: str) -> dict[str, list[np.ndarray]]:
    """The replica's model state (``KerasTrainable.snapshot``)."""
    return trainable(service, model_id).snapshot()
