"""The commands the client sends to the replicas for a Keras 3 model (``command(service, *args)``)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist import context, fault_points
from daskdist.exceptions import WeightsDifferError
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
    "begin_loop",
    "elastic_train_epoch",
    "end_loop",
    "evaluate",
    "install_model",
    "model_state",
    "set_learning_rate",
    "test_steps",
    "train_epoch",
    "train_steps",
]

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
    hooks.install()
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


# -- a loop in several commands (per-batch callbacks on the client between them) ------------------


def begin_loop(service: ReplicaService, model_id: str, loop: str, batches: Any) -> None:
    """Open the ``"train"`` or ``"test"`` loop of the model over this replica's shard of ``batches``."""
    trainable(service, model_id).begin(loop, batches)


def train_steps(service: ReplicaService, model_id: str, count: int | None, driver: StepDriver,
                learning_rate: float | None) -> dict[str, Any]:
    """Up to ``count`` steps of the open training loop; ``{"steps": run, "logs": the epoch's global logs so far}``."""
    set_learning_rate(service, model_id, learning_rate)
    resident = trainable(service, model_id)
    done = resident.train_steps(count, driver, _RecordingTimer(service))
    service.flush_step_events()
    return {"steps": done, "logs": resident.global_metrics()}


def test_steps(service: ReplicaService, model_id: str, count: int | None) -> dict[str, Any]:
    """Up to ``count`` steps of the open evaluation loop; ``{"steps": run, "logs": the global logs so far}``."""
    resident = trainable(service, model_id)
    done = resident.test_steps(count)
    return {"steps": done, "logs": resident.global_metrics()}


def end_loop(service: ReplicaService, model_id: str, loop: str) -> dict[str, Any]:
    """Close the open loop: its global logs; after training, replica 0 adds the model's state (as ``train_epoch``)."""
    resident = trainable(service, model_id)
    if loop == "train":
        logs = resident.end_train()
        return {"logs": logs, "state": resident.snapshot() if service.rank == 0 else None}
    resident.close(loop)
    return {"logs": resident.global_metrics(), "state": None}


# -- elastic epochs -----------------------------------------------------------------------------

_PROGRESS_INTERVAL = 0.25  # seconds between replica 0's progress events


def elastic_train_epoch(service: ReplicaService, model_id: str, batches: Any, steps: int, driver: StepDriver,
                        learning_rate: float | None, key: tuple[int, int], first_step: int, commit_every: int,
                        tag: str, admit_every: float | None = None, room: bool = False) -> dict[str, Any]:
    """Steps ``first_step`` ... of an elastic epoch, committing every ``commit_every`` steps and at the end.

    ``batches`` holds the epoch's global batches from ``first_step`` on
    (planned over this generation's members); ``steps`` is their count;
    ``key`` is ``(fit, epoch)``. A commit keeps every resident's state, this
    model's with the epoch's metric totals so far (summed over the replicas,
    so a replica lost later still counts); how a commit stays off the step's
    path: ``KerasCommits``. With ``admit_every`` (seconds) and ``room`` (the
    group may grow) replica 0 looks for free workers; when some wait, or the
    scheduler said members retire, every replica stops at that commit and
    answers ``{"stopped_at": step, "leave": ...}`` (``elastic.boundary``).
    Replica 0 reports its progress as the built-in layers' ``fit`` does (the
    ``PROGRESS_TOPIC`` event: tag, epoch, step). Returns the epoch's global
    logs and, from replica 0, the model's state.
    """
    import time

    from daskdist.elastic.boundary import FreeWorkerWatch, StopAtCommit, stop_reply
    from daskdist.elastic.replica import commit_now
    from daskdist.keras.models import PROGRESS_TOPIC
    from daskdist.plugins.keras3.commits import KerasCommits

    set_learning_rate(service, model_id, learning_rate)
    resident = trainable(service, model_id)
    fit, epoch = key
    commits = KerasCommits(service, model_id, resident, driver, FreeWorkerWatch(service, admit_every, room),
                           (fit, epoch, first_step), learning_rate)
    resident.begin("train", batches)
    if first_step:  # the epoch's metric totals at the commit it goes on from: all on replica 0, zeros elsewhere
        resident.resume_metrics(service.rank, commits.totals_at((fit, epoch, first_step)))
    timer = _RecordingTimer(service)
    step, last, sent = first_step, first_step + steps, 0.0
    resident.exchange_hook = commits.exchange
    try:
        while step < last:
            commits.before_step(at_commit=(step + 1) % commit_every == 0 and step + 1 != last)
            if not resident.train_steps(1, driver, timer):
                break
            step += 1
            if service.rank == 0 and time.monotonic() - sent >= _PROGRESS_INTERVAL:
                sent = time.monotonic()
                service.log_event(PROGRESS_TOPIC, {"tag": tag, "epoch": epoch, "step": step})
            commits.after_step((fit, epoch, step))
    except StopAtCommit as stop:
        service.flush_step_events()
        return stop_reply(stop)
    finally:
        resident.exchange_hook = None
        resident.close("train")
        commits.finish()  # a commit whose totals no step carried is dropped (the epoch's end follows); its copy ends
    if step > first_step:  # the epoch's end: moving statistics averaged, then committed as they now are
        resident.average_non_trainable()
        resident.commit_metrics()
        commit_now(service, (fit, epoch, step))
    logs = resident.global_metrics()
    service.flush_step_events()
    return {"logs": logs, "state": resident.snapshot() if service.rank == 0 else None}
