"""What keras and data may use of a replica, as a typed protocol (the replica side of the contract).

Commands sent through ``StrategyExtended.run_on_replicas`` /
``run_on_replica`` receive the replica's service as their first argument.
Upper layers type it as ``ReplicaService`` and use nothing else: its rank and
size, its step timer, the Dask worker for events, and the resident objects
installed with ``StrategyExtended.install_resident``. The replica runtime
implements it.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = [
    "GRADIENT_APPLIER",
    "EventSink",
    "ReplicaService",
    "ReplicaStepTimer",
    "gradient_applier",
    "resident",
    "resident_key",
]


class ReplicaStepTimer(Protocol):
    """The replica's per-step phase timer (``daskdist.replica.timing.StepTimer``)."""

    def begin(self, run_id: int) -> None: ...

    def end(self, samples: int | None = None) -> Any: ...

    def add_apply(self, seconds: float) -> None: ...

    def add_samples(self, samples: int) -> None: ...

    def add_input_wait(self, seconds: float) -> None: ...


class EventSink(Protocol):
    """Where a replica's events go (the Dask worker: ``Worker.log_event``)."""

    def log_event(self, topic: str | list[str], msg: Any) -> None: ...


class ReplicaService(Protocol):
    """One replica as commands see it."""

    rank: int
    size: int

    @property
    def timer(self) -> ReplicaStepTimer: ...

    @property
    def worker(self) -> EventSink: ...

    def record_step(self, timing: Any) -> None:
        """Queue a finished step's timing for the scheduler (dashboard, /metrics)."""

    def flush_step_events(self) -> None:
        """Send the step timings queued so far to the scheduler now."""

    def add_resident(self, object_id: str, obj: Any) -> None: ...

    def resident_object(self, object_id: str) -> Any: ...


def resident_key(kind: str, object_id: str) -> str:
    """The key a resident of ``kind`` (``"model"``, ``"dataset"``, ...) is stored under."""
    return f"{kind}:{object_id}"


def resident(service: ReplicaService, kind: str, object_id: str) -> Any:
    """The object installed on this replica with ``install_resident(kind, object_id, obj)``."""
    return service.resident_object(resident_key(kind, object_id))


#: Where a strategy whose parameters are not updated on the replicas (CentralStorage) installs the object that
#: replaces ``fit``'s all-reduce and local optimizer step: ``apply_gradients(service, model_key, optimizer,
#: params, grads, stats) -> summed stats``, ``model_state(service, model_key)``, ``set_model(service, model_key,
#: params=None, optimizer_state=None)``.
GRADIENT_APPLIER = ("strategy", "gradient-applier")


def gradient_applier(service: ReplicaService) -> Any:
    """The strategy's gradient applier on this replica, or ``None`` (all-reduce and apply on every replica)."""
    try:
        return resident(service, *GRADIENT_APPLIER)
    except KeyError:
        return None
