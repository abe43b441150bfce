"""Test-only fault points: one replica stops at one phase of one training step, so a test can kill it there.

Set on the client (it travels to the replicas in the group's config snapshot)::

    dask.config.set({"daskdist.testing.pause-at": "reduce-scatter:4:1",
                     "daskdist.testing.pause-file": "/tmp/paused.json"})

The replica of rank 1, at training step 4 (the optimizer's ``iterations``
when the step starts, so steps count across epochs), inside the ring
all-reduce's reduce-scatter half, writes ``pause-file`` (JSON: its ``pid``,
its nanny's ``ppid``, its worker ``address``, ``phase``, ``step``, ``rank``) and
sleeps ``pause-seconds``; the test reads the file and kills the process. A
point fires once: the file is created exclusively, so no replica pauses again
once it exists (after a loss, another replica takes the victim's rank and
replays the step).

Phases (``PHASES``): ``input`` (before the step's batch is taken), ``forward``
(after the forward pass, before the backward one), ``reduce-scatter`` and
``all-gather`` (after the first exchange of each half of the ring
all-reduce: ``CommunicationOptions(implementation="RING")`` makes the
gradients go through it), ``apply`` (the optimizer has updated the first
parameter, not the others) and ``commit`` (an elastic commit of the step,
at the start of its copy, in the thread that copies it: ``bound``).

Zero cost when unset: a training command reads the key once (``arm``); the
points on the hot paths test one module-level boolean, ``ARMED``, false
unless a fault point was ever armed in the process. Not for production use.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from daskdist import config

__all__ = ["ARMED", "PHASES", "PausePoint", "arm", "begin_step", "bound", "reached"]

logger = logging.getLogger(__name__)

PHASES = ("input", "forward", "reduce-scatter", "all-gather", "apply", "commit")

#: Whether a fault point was armed in this process: the only thing hot paths look at.
ARMED = False

_local = threading.local()


@dataclass(frozen=True)
class PausePoint:
    """Where a replica pauses: ``phase`` of training step ``step`` on the replica of rank ``rank``."""

    phase: str
    step: int
    rank: int

    @classmethod
    def parse(cls, spec: str) -> PausePoint:
        """``"<phase>:<step>:<rank>"`` (``"apply:4:1"``).

        Raises
        ------
        ValueError
            Not three fields, an unknown phase, or a step or rank that is not an integer >= 0.
        """
        parts = str(spec).split(":")
        if len(parts) != 3 or parts[0] not in PHASES or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"daskdist.testing.pause-at must be '<phase>:<step>:<rank>' with a phase among "
                             f"{', '.join(PHASES)}, got {spec!r}")
        return cls(parts[0], int(parts[1]), int(parts[2]))


def arm(rank: int, step_of: Callable[[], int]) -> Callable[[], None] | None:
    """At the start of a training command on a replica: arm this thread's fault point from the settings.

    Returns ``None`` when ``daskdist.testing.pause-at`` is unset (nothing
    else happens then), else the callable that the training loop calls before
    taking each step's batch (``begin_step`` with ``step_of()``, then the
    ``input`` point).
    """
    global ARMED
    spec = config.get("testing.pause-at")
    if not spec:
        _local.point = None
        return None
    point = PausePoint.parse(spec)
    path = config.get("testing.pause-file")
    if not path:
        raise ValueError("daskdist.testing.pause-at needs daskdist.testing.pause-file (where the paused replica "
                         "says who it is)")
    _local.point = point if point.rank == rank else None
    _local.rank, _local.path, _local.step = rank, str(path), -1
    _local.seconds = config.get_seconds("testing.pause-seconds")
    ARMED = True

    def before_batch() -> None:
        begin_step(step_of())
        reached("input")

    return before_batch


def begin_step(step: int) -> None:
    """The training step this thread is in (the optimizer's ``iterations`` before it)."""
    _local.step = step


def reached(phase: str) -> None:
    """Fault point ``phase``: pause here if this thread's armed point names it and this step (once, see module)."""
    pause = bound(phase)
    if pause is not None:
        pause()


def bound(phase: str) -> Callable[[], None] | None:
    """Fault point ``phase`` of this thread's current step, as a callable another thread may call.

    ``None`` unless this thread's armed point names ``phase`` and the current
    step. For work a replica hands to a helper thread (a commit's copy): the
    pause then happens where that thread runs it. Disarms this thread's point.
    """
    point = getattr(_local, "point", None)
    if point is None or point.phase != phase or point.step != _local.step:
        return None
    _local.point = None
    path, seconds, address = _local.path, _local.seconds, _worker_address()  # the worker, known in its thread

    def pause() -> None:
        try:
            fd = os.open(path + ".lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # it fired already (in this or another process): run on
            return
        os.close(fd)
        record = {"pid": os.getpid(), "ppid": os.getppid(), "address": address, "phase": phase,
                  "step": point.step, "rank": point.rank, "host": socket.gethostname()}
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as f:
            json.dump(record, f)
        os.replace(partial, path)  # the test sees the whole record or none
        logger.warning("Test fault point: replica %d pauses at %s of step %d for %g s (daskdist.testing.pause-at)",
                       point.rank, phase, point.step, seconds)
        time.sleep(seconds)

    return pause


def _worker_address() -> str | None:
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except ValueError:  # not in a Dask worker (a replica thread of a threaded test cluster still is one)
        return None
