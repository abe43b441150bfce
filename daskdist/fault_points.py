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
at the start of its copy, in the thread that copies it: ``bound``). Those are
``STEP_PHASES``. ``restore`` is no phase of a step: it fires on a replica
going back to a commit during an elastic recovery (``restore_commit``, or
``install_commit`` for a member given a survivor's commit), after the commit's
state is written into the replica and before it answers; its step is the
restored commit's step (the epoch's global batches done at that commit, the
third field of its ``CommitKey``) and its rank the replica's rank in the new
generation (``restoring``). A step of ``*`` matches any step (``"restore:*:1"``:
the first restore on rank 1, whatever commit the survivors agree on).
``state-commit`` is no phase of a step either: it fires on a replica that
has just committed for ``dd.elastic.State.commit`` (``commit_now``), before it
answers, so a kill there loses the reply of a commit every replica made; its
step is the commit's serial number in its ``State`` (the second field of its
``CommitKey``: 1 for the state's first commit), its rank the replica's
(``state_committed``). ``state-copy`` fires in the thread that copies such
a commit off the step path (a ``TorchModel``'s: ``commit_now``), before it
copies; step and rank as ``state-commit``'s (``state_copying``). ``install``
fires on a replica that has just been given a resident (a model ``fit``
installs: ``install_resident``), before it answers; its step is always 0
(``"install:0:1"``), its rank the replica's (``installed``).

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

__all__ = ["ARMED", "PHASES", "STEP_PHASES", "PausePoint", "arm", "begin_step", "bound", "installed", "reached",
           "restoring", "state_committed", "state_copying"]

logger = logging.getLogger(__name__)

#: The phases of a training step (``arm``, ``reached``, ``bound``).
STEP_PHASES = ("input", "forward", "reduce-scatter", "all-gather", "apply", "commit")
#: Every phase: those of a step, and ``restore`` (a replica going back to a commit in a recovery: ``restoring``).
PHASES = (*STEP_PHASES, "restore", "state-commit", "state-copy", "install")

#: Whether a fault point was armed in this process: the only thing hot paths look at.
ARMED = False

_local = threading.local()


@dataclass(frozen=True)
class PausePoint:
    """Where a replica pauses: ``phase`` of training step ``step`` (``None``: any) on the replica of rank ``rank``."""

    phase: str
    step: int | None
    rank: int

    def matches(self, phase: str, step: int) -> bool:
        """Whether this point names ``phase`` and ``step``."""
        return self.phase == phase and self.step in (None, step)

    @classmethod
    def parse(cls, spec: str) -> PausePoint:
        """``"<phase>:<step>:<rank>"`` (``"apply:4:1"``; ``"restore:*:1"``: any step).

        Raises
        ------
        ValueError
            Not three fields, an unknown phase, a step that is neither ``*`` nor an integer >= 0, or a rank
            that is not an integer >= 0.
        """
        parts = str(spec).split(":")
        if (len(parts) != 3 or parts[0] not in PHASES or not (parts[1].isdigit() or parts[1] == "*")
                or not parts[2].isdigit()):
            raise ValueError(f"daskdist.testing.pause-at must be '<phase>:<step>:<rank>' with a phase among "
                             f"{', '.join(PHASES)} and a step that is an integer or '*', got {spec!r}")
        return cls(parts[0], None if parts[1] == "*" else int(parts[1]), int(parts[2]))


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
    if point is None or not point.matches(phase, _local.step):
        return None
    _local.point = None
    return _pause(point, phase, _local.step, _local.path, _local.seconds, _worker_address())


def restoring(rank: int, step: int) -> None:
    """Fault point ``restore``: the replica of rank ``rank`` (this generation's) restored a commit of ``step``.

    Called by the elastic restore commands when ``ARMED`` (a training command armed a point in this
    process); reads the settings again, since ranks change with the generation. Pauses once, as the others.
    """
    spec = config.get("testing.pause-at")
    if not spec:
        return
    point = PausePoint.parse(spec)
    path = config.get("testing.pause-file")
    if point.rank != rank or not point.matches("restore", step) or not path:
        return
    _pause(point, "restore", step, str(path), config.get_seconds("testing.pause-seconds"), _worker_address())()


def state_committed(rank: int, serial: int) -> None:
    """Fault point ``state-commit``: the replica of rank ``rank`` committed ``State`` commit ``serial``.

    Called by ``commit_now`` (a custom loop's commits arm nothing): costs a settings lookup per commit.
    """
    spec = config.get("testing.pause-at")
    if not spec:
        return
    point = PausePoint.parse(spec)
    path = config.get("testing.pause-file")
    if point.rank != rank or not point.matches("state-commit", serial) or not path:
        return
    _pause(point, "state-commit", serial, str(path), config.get_seconds("testing.pause-seconds"), _worker_address())()


def state_copying(rank: int, serial: int) -> Callable[[], None] | None:
    """Fault point ``state-copy``, for the thread that copies ``State`` commit ``serial`` of the replica of rank
    ``rank`` off the step path (``commit_now``): the pause to call there first, or ``None``.

    A settings lookup per commit, as ``state_committed``.
    """
    spec = config.get("testing.pause-at")
    if not spec:
        return None
    point = PausePoint.parse(spec)
    path = config.get("testing.pause-file")
    if point.rank != rank or not point.matches("state-copy", serial) or not path:
        return None
    return _pause(point, "state-copy", serial, str(path), config.get_seconds("testing.pause-seconds"),
                  _worker_address())


def installed(rank: int) -> None:
    """Fault point ``install``: the replica of rank ``rank`` was given a resident (step 0).

    Called by ``install_resident`` (rare: a model's install, an elastic newcomer's): costs a settings lookup.
    """
    spec = config.get("testing.pause-at")
    if not spec:
        return
    point = PausePoint.parse(spec)
    path = config.get("testing.pause-file")
    if point.rank != rank or not point.matches("install", 0) or not path:
        return
    _pause(point, "install", 0, str(path), config.get_seconds("testing.pause-seconds"), _worker_address())()


def _pause(point: PausePoint, phase: str, step: int, path: str, seconds: float,
           address: str | None) -> Callable[[], None]:
    """The pause of ``point`` (reached at ``phase`` of ``step``): fires once, see the module."""

    def pause() -> None:
        try:
            fd = os.open(path + ".lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # it fired already (in this or another process): run on
            return
        os.close(fd)
        record = {"pid": os.getpid(), "ppid": os.getppid(), "address": address, "phase": phase,
                  "step": step, "rank": point.rank, "host": socket.gethostname()}
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as f:
            json.dump(record, f)
        os.replace(partial, path)  # the test sees the whole record or none
        logger.warning("Test fault point: replica %d pauses at %s of step %d for %g s (daskdist.testing.pause-at)",
                       point.rank, phase, step, seconds)
        time.sleep(seconds)

    return pause


def _worker_address() -> str | None:
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except ValueError:  # not in a Dask worker (a replica thread of a threaded test cluster still is one)
        return None
