"""The replica's step timer as the training loops use it: each finished step also goes to the scheduler."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from daskdist import context

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService

__all__ = ["RecordingTimer", "StepTimerLike", "replica_timer"]


class StepTimerLike(Protocol):
    """A step timer as a loop uses it."""

    def begin(self, step: int) -> None: ...
    def add_samples(self, samples: int) -> None: ...
    def end(self) -> None: ...


class RecordingTimer:
    """A replica's step timer whose finished steps also go to the scheduler (dashboard, /metrics)."""

    def __init__(self, service: ReplicaService):
        self._service = service
        self._timer = service.timer

    def begin(self, step: int) -> None:
        self._timer.begin(step)

    def add_apply(self, seconds: float) -> None:
        self._timer.add_apply(seconds)

    def add_samples(self, samples: int) -> None:
        self._timer.add_samples(samples)

    def end(self) -> None:
        self._service.record_step(self._timer.end())

    def flush(self) -> None:
        """Send the steps recorded so far to the scheduler now."""
        self._service.flush_step_events()


def replica_timer() -> RecordingTimer | None:
    """The running replica's ``RecordingTimer``, or ``None`` outside a replica."""
    service = context.current_runtime()
    return RecordingTimer(service) if service is not None else None
