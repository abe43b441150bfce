"""The trainer's replica commands (``command(service, *args)``), one set for every adapter.

The client sends them to every replica (``run_on_replicas``); each runs the
model installed as ``(MODEL, model_id)`` (a ``training.replica.ReplicaModel``)
over the replica's shard with the strategy's step driver:

* ``train_epoch``: a whole epoch in one command, replica 0 sending live
  progress events (``training.progress``) when the client gives a tag;
* ``begin_loop`` / ``train_steps`` / ``test_steps`` / ``end_loop``: a loop in
  several commands, ``steps_per_execution`` steps each, the client's per-batch
  callbacks between them (``training.stepwise``);
* ``evaluate``: a whole evaluation; ``model_state``: the replica's state;
  ``model_weights``: the replica's weights (its ``get_weights``).

A training command's answer is ``{"logs": the global logs, "state": replica
0's ``snapshot()`` when asked, else ``None``}``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from daskdist import fault_points
from daskdist.group.service import MODEL
from daskdist.training.loop import ReplicaLoop
from daskdist.training.progress import ProgressReporter
from daskdist.training.replica import ReplicaModel
from daskdist.training.timer import RecordingTimer

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService
    from daskdist.strategy.drivers.contract import StepDriver

__all__ = ["begin_loop", "end_loop", "evaluate", "model_state", "model_weights", "replica_model", "test_steps",
           "train_epoch", "train_steps"]

# the open loops of each resident model (``begin_loop`` ... ``end_loop``), by loop kind
_OPEN: weakref.WeakKeyDictionary[Any, dict[str, ReplicaLoop]] = weakref.WeakKeyDictionary()


def replica_model(service: ReplicaService, model_id: str) -> Any:
    """The model resident installed as ``model_id`` on this replica."""
    return service.objects.get(MODEL, model_id)


def _state(service: ReplicaService, resident: ReplicaModel, with_state: bool) -> dict[str, Any] | None:
    return resident.snapshot() if with_state and service.rank == 0 else None


def open_loop(service: ReplicaService, resident: ReplicaModel, loop: str, batches: Any) -> ReplicaLoop:
    """Open the ``loop`` of ``resident`` over ``batches`` (metrics reset; a loop of that kind still open closed)."""
    close_loop(resident, loop)
    timer = RecordingTimer(service)  # evaluation steps are timed too (the dashboard's samples/s)
    resident.begin_loop(loop, timer)
    before_batch = fault_points.arm(service.rank, resident.step_count) if loop == "train" else None
    opened = ReplicaLoop(batches, timer, before_batch)
    _OPEN.setdefault(resident, {})[loop] = opened
    return opened


def close_loop(resident: ReplicaModel, loop: str) -> None:
    """Close the ``loop`` of ``resident``, if one is open."""
    opened = _OPEN.get(resident, {}).pop(loop, None)
    if opened is not None:
        opened.close()
        resident.end_loop(loop)


def train_epoch(service: ReplicaService, model_id: str, batches: Any, steps: int | None, driver: StepDriver,
                learning_rate: float | None, tag: str | None = None, epoch: int = 0,
                with_state: bool = False) -> dict[str, Any]:
    """One epoch over this replica's shard (at most ``steps``); ``{"logs", "state"}``.

    ``tag``: the fit's tag, replica 0 then sends progress events;
    ``with_state``: replica 0 adds the model's state (the client's copy takes it).
    """
    resident = replica_model(service, model_id)
    resident.set_learning_rate(learning_rate)
    opened = open_loop(service, resident, "train", batches)
    progress = ProgressReporter(service, tag, epoch) if tag is not None else None
    after = (lambda done: progress(done, resident.progress_logs)) if progress is not None else None
    try:
        opened.steps(steps, lambda batch: resident.train_batch(batch, driver), after)
    finally:
        close_loop(resident, "train")
    resident.end_train()
    logs = resident.global_logs("train")
    if progress is not None:
        progress.end(logs)
    service.flush_step_events()
    return {"logs": logs, "state": _state(service, resident, with_state)}


def evaluate(service: ReplicaService, model_id: str, batches: Any, steps: int | None) -> dict[str, float]:
    """Loss and metrics over this replica's shard (at most ``steps``), over every replica's rows."""
    resident = replica_model(service, model_id)
    opened = open_loop(service, resident, "test", batches)
    try:
        opened.steps(steps, resident.test_batch)
    finally:
        close_loop(resident, "test")
    service.flush_step_events()
    logs: dict[str, float] = resident.global_logs("test")
    return logs


def model_state(service: ReplicaService, model_id: str) -> dict[str, Any]:
    """The replica's model state (its ``snapshot``)."""
    state: dict[str, Any] = replica_model(service, model_id).snapshot()
    return state


def model_weights(service: ReplicaService, model_id: str) -> list[Any]:
    """The replica's copy of the model's weights, as numpy arrays in ``get_weights``' order (its ``weights``)."""
    weights: list[Any] = replica_model(service, model_id).weights()
    return weights


# -- a loop in several commands (per-batch callbacks on the client between them) ------------------


def begin_loop(service: ReplicaService, model_id: str, loop: str, batches: Any) -> None:
    """Open the ``"train"`` or ``"test"`` loop of the model over this replica's shard of ``batches``."""
    open_loop(service, replica_model(service, model_id), loop, batches)


def train_steps(service: ReplicaService, model_id: str, count: int | None, driver: StepDriver,
                learning_rate: float | None) -> dict[str, Any]:
    """Up to ``count`` steps of the open training loop; ``{"steps": run, "logs": the epoch's global logs so far}``."""
    resident = replica_model(service, model_id)
    resident.set_learning_rate(learning_rate)
    done = _OPEN[resident]["train"].steps(count, lambda batch: resident.train_batch(batch, driver))
    service.flush_step_events()
    return {"steps": done, "logs": resident.global_logs("train")}


def test_steps(service: ReplicaService, model_id: str, count: int | None) -> dict[str, Any]:
    """Up to ``count`` steps of the open evaluation loop; ``{"steps": run, "logs": the global logs so far}``."""
    resident = replica_model(service, model_id)
    done = _OPEN[resident]["test"].steps(count, resident.test_batch)
    service.flush_step_events()
    return {"steps": done, "logs": resident.global_logs("test")}


def end_loop(service: ReplicaService, model_id: str, loop: str, with_state: bool = False) -> dict[str, Any]:
    """Close the open loop: its global logs; after training (``with_state``) replica 0 adds the model's state."""
    resident = replica_model(service, model_id)
    close_loop(resident, loop)
    if loop == "train":
        resident.end_train()
        return {"logs": resident.global_logs("train"), "state": _state(service, resident, with_state)}
    return {"logs": resident.global_logs("test"), "state": None}
